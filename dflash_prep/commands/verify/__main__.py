"""`python -m dflash_prep.commands.verify OUT ...`: the same as `dflash-prep verify OUT ...`."""

import sys

from dflash_prep.commands.verify.entry import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m dflash_prep.commands.extract [--recipe PATH] [--set key=value ...]`, and what `dflash-prep launch -m
dflash_prep.commands.extract` (accelerate's module launch) runs in every process: the extraction, from any folder."""

import sys

from dflash_prep.commands.extract.entry import main

if __name__ == "__main__":
    sys.exit(main(own_process=True))

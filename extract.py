"""Entry point for `dflash-prep launch [accelerate launch options] extract.py [--recipe PATH] [--set key=value ...]`
(also `accelerate launch extract.py ...`, which reports every failure as exit code 1, or `python extract.py ...`).

Without --recipe it runs dflash_prep/demo/tiny-demo.yaml, a CPU-sized demo that needs no network.
"""

import sys

from dflash_prep.commands.extract import main

if __name__ == "__main__":
    sys.exit(main(own_process=True))

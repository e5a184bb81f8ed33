"""Entry point for `accelerate launch extract.py [--recipe PATH] [--set key=value ...]`.

Without --recipe it runs recipes/tiny-demo.yaml, a CPU-sized demo that needs no network.
"""

import sys

from dflash_prep.extract import main

if __name__ == "__main__":
    sys.exit(main())

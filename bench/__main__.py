"""`python3 -m bench list` / `python3 -m bench run SCENARIO ...`: the benchmark's device rounds (scenarios.py)."""

import sys

from bench.scenarios import main

if __name__ == "__main__":
    sys.exit(main())

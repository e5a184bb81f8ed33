"""The commands a user runs: the extraction loop and its job bookkeeping (identity, the run's claim on its folder, the
cost model of the rank split, the final merge), `plan`, `inspect`, `verify`, `launch`, and the `dflash-prep` CLI.

May import every other folder; nothing imports it.
"""

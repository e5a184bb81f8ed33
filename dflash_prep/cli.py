"""`dflash-prep` command line: `dflash-prep extract [--recipe PATH] [--set key=value ...]`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-prep", description="Hidden-state extraction for drafter training.")
    sub = parser.add_subparsers(dest="command", required=True)
    from .extract import add_extract_args

    p_extract = sub.add_parser("extract", help="run an extraction recipe (also: accelerate launch extract.py)")
    add_extract_args(p_extract)
    args, rest = parser.parse_known_args(argv)
    if args.command == "extract":
        from .extract import main as extract_main

        return extract_main((["--recipe", args.recipe] if args.recipe else [])
                            + [a for kv in args.overrides for a in ("--set", kv)] + rest)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

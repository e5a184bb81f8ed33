"""`dflash-prep` command line.

    dflash-prep extract [--recipe PATH] [--set key=value ...]
    dflash-prep launch [accelerate launch options] -m dflash_prep.commands.extract [--recipe PATH] [--set key=value ...]
    dflash-prep export OUT --to specforge|speculators|modelopt --dest DIR
    dflash-prep inspect OUT [--check]
    dflash-prep plan [--recipe PATH] [--set key=value ...] [--num-gpus N] [--tokens-per-second X]
    dflash-prep verify OUT [--num-samples N] [--seed S]
    dflash-prep vocab OUT --size N [--layout speculators|specforge|all] [--dest DIR]
    dflash-prep demo-server [--dir DIR] [--port 8000]       the demo's model served by `transformers serve` (CPU)
    dflash-prep --version
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from dflash_prep import __version__

    if argv is None:  # the console script: this process is the command's
        from dflash_prep.signals import run_owns_process

        run_owns_process()

    parser = argparse.ArgumentParser(prog="dflash-prep", description="Hidden-state extraction for drafter training.")
    parser.add_argument("--version", action="version", version=f"dflash-prep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from dflash_prep.recipe.schema import add_recipe_args

    p_extract = sub.add_parser("extract", help="run an extraction recipe (also: accelerate launch extract.py)")
    add_recipe_args(p_extract)
    sub.add_parser("launch", help="`accelerate launch` that keeps the script's exit code (2, 3) and a clean console",
                   add_help=False)
    sub.add_parser("export", help="write an output in a trainer's layout (specforge, speculators, modelopt)",
                   add_help=False)
    sub.add_parser("inspect", help="show what an output holds; --check re-hashes every shard", add_help=False)
    sub.add_parser("plan", help="what a recipe will cost (samples, tokens, batches, bytes, wall time), no weights",
                   add_help=False)
    sub.add_parser("verify", help="check hashes, then re-run random samples alone and compare the stored states",
                   add_help=False)
    sub.add_parser("vocab", help="draft-vocabulary mapping (d2t/t2d) from the output's supervised-token counts",
                   add_help=False)
    # on-policy data: the target's own answers first (commands/regenerate.py)
    p_regenerate = sub.add_parser("regenerate", help="the target writes the data's assistant turns itself (a server "
                                  "or in-process generate) into a dataset extraction reads")
    add_recipe_args(p_regenerate)
    sub.add_parser("demo-server", help="serve the demo's tiny model with `transformers serve` (CPU, offline)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo-server":
        from dflash_prep.commands.demo_server import main as demo_server_main

        return demo_server_main(rest)
    if args.command == "regenerate":
        from dflash_prep.commands.regenerate import main as regenerate_main

        return regenerate_main((["--recipe", args.recipe] if args.recipe else [])
                               + [a for kv in args.overrides for a in ("--set", kv)] + rest)
    if args.command == "launch":
        from dflash_prep.commands.launch import main as launch_main

        return launch_main(rest)
    if args.command == "export":
        from dflash_prep.consume.export import main as export_main

        return export_main(rest)
    if args.command == "inspect":
        from dflash_prep.commands.inspect import main as inspect_main

        return _reader_stopped_is_fine(inspect_main, rest)
    if args.command == "plan":
        from dflash_prep.commands.plan import main as plan_main

        return _reader_stopped_is_fine(plan_main, rest)
    if args.command == "verify":
        from dflash_prep.commands.verify import main as verify_main

        return verify_main(rest)
    if args.command == "vocab":
        from dflash_prep.consume.vocab import main as vocab_main

        return vocab_main(rest)
    if args.command == "extract":
        from dflash_prep.commands.extract import main as extract_main

        return extract_main((["--recipe", args.recipe] if args.recipe else [])
                            + [a for kv in args.overrides for a in ("--set", kv)] + rest)
    parser.error(f"unknown command {args.command}")
    return 2


def _reader_stopped_is_fine(command, argv: list[str]) -> int:
    """A report's command (`plan`, `inspect`) whose reader stopped reading (`| head`): exit code 0 with nothing more
    printed, instead of a BrokenPipeError (exit code 1, which says "stopped, resumable"). Its later writes, and the
    interpreter's flush at exit, go to /dev/null."""
    try:
        return command(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


if __name__ == "__main__":
    sys.exit(main())

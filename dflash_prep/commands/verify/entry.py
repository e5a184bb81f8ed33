"""`dflash-prep verify OUT [--num-samples N] [--seed S] ...`: the command line, its errors and exit codes (0 pass, 1 a
check failed, 2 the output cannot be verified)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash_prep.commands.verify.report import CannotVerify, finite_or_null, format_report
from dflash_prep.commands.verify.run import FP8_REFERENCES, verify
from dflash_prep.recipe.location import one_line_store_errors


def build_parser(prog: str = "dflash-prep verify") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Check an output's manifest and shard hashes, then re-run "
                                                       "random samples alone through the model and compare.")
    p.add_argument("out", help="extraction output folder (holds manifest.json and recipe.resolved.yaml)")
    p.add_argument("--num-samples", type=int, default=8, help="samples to re-run (default 8; all when larger)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample draw (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error per layer, used as given: no widening to the measured rounding noise "
                        "(default: by stored and compute dtype, widened to 2x the noise floor, see docs)")
    p.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                   help="skip the padded-batch reference that measures each layer's rounding noise (fixed "
                        "tolerance only)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of OUT/recipe.resolved.yaml (e.g. a moved model path)")
    p.add_argument("--fp8-reference", choices=FP8_REFERENCES, default="fp8",
                   help="for an output extracted from a block-FP8 checkpoint run as FP8: re-run the samples through "
                        "the same FP8 model (default: within the compute dtype's tolerance) or through the checkpoint "
                        "dequantized (within the FP8 allowance more: the format's own error)")
    p.add_argument("--skip-hash", action="store_true", help="skip re-hashing the shards (values only)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _device_problem(name: str) -> str | None:
    """Why `--device name` cannot run the reference here (not a torch device, or CUDA absent), None if it can."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        return f"not a torch device ({str(e).splitlines()[0][:120]})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


@one_line_store_errors
def main(argv: list[str] | None = None) -> int:
    """`dflash-prep verify OUT [--num-samples N] [--seed S]`: 0 pass, 1 fail, 2 cannot verify."""
    args = build_parser().parse_args(argv)
    if args.num_samples < 1:
        print("error: --num-samples must be >= 1", file=sys.stderr)
        return 2
    if args.tolerance is not None and not 0 <= args.tolerance < float("inf"):  # NaN too: it would fail every layer
        print(f"error: --tolerance must be a finite number >= 0 (a relative error), got {args.tolerance}",
              file=sys.stderr)
        return 2
    if args.device is not None and (problem := _device_problem(args.device)):
        print(f"error: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    if "://" not in str(args.out) and not Path(args.out).is_dir():  # a mistyped folder: not "has not finished"
        print(f"error: cannot verify: {args.out}: no such folder", file=sys.stderr)
        return 2
    import transformers

    transformers.logging.set_verbosity_error()  # no kernel-fallback notices on the console
    quiet = args.json
    try:
        report = verify(args.out, args.num_samples, args.seed, args.overrides, args.device, args.tolerance,
                        check_shards=not args.skip_hash, noise_floor=args.noise_floor, fp8_reference=args.fp8_reference,
                        log=(lambda *a: None) if quiet else (lambda *a: print(*a, flush=True)), progress=not quiet)
    except CannotVerify as e:
        print(f"error: cannot verify: {e}", file=sys.stderr)
        return 2
    if report.is_main_process:
        print(json.dumps(finite_or_null(report.to_json()), indent=2, allow_nan=False) if args.json
              else format_report(report))
    return 0 if report.ok else 1


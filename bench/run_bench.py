#!/usr/bin/env python
"""Extraction benchmark: per-sample vs fixed-batch vs dflash-prep, same process, same samples.

    python bench/run_bench.py --model qwen3.6-27b|llama3.1-8b|tiny-qwen3.5|tiny-llama
        [--num-samples N] [--per-sample-max-seconds S] [--modes per_sample,fixed_batch,dflash_prep]
        [--results-dir DIR] [--max-tokens-per-batch N|auto] [--out-dir DIR] ...   (see --help)

Modes (all read the same list of pre-drawn samples; a time-bounded mode runs a prefix of it):

  per_sample   one sample at a time through the full CausalLM with `output_hidden_states=True`; the
               captured layers are concatenated to [T, k*H] and saved as one safetensors file per sample
               (what users start with).
  fixed_batch  consecutive batches of 32 (the list is i.i.d. draws, so these are random batches, as with a
               shuffled dataset), right-padded to the batch maximum, `output_hidden_states=True` on the
               CausalLM (no hooks), unpadded and saved per sample with torch.save in SpecForge's layout
               (`rows_{g}-{g+2000}/data_{idx}.ckpt`). A batch that runs out of GPU memory is split in two
               and retried (counted in `oom_splits`; the wasted time stays in the wall time).
  dflash_prep  the real path end to end: the benchmark writes the samples as a parquet of pre-tokenized
               rows (`id`, `input_ids`, `loss_mask` all ones) and calls `dflash_prep.commands.extract.run_extraction`
               on a recipe whose `model.config` is the benchmark config (hooks, planner, loader, async shard
               writer, manifest: all included).
  X_warm       (optional: per_sample_warm, fixed_batch_warm, dflash_prep_warm, each after its X) mode X again,
               in the same process, on exactly the samples X ran: the same shapes, so what X compiled and
               autotuned (Triton/fla kernels of the Gated DeltaNet layers, cuBLAS heuristics) is reused. Cold
               pass = what a short or fresh run pays; warm pass = the steady state of a long run; their
               difference = the first-shape cost (`warm_vs_cold` in the report).

Every mode builds the model the same way (`dflash_prep.target.model.load_model`: random weights drawn on the device
with the same seed, `from_config(..., dtype=...)` under `torch.device(...)`), so all modes see identical
weights (a checksum per mode proves it) and their states can be compared (`consistency` in the report).

Random weights, pre-drawn random token ids: the numbers measure the extraction machinery, not a checkpoint.

The parts live in the `bench` package, one module per concern (bench/__init__.py lists them); this file is
the command line. The names tests and other scripts use are re-exported here.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
# `python bench/run_bench.py` puts bench/ first on sys.path: take it off, so that the bench modules' names
# (models, timing, ...) cannot shadow other modules; they are imported as the `bench` package, from the
# checkout (the dflash_prep package too, when it is not installed).
if sys.path and Path(sys.path[0] or ".").resolve() == BENCH_DIR:
    sys.path.pop(0)
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import bench  # noqa: E402, F401 - sets PYTORCH_CUDA_ALLOC_CONF before torch is imported
from bench.context import Ctx, environment, fs_info, resolve_device  # noqa: E402, F401
from bench.models import CONFIG_DIR, MODELS, TOKENIZER_DIR, ModelSpec, auto_token_budget, model_info, weights_checksum  # noqa: E402, F401
from bench.modes import (  # noqa: E402, F401
    ALL_MODES,
    DEFAULT_MODES,
    PROFILE,
    REPEATS_OF_DFLASH,
    RUNNERS,
    VARIANT,
    run_dflash,
    run_fixed_batch,
    run_mode,
    run_per_sample,
)
from bench.outputs import compare, dir_bytes, read_samples, written_ids  # noqa: E402, F401
from bench.profiling import KERNEL_CATEGORIES, kernel_profile  # noqa: E402, F401
from bench.report import consistency_of, new_report, render_markdown, warm_overheads, write_report  # noqa: E402
from bench.samples import Samples, make_samples  # noqa: E402, F401
from bench.timing import GB, finish_result, measure_gemm  # noqa: E402, F401
from dflash_prep.recipe.schema import ModelSection  # noqa: E402
from dflash_prep.target.model import DTYPES  # noqa: E402


def parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    import yaml

    out = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--dflash-set {item!r}: expected KEY=VALUE, e.g. batching.length_growth=1.25")
        key, text = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(text)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list, run in this order, of {', '.join(ALL_MODES)} (default {DEFAULT_MODES})")
    p.add_argument("--num-samples", type=int, default=None, help="size of the sample list (model default)")
    p.add_argument("--per-sample-max-seconds", type=float, default=None, help="time budget (model default)")
    p.add_argument("--per-sample-max-samples", type=int, default=None, help="sample cap (default: the list)")
    p.add_argument("--fixed-batch-max-seconds", type=float, default=None, help="time budget (model default)")
    p.add_argument("--fixed-batch-max-samples", type=int, default=None, help="sample cap (default: the list)")
    p.add_argument("--fixed-batch-size", type=int, default=32, help="default 32 (SpecForge-like)")
    p.add_argument("--dflash-max-tokens", type=int, default=None,
                   help="real tokens given to dflash-prep: the longest prefix of the list under it (model default)")
    p.add_argument("--max-tokens-per-batch", default="auto", help="dflash-prep padded-token budget: N or auto (default: from GPU memory)")
    p.add_argument("--dflash-set", dest="dflash_set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra dflash-prep recipe override, e.g. batching.length_growth=1.25 (repeatable)")
    p.add_argument("--variant-set", dest="variant_set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"recipe overrides of the {VARIANT} mode, on top of --dflash-set (e.g. "
                        f"model.padding_mask=false): dflash_prep again, same samples, same process")
    p.add_argument("--results-dir", default=str(BENCH_DIR / "results"), help="default bench/results/")
    p.add_argument("--out-dir", default=None,
                   help="where modes write (a fresh subfolder, deleted after each mode); default: the system "
                        "temp dir (/tmp), i.e. the real disk; /dev/shm measures without the disk")
    p.add_argument("--keep-outputs", action="store_true", help="keep every mode's output (tests)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (model default)")
    p.add_argument("--storage-dtype", default="bfloat16", choices=list(DTYPES), help="dtype of stored states (default bfloat16)")
    p.add_argument("--logits", default="all", choices=["all", "last"],
                   help="baselines: full-vocab logits for every position (plain CausalLM call, the default) or "
                        "logits_to_keep=1")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, token ids and weights (default 0)")
    p.add_argument("--length-mu", type=float, default=5.41, help="lognormal mu of sample lengths (default 5.41)")
    p.add_argument("--length-sigma", type=float, default=0.9, help="lognormal sigma of sample lengths (default 0.9)")
    p.add_argument("--min-length", type=int, default=16, help="length clip (default 16)")
    p.add_argument("--max-length", type=int, default=None, help="length clip (model default, 4096 for real models)")
    p.add_argument("--gemm-size", type=int, default=None, help="GEMM n for the MFU rate (8192 on GPU, 1024 on CPU)")
    p.add_argument("--check-samples", type=int, default=4,
                   help="first N samples read back from every mode and compared (0: every sample; default 4)")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The arguments with the model's defaults filled in, and the modes in run order. Raises SystemExit (the
    one-line reason) on modes that are unknown, repeated, out of order, or a variant without overrides."""
    args = build_parser().parse_args(argv)
    spec = MODELS[args.model]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes {args.modes!r}: expected distinct names among {ALL_MODES}")
    for i, m in enumerate(modes):
        if m.endswith("_warm") and m.removesuffix("_warm") not in modes[:i]:
            raise SystemExit(f"--modes: {m} repeats {m.removesuffix('_warm')}, which must come before it")
        if m in REPEATS_OF_DFLASH and "dflash_prep" not in modes[:i]:
            raise SystemExit(f"--modes: {m} repeats dflash_prep, which must come before it")
    if (VARIANT in modes) != bool(args.variant_set):
        raise SystemExit(f"--variant-set goes with the {VARIANT} mode, and the mode needs at least one")
    args.variant_overrides = parse_overrides(args.variant_set)
    args.per_sample_max_seconds = args.per_sample_max_seconds or spec.per_sample_max_seconds
    args.fixed_batch_max_seconds = args.fixed_batch_max_seconds or spec.fixed_batch_max_seconds
    args.dflash_max_tokens = args.dflash_max_tokens or spec.dflash_max_tokens
    args.dflash_overrides = parse_overrides(args.dflash_set)
    return args, modes


def build_context(args: argparse.Namespace) -> Ctx:
    """Device, output folder (a fresh one under `--out-dir`), model section and config, parameter counts,
    the sample list and dflash-prep's token budget: what every mode shares."""
    spec = MODELS[args.model]
    max_length = args.max_length or spec.max_length
    device = resolve_device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")  # run_extraction's PartialState device
    dtype_name = args.dtype or spec.dtype
    dtype, storage_dtype = DTYPES[dtype_name], DTYPES[args.storage_dtype]

    out_base = Path(args.out_dir) if args.out_dir else Path(tempfile.gettempdir())
    out_base.mkdir(parents=True, exist_ok=True)
    out_root = Path(tempfile.mkdtemp(prefix=f"dflash-bench-{args.model}-", dir=out_base))
    # datasets' cache of the parquet load and tokenization: inside the run folder, removed with it (only
    # effective if `datasets` was not imported yet by this process).
    os.environ.setdefault("HF_DATASETS_CACHE", str(out_root / "hf-datasets-cache"))

    from transformers import AutoConfig

    section = ModelSection(config=str(CONFIG_DIR / spec.config), init_seed=args.seed,
                           tokenizer=str(TOKENIZER_DIR), dtype=dtype_name, attn_implementation="sdpa")
    config = AutoConfig.from_pretrained(section.config)
    layer_ids = list(spec.layer_ids)
    info = model_info(config, layer_ids)
    n = args.num_samples or spec.num_samples
    samples = make_samples(n, args.length_mu, args.length_sigma, args.min_length, max_length,
                           info["vocab_size"], args.seed)
    if args.max_tokens_per_batch == "auto":
        budget, how = auto_token_budget(device, config, info, dtype_name, args.storage_dtype, len(layer_ids))
    else:
        budget, how = int(args.max_tokens_per_batch), "command line"
    return Ctx(args, spec, device, dtype, storage_dtype, section, config, layer_ids, info, samples, out_root,
               budget, how)


def main(argv: list[str] | None = None) -> dict:
    """Run the modes in order and write the report after each; returns the report (its paths included)."""
    args, modes = parse_args(argv)
    t_start = time.perf_counter()
    timestamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    ctx = build_context(args)
    device, samples = ctx.device, ctx.samples
    print(f"[bench] {args.model} on {device} ({ctx.section.dtype}), {len(samples.ids)} samples / "
          f"{samples.params['num_tokens']:,} tokens, modes {modes}, outputs under {ctx.out_root}",
          file=sys.stderr, flush=True)

    gemm = measure_gemm(device, ctx.dtype, args.gemm_size or (8192 if device.type == "cuda" else 1024))
    print(f"[bench] GEMM {gemm['size']}^3 {gemm['dtype']}: {gemm['tflops']:.1f} TFLOP/s", file=sys.stderr)

    check_ids = samples.ids if args.check_samples == 0 else samples.ids[: args.check_samples]
    command = [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv)
    report = new_report(ctx, modes, timestamp, command, gemm)
    states = {}
    try:
        for mode in modes:
            report["modes"][mode], states[mode] = run_mode(ctx, mode, gemm, check_ids, report["modes"])
            # Written after every mode, so a run cut short still leaves the figures of the finished modes.
            report["consistency"] = consistency_of(report["modes"], states, check_ids, len(ctx.layer_ids))
            report["warm_vs_cold"] = warm_overheads(report["modes"])
            report["wall_seconds"] = time.perf_counter() - t_start
            write_report(report)
    finally:
        if not args.keep_outputs:
            shutil.rmtree(ctx.out_root, ignore_errors=True)
    report["complete"] = True
    write_report(report)
    print(render_markdown(report))
    print(f"[bench] wrote {report['json_path']} and {report['markdown_path']}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()

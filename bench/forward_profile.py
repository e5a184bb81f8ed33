"""Where a packed forward's GPU time goes: one benchmark model, one packed row, kernels by device time.

    python3 bench/forward_profile.py [--model qwen3.6-27b] [--row-tokens 32768] [--kernels auto] [--json OUT]
    python3 bench/forward_profile.py --checkpoint DIR [--fp8-weights auto|dequantize] ...   (a saved checkpoint)

Builds the benchmark model with random bf16 weights (its layers after the deepest captured one dropped, as the
extraction does), applies `model.kernels` and the packed attention as the extraction does, and fills one packed
row with samples of the benchmark's length distribution (lognormal, mean ~320). Then, with the capture hooks on
the benchmark's layers:

- `gpu_seconds`: CUDA-event time of `--repeats` warm forwards (after `--warmup` forwards that compile), each
  alone on the device, their median and `real_tokens_per_second` = the row's real tokens / median;
- `profile`: one more forward under torch.profiler, CUDA activity only, grouped by kernel name and category
  (bench/profiling.py): what each kernel costs, so a lever can be sized before it is built.

One process per variant (another `--kernels`, another transformers on PYTHONPATH): the model is patched in place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.kernels_check import slice_section  # noqa: E402
from bench.profiling import kernel_profile  # noqa: E402
from dflash_prep.plan.batches import SampleInfo, collate_packed  # noqa: E402
from dflash_prep.target import packing  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import apply_kernels, select_kernels  # noqa: E402
from dflash_prep.target.layers import dflash_layer_ids  # noqa: E402
from dflash_prep.target.model import drop_layers_after, load_config, load_model  # noqa: E402


def row_samples(vocab: int, row_tokens: int, seed: int = 0) -> list[SampleInfo]:
    """Samples of the benchmark's length distribution filling one row of `row_tokens` (up to 64 left free)."""
    g = np.random.default_rng(seed)
    out, used = [], 0
    while True:
        n = int(np.clip(np.rint(g.lognormal(5.41, 0.9)), 16, 4096))
        if used + n > row_tokens - 64:
            return out
        out.append(SampleInfo(f"{len(out):010d}", len(out), None, g.integers(1, vocab, n).astype(np.int32),
                              np.ones(n, np.uint8)))
        used += n


def timed(fn, device) -> float:
    """GPU seconds of `fn()` alone on the device."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3


def profile_forward(args, device, tmp: Path) -> dict:
    import transformers
    from torch.profiler import ProfilerActivity, profile

    if args.checkpoint:  # a saved checkpoint (e.g. bench/targets_check.py's block-FP8 one), loaded as a run does
        from dflash_prep.recipe.schema import ModelSection

        section = ModelSection(name_or_path=args.checkpoint, tokenizer=str(REPO / "dflash_prep" / "demo" /
                                                                           "tiny-demo" / "tokenizer"),
                               dtype="bfloat16", fp8_weights=args.fp8_weights)
        config = load_config(section)
        num_layers = config.get_text_config().num_hidden_layers
    else:
        num_layers = args.layers or json.loads((REPO / "bench" / "configs" / f"{args.model}.json").read_text())[
            "num_hidden_layers"]
        section = dataclasses.replace(slice_section(args.model, num_layers, tmp), dtype="bfloat16")
        config = load_config(section)
    layer_ids = dflash_layer_ids(num_layers, 5)
    kernels = select_kernels(args.kernels if args.kernels == "auto" else args.kernels.split(","), config,
                             device.type)
    from dflash_prep.target import moe

    moe.DYNAMIC_DIMS = args.moe_dynamic
    t0 = time.perf_counter()
    model = load_model(section, config, device)
    drop_layers_after(model, layer_ids[-1])
    apply_kernels(model, kernels)
    packing.use_packed_attention(model, device.type)
    build_seconds = time.perf_counter() - t0
    samples = row_samples(config.get_text_config().vocab_size, args.row_tokens)
    tensors = collate_packed(samples, args.row_tokens, 0).tensors_on(device)
    real = sum(len(s.input_ids) for s in samples)
    with LayerCapture(model, layer_ids, storage_dtype=torch.bfloat16) as cap:
        run = lambda: cap.run(**tensors)  # noqa: E731
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            run()
        torch.cuda.synchronize(device)
        warmup_seconds = time.perf_counter() - t0
        times = [timed(run, device) for _ in range(args.repeats)]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
    median = statistics.median(times)
    return {"model": args.checkpoint or args.model, "fp8_weights": args.fp8_weights if args.checkpoint else None,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "kernels": list(kernels.names), "moe_dynamic": args.moe_dynamic, "layer_ids": layer_ids,
            "layers_run": layer_ids[-1] + 1,
            "row_tokens": args.row_tokens, "real_tokens": real, "num_samples": len(samples),
            "build_seconds": build_seconds, "warmup_seconds": warmup_seconds, "gpu_seconds": times,
            "real_tokens_per_second": real / median, "attention_calls": dict(packing.ATTENTION_CALLS),
            "profile": kernel_profile(prof, True, top=args.top)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3.6-27b")
    p.add_argument("--layers", type=int, default=0, help="the first N decoder layers only (default: all)")
    p.add_argument("--row-tokens", type=int, default=32768)
    p.add_argument("--kernels", default="auto", help="auto, or a comma list of model.kernels names")
    p.add_argument("--moe-dynamic", choices=("tokens", "all"), default="tokens",
                   help="the compiled experts' dynamic sizes (dflash_prep.target.moe.DYNAMIC_DIMS): the product's "
                        "`tokens`, or `all` (torch.compile(dynamic=True), before 2026-12-04)")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint folder to load instead of --model's random weights (a block-FP8 one runs as "
                        "FP8, or dequantized with --fp8-weights dequantize)")
    p.add_argument("--fp8-weights", choices=("auto", "dequantize"), default="auto",
                   help="model.fp8_weights for --checkpoint")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("forward_profile: needs CUDA", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        result = profile_forward(args, torch.device("cuda"), Path(tmp))
    prof = result["profile"]
    print(f"{result['model']} transformers {result['transformers']} kernels {result['kernels']}: "
          f"{result['real_tokens']} real tokens, GPU {[round(t, 3) for t in result['gpu_seconds']]} s, "
          f"{result['real_tokens_per_second']:,.0f} tok/s; profiled {prof['total_seconds']:.3f} s")
    for cat, v in prof["categories"].items():
        print(f"  {cat:16s} {v['seconds']:.3f} s {v['share']:.1%}")
    for row in prof["top"]:
        print(f"  {row['seconds']:.4f} s {row['share']:6.1%} x{row['calls']:<5d} {row['name'][:110]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

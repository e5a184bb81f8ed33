"""Where does the host wait in a packed forward? (GPU diagnosis of the packed rows' idle time.)

The 8B benchmark with packed rows of 131,072 tokens left the GPU idle ~0.5 s per forward, and each forward's host
time equalled a forward's GPU time: the host waits on the device somewhere inside `LayerCapture.run` of a packed
row, not of a padded batch. This script finds where, on slices of the benchmark shapes with `model.kernels: auto`,
bf16, as the extraction runs them:

    python3 bench/sync_probe.py [--models llama3.1-8b,qwen3.6-27b] [--layers 8] [--row-tokens 32768] --json OUT

Per model and path (packed row / padded batch of the same samples):
- `host_seconds`: host time of a forward enqueued while the previous one still runs (about the GPU time when the
  forward synchronizes; a few ms per layer when it does not), and `gpu_seconds` of the same forward;
- `syncs`: every synchronizing CUDA call `torch.cuda.set_sync_debug_mode("warn")` reports in one forward, with the
  innermost Python frames that made it (file:line function), counted;
- `runtime_calls`: CUDA runtime calls of one forward by host time (torch.profiler: cudaStreamSynchronize,
  cudaHostAlloc, cudaFree, cudaMemcpyAsync, ...), which also shows waits the debug mode does not report.
And `pinned_alloc_seconds`: one fresh pinned host buffer of a packed row's captured states (bf16), twice.
On a CPU the script runs tiny configs as a smoke test (no syncs to find).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.kernels_check import slice_section  # noqa: E402
from dflash_prep.plan import batches  # noqa: E402
from dflash_prep.plan.batches import SampleInfo, collate  # noqa: E402
from dflash_prep.target import packing  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import apply_kernels, select_kernels  # noqa: E402
from dflash_prep.target.model import drop_layers_after, load_config, load_model  # noqa: E402


def _samples(config, row_tokens: int, seed: int = 0) -> list[SampleInfo]:
    """Lengths of the benchmark's distribution (lognormal, mean ~320) filling one row of `row_tokens`."""
    g = np.random.default_rng(seed)
    vocab = config.get_text_config().vocab_size
    out, used = [], 0
    while True:
        n = int(np.clip(g.lognormal(5.41, 0.9), 16, 4096))
        if used + n > row_tokens - 64:
            return out
        out.append(SampleInfo(f"{len(out):010d}", len(out), None, g.integers(1, vocab, n).astype(np.int32),
                              np.ones(n, np.uint8)))
        used += n


def _frames(stack: list) -> str:
    """The innermost frames outside torch's own Python and this script: where the sync was asked for."""
    keep = [f for f in stack if "sync_probe" not in f.filename and "/warnings.py" not in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(keep[-6:]))


def _syncs_of(fn) -> dict:
    """Run `fn` under the sync debug mode; the synchronizing calls it made, by the frames that made them."""
    found = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        found[f"{str(message)[:80]} | {_frames(traceback.extract_stack())}"] += 1

    old = warnings.showwarning
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return dict(found.most_common(20))


def _runtime_calls(fn) -> list:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()
            if e.key.startswith("cuda") or e.key.startswith("aten::item") or "local_scalar" in e.key]
    rows.sort(key=lambda r: -r[1])
    return [{"name": n, "host_seconds": s, "calls": c} for n, s, c in rows[:15]]


def probe_path(cap: LayerCapture, tensors: dict, device) -> dict:
    """Timings, syncs and runtime calls of forwards of `tensors` (packed row or padded batch)."""
    run = lambda: cap.run(**tensors)  # noqa: E731
    run()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()  # the device is busy with this one while the next is enqueued
    first_host = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t1 = time.perf_counter()
    start.record()
    run()
    end.record()
    second_host = time.perf_counter() - t1
    torch.cuda.synchronize(device)
    return {"host_seconds_first": first_host, "host_seconds": second_host,
            "gpu_seconds": start.elapsed_time(end) / 1e3, "syncs": _syncs_of(run),
            "runtime_calls": _runtime_calls(run)}


def probe_model(name: str, num_layers: int, row_tokens: int, device, tmp: Path) -> dict:
    section = dataclasses.replace(slice_section(name, num_layers, tmp), dtype="bfloat16")
    config = load_config(section)
    kernels = select_kernels("auto", config, device.type)
    model = load_model(section, config, device)
    apply_kernels(model, kernels)
    layer_ids = [1, num_layers - 2]
    drop_layers_after(model, layer_ids[-1])
    samples = _samples(config, row_tokens)
    T = -(-max(len(s.input_ids) for s in samples) // 64) * 64
    out = {"kernels": list(kernels.names), "num_samples": len(samples), "row_tokens": row_tokens,
           "real_tokens": sum(len(s.input_ids) for s in samples)}
    with LayerCapture(model, layer_ids, storage_dtype=torch.bfloat16, padding_mask=False) as cap:
        out["padded"] = probe_path(cap, collate(samples, T, 0).tensors_on(device), device)
    packing.use_packed_attention(model, device.type)
    row = batches.collate_packed(samples, row_tokens, 0)
    with LayerCapture(model, layer_ids, storage_dtype=torch.bfloat16) as cap:
        out["packed"] = probe_path(cap, row.tensors_on(device), device)
    out["attention_calls"] = dict(packing.ATTENTION_CALLS)
    del model
    torch.cuda.empty_cache()
    return out


def pinned_alloc(num_bytes: int) -> list[float]:
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        buf = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        times.append(time.perf_counter() - t0)
        del buf
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3.1-8b,qwen3.6-27b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--row-tokens", type=int, default=32768)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_probe: needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = {"torch": torch.__version__, "row_tokens": args.row_tokens, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [m for m in args.models.split(",") if m]:
            try:
                result["models"][name] = probe_model(name, args.layers, args.row_tokens, device, Path(tmp))
            except Exception as e:  # noqa: BLE001 - the other model's figures still count
                traceback.print_exc()
                result["models"][name] = {"error": f"{type(e).__name__}: {e}"}
    # a packed row of the 8B shape: 5 layers x 4096 x 2 bytes per token
    result["pinned_alloc_seconds"] = {str(n): pinned_alloc(n * 5 * 4096 * 2) for n in (32768, 131072)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

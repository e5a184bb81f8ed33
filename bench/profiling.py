"""Where the time of a profiled dflash-prep pass goes: torch.profiler events grouped by kernel category."""

from __future__ import annotations

import re

# Kernel name patterns, first match wins: where a forward's GPU time goes.
KERNEL_CATEGORIES = (  # attention first: flash / mem-efficient kernels carry "cutlass" in their template names
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|addmm|bmm|\bmm\b|linear|cublas", re.I)),
    # flash-linear-attention's Gated DeltaNet kernels (chunk_gated_delta_rule_fwd_kernel_h_blockdim64, solve_tril,
    # merge_16x16_to_64x64_inverse, recompute_w_u_fwd, chunk_scaled_dot_kkt_fwd, chunk_local_cumsum, l2norm_fwd,
    # gdn_gate_fwd, chunk_fwd_kernel_o, ...)
    ("gated_deltanet", re.compile(r"chunk|delta|fla_|l2norm|solve_tril|recompute_w_u|cumsum|recurrent|kkt|"
                                  r"gdn|beta_sigmoid|merge_\d+x\d+|inverse", re.I)),
    ("conv", re.compile(r"conv", re.I)),
    ("memory", re.compile(r"memcpy|memset|copy|cat|index|gather|scatter|fill", re.I)),
    ("norm", re.compile(r"norm|rsqrt", re.I)),
)


def kernel_profile(prof, cuda: bool, top: int = 40) -> dict:
    """Seconds and share per kernel category and the `top` kernels (GPU: kernels by self device time; CPU: ops
    by self CPU time), from a finished torch.profiler session."""
    from torch.autograd import DeviceType

    rows = []
    for evt in prof.key_averages():
        if cuda:
            # Kernels, copies and memsets only: a CPU op (aten::mm) or runtime event (cudaLaunchKernel, "Command
            # Buffer Full") also carries the device time of what it launched or waited for, which counted twice.
            if getattr(evt, "device_type", None) != DeviceType.CUDA:
                continue
            t = getattr(evt, "self_device_time_total", None)
            t = getattr(evt, "self_cuda_time_total", 0) if t is None else t
        else:
            t = evt.self_cpu_time_total
        if t and t > 0:
            rows.append((evt.key, t / 1e6, evt.count))
    total = sum(t for _, t, _ in rows) or 1.0
    categories: dict[str, float] = {}
    for name, t, _ in rows:
        cat = next((c for c, pattern in KERNEL_CATEGORIES if pattern.search(name)), "other")
        categories[cat] = categories.get(cat, 0.0) + t
    rows.sort(key=lambda r: -r[1])
    return {"device": "cuda" if cuda else "cpu", "total_seconds": total,
            "categories": {c: {"seconds": t, "share": t / total}
                           for c, t in sorted(categories.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "seconds": t, "share": t / total, "calls": c} for n, t, c in rows[:top]]}


def synchronizing_calls(fn):
    """Run `fn()` with torch's CUDA sync debug mode on; returns (its result, {message | innermost frames: count})
    for every synchronizing call the mode reports (item(), copies to pageable memory, explicit syncs; it does not
    see implicit driver waits such as a pinned allocation, which torch.profiler's runtime calls show)."""
    import collections
    import traceback
    import warnings
    from pathlib import Path

    import torch

    found = collections.Counter()

    def frames() -> str:
        stack = [f for f in traceback.extract_stack()[:-2] if "/warnings.py" not in f.filename]
        return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack[-6:]))

    def show(message, category, filename, lineno, file=None, line=None):
        found[f"{str(message)[:60]} | {threading_name()} | {frames()}"] += 1

    def threading_name() -> str:
        import threading
        return threading.current_thread().name

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, dict(found.most_common(30))

"""A forward's states from the GPU to the host: one asynchronous copy per batch on a stream of its own, and the GPU
time of the forwards read from CUDA events (no per-batch sync)."""

from __future__ import annotations

import torch


def to_host(out, device: torch.device):
    """One asynchronous copy of a forward's packed states and per-sample non-finite flags into pinned host
    memory; returns (states, final states, flags, event). What is already on the host (CPU runs, a batch joined
    after an OOM split) passes through with event None. (bench/run_bench.py wraps this function.)

    The copy runs on a stream of its own (`copy_stream`), after the forward that made the states: the next forward
    does not wait for it (on the compute stream it cost 0.24 s of a 21.9 s benchmark loop of the 27B hybrid and
    0.38 s of 18.0 s of the 8B shape, bench/RESULTS.md, fifth round). `record_stream` keeps the caching allocator
    from reusing the states' GPU memory before the copy is done; `event` completes when the host copy is."""
    tensors = (out.hidden_states_NK, out.final_NH, out.nonfinite_B)
    if device.type != "cuda" or out.hidden_states_NK.device.type != "cuda":
        return (*tensors, None)
    stream = copy_stream(out.hidden_states_NK.device)
    stream.wait_stream(torch.cuda.current_stream(out.hidden_states_NK.device))
    host = []
    with torch.cuda.stream(stream):
        for t in tensors:
            if t is not None:
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t, non_blocking=True)
                t.record_stream(stream)
                t = pinned
            host.append(t)
        event = torch.cuda.Event()
        event.record(stream)
    return (*host, event)


_COPY_STREAMS: dict = {}


def copy_stream(device: torch.device):
    """The device-to-host copy stream of `device` (one per device and process, made on first use)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


class GpuTimer:
    """Sums the GPU time of the forwards with CUDA events (no per-batch sync; read once at the end)."""

    def __init__(self):
        self.pairs: list = []

    def start(self) -> None:
        self.pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self.pairs[-1][0].record()

    def stop(self) -> None:
        self.pairs[-1][1].record()

    def total_seconds(self) -> float:
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / 1000.0

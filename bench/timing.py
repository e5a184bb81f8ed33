"""Timers and rates: the GEMM peak (the MFU denominator), synchronous per-batch timings of the baselines,
CUDA-event timings of dflash-prep's forwards and copies, and the derived figures of every mode (tok/s, MFU)."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.models import weights_checksum

GB = 1e9


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def peak_memory(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def measure_gemm(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> dict:
    """Dense GEMM rate on this device: n x n x n matmul, warmed, median of `repeats` timed calls."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    del a, b
    free_memory(device)
    median = float(np.median(times))
    return {"size": n, "dtype": str(dtype).replace("torch.", ""), "device": str(device), "repeats": repeats,
            "median_seconds": median, "flops_per_second": 2 * n**3 / median,
            "tflops": 2 * n**3 / median / 1e12, "all_tflops": [2 * n**3 / t / 1e12 for t in times]}


# --------------------------------------------------------------------------------------- per-batch records
@dataclass
class BatchLog:
    """Per-forward timings of a mode (baselines: synchronous wall times)."""

    shapes_seen: set = field(default_factory=set)
    num_batches: int = 0
    num_samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    forward_seconds: float = 0.0
    copy_seconds: float = 0.0
    write_seconds: float = 0.0
    bytes_written: int = 0
    first_shape_batches: int = 0
    first_shape_seconds: float = 0.0  # forward time of batches whose shape was new
    first_shape_batch_seconds: float = 0.0  # whole time (forward, copy, save) of those batches
    first_shape_real_tokens: int = 0

    def add(self, shape: tuple, real: int, padded: int, t_forward: float, t_copy: float, t_write: float,
            nbytes: int, num_samples: int) -> None:
        new = shape not in self.shapes_seen
        self.shapes_seen.add(shape)
        self.num_batches += 1
        self.num_samples += num_samples
        self.real_tokens += real
        self.padded_tokens += padded
        self.forward_seconds += t_forward
        self.copy_seconds += t_copy
        self.write_seconds += t_write
        self.bytes_written += nbytes
        if new:
            self.first_shape_batches += 1
            self.first_shape_seconds += t_forward
            self.first_shape_batch_seconds += t_forward + t_copy + t_write
            self.first_shape_real_tokens += real


# ----------------------------------------------------------------------------------------------- dflash-prep
class DflashTimings:
    """Per-batch timings of run_extraction, gathered by wrapping module globals of the extraction's loop.

    `loop.LayerCapture.run` (the forward), `loop.to_host` (the device-to-host copy) are bracketed by CUDA events on
    the current stream: no synchronization is added, the pipeline runs as it does without the benchmark; the
    events are read after the run. On CPU, wall-clock times (CPU ops are synchronous).
    """

    def __init__(self, device: torch.device, layer_ids: list[int]):
        self.cuda = device.type == "cuda"
        self.layer_ids = layer_ids
        self.batches: list[dict] = []
        self.checksum: float | None = None
        self.load_seconds: float | None = None

    def mark(self, stream=None):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            return e
        return time.perf_counter()

    def span(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    @contextlib.contextmanager
    def installed(self):
        from dflash_prep.commands.extract import host_copy, loop, target_load

        timings = self
        orig_capture, orig_to_host, orig_load = loop.LayerCapture, loop.to_host, target_load.load_model

        class TimedCapture(orig_capture):
            def run(self, input_ids, attention_mask, position_ids, flat_index, **packed):
                # packed: a packed row's cu_seqlens and max_length (batching.packing)
                rec = {"shape": tuple(input_ids.shape), "real": int(flat_index.shape[0]),
                       "start": timings.mark(), "host_start": time.perf_counter()}
                timings.batches.append(rec)
                out = super().run(input_ids, attention_mask, position_ids, flat_index, **packed)
                rec["forward_end"] = timings.mark()
                rec["host_forward"] = time.perf_counter() - rec["host_start"]
                return out

        def timed_to_host(captured, device):
            t0 = time.perf_counter()
            out = orig_to_host(captured, device)
            if timings.batches:
                # the copy runs on the extraction's copy stream: its end is marked there (on CPU, now)
                timings.batches[-1]["copy_end"] = timings.mark(host_copy.copy_stream(device) if timings.cuda else None)
                # host time of the copy's enqueue (pinned allocation included), and when it ended: the gap to the
                # next forward's start is the loop's own host time (writer hand-off, the next batch)
                timings.batches[-1]["host_copy"] = time.perf_counter() - t0
                timings.batches[-1]["host_copy_end"] = time.perf_counter()
            return out

        def timed_load(section, config, device):
            t0 = time.perf_counter()
            model = orig_load(section, config, device)
            sync(device)
            timings.load_seconds = time.perf_counter() - t0
            timings.checksum = weights_checksum(model, timings.layer_ids)
            return model

        loop.LayerCapture, loop.to_host, target_load.load_model = TimedCapture, timed_to_host, timed_load
        try:
            yield self
        finally:
            loop.LayerCapture, loop.to_host, target_load.load_model = orig_capture, orig_to_host, orig_load

    def resolve(self) -> dict:
        """Sum the per-batch spans (after the run, once every event has completed)."""
        if self.cuda:
            torch.cuda.synchronize()
        seen, fwd, copy, first_s, first_n, first_real, host_fwd = set(), 0.0, 0.0, 0.0, 0, 0, 0.0
        per_batch = []
        for i, rec in enumerate(self.batches):
            f = self.span(rec["start"], rec["forward_end"])
            c = self.span(rec["forward_end"], rec["copy_end"]) if "copy_end" in rec else 0.0
            fwd, copy, host_fwd = fwd + f, copy + c, host_fwd + rec["host_forward"]
            first = rec["shape"] not in seen
            if first:
                seen.add(rec["shape"])
                first_s, first_n, first_real = first_s + f, first_n + 1, first_real + rec["real"]
            per_batch.append({"B": rec["shape"][0], "T": rec["shape"][1], "real_tokens": rec["real"],
                              "forward_seconds": f, "copy_seconds": c, "host_forward_seconds": rec["host_forward"],
                              "host_copy_seconds": rec.get("host_copy"),
                              "host_gap_seconds": (self.batches[i + 1]["host_start"] - rec["host_copy_end"]
                                                   if i + 1 < len(self.batches) and "host_copy_end" in rec else None),
                              "first_of_shape": first})
        return {"forward": fwd, "copy": copy, "first_shape_seconds": first_s, "first_shape_batches": first_n,
                "first_shape_real_tokens": first_real, "num_shapes": len(seen), "host_forward": host_fwd,
                "shapes": sorted(seen, key=lambda s: (-s[1], -s[0])), "batches": per_batch}


# ----------------------------------------------------------------------------------------------- rates
def finish_result(ctx, res: dict, gemm: dict) -> dict:
    """Derived figures, the same formulas for every mode (`ctx`: a bench.context.Ctx; only its model info's
    `decoder_params_active_needed` is read: the parameters a token runs through, an MoE's active experts)."""
    loop = res["loop_seconds"]
    real, padded = res["num_real_tokens"], res["num_padded_tokens"]
    tps = real / loop if loop > 0 else None
    res["tokens_per_second"] = tps
    res["samples_per_second"] = res["num_samples"] / loop if loop > 0 else None
    res["padding_efficiency"] = real / padded if padded else None
    flops = gemm["flops_per_second"]
    # MFU = 2 x params a token runs through in the executed decoder layers x real tok/s / measured GEMM rate
    # (lm_head not counted; an MoE counts its active experts)
    res["mfu"] = 2 * res["decoder_params_executed"] * tps / flops if tps else None
    # ... and over the layers the capture needs (same numerator in every mode: comparable useful work)
    res["mfu_needed_layers"] = 2 * ctx.info["decoder_params_active_needed"] * tps / flops if tps else None
    steady = res.get("tokens_per_second_excl_first_shapes")
    res["mfu_excl_first_shapes"] = 2 * res["decoder_params_executed"] * steady / flops if steady else None
    res["write_gb_per_second"] = res["bytes_written"] / loop / GB if loop > 0 else None
    return res

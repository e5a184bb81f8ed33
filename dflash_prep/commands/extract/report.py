"""What a rank says about its run: its figures (`OUT/index/rank-R.done.json`, listed in the summary), and the one
paragraph of a run that stopped cleanly (what went wrong, what is committed, how to go on)."""

from __future__ import annotations

import errno
from collections import Counter
from pathlib import Path

import torch

from dflash_prep.commands.cost import FORWARD_FLOPS_PER_SECOND, WRITE_BYTES_PER_SECOND
from dflash_prep.store.lease import call_within
from dflash_prep.store.manifest import read_committed
from dflash_prep.store.writer import AsyncShardWriter, NonFiniteStatesError
from dflash_prep.target.model import decoder_params_in
from dflash_prep.units import format_rate


def rank_report(run, model, writer: AsyncShardWriter, loop) -> dict:
    """This rank's figures for the run (`run`: job.Run; `loop`: loop.LoopResult)."""
    stats, runner, gpu_seconds = loop.stats, loop.runner, loop.gpu_forward_seconds
    return {
        "rank": run.rank, "num_batches": stats.num_batches, "num_samples": stats.num_samples,
        "num_real_tokens": stats.num_real_tokens, "num_padded_tokens": stats.num_padded_tokens,
        "num_shapes": len(stats.shapes_seen), "loop_seconds": loop.loop_seconds,
        "forward_seconds": stats.forward_seconds, "gpu_forward_seconds": gpu_seconds,
        "gpu_idle_seconds": None if gpu_seconds is None else max(loop.loop_seconds - gpu_seconds, 0.0),
        "data_wait_seconds": stats.data_wait_seconds,
        "writer_wait_seconds": stats.writer_wait_seconds, "writer_drain_seconds": stats.writer_drain_seconds,
        "write_seconds": writer.write_seconds,
        "num_writer_threads": len(writer.writers), "peak_pending_bytes": writer.peak_pending_bytes,
        "bytes_written": writer.bytes_written, "shards_committed": len(writer.committed),
        "decoder_params_run": decoder_params_in(model, active=True),  # per token (MoE: active experts)
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None,
        "num_failed": len(writer.failed),
        "failed": dict(sorted(Counter(f["reason"] for f in writer.failed).items())),
        "num_oom": runner.num_ooms if runner is not None else 0,
        "num_split_batches": runner.num_split_batches if runner is not None else 0,
        "oom_batch_caps": {str(T): n for T, n in sorted(runner.caps.items())} if runner is not None else {},
        "oom_packed_token_cap": runner.packed_token_cap if runner is not None else None,
        "kernels": list(run.kernels.names),
        "startup_seconds": dict(run.startup_seconds),
        "packed": run.packing.packed,
    }


def idle_rank_report(rank: int) -> dict:
    """The report of a rank that had nothing to run."""
    report = {key: 0 for key in ("num_batches", "num_samples", "num_real_tokens", "num_padded_tokens", "num_shapes",
                                 "num_failed", "num_oom", "num_split_batches", "bytes_written", "shards_committed",
                                 "num_writer_threads", "peak_pending_bytes", "decoder_params_run")}
    report.update({key: 0.0 for key in ("loop_seconds", "forward_seconds", "data_wait_seconds",
                                        "writer_wait_seconds", "writer_drain_seconds", "write_seconds")})
    report.update(rank=rank, gpu_forward_seconds=None, gpu_idle_seconds=None, peak_gpu_memory_bytes=None,
                  failed={}, oom_batch_caps={}, oom_packed_token_cap=None, kernels=[], startup_seconds={},
                  predicted_seconds=None)
    return report


def prediction_note(run, report: dict) -> str:
    """The split's predicted seconds of this rank's share, with what they rest on: one H200's measured rates
    (cost.py), so said on GPU runs only; a CPU run gets none (no basis: the rates are a GPU's)."""
    predicted = report.get("predicted_seconds")
    if predicted is None or run.device.type != "cuda":
        return ""
    return (f" (the split predicted {predicted:.1f}s from one H200's rates: {FORWARD_FLOPS_PER_SECOND / 1e12:.0f} "
            f"TFLOP/s forwards, {format_rate(WRITE_BYTES_PER_SECOND)} writes)")


COUNT_WAIT_SECONDS = 10.0  # how long a stop message waits for the store's list of committed shards


def stopped_message(out_dir: Path, rank: int, writer: AsyncShardWriter, error: BaseException,
                    committed=None) -> str:
    """One paragraph for a run that stopped cleanly: what went wrong, what is committed (`committed()`, else
    `out_dir`'s indexes), how to go on."""
    if isinstance(error, NonFiniteStatesError):
        what, fix = str(error), "fix the cause (or set output.nan_policy: fail_sample), then re-run the same command"
    else:
        what = f"writing shards failed: {type(error).__name__}: {error}"
        fix = ("free disk space under the output folder, then re-run the same command"
               if isinstance(error, OSError) and error.errno == errno.ENOSPC else
               "fix the cause, then re-run the same command")
    try:
        committed = read_committed(out_dir) if committed is None else \
            call_within(committed, COUNT_WAIT_SECONDS, "stop-message-count")
        done = (f"{sum(r.num_samples for r in committed)} samples in {len(committed)} shards are committed and "
                f"intact ({len(writer.committed)} of those shards by rank {rank} in this run)")
    except OSError:  # NoAnswerInTime too: a store that stopped answering is not waited on for a count
        done = "the shards committed so far are intact"
    return (f"rank {rank} stopped: {what}. {done}; the shards being written were discarded, nothing partial is "
            f"visible. To resume: {fix} (committed batches are not redone).")

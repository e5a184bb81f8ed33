"""The forward loop of one rank: batches -> forward with the capture hooks -> one async copy to the host -> the
writer lanes, until the loader is done or a stop signal arrives.

A write error or a fatal NaN stops the run cleanly (ExtractionError); the open shards are dropped. The processes of a
tensor-parallel replica agree after every batch whether any of them stops or failed (replica.ReplicaAgreement), so
they leave the loop together. (bench/timing.py wraps this module's `LayerCapture` and `to_host`.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from dflash_prep.commands.extract.host_copy import GpuTimer, to_host
from dflash_prep.commands.extract.progress import STOP_WAIT_SECONDS, JobProgress
from dflash_prep.commands.extract.report import stopped_message
from dflash_prep.commands.extract.stop import EXTRACTION_STOP_MESSAGE, StopRequest
from dflash_prep.commands.job import Run, committed_records
from dflash_prep.errors import ExtractionError, StopRequested
from dflash_prep.store.writer import AsyncShardWriter, NonFiniteStatesError, PendingBatch
from dflash_prep.target.backoff import BatchRunner
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.model import STORAGE_TORCH_DTYPES

log = logging.getLogger("dflash_prep")


@dataclass
class RankStats:
    num_samples: int = 0
    num_real_tokens: int = 0
    num_padded_tokens: int = 0
    num_batches: int = 0
    forward_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    writer_wait_seconds: float = 0.0  # the loop blocked on writers (pending batches at their bound)
    writer_drain_seconds: float = 0.0  # after the last forward, until the writers had written everything
    shapes_seen: set = field(default_factory=set)


@dataclass
class LoopResult:
    stats: RankStats
    runner: BatchRunner | None
    loop_seconds: float
    gpu_forward_seconds: float | None


def forward_loop(run: Run, model, loader, writer: AsyncShardWriter, progress: JobProgress) -> LoopResult:
    """Every batch of `loader` through `model` into `writer` (see the module docstring), counted in `progress`; a
    stop signal commits the batches captured so far and raises ExtractionError."""
    gpu_timer = GpuTimer() if run.device.type == "cuda" else None
    stats, runner, stop, stopped_early = RankStats(), None, StopRequest(EXTRACTION_STOP_MESSAGE), False
    t_loop = time.perf_counter()
    try:
        with LayerCapture(model, run.layer_ids, capture_final=run.recipe.layers.capture_final,
                          storage_dtype=STORAGE_TORCH_DTYPES[run.recipe.output.dtype],
                          padding_mask=run.recipe.model.padding_mask) as capture:
            runner = BatchRunner(capture, run.faults, agree_oom=run.agreement.agree_attempt)
            t_wait = time.perf_counter()
            for batch in loader:
                stats.data_wait_seconds += time.perf_counter() - t_wait
                _forward_agreed(run, batch, runner, writer, stats, gpu_timer, stop)
                _check_leases(run)
                if stats.num_batches == 1:  # its DataLoader start, collate, first-seen shape, hooks
                    run.startup_seconds["first_batch"] = time.perf_counter() - t_loop
                progress.update(stats.num_samples, stats.num_real_tokens, writer.wait_seconds)
                if stop.requested:
                    stopped_early = True  # the batches captured so far are written and committed below
                    break
                t_wait = time.perf_counter()
        t_drain = time.perf_counter()
        writer.close()
        stats.writer_drain_seconds = time.perf_counter() - t_drain
        progress.finish(stats.num_samples, stats.num_real_tokens)
    except BaseException as e:
        progress.close()
        _abort_writer(run, writer, e)
        raise
    finally:
        stop.restore()
    if stopped_early:
        progress.close()
        _stop_after_commit(run, stop.signal_name, stats.num_batches, progress)
    stats.writer_wait_seconds = writer.wait_seconds
    result = LoopResult(stats, runner, time.perf_counter() - t_loop,
                        gpu_timer.total_seconds() if gpu_timer is not None else None)
    progress.follow_others(stats.num_samples, stats.num_real_tokens,  # the main's bar, outside its loop's time
                           quiet_seconds=min(run.recipe.output.peer_timeout_seconds, 60.0))
    return result


def _check_leases(run: Run) -> None:
    """Stop (ExtractionError) once another run took over a lease of this process (locks.py): this process stopped
    renewing it for longer than the lease (frozen, or cut off from the output's filesystem), and the other run now
    owns the folder; nothing more is written."""
    lost = [lock for lock in run.locks if lock.lost]
    if lost:
        raise ExtractionError(f"another run took over this run's claim on {run.out_dir} (the lease "
                              f"{lost[0].lease.name}: this process did not renew it for longer than "
                              f"output.lease_seconds={run.recipe.output.lease_seconds:g}, frozen or cut off); "
                              f"stopping without writing more: committed shards are intact")


def _forward_agreed(run: Run, batch, runner: BatchRunner, writer: AsyncShardWriter, stats: RankStats,
                    gpu_timer: GpuTimer | None, stop: StopRequest) -> None:
    """`_forward_one`, then one agreement of the replica's processes (replica.ReplicaAgreement; free with one
    process per replica): a stop asked of any of them is a stop for all (`stop` is set), a failure of any (a write
    error or a fatal NaN seen by the writer, an error in a forward) stops the others with ExtractionError; the
    failing process says so before raising its own error."""
    try:
        _forward_one(run, batch, runner, writer, stats, gpu_timer)
        if run.faults is not None:
            run.faults.after_batch(run.state.process_index, stats.num_batches)
    except Exception:
        run.agreement.agree(stop.requested, True)
        raise
    stop_any, failed_any = run.agreement.agree(stop.requested, False)
    if failed_any:
        raise ExtractionError(f"rank {run.rank} stopped: another process of its replica failed (its log says why); "
                              f"committed shards are intact, re-run the same command to resume")
    if stop_any and not stop.requested:
        stop.signal_name = "the stop of another process of its replica"


def _forward_one(run: Run, batch, runner: BatchRunner, writer: AsyncShardWriter, stats: RankStats,
                 gpu_timer: GpuTimer | None) -> None:
    """One planned batch: forward (with OOM backoff), the async host copy, handed to the writer; stats counted."""
    t_fwd = time.perf_counter()
    tensors = batch.tensors_on(run.device)
    if gpu_timer is not None:
        gpu_timer.start()
    out = runner.run(batch, tensors)
    if gpu_timer is not None:
        gpu_timer.stop()
    hs, final, nonfinite, event = to_host(out, run.device)
    stats.forward_seconds += time.perf_counter() - t_fwd
    writer.submit(PendingBatch(batch.batch_id, out.samples, hs, final, event, run.layer_ids,
                               failed=out.failed, nonfinite_B=nonfinite))
    stats.num_batches += 1
    stats.num_samples += len(batch.samples)
    stats.num_real_tokens += batch.num_real_tokens
    stats.num_padded_tokens += batch.num_padded_tokens
    stats.shapes_seen.add(tuple(batch.input_ids.shape))


def _abort_writer(run: Run, writer: AsyncShardWriter, error: BaseException) -> None:
    """The loop failed: drop the open shards; a write error or a fatal NaN becomes a clean ExtractionError."""
    try:
        writer.abort()  # drains the queue, drops the open shard (its .tmp)
    except Exception as abort_error:  # noqa: BLE001 - the original error is the one to report
        log.error("could not clean up the open shard: %s", abort_error)
    if error is writer.error or isinstance(error, NonFiniteStatesError):
        message = stopped_message(run.out_dir, run.rank, writer, error, lambda: committed_records(run))
        log.error("%s", message, exc_info=error, extra={"console": False})
        raise ExtractionError(message) from error
    log.exception("extraction failed on rank %d; committed shards are intact, re-run the same command "
                  "to resume", run.rank)


def _stop_after_commit(run: Run, signal_name: str | None, num_batches: int, progress: JobProgress) -> None:
    """A stop signal arrived: every batch this rank captured was written and committed; raise StopRequested. The
    main process first waits for the other ranks to commit theirs (progress.py), then says one count for all."""
    message = (f"rank {run.rank} stopped on {signal_name}: {num_batches} batch(es) of this run were written and "
               f"committed")
    if run.is_main:
        running = progress.wait_for_others(STOP_WAIT_SECONDS)
        committed = sum(r.num_samples for r in committed_records(run))
        message = (f"stopped on {signal_name}: every rank committed the batches it had captured (on rank {run.rank}, "
                   f"{num_batches} batch(es) of this run were written and committed); {committed} samples committed "
                   f"in all"
                   + (f" so far (rank(s) {', '.join(map(str, running))} still running)" if running else ""))
    message += "; re-run the same command to resume"
    log.warning("%s", message, extra={"console": False})
    raise StopRequested(message)

"""One rank's run of a job, stage after stage in data-flow order (`_run_extraction` reads top to bottom):

    start               recipe checks, config, layer ids, kernels, replica, token budget, tokenizer     (start.py)
    take_output         the output's bookkeeping in order: claim (locks, identity), the rows (_tokenize),
                        the repair of what a crash left, the run recorded, the frozen plan               (claim.py)
    TargetLoad          the model loads on a thread of its own while the rows are tokenized             (target_load.py)
    _plan               the global plan minus what is committed, this replica's share                  (planner)
    _run_rank           load_target -> DataLoader -> forward_loop -> writer lanes                       (loop.py)
    finish_run          main process: token frequencies, failed.jsonl, summary, manifest last           (finish.py)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import sys
import time

# Before torch touches CUDA: fewer fragmentation OOMs with batches of changing shapes (user settings win).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from dflash_prep.commands.extract.claim import take_output  # noqa: E402
from dflash_prep.commands.extract.finish import finish_run, samples_beyond_context  # noqa: E402
from dflash_prep.commands.extract.loop import forward_loop  # noqa: E402
from dflash_prep.commands.extract.peers import PeerLostError  # noqa: E402
from dflash_prep.commands.extract.progress import JobProgress, clear_progress  # noqa: E402
from dflash_prep.commands.extract.report import idle_rank_report, prediction_note, rank_report  # noqa: E402
from dflash_prep.commands.extract.start import start  # noqa: E402
from dflash_prep.commands.extract.stop import init_worker  # noqa: E402
from dflash_prep.commands.extract.target_load import TargetLoad, load_target  # noqa: E402
from dflash_prep.commands.job import REFUSALS, RankPlan, Run, committed_records, manifest_readable  # noqa: E402
from dflash_prep.data.rows import check_data_verdict, load_rows, tokenize_dataset  # noqa: E402
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_STOPPED  # noqa: E402
from dflash_prep.io import atomic_write_json  # noqa: E402
from dflash_prep.plan.batches import PlannedBatches  # noqa: E402
from dflash_prep.plan.planner import plan_stats, rank_finish_seconds, split_across_ranks  # noqa: E402
from dflash_prep.recipe.schema import Recipe  # noqa: E402
from dflash_prep.signals import ignore_stop_signals  # noqa: E402
from dflash_prep.store.manifest import next_shard_number  # noqa: E402
from dflash_prep.store.records import SHARDS_DIR, rank_name  # noqa: E402
from dflash_prep.store.remote import ShardUploader  # noqa: E402
from dflash_prep.store.sizes import check_free_space  # noqa: E402
from dflash_prep.store.writer import AsyncShardWriter, DiscardingWriter, lanes  # noqa: E402
from dflash_prep.target.model import hidden_size_of, padding_token_id, vocab_size_of  # noqa: E402
from dflash_prep.target.packing import replay_stored_layout  # noqa: E402
from dflash_prep.units import format_bytes  # noqa: E402

log = logging.getLogger("dflash_prep")


def run_extraction(recipe: Recipe, own_process: bool = False) -> dict | None:
    """Run the job of `recipe` on this process's rank. Returns the summary on the main process.

    The output folder is locked for the run (locks.py): a second run into it stops before touching anything.
    `own_process`: this process runs the extraction and exits after it (the launched script), so an error before
    the model finished loading returns at once, leaving the load to the process's exit (`main`); otherwise the
    load is waited for."""
    held: list = []
    try:
        return _run_extraction(recipe, held, own_process)
    finally:
        for lock in reversed(held):
            lock.release()


def _run_extraction(recipe: Recipe, held: list, own_process: bool = False) -> dict | None:
    """The stages, in data-flow order; each is a function below (or of its own module). The model loads on a
    thread of its own while the rows are tokenized and the plan made (`TargetLoad`)."""
    run = start(recipe)                        # process group, logging; every recipe check before any weights
    if run.remote is not None:
        held.append(run.remote)                # released last: this node's logs uploaded beside the output
    try:
        data, rank_plan = _run_share(run, held, own_process)
    except BaseException as e:
        if run.is_main and not isinstance(e, PeerLostError):  # the others learn it at their next wait, and end
            if isinstance(e, REFUSALS):  # said before the others end: the launcher may stop this process once they do
                print(f"error: {e}", file=sys.stderr, flush=True)
                e.reported = True  # entry.py prints it no second time
            run.peers.abort(EXIT_BAD_RECIPE if isinstance(e, REFUSALS) else EXIT_STOPPED)  # quietly (peers.py)
        raise
    if not run.is_main:
        ignore_stop_signals()  # its share is committed and every rank's too: the main process finishes the output
        return None
    clear_progress(run.out_dir)  # every rank is done: the live figures have served
    return finish_run(run, data, rank_plan)  # manifest last


STARTUP_LABELS = {"start": "to the output's claim"}  # the log's words for the summary's startup_seconds keys


def _run_share(run: Run, held: list, own_process: bool):
    """From the claim of the output to the end of every rank's share: -> (data, rank plan)."""
    load, times = None, {}

    def tokenize(run: Run):  # called by take_output once the output is claimed
        nonlocal load
        times["claimed"] = time.perf_counter()
        run.startup_seconds["start"] = times["claimed"] - run.t_start
        load = TargetLoad.start_if_safe(run)   # the weights load while this thread tokenizes and plans
        data = _tokenize(run)                  # rows -> token ids + loss masks (datasets cache), skips counted
        times["tokenized"] = time.perf_counter()
        return data

    try:
        # the claim (locks, identity), the rows, the repair of what a crash left, the frozen plan (claim.py)
        data, plan = take_output(run, held, tokenize)
        rank_plan = _plan(run, data, plan)     # the global plan minus what is committed, this rank's share
        run.startup_seconds.update(tokenize=times["tokenized"] - times["claimed"],
                                   plan=time.perf_counter() - times["tokenized"])
    except BaseException:
        if load is not None and not own_process:
            load.wait()  # in-process callers get no thread left behind; a process of its own exits at once (main)
        raise
    lock_fds = tuple(lock.fd for lock in held if lock.fd is not None)
    report = _run_rank(run, data, rank_plan, lock_fds, load)  # model + kernels + hooks + loop -> committed shards
    # one process per replica writes; a finished output keeps its run's figures
    if run.is_writer and (rank_plan.todo or not manifest_readable(run.out_dir)):
        atomic_write_json(run.out_dir / "index" / f"{rank_name(run.rank)}.done.json", report)
        if run.remote is not None:  # the main process may be on another node: it reads the store's
            run.remote.push([f"index/{rank_name(run.rank)}.done.json"])
    log.info("rank %d done: %d samples, %d tokens in %.1fs%s; start-up: %s", run.rank,
             report["num_samples"], report["num_real_tokens"], report["loop_seconds"], prediction_note(run, report),
             ", ".join(f"{STARTUP_LABELS.get(k, k.replace('_', ' '))} {v:.1f}s"
                       for k, v in run.startup_seconds.items() if not isinstance(v, bool)))
    run.peers.wait("every rank finishes its share of the plan")
    return data, rank_plan


def _uploader(run: Run):
    """An object-store output's uploader of this rank's shards (store/remote.py), else None (local commits)."""
    if run.remote is None:
        return None
    # what a killed run of this rank left in this node's staging folder was never uploaded: redone, not kept
    shutil.rmtree(run.out_dir / SHARDS_DIR / rank_name(run.rank), ignore_errors=True)
    part = run.faults.upload_part_bytes if run.faults is not None and run.faults.upload_part_bytes else None
    return ShardUploader(run.remote, run.rank, run.recipe.output.max_uploads_in_flight,
                         lease=run.remote.rank_lease, fence=run.fence, **({"chunk_bytes": part} if part else {}))


def _tokenize(run: Run):
    """Rows -> tokenized data (cached by datasets: the main process fills the cache, the others read it). The data
    verdict (nothing kept, too much skipped: exit 2) comes before the output is prepared."""
    if not run.is_main:  # the main process fills the cache first (accelerate's main_process_first, bounded)
        run.peers.wait("the main process tokenizes the rows")
    rows = load_rows(run.recipe.data)
    data = tokenize_dataset(rows, run.tokenizer, run.recipe.data, vocab_size_of(run.config))
    if run.is_main:
        run.peers.wait("every process waits for the tokenized rows")
    check_data_verdict(data, run.recipe.data)
    if run.is_main:
        samples = "" if data.num_candidates == data.num_rows else f" -> {data.num_candidates} samples (per turn)"
        log.info("data: %d rows%s, %d kept, %d skipped%s", data.num_rows, samples, len(data.kept),
                 sum(data.skipped_counts.values()), f" {data.skipped_counts}" if data.skipped_counts else "")
        if data.samples:
            from dflash_prep.data.samples import samples_line

            log.info("data: samples (data.samples: %s): %s", run.recipe.data.samples, samples_line(data.samples))
        beyond = samples_beyond_context(run, [int(n) for n in data.kept["num_tokens"]])
        if beyond:  # only with data.allow_beyond_context (start-up refuses it otherwise)
            log.warning("data: %d kept row(s) are longer than the model's context of %d positions; extracted as "
                        "data.allow_beyond_context says", beyond, run.context_length)
    return data


def _plan(run: Run, data, plan: list) -> RankPlan:
    """The global plan (frozen in OUT/plan.json by the first run), minus the committed batches, split over this
    run's ranks by predicted time (cost.py: the forward's FLOPs and the write's bytes of each batch)."""
    lengths = [int(n) for n in data.kept["num_tokens"]]
    run.packing = replay_stored_layout(run.packing, bool(plan) and plan[0].packed, run.config, run.device.type,
                                       run.kernels.names)
    if run.faults is not None:
        run.faults.before_plan()
    committed = committed_records(run)
    # every rank splits the same todo list, so none may commit before all have read the index: a rank slow to
    # start would otherwise see a faster rank's new shards and take a share that overlaps or leaves a gap
    run.peers.wait("every rank reads the committed shards")
    done_batches = {b for r in committed for b in r.batch_ids}
    todo = [p for p in plan if p.batch_id not in done_batches]
    cost = functools.partial(run.cost_model.cost_of, lengths=lengths)
    shares = split_across_ranks(todo, run.world, cost)  # every rank finishes at the same predicted time
    rank_plan = RankPlan(lengths=lengths, stats=plan_stats(plan), committed=committed, todo=todo,
                         mine=shares[run.rank],
                         predicted_seconds=[rank_finish_seconds([cost(b) for b in s]) for s in shares])
    if run.is_main:
        s = rank_plan.stats
        packed = run.packing.packed
        log.info("plan: %d %s, %d shapes, batch size %s-%s (mean %.1f), %s %s-%s, padding efficiency %.3f",
                 s["num_batches"], "packed rows" if packed else "batches", s["num_shapes"], s["batch_size_min"],
                 s["batch_size_max"], s["batch_size_mean"] or 0, "row length" if packed else "padded length",
                 s["padded_length_min"], s["padded_length_max"], s["padding_efficiency"] or 0)
        if done_batches:
            log.info("resume: %d of %d batches already committed, %d left over %d rank(s)",
                     len(plan) - len(todo), len(plan), len(todo), run.world)
        if run.remote is None:
            check_free_space(run.out_dir, lengths, shares, run.layer_ids, hidden_size_of(run.config), run.recipe)
        else:
            out = run.recipe.output
            log.info("output: %s, shards staged in %s (at most %s per rank: (%d writer threads + %d uploads in "
                     "flight) x %s)",
                     run.remote.url, run.out_dir, format_bytes((out.num_writer_threads + out.max_uploads_in_flight)
                                                               * out.max_shard_bytes),
                     out.num_writer_threads, out.max_uploads_in_flight, format_bytes(out.max_shard_bytes))
    return rank_plan


def _run_rank(run: Run, data, rank_plan: RankPlan, lock_fds: tuple, load: TargetLoad | None) -> dict:
    """This rank's batches through the model into the writer; the rank's report. A finished output re-run has
    nothing to do: the model is not even loaded (a load already under way is waited for and dropped)."""
    if not rank_plan.todo:
        if load is not None:
            load.wait()
        log.info("every batch of the plan is committed: nothing to run, the model is not loaded")
        return {**idle_rank_report(run.rank), "startup_seconds": dict(run.startup_seconds)}
    model = load_target(run, load)
    run.agreement.watch(model)  # a tensor-parallel replica's OOM splits compare its collectives (replica.py)
    writer = DiscardingWriter() if not run.is_writer else AsyncShardWriter(
        lanes(run.out_dir, run.rank, run.recipe.output.max_shard_bytes,
              next_shard_number(rank_plan.committed, rank_name(run.rank)), run.recipe.output.num_writer_threads,
              run.faults, publisher=_uploader(run), run_id=run.run_id, write_mode=run.recipe.output.write_mode,
              fence=run.fence if run.remote is None else None),
        nan_policy=run.recipe.output.nan_policy,
        max_pending_bytes=run.recipe.output.max_pending_bytes)
    loader = torch.utils.data.DataLoader(
        PlannedBatches(data.kept, rank_plan.mine, padding_token_id(run.tokenizer, vocab_size_of(run.config))),
        batch_size=None, shuffle=False, num_workers=run.recipe.batching.num_workers,
        pin_memory=run.device.type == "cuda", persistent_workers=False,
        prefetch_factor=4 if run.recipe.batching.num_workers else None,
        worker_init_fn=functools.partial(init_worker, lock_fds))
    total = len(rank_plan.lengths)
    progress = JobProgress(run, total, total - sum(len(p.sample_indices) for p in rank_plan.todo))
    with gil_switch_interval(run.recipe.output.switch_interval_seconds):
        loop = forward_loop(run, model, loader, writer, progress)
    report = rank_report(run, model, writer, loop)
    report["predicted_seconds"] = rank_plan.predicted_seconds[run.rank] if rank_plan.predicted_seconds else None
    return report


@contextlib.contextmanager
def gil_switch_interval(seconds: float | None):
    """`sys.setswitchinterval(seconds)` for the block (the writer lanes' turn at the GIL: recipe key
    `output.switch_interval_seconds`), the process's own interval back after it; None changes nothing."""
    if seconds is None:
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    log.info("GIL switch interval %.3g ms while the writer lanes run (output.switch_interval_seconds; Python's: "
             "%.3g ms)", seconds * 1e3, before * 1e3)
    try:
        yield
    finally:
        sys.setswitchinterval(before)

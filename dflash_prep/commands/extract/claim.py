"""The start of a run's bookkeeping, in one place: the claim of the output, the job's identity, the repair of what a
crash left, the run's record and the frozen plan. `take_output` is the sequence; each step is a function below:

    claim_output       main: the run's lock (flock + lease; the store's lease too), no orphaned rank writing, the
                       output of another job refused (identity without the rows); the run id and the fencing
                       token (the run lease's generation) to every process; every writing rank its own lock
    tokenize           the caller's (run.py): rows -> token ids; the model loads meanwhile
    prepare_output     main: the rows' identity checked; torn index lines cut, committed shards whose file is missing
                       or damaged dropped, uncommitted files removed (the record store, store/record_store.py);
                       the recipe, the skipped rows and the run recorded (nothing written for a finished output)
    load_or_make_plan  every process: OUT/plan.json, made once by the main process, read back by all

An object-store output (`run.remote`): the claim copies its small files into the staging folder, and what is
repaired or written here is uploaded (store/remote.py).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from dflash_prep import __version__
from dflash_prep.commands.extract.console import attach_log_file
from dflash_prep.commands.extract.progress import clear_progress
from dflash_prep.commands.job import (
    _OUTPUT_MARKERS,
    PLAN_NAME,
    RECIPE_NAME,
    SKIPPED_NAME,
    Run,
    check_identity,
    manifest_readable,
    read_stored_plan,
)
from dflash_prep.io import atomic_write_json, atomic_write_jsonl
from dflash_prep.plan.planner import PlannedBatch, make_plan, plan_settings
from dflash_prep.recipe.fingerprints import inputs_stamp, rows_fingerprint
from dflash_prep.recipe.schema import Recipe, RecipeError
from dflash_prep.store.locks import (
    LOCKS_DIR,
    OutputFence,
    OutputLock,
    check_no_rank_writing,
    lock_rank,
    lock_run,
    new_run_id,
)
from dflash_prep.store.manifest import STATE_NAME, OutputStateError, damaged_shards, read_state_json, shard_store
from dflash_prep.store.remote import RemoteFence, claim_rank, claim_run

log = logging.getLogger("dflash_prep")


def take_output(run: Run, held: list, tokenize: Callable[[Run], object]) -> tuple[object, list[PlannedBatch]]:
    """A run's bookkeeping from the claim of the output to its plan (module docstring). `held` receives the locks
    this process takes (the caller releases them, last first); `tokenize(run)` gives the tokenized data (its
    `kept` rows, `skipped_rows`). -> (the data, the global plan as stored)."""
    claim_output(run, held)
    data = tokenize(run)
    if run.is_main:
        run.identity["data_rows"] = rows_fingerprint(data.kept)
        # refuses rows that differ; repairs what a crash left (fenced in a store)
        if not prepare_output(run.out_dir, run.recipe, run.identity, run.remote, run.fence):
            atomic_write_jsonl(run.out_dir / SKIPPED_NAME, data.skipped_rows)
            if run.remote is not None:
                run.remote.push([SKIPPED_NAME])
    lengths = [int(n) for n in data.kept["num_tokens"]]
    plan = load_or_make_plan(run.out_dir, lengths, run.recipe, run.is_main, run.peers, packed=run.packing.packed,
                             remote=run.remote)
    return data, plan


def claim_output(run: Run, held: list) -> None:
    """The main process locks the folder (locks.py: a flock and a lease, for runs on any host) and checks it is this
    job's before anything in it is touched; its run id and fencing token reach every process; then every writing
    rank holds its own lock (both released when its process dies: the flock by the kernel, the lease once it
    lapses)."""
    output = run.recipe.output
    token = 0
    if run.is_main:
        token = _lock_run(run, held)
        open_output(run.out_dir, run.recipe, run.identity, run.remote)
        run.inputs_stamp = inputs_stamp(run.recipe)  # before any input is read: written once the output is finished
        clear_progress(run.out_dir)  # the progress files of an earlier run (progress.py)
        attach_log_file(run.out_dir, run.state.process_index)  # the folder is this job's: its log from here on
        log.info("run %s holds %s (fencing token %d)", run.run_id,
                 run.remote.url if run.remote is not None else run.out_dir, token)
    shared = run.peers.wait("the main process claims the output",
                            payload=(token << 32) | int(run.run_id or "0", 16))
    run.run_id, token = f"{shared & 0xFFFFFFFF:08x}", shared >> 32
    if not run.is_main:
        attach_log_file(run.out_dir, run.state.process_index)
    run.fence = RemoteFence(run.remote, token) if run.remote is not None else \
        OutputFence(run.out_dir, token, run.run_id)
    if run.remote is not None:
        run.remote.fence = run.fence  # its logs are uploaded at the end only while the run holds the output
    if run.is_writer:  # the other processes of a replica write nothing
        held.append(lock_rank(run.out_dir, run.rank, run.run_id, output.lease_seconds))
        if run.remote is not None:
            run.remote.rank_lease = claim_rank(run.remote, run.rank)
            held.append(run.remote.rank_lease)
    run.locks = [lock for lock in held if isinstance(lock, OutputLock)]  # an object store's leases: store/lease.py


def _lock_run(run: Run, held: list) -> int:
    """The main process's locks of the output: -> the run's fencing token, the generation of its run lease (of
    the store's, for an object-store output), above every token the output's records carry."""
    floor = 0 if run.remote is not None else shard_store(run.out_dir).max_fence() + 1
    lock = lock_run(run.out_dir, new_run_id(), run.recipe.output.lease_seconds, min_generation=floor)
    held.append(lock)  # object store: its staging folder
    run.run_id = lock.run_id
    check_no_rank_writing(run.out_dir, run.run_id)  # no orphaned worker of an earlier run still writes
    if run.remote is None:
        return lock.lease.generation
    # the store's lease (store/lease.py), no live rank lease
    held.append(claim_run(run.remote, run.recipe.output.require_conditional_writes))
    return held[-1].generation


def open_output(out_dir: Path, recipe: Recipe, identity: dict, remote=None) -> None:
    """Main process, holding the run lock, before the data is read: start afresh (`output.overwrite`) or check
    that the output is this job's (all but the data rows, which are not tokenized yet). An object-store output
    (`remote`): its small files are first copied into the staging folder `out_dir` (remote.py)."""
    if remote is not None:
        refuse_unsafe_remote_output(remote, recipe)
        if recipe.output.overwrite:
            remote.clear()
        remote.pull_state()
    if recipe.output.overwrite and out_dir.exists():
        for child in out_dir.iterdir():
            if child.name in ("logs", LOCKS_DIR):
                continue  # the live log handlers of this run write there; this run holds its lock there
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    check_identity(out_dir, identity, recipe)


def refuse_unsafe_remote_output(remote, recipe: Recipe) -> None:
    """`output.overwrite` on a store prefix that holds objects but no dflash-prep output (RecipeError): the user's
    objects are never deleted."""
    names = remote.names() - {LOCKS_DIR}
    if recipe.output.overwrite and names and "logs" not in names and not names & set(_OUTPUT_MARKERS):
        raise RecipeError(f"recipe key `output.overwrite` = True: {remote.url} is not a dflash-prep output (no "
                          f"{', '.join(_OUTPUT_MARKERS)}; it holds {', '.join(sorted(names)[:5])}...): refusing to "
                          f"delete its objects; set output.dir to a new or empty prefix")


def prepare_output(out_dir: Path, recipe: Recipe, identity: dict, remote=None, fence=None) -> bool:
    """Main process, once the rows are tokenized: check the data rows, clean up a crashed run, drop committed
    shards whose file is missing or damaged (their batches are redone), save the recipe and the run state.

    Returns True for a finished output found intact (a readable manifest, nothing repaired, dropped or removed):
    then nothing is written, so re-running a finished job leaves the output as it was. An object-store output
    (`remote`): `out_dir` is the staging folder holding a copy of its indexes; the shards are checked, dropped and
    removed in the store, and what is repaired or written here is uploaded."""
    check_identity(out_dir, identity, recipe)
    changed = repair_output(out_dir, remote, fence)
    if not changed and manifest_readable(out_dir):
        return True
    record_run(out_dir, recipe, identity)
    if remote is not None:
        if fence is not None:
            fence.check()
        remote.push([RECIPE_NAME, STATE_NAME])
    return False


def repair_output(out_dir: Path, remote=None, fence=None) -> bool:
    """What a crash left, repaired by the record store (`RecordStore.prepare`), each step logged; the store's
    objects too for an object-store output, each change to the store once `fence` (the run's fence; a store's
    only is used) says this run still holds it. -> whether a record was dropped or a file removed."""
    check = remote.damaged_shards if remote is not None else (lambda committed: damaged_shards(out_dir, committed))
    found = shard_store(out_dir).prepare(check=check)
    for index, records_cut in found.repaired:
        if remote is not None:
            if fence is not None:
                fence.check()
            remote.push([str(Path(index).relative_to(out_dir))])
        if records_cut:
            log.warning("%s holds an unreadable line before %d readable record(s) (an edit, or damage): cut at that "
                        "line; the shards of those records are redone", index, records_cut)
        else:
            log.warning("%s ended in a torn line (a crash while appending): cut back to its last complete line", index)
    for path, why in found.damaged.items():
        log.warning("committed shard %s is damaged (%s): its batches are redone", path, why)
    for record in found.superseded:
        log.warning("shard %s was committed by a run that had lost the output (frozen past its lease); another "
                    "run's record holds its samples: kept that one, dropped this one", record.path)
    removed = list(found.removed)
    if remote is not None:
        dropped = set(found.damaged) | {r.path for r in found.superseded}
        if dropped:
            remote.drop(dropped, fence)
        removed += remote.remove_uncommitted(found.committed, fence)
    if removed:
        log.info("removed %d uncommitted file(s) left by an interrupted run", len(removed))
    return bool(found.damaged or found.superseded or removed)


def record_run(out_dir: Path, recipe: Recipe, identity: dict) -> None:
    """The recipe as it runs (with the stored plan's batching) and the run state: identity, version, the runs."""
    (out_dir / RECIPE_NAME).write_text(_with_stored_batching(recipe, out_dir).to_yaml())
    state_path = out_dir / STATE_NAME
    runs = read_state_json(state_path).get("runs", []) if state_path.exists() else []
    runs.append({"started_at": time.time(), "dflash_prep_version": __version__,
                 "attn_implementation": recipe.model.attn_implementation})
    atomic_write_json(state_path, {"identity": identity, "dflash_prep_version": __version__, "runs": runs})


def load_or_make_plan(out_dir: Path, lengths: list[int], recipe: Recipe, is_main: bool, state,
                      packed: bool = False, remote=None) -> list[PlannedBatch]:
    """The global plan: made once by the main process (packed rows when `packed`) and frozen in OUT/plan.json (so
    resumes run the same batches whatever the number of ranks); every rank reads it back. A stored plan keeps its
    layout (`PlannedBatch.packed`, false for a plan.json written before packing existed). An object-store output
    (`remote`): the main process uploads the plan, the others read the store's (their node may be another)."""
    path = out_dir / PLAN_NAME
    if is_main and not path.exists():
        plan = make_plan(lengths, recipe, packed=packed)
        atomic_write_json(path, {"batching": plan_settings(recipe), "num_samples": len(lengths), "packed": packed,
                                 "batches": [[p.padded_length, list(p.sample_indices)] for p in plan]})
        if remote is not None:
            remote.push([PLAN_NAME])
    state.wait_for_everyone()
    if remote is not None and not is_main:
        remote.pull_file(PLAN_NAME)
    stored = read_stored_plan(path, lengths)
    if is_main and {k: v for k, v in stored["batching"].items() if k != "packing"} != \
            {k: v for k, v in plan_settings(recipe).items() if k != "packing"}:
        log.warning("batching settings differ from the stored plan; resuming with the stored plan %s",
                    stored["batching"])
    stored_packed = bool(stored.get("packed", False))
    return [PlannedBatch(batch_id=i, sample_indices=tuple(idx), padded_length=T,
                        num_real_tokens=sum(lengths[j] for j in idx), packed=stored_packed)
            for i, (T, idx) in enumerate(stored["batches"])]


def _with_stored_batching(recipe: Recipe, out_dir: Path) -> Recipe:
    """`recipe` with the batching settings of the output's stored plan, when there is one: a resume runs those
    batches whatever its own `batching` says, so the recipe saved beside the output says what ran. (A plan.json
    that cannot be read is left to load_or_make_plan, which names it.)"""
    try:
        stored = read_state_json(out_dir / PLAN_NAME)["batching"] if (out_dir / PLAN_NAME).is_file() else None
    except (OutputStateError, KeyError, TypeError):
        return recipe
    if not isinstance(stored, dict):
        return recipe
    names = {f.name for f in dataclasses.fields(recipe.batching)}
    batching = dataclasses.replace(recipe.batching, **{k: v for k, v in stored.items() if k in names})
    return dataclasses.replace(recipe, batching=batching)



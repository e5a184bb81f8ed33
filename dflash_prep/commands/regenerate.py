"""`dflash-prep regenerate`: the target writes the assistant turns of the data itself (on-policy data).

    dflash-prep regenerate [--recipe R] [--set k=v ...]                       one process (a server, or CPU/1 GPU)
    dflash-prep launch [accelerate options] -m dflash_prep.commands.regenerate [--recipe R] ...   N processes

and, with a `regenerate:` section in the recipe, `dflash-prep launch extract.py --recipe R` runs the regeneration
first (resuming it; `regenerate_first`) and extracts from its output.

The stages, in order (`run_regeneration`): recipe checks, the output folder claimed (locks, identity: exit code 2 on
another job's output), the rows loaded (data/rows.py, all of `data.*`), the chunks left (output.py) split over the
processes, the engine (regen/openai_engine.py, or the in-process regen/hf_engine.py) and its identity checked, the
loop (regen/loop.py) with a progress bar, then on the main process, once every process is done: skipped.jsonl,
summary.json, manifest.json and the dataset files, last. Exit codes: 0 done, 1 stopped (a signal, a server down
past its retries, a write error: re-run the same command to resume), 2 refused (a bad recipe, an output of another
job, an output another run is writing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import time
from collections import Counter
from pathlib import Path

from dflash_prep import __version__
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_STOPPED
from dflash_prep.faults import Faults
from dflash_prep.io import atomic_write_json
from dflash_prep.recipe.fingerprints import input_files_sha256, weights_fingerprint
from dflash_prep.recipe.schema import REGEN_IDENTITY_KEYS, Recipe, RecipeError, RegenerateSection, add_recipe_args
from dflash_prep.regen import output as regen_output
from dflash_prep.regen.conversation import RegenSettings
from dflash_prep.regen.engine import EngineUnavailable
from dflash_prep.regen.loop import REGEN_STOP_MESSAGE, EngineFailed, LoopStopped, RegenLoop
from dflash_prep.regen.sampling import generation_config_source, read_generation_defaults, resolve_sampling
from dflash_prep.data.rows import read_chat_template
from dflash_prep.signals import StopRequest, ignore_stop_signals, run_owns_process
from dflash_prep.store.locks import (
    LeaseLostError,
    OutputBusyError,
    OutputFence,
    check_no_rank_writing,
    lock_rank,
    lock_run,
)
from dflash_prep.store.manifest import OutputStateError, read_state_json

log = logging.getLogger("dflash_prep")

OPENAI_PARALLEL_CALLS = 8  # engine calls in flight (each of half the servers' slots): slots stay busy past a tail
TRANSFORMERS_ROWS_IN_FLIGHT = 1024


class RegenStopped(RuntimeError):
    """The regeneration stopped, resumable (exit code 1)."""


class RegenRefused(RuntimeError):
    """The regeneration finished but answered no row, or skipped more than `data.max_skipped_fraction` of them
    (exit code 2: the recipe or the server needs fixing, not a resume)."""


def section_of(recipe: Recipe) -> RegenerateSection:
    return recipe.regenerate if recipe.regenerate is not None else RegenerateSection()


def output_dir_of(recipe: Recipe) -> Path:
    """`regenerate.output_dir`, default `<output.dir>-regenerated`."""
    section = section_of(recipe)
    return Path(section.output_dir or f"{recipe.output.dir.rstrip('/')}-regenerated")


def served_model_name(recipe: Recipe) -> str:
    section = section_of(recipe)
    name = section.served_model_name or recipe.model.name_or_path
    if section.engine == "openai" and not name:
        raise RecipeError("recipe key `regenerate.served_model_name` = None: set the name the servers serve the "
                          "model under (`model.config` builds random weights and names no served model)")
    return name


# ------------------------------------------------------------------------------------------------ checks
def _check_output_dir(recipe: Recipe, out_dir: Path) -> None:
    """RecipeError for an output folder that is a file, lies inside the data (it would be read back as rows), or
    shares its place with the extraction's output (an `output.overwrite` would delete it)."""
    extraction = Path(recipe.output.dir).resolve()
    resolved = out_dir.resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(f"recipe key `regenerate.output_dir` = {str(out_dir)!r} is a file, not a folder")
    if resolved == extraction or resolved.is_relative_to(extraction) or extraction.is_relative_to(resolved):
        raise RecipeError(f"recipe key `regenerate.output_dir` = {str(out_dir)!r}: it overlaps `output.dir` = "
                          f"{str(extraction)!r}; the two outputs need folders of their own")
    from dflash_prep.commands.job import _written_path_matching_data  # the extraction's own check; same file names

    hit = _written_path_matching_data(recipe.data.path, out_dir)
    if hit is not None:
        raise RecipeError(f"recipe key `regenerate.output_dir` = {str(out_dir)!r}: it lies inside the data "
                          f"(`data.path` = {recipe.data.path!r} would read {hit} as rows); put it elsewhere")


def _setup_logging(out_dir: Path, rank: int, is_main: bool) -> None:
    """The extraction's console and log files (commands/extract/console.py): console from the main process only, one
    line a message; every rank to its own log file."""
    from dflash_prep.commands.extract.console import attach_log_file, setup_logging

    setup_logging(out_dir, rank, is_main)
    attach_log_file(out_dir, rank)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise


def rows_fingerprint(rows) -> dict:
    """{"sha256", "num_rows"} of the loaded rows' content (their Arrow data, re-chunked alike), so a file edited,
    shuffled or replaced in place is told apart from the one the output was made from."""
    import pyarrow as pa

    digest = hashlib.sha256()
    for table in rows.with_format("arrow").iter(batch_size=65536):
        for batch in table.combine_chunks().to_batches():
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, batch.schema) as writer:
                writer.write_batch(batch)
            digest.update(sink.getvalue())
    return {"sha256": digest.hexdigest(), "num_rows": len(rows)}


def job_identity(recipe: Recipe, sampling: dict, settings: RegenSettings) -> dict:
    """What must match between an output and a run resuming into it, before the engine exists (its own part,
    `engine`, is added once it does)."""
    section = section_of(recipe)
    d = recipe.to_dict()
    return {
        "engine_kind": section.engine,
        "served_model_name": served_model_name(recipe) if section.engine == "openai" else None,
        "model": {k: d["model"][k] for k in ("name_or_path", "config", "init_seed", "tokenizer", "dtype")},
        "data": {k: d["data"][k] for k in ("path", "format", "split", "max_samples", "id_column")},
        "sampling": sampling,
        "max_tokens": section.max_tokens,
        "turns": settings.turns,
        "on_length": settings.on_length,
        "seed": settings.seed,
        "chat_template_kwargs": settings.chat_template_kwargs,
        "chat_template": chat_template_identity(recipe),
        "row_format": regen_output.FORMAT_VERSION,
        # the in-process engine's inputs by content, read without loading anything (under a second), so weights,
        # a tokenizer or a template replaced in place are refused on a finished output too
        "weights": weights_fingerprint(recipe.model) if section.engine == "transformers" else None,
        "input_files": input_files_sha256(recipe) if section.engine == "transformers" else None,
    }


def chat_template_identity(recipe: Recipe) -> dict:
    """The template the prompts are rendered with: `data.chat_template`'s text by its sha256, or the tokenizer's
    own (its text is part of the tokenizer's fingerprint in the engine's identity). Never null, so that a template
    set or removed later is a change; the text itself is kept in the manifest (`chat_template_text`)."""
    text = read_chat_template(recipe.data)
    return {"source": "data.chat_template" if text is not None else "tokenizer",
            "sha256": hashlib.sha256((text or "").encode()).hexdigest()}


# ------------------------------------------------------------------------------------------------ the run
def run_regeneration(recipe: Recipe, whole_command: bool = False) -> dict | None:
    """Regenerate `recipe`'s rows into `output_dir_of(recipe)` on this process's rank (any number of processes
    under accelerate). Returns the summary on the main process. Raises RecipeError, RegenMismatchError,
    OutputBusyError, OutputStateError (refused), RegenStopped, EngineUnavailable, LoopStopped (stopped).
    `whole_command`: nothing follows in this process (`dflash-prep regenerate`, not the one-recipe form's first
    stage), so its stop signals are ignored once the output is written (signals.ignore_stop_signals)."""
    held: list = []
    try:
        return _run(recipe, held, whole_command)
    finally:
        for lock in reversed(held):
            lock.release()


def _run(recipe: Recipe, held: list, whole_command: bool = False) -> dict | None:
    import torch
    from accelerate import PartialState

    t_start = time.perf_counter()
    section, out_dir = section_of(recipe), output_dir_of(recipe)
    state = PartialState(cpu=not torch.cuda.is_available())
    _check_output_dir(recipe, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(out_dir, state.process_index, state.is_main_process)
    log.info("dflash-prep %s regenerate: rank %d of %d, engine %s -> %s", __version__, state.process_index,
             state.num_processes, section.engine, out_dir)
    defaults, where = read_generation_defaults(generation_config_source(section, recipe.model.name_or_path))
    sampling = resolve_sampling(defaults, section.sampling)
    settings = RegenSettings(turns=section.turns, sampling=sampling, max_tokens=section.max_tokens,
                             chat_template_kwargs=dict(section.chat_template_kwargs
                                                       if section.chat_template_kwargs is not None
                                                       else recipe.data.chat_template_kwargs),
                             on_length=section.on_length, seed=section.seed)
    if state.is_main_process:
        log.info("sampling %s (defaults from %s; regenerate.sampling %s)", sampling or "greedy", where,
                 section.sampling or "{}")
        if settings.chat_template_kwargs != dict(recipe.data.chat_template_kwargs):
            log.warning("regenerate.chat_template_kwargs %s differ from data.chat_template_kwargs %s: the prompts "
                        "are rendered with the first, the extraction renders the rows with the second",
                        settings.chat_template_kwargs, dict(recipe.data.chat_template_kwargs))
    identity = job_identity(recipe, sampling, settings)
    from dflash_prep.data.rows import check_data_source, load_rows

    check_data_source(recipe.data)
    with state.main_process_first():
        rows = load_rows(recipe.data)
    if state.is_main_process:
        identity["data_rows"] = rows_fingerprint(rows)
        # the fencing token above every record's: this run's records win over a frozen earlier run's late ones
        held.append(lock_run(out_dir, min_generation=regen_output.chunk_store(out_dir).max_fence() + 1))
        check_no_rank_writing(out_dir)
        regen_output.open_output(out_dir, identity, section.overwrite)
        rows_per_shard = regen_output.stored_rows_per_shard(out_dir, section.rows_per_shard)
        committed = regen_output.prepare(out_dir)
        num_chunks = math.ceil(len(rows) / rows_per_shard)
        done = regen_output.done_chunks(committed, rows_per_shard, len(rows))
        if len(done) < num_chunks or not regen_output.is_finished(out_dir):
            regen_output.remove_dataset_files(out_dir)
            previous = read_state_json(out_dir / regen_output.STATE_NAME).get("identity", {}) \
                if (out_dir / regen_output.STATE_NAME).exists() else {}
            regen_output.record_run(out_dir, {**identity, "engine": previous.get("engine")}, rows_per_shard,
                                    recipe.to_yaml())
    state.wait_for_everyone()
    held.append(lock_rank(out_dir, state.process_index))
    fence = OutputFence.of_holder(out_dir)  # the main process's run lease: checked at every commit
    rows_per_shard = regen_output.stored_rows_per_shard(out_dir, section.rows_per_shard)
    faults = Faults.from_env()  # test-only (faults.py): None unless DFLASH_PREP_FAULTS is set
    if faults is not None:
        faults.before_plan()
    committed = regen_output.read_committed(out_dir)
    # every process splits the same todo list, so none may commit before all have read the index: a process slow
    # to start would otherwise see a faster one's new chunks and take a share that overlaps or leaves a gap
    state.wait_for_everyone()
    num_chunks = math.ceil(len(rows) / rows_per_shard)
    done = regen_output.done_chunks(committed, rows_per_shard, len(rows))
    todo = [c for c in range(num_chunks) if c not in done]
    mine = todo[state.process_index::state.num_processes]
    if state.is_main_process:
        log.info("data: %d rows in %d chunk(s) of %d; %d committed, %d left over %d process(es)", len(rows),
                 num_chunks, rows_per_shard, len(done), len(todo), state.num_processes)
    report = {"rank": state.process_index, "rows_done": 0, "requests": 0, "completion_tokens": 0,
              "prompt_tokens": 0, "loop_seconds": 0.0}
    if mine:
        report = _run_rank(recipe, state, out_dir, rows, mine, rows_per_shard, settings, identity,
                           _committed_rows(committed, mine), fence)
    if todo:  # this run's figures, one file per rank (an idle rank's zeros included)
        (out_dir / regen_output.INDEX_DIR).mkdir(exist_ok=True)
        atomic_write_json(out_dir / regen_output.INDEX_DIR / f"rank-{state.process_index:05d}.done.json", report)
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return _finish(recipe, out_dir, rows, rows_per_shard, num_chunks, identity, sampling, report, t_start,
                   state.num_processes, ran=bool(todo), fence=fence, whole_command=whole_command)


def _committed_rows(committed: dict, chunks: list[int]) -> dict[int, tuple[set[int], int]]:
    """chunk -> (its source positions the index already lists, the number of its next part), for `chunks`."""
    parts = regen_output.parts_by_chunk(committed)
    return {c: (set().union(*map(regen_output.positions_of, parts[c])), parts[c][-1].part + 1)
            for c in chunks if c in parts}


def _build_engine(recipe: Recipe, device, servers=None):
    section = section_of(recipe)
    if section.engine == "openai":
        from dflash_prep.regen.openai_engine import OpenAIEngine

        try:
            import openai  # noqa: F401
        except ImportError:
            raise RecipeError("recipe key `regenerate.engine` = 'openai' needs the `openai` client: "
                              "pip install '.[regenerate]' in a checkout of dflash-prep (or pip install openai)") from None
        if servers is not None:
            return OpenAIEngine(section, served_model_name(recipe), base_urls=servers.base_urls,
                                on_server_down=servers.on_server_down)
        return OpenAIEngine(section, served_model_name(recipe))
    try:
        from dflash_prep.regen.hf_engine import TransformersEngine
    except ImportError as e:
        raise RecipeError(f"recipe key `regenerate.engine` = 'transformers': the in-process engine cannot be "
                          f"imported here ({e}); use `engine: openai` with a server") from None
    try:
        return TransformersEngine(recipe.model, device, max_tokens_per_batch=section.max_tokens_per_batch,
                                  max_batch_size=section.max_batch_size,
                                  chat_template=read_chat_template(recipe.data))
    except ValueError as e:  # a token budget that cannot hold one request
        raise RecipeError(f"recipe key `regenerate.max_tokens_per_batch` = {section.max_tokens_per_batch}: {e}") \
            from None


def _run_rank(recipe: Recipe, state, out_dir: Path, rows, mine: list[int], rows_per_shard: int,
              settings: RegenSettings, identity: dict, committed: dict, fence) -> dict:
    """This process's chunks through the engine (its managed servers started first and stopped last, whatever
    ends the run); its report."""
    stop = StopRequest(REGEN_STOP_MESSAGE)
    try:
        with _managed_servers(recipe, state, out_dir, stop) as servers:
            if stop.requested:
                raise LoopStopped(f"stopped on {stop.signal_name}")
            return _drive(recipe, state, out_dir, rows, mine, rows_per_shard, settings, identity, committed, stop,
                          servers, fence)
    finally:
        stop.restore()


def _managed_servers(recipe: Recipe, state, out_dir: Path, stop):
    """regen/servers.ManagedServers for `regenerate.servers` (a context manager), else a null one."""
    import contextlib
    import os

    section = section_of(recipe)
    if section.servers is None:
        return contextlib.nullcontext(None)
    from dflash_prep.regen.servers import ManagedServers

    if not recipe.model.name_or_path:
        raise RecipeError("recipe key `regenerate.servers`: the servers need `model.name_or_path` (a model folder "
                          "or hub id); `model.config` builds random weights in this process only")
    template = recipe.data.chat_template
    if template is not None and section.servers.preset == "transformers":
        raise RecipeError("recipe key `regenerate.servers.preset` = 'transformers': `transformers serve` renders "
                          "with the model folder's own chat template and takes no other; `data.chat_template` is "
                          "set: put the template in the model folder, or use vllm / sglang / a command")
    if template is not None and ("{%" in template or "{{" in template):  # inline: the servers read a file
        path = out_dir / "logs" / f"chat_template-{state.process_index:05d}.jinja"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template)
        template = str(path)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        return ManagedServers(section.servers, recipe.model.name_or_path, served_model_name(recipe), template,
                              out_dir / "logs", state.process_index, state.local_process_index, local_world,
                              stop=stop)
    except ValueError as e:
        raise RecipeError(f"recipe key `regenerate.servers`: {e}") from None


def _drive(recipe: Recipe, state, out_dir: Path, rows, mine: list[int], rows_per_shard: int,
           settings: RegenSettings, identity: dict, committed: dict, stop, servers, fence) -> dict:
    section = section_of(recipe)
    t0 = time.perf_counter()
    engine = _build_engine(recipe, state.device, servers)
    try:
        engine_identity = engine.identity()
        regen_output.check_identity(out_dir, {"engine": engine_identity})
        if state.is_main_process:
            stored = read_state_json(out_dir / regen_output.STATE_NAME)
            stored["identity"] = {**identity, "engine": engine_identity}
            atomic_write_json(out_dir / regen_output.STATE_NAME, stored)
        log.info("engine ready in %.1fs: %s", time.perf_counter() - t0, engine_identity)
        if section.engine == "openai" and state.is_main_process:
            from dflash_prep.regen.template_check import check_server_template

            check_server_template(engine, recipe, settings.chat_template_kwargs)
        if section.engine == "openai":
            concurrency = engine.total_concurrency
            window = section.max_rows_in_flight or 4 * concurrency
            batch_size, parallel = max(1, math.ceil(concurrency / 2)), OPENAI_PARALLEL_CALLS
        else:
            window = section.max_rows_in_flight or TRANSFORMERS_ROWS_IN_FLIGHT
            batch_size, parallel = window, 1
        provenance = {"engine": section.engine, "model": engine_identity.get("served_model_name")
                      or str(recipe.model.name_or_path or recipe.model.config),
                      "sampling": json.dumps(settings.sampling, sort_keys=True), "max_tokens": settings.max_tokens}
        total = sum(len(regen_output.chunk_rows(c, rows_per_shard, len(rows)))
                    - (len(committed[c][0]) if c in committed else 0)
                    for c in mine)
        progress = _Progress(total, state.num_processes) if state.is_main_process else None
        loop = RegenLoop(engine, rows, mine, rows_per_shard, settings,
                         regen_output.ChunkCommitter(out_dir, state.process_index, fence=fence), provenance,
                         recipe.data.id_column, window, batch_size, parallel, stop=stop,
                         on_progress=progress.update if progress else None,
                         finish_calls_on_stop=section.engine == "transformers",
                         thread_init=_cuda_device_setter(state.device), committed=committed,
                         commit_seconds=section.commit_seconds,
                         on_answered=progress.answered if progress else None)
        try:
            stats = loop.run()
        finally:
            if progress is not None:
                progress.close()
    finally:
        engine.close()
    return {"rank": state.process_index, "rows_done": stats.rows_done, "rows_written": stats.rows_written,
            "chunks_committed": stats.chunks_committed, "requests": stats.requests,
            "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "loop_seconds": stats.loop_seconds, "engine_seconds": stats.engine_seconds}


def _cuda_device_setter(device):
    """For a CUDA device: a function making it the calling thread's current device (the engine runs in threads of
    the loop's own); else None."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return lambda: torch.cuda.set_device(index)


class _Progress:
    """tqdm over this rank's rows (rows done), with the requests answered so far counted as they come in from the
    engines' threads (`requests`: one per generated turn, so a multi-turn row counts several; per request for both
    engines, so a long batch or a slow multi-turn row still moves the line), requests/s, generated tokens/s (all
    processes: x the number of processes) and tqdm's ETA."""

    def __init__(self, total_rows: int, world: int):
        import threading

        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_rows, desc=f"regenerate (rank 0 of {world})", unit="row", dynamic_ncols=True,
                        file=sys.stderr, mininterval=1.0)
        self.world, self.t0, self.done, self.requests_answered = world, time.perf_counter(), 0, 0
        self._lock = threading.Lock()

    def answered(self, n: int) -> None:
        """n more requests answered (any thread)."""
        with self._lock:
            self.requests_answered += n
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(refresh=False, requests=self.requests_answered,
                                 req_s=f"{self.requests_answered * self.world / elapsed:,.1f}")
            self.bar.update(0)  # redraws at most every `mininterval`

    def update(self, stats) -> None:
        with self._lock:
            self.bar.update(stats.rows_done - self.done)
            self.done = stats.rows_done
            elapsed = max(time.perf_counter() - self.t0, 1e-9)
            self.bar.set_postfix(refresh=False, requests=self.requests_answered,
                                 req_s=f"{self.requests_answered * self.world / elapsed:,.1f}",
                                 gen_tok_s=f"{stats.completion_tokens * self.world / elapsed:,.0f}")

    def close(self) -> None:
        self.bar.close()


# ------------------------------------------------------------------------------------------------ the end
def _finish(recipe: Recipe, out_dir: Path, rows, rows_per_shard: int, num_chunks: int, identity: dict,
            sampling: dict, report: dict, t_start: float, world: int, ran: bool, fence=None,
            whole_command: bool = False) -> dict:
    """Main process, every rank done: check every chunk is committed, then skipped.jsonl, summary.json,
    manifest.json and the dataset files (last). A finished output re-run changes nothing."""
    summary_path = out_dir / regen_output.SUMMARY_NAME
    if not ran and regen_output.is_finished(out_dir) and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        log.info("the regeneration was already finished: %s left as it is", out_dir)
        check_verdict(summary, recipe.data.max_skipped_fraction)
        return summary
    committed = regen_output.read_committed(out_dir)
    done = regen_output.done_chunks(committed, rows_per_shard, len(rows))
    missing = [c for c in range(num_chunks) if c not in done]
    if missing:
        raise RegenStopped(f"{len(missing)} of {num_chunks} chunk(s) are not committed (e.g. chunk {missing[0]})")
    records = [committed[k] for k in sorted(committed)]
    skipped = [s for r in records for s in r.skipped]
    answered = sum(r.num_rows for r in records)
    if answered + len(skipped) != len(rows):
        outside = [(r.path, p) for r in records for p in sorted(regen_output.positions_of(r))
                   if not 0 <= p < len(rows) or p not in regen_output.chunk_rows(r.chunk, rows_per_shard, len(rows))]
        where = f" ({outside[0][0]} lists row {outside[0][1]}, outside its chunk)" if outside else ""
        raise OutputStateError(f"{len(rows)} rows, {answered} written and {len(skipped)} skipped: the index does "
                               f"not account for every row{where}; start afresh with --set "
                               f"regenerate.overwrite=true")
    reports = [json.loads(p.read_text()) for p in sorted((out_dir / regen_output.INDEX_DIR).glob("rank-*.done.json"))]
    reports = [r for r in reports if r.get("rank", 0) < world] if ran else []
    totals = _totals(records)
    this_run_seconds = max((r.get("loop_seconds", 0.0) for r in reports), default=0.0)
    engine = read_state_json(out_dir / regen_output.STATE_NAME).get("identity", {}).get("engine")
    summary = {
        "output_dir": str(out_dir),
        "engine": section_of(recipe).engine,
        "engine_identity": engine,
        "sampling": sampling,
        "turns": section_of(recipe).turns,
        "num_rows": len(rows),
        "num_answered": answered,
        "num_skipped": len(skipped),
        "skipped": dict(sorted(Counter(s["reason"] for s in skipped).items())),
        "rejected_examples": [s["detail"] for s in skipped if s["reason"] == "rejected_by_engine"][:3],
        "skip_examples": _skip_examples(skipped),
        "token_ids": _token_ids_summary(records, engine),
        **totals,
        "num_ranks": world,
        "wall_seconds": time.perf_counter() - t_start,
        "this_run": {"requests": sum(r.get("requests", 0) for r in reports),
                     "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in reports),
                     "completion_tokens": sum(r.get("completion_tokens", 0) for r in reports),
                     "loop_seconds": this_run_seconds,
                     "requests_per_second": sum(r.get("requests", 0) for r in reports) / this_run_seconds
                     if this_run_seconds else None,
                     "generated_tokens_per_second": sum(r.get("completion_tokens", 0) for r in reports)
                     / this_run_seconds if this_run_seconds else None},
    }
    manifest = {
        "format": regen_output.FORMAT, "format_version": regen_output.FORMAT_VERSION,
        "dflash_prep_version": __version__, "identity": {**identity, "engine": engine},
        "chat_template_text": read_chat_template(recipe.data),
        "regenerate": {k: v for k, v in dataclasses.asdict(section_of(recipe)).items() if k in REGEN_IDENTITY_KEYS},
        "rows_per_shard": rows_per_shard, "num_rows": len(rows), "num_answered": answered,
        "num_skipped": len(skipped), "skipped": summary["skipped"], **totals,
        "shards": [{"path": r.path, "chunk": r.chunk, "part": r.part, "num_rows": r.num_rows, "num_bytes": r.num_bytes,
                    "sha256": r.sha256} for r in records],
    }
    regen_output.write_dataset_files(out_dir, records, manifest, skipped, summary, fence)
    if whole_command:  # the output is finished: a Ctrl-C from here on could only report a failure (signals.py)
        ignore_stop_signals()
    _log_done(summary, out_dir)
    check_verdict(summary, recipe.data.max_skipped_fraction)
    return summary


def _skip_examples(skipped: list[dict]) -> dict:
    """reason -> the first skipped row of that reason (sample id, the row's own id, the detail)."""
    out: dict = {}
    for s in skipped:
        out.setdefault(s["reason"], {k: s.get(k) for k in ("sample_id", "source_row", "source_id", "detail")})
    return out


def _token_ids_summary(records: list, engine_identity: dict | None) -> dict:
    """Whether the answers carry the engine's token ids: `source` (`returned`: the in-process engine, or servers
    that return them; `none`: a server that returns none, the extraction re-tokenizes the text)."""
    source = "returned" if (engine_identity or {}).get("engine") != "openai" else \
        (engine_identity or {}).get("token_ids", "none")
    return {"source": source}


def check_verdict(summary: dict, max_skipped_fraction: float) -> None:
    """RegenRefused when the regeneration answered no row, or skipped more than `max_skipped_fraction` of them; the
    message names the top skip reasons, each with its count and an example row."""
    rows, answered, skipped = summary["num_rows"], summary["num_answered"], summary["num_skipped"]
    if answered and skipped <= max_skipped_fraction * rows:
        return
    examples = summary.get("skip_examples", {})
    reasons = []
    for reason, n in sorted(summary.get("skipped", {}).items(), key=lambda kv: -kv[1])[:3]:
        e = examples.get(reason) or {}
        where = f"row {e['sample_id']}" if e.get("sample_id") else ""
        where += f", id {e['source_id']!r}" if e.get("source_id") is not None else ""
        where += f": {e['detail']}" if e.get("detail") else ""
        reasons.append(f"{reason}: {n}" + (f" (e.g. {where})" if where else ""))
    what = (f"the regeneration answered no row of {rows}" if not answered else
            f"the regeneration skipped {skipped} of {rows} rows, more than data.max_skipped_fraction="
            f"{max_skipped_fraction}")
    raise RegenRefused(f"{what} - {'; '.join(reasons)}. The output {summary['output_dir']} keeps the answers it "
                       f"has; fix the recipe or the server and start afresh with --set regenerate.overwrite=true")


def _totals(records: list) -> dict:
    finish, tools, ended = Counter(), Counter(), Counter()
    for r in records:
        finish.update(r.finish_reasons)
        tools.update(r.tool_calls)
        ended.update(r.ended_early)
    return {"num_requests": sum(r.num_requests for r in records),
            "prompt_tokens": sum(r.prompt_tokens for r in records),
            "completion_tokens": sum(r.completion_tokens for r in records),
            "finish_reasons": dict(sorted(finish.items())), "tool_calls": dict(sorted(tools.items())),
            "ended_early": dict(sorted(ended.items()))}


def _log_done(summary: dict, out_dir: Path) -> None:
    run = summary["this_run"]
    rate = (f"; this run {run['requests']} requests in {run['loop_seconds']:.1f}s, "
            f"{run['requests_per_second']:.2f} req/s, {run['generated_tokens_per_second']:,.0f} generated tok/s"
            if run["requests_per_second"] else "")
    log.info("done: %d rows, %d answered, %d skipped%s; finish reasons %s%s; tokens in %s, out %s%s -> %s",
             summary["num_rows"], summary["num_answered"], summary["num_skipped"],
             f" {summary['skipped']}" if summary["skipped"] else "", summary["finish_reasons"],
             f", tool calls {summary['tool_calls']}" if summary["tool_calls"] else "",
             f"{summary['prompt_tokens']:,}", f"{summary['completion_tokens']:,}", rate, out_dir)


# ------------------------------------------------------------------------------------------------ entry points
def run_and_report(recipe: Recipe, whole_command: bool = False) -> tuple[dict | None, int]:
    """`run_regeneration` with every error as one line on stderr and its exit code: (summary or None, code)."""
    out_dir = output_dir_of(recipe)
    try:
        return run_regeneration(recipe, whole_command), 0
    except (RecipeError, regen_output.RegenMismatchError, OutputBusyError, OutputStateError, RegenRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, EXIT_BAD_RECIPE
    except (EngineUnavailable, EngineFailed, LoopStopped, RegenStopped, LeaseLostError) as e:
        _stopped(f"regeneration stopped: {e}. Committed shards are intact; re-run the same command to resume",
                 out_dir)
        return None, EXIT_STOPPED
    except KeyboardInterrupt:
        _stopped("regeneration stopped by Ctrl-C; committed shards are intact, re-run the same command to resume",
                 out_dir)
        return None, EXIT_STOPPED
    except OSError as e:
        _stopped(f"regeneration stopped: {type(e).__name__}: {e}. Committed shards are intact; fix the cause and "
                 f"re-run the same command to resume", out_dir)
        return None, EXIT_STOPPED


def _stopped(message: str, out_dir: Path) -> None:
    if log.handlers:
        log.error("%s", message, extra={"console": False})
    print(f"error: {message} (details in {out_dir / 'logs'})", file=sys.stderr)


def regenerate_first(recipe: Recipe) -> tuple[Recipe, int | None]:
    """The one-recipe form: a recipe with a `regenerate:` section is regenerated first (resumed if it was begun),
    then extracted from its output. -> (the recipe with `data.path` = the regeneration's output, None), or (recipe,
    exit code) when the regeneration did not finish. A recipe without the section is returned as it is."""
    if recipe.regenerate is None:
        return recipe, None
    from dflash_prep.commands.job import OutputMismatchError

    data = dataclasses.replace(recipe.data, path=str(output_dir_of(recipe)), format="auto", id_column=None)
    extraction = dataclasses.replace(recipe, data=data)
    try:
        _refuse_an_extraction_of_other_data(extraction)
    except OutputMismatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return recipe, EXIT_BAD_RECIPE
    _, code = run_and_report(recipe)
    if code:
        return recipe, code
    return extraction, None


def _refuse_an_extraction_of_other_data(extraction: Recipe) -> None:
    """The one-recipe form, before any answer is generated: `output.dir` already holding an extraction of other data
    than this regeneration's rows (another job, e.g. a quick start's output) is refused now (OutputMismatchError,
    the extraction's own check on the `data` part of its identity), not after the regeneration. A local folder
    only (an object-store output is checked by the extraction); `output.overwrite` starts afresh as ever."""
    from dflash_prep.commands.job import check_identity, data_identity
    from dflash_prep.recipe.location import is_remote, local_path

    if extraction.output.overwrite or is_remote(extraction.output.dir):
        return
    check_identity(local_path(extraction.output.dir), {"data": data_identity(extraction)}, extraction)


def main(argv: list[str] | None = None) -> int:
    """`dflash-prep regenerate [--recipe PATH] [--set key=value ...]`. Returns the exit code."""
    import argparse

    from dflash_prep.recipe.schema import load_recipe

    if argv is None:  # `python -m`: this process is the command's
        run_owns_process()
    parser = argparse.ArgumentParser(prog="dflash-prep regenerate", description=__doc__.splitlines()[0])
    add_recipe_args(parser)
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    return run_and_report(recipe, whole_command=True)[1]


if __name__ == "__main__":
    sys.exit(main())

"""The extraction loop: recipe -> tokenized rows -> global plan -> this rank's batches -> hooks -> shards.

Run under `accelerate launch` (any number of processes, nodes) or plain `python`: each process is one rank
with its own model copy and its own shards; the batch plan is global and deterministic, so ranks agree on it
without communicating, and the main process merges the rank indexes into `OUT/manifest.json` at the end.

Resume: the plan is frozen in `OUT/plan.json` by the first run. Re-running the same command keeps committed
shards, discards uncommitted files, and runs only the batches no index lists, split over however many ranks
the new run has. An output made by a different job is refused unless `output.overwrite` is set: recipe keys
(model, data, layers, storage dtype) and content (identity.py: the tokenized rows, the weights) must match. A
committed shard whose file is missing, cut or swapped is dropped and its batches redone; a finished output
re-runs without loading the model.

Failures: a CUDA OOM in a forward splits the batch and retries (backoff.py); a sample that does not fit alone,
or whose states hold a NaN/Inf, is recorded as failed in the index line of the shard that commits its batch, so
a resume neither redoes nor forgets it; the manifest counts failed samples by reason and OUT/failed.jsonl lists
them. A write error (a full disk) or `output.nan_policy: fatal` stops the run with `ExtractionError`: committed
shards intact, nothing partial visible, a message saying what is committed and that re-running resumes.
Exit codes of `main`: 0 done, 1 stopped (resumable), 2 refused (bad recipe, an output of another job or a
damaged one), 3 done but more samples failed than `output.max_failed_samples`. `accelerate launch` turns 2 and 3
into 1; `dflash-prep launch` (launch.py) keeps them.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Before torch touches CUDA: fewer fragmentation OOMs with batches of changing shapes (user settings win).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from . import __version__  # noqa: E402
from .backoff import BatchRunner  # noqa: E402
from .budget import resolve_token_budget  # noqa: E402
from .capture import LayerCapture  # noqa: E402
from .collate import PlannedBatches  # noqa: E402
from .data import check_data_source, check_data_verdict, load_rows, tokenize_dataset  # noqa: E402
from .faults import Faults  # noqa: E402
from .identity import describe_weights_change, rows_fingerprint, weights_fingerprint  # noqa: E402
from .kernels import KernelChoice, apply_kernels, select_kernels  # noqa: E402
from .layers import find_decoder, num_decoder_layers, resolve_layer_ids  # noqa: E402
from .locks import LOCKS_DIR, OutputBusyError, check_no_rank_writing, lock_rank, lock_run  # noqa: E402
from .manifest import (MANIFEST_NAME, STATE_NAME, OutputStateError, atomic_write_json,  # noqa: E402
                       atomic_write_jsonl, build_manifest, damaged_shards, drop_records, next_shard_number,
                       read_committed, read_state_json, remove_uncommitted, repair_indexes, write_manifest)
from .model import (STORAGE_TORCH_DTYPES, decoder_params_in, describe_source, drop_layers_after,  # noqa: E402
                    hidden_size_of, load_config, load_model, load_tokenizer, model_fingerprint, padding_token_id,
                    vocab_size_of)
from .norms import FINAL_NORM_NAME, describe_final_norm, read_final_norm, write_final_norm  # noqa: E402
from .model import tokenizer_fingerprint as _tokenizer_fingerprint  # noqa: E402  (moved to model.py)
from .planner import PlannedBatch, ShapeBuckets, plan_batches, plan_stats, split_across_ranks  # noqa: E402
from .recipe import Recipe, RecipeError  # noqa: E402
from .vocab import count_supervised_tokens, write_token_freq  # noqa: E402
from .writer import AsyncShardWriter, NonFiniteStatesError, PendingBatch, lanes, rank_name  # noqa: E402

log = logging.getLogger("dflash_prep")

PLAN_NAME = "plan.json"
RECIPE_NAME = "recipe.resolved.yaml"
SUMMARY_NAME = "summary.json"
SKIPPED_NAME = "skipped.jsonl"
KERNELS_NAME = "kernels.jsonl"  # one line per run that loaded the model: the fused kernels it applied
FAILED_NAME = "failed.jsonl"
EXIT_STOPPED, EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES = 1, 2, 3


class OutputMismatchError(RuntimeError):
    """Resuming into an output made by a different job."""


class ExtractionError(RuntimeError):
    """The run stopped cleanly (write error, fatal NaN): committed shards are intact; re-running resumes."""


class _StopRequest:
    """SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) asks the run to stop at the next batch
    boundary: the batches already captured are written and their shards committed, so a resume redoes nothing
    that was computed; a second signal stops at once (the default handlers are back). Installed only in the
    main thread (signal handlers can only be set there)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name
        self.restore()  # a second signal acts at once
        log.warning("%s received: finishing the batches in flight and committing their shards; send it again to "
                    "stop at once (a resume is safe either way)", self.signal_name)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _init_worker(lock_fds: tuple[int, ...], worker_id: int) -> None:
    """A DataLoader worker (forked from the rank):
    - drops its copies of the output's lock descriptors (a forked child shares the parent's flock, which would
      outlive a main process killed alone, e.g. by the OOM killer, and block every resume), and dies with the rank
      (PR_SET_PDEATHSIG, Linux) instead of lingering;
    - leaves SIGTERM/SIGINT to the main process (which then stops at a batch boundary and shuts the workers
      down); a worker killed by the signal would otherwise make the loader fail under the loop's feet."""
    for fd in lock_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    _die_with_parent()
    for sig in _StopRequest.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that forked it ends (Linux prctl; elsewhere a no-op)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


class _ConsoleFormatter(logging.Formatter):
    """The console gets one line per message; tracebacks go to the rank's log file only."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


@dataclass
class RankStats:
    num_samples: int = 0
    num_real_tokens: int = 0
    num_padded_tokens: int = 0
    num_batches: int = 0
    forward_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    writer_wait_seconds: float = 0.0
    shapes_seen: set = field(default_factory=set)


# ---------------------------------------------------------------------------------------------------- setup
def _setup_logging(out_dir: Path, rank: int, is_main: bool) -> None:
    """Console from the main process only; every rank to its own log file."""
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fh = logging.FileHandler(out_dir / "logs" / f"{rank_name(rank)}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(fh)
    if is_main:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(_ConsoleFormatter("[dflash-prep] %(message)s"))
        ch.addFilter(lambda record: getattr(record, "console", True))  # extra={"console": False}: file only
        log.addHandler(ch)
    # Known noisy library messages: keep them in the file log, off the console.
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _run_identity(recipe: Recipe, config, layer_ids: list[int], tokenizer, is_main: bool) -> dict:
    """What must match between an output and a run that resumes into it. The weights' fingerprint (identity.py)
    is read by the main process only; the tokenized rows' fingerprint (`data_rows`) is added once they exist."""
    return {
        "model": model_fingerprint(recipe.model, config),
        "model_source": describe_source(recipe.model),
        "weights": weights_fingerprint(recipe.model) if is_main else None,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "data": {k: v for k, v in recipe.to_dict()["data"].items() if k != "num_proc"},
        "layer_ids": layer_ids,
        "capture_final": recipe.layers.capture_final,
        "dtype": recipe.output.dtype,
    }


def _identity_diffs(previous: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, e.g. ['data.max_length', 'layer_ids']."""
    diffs = []
    for key in sorted(set(previous) | set(current)):
        a, b, name = previous.get(key), current.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _identity_diffs(a, b, f"{name}.")
        elif a != b:
            diffs.append(name)
    return diffs


def _difference(key: str, previous: dict, current: dict) -> str:
    """How `key` of the identity differs, in words."""
    if key in ("model", "tokenizer"):
        return f"{key} fingerprint differs"
    if key == "weights":
        return f"model weights differ ({describe_weights_change(previous[key], current[key])})"
    if key == "data_rows":
        return (f"data rows differ: the tokenized rows of data.path are not the ones the output was made from "
                f"({previous[key]['num_rows']} kept rows then, {current[key]['num_rows']} now; edited, shuffled "
                f"or replaced in place)")

    def value(d, dotted):
        for part in dotted.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d
    return f"{key}: output has {value(previous, key)!r}, this run has {value(current, key)!r}"


def _check_identity(out_dir: Path, identity: dict) -> None:
    """Refuse (OutputMismatchError, one line) when `out_dir` holds the output of another job. Keys this run has not
    computed (None) and keys an older output did not record are not compared."""
    path = out_dir / STATE_NAME
    if not path.exists():
        return
    previous = read_state_json(path)["identity"]
    atomic_keys = ("weights", "data_rows")  # compared whole, described by _difference
    diffs = []
    for key in sorted(set(previous) | set(identity)):
        if previous.get(key) is None or identity.get(key) is None:
            continue
        if key in atomic_keys or not (isinstance(previous[key], dict) and isinstance(identity[key], dict)):
            diffs += [key] if previous[key] != identity[key] else []
        else:
            diffs += _identity_diffs(previous[key], identity[key], f"{key}.")
    if diffs:
        details = "; ".join(_difference(k, previous, identity) for k in diffs)
        raise OutputMismatchError(
            f"{out_dir} holds an extraction of a different job ({details}). Use another output.dir, or "
            f"--set output.overwrite=true to start afresh.")


_OUTPUT_MARKERS = (STATE_NAME, PLAN_NAME, MANIFEST_NAME)


def _refuse_unsafe_output_dir(recipe: Recipe) -> None:
    """Before anything is created: `output.overwrite` on a folder that is not an output of this tool would delete
    the user's files, and an output inside the data (`data.path` a folder holding it, or a glob matching the
    files a run writes there) would be read back as rows. Both raise RecipeError."""
    out_dir = Path(recipe.output.dir)
    if recipe.output.overwrite and out_dir.is_dir():
        names = {p.name for p in out_dir.iterdir()}
        if names - {"logs", LOCKS_DIR} and not names & set(_OUTPUT_MARKERS):
            raise RecipeError(
                f"recipe key `output.overwrite` = True: {out_dir} is not a dflash-prep output (no "
                f"{', '.join(_OUTPUT_MARKERS)}; it holds {', '.join(sorted(names)[:5])}...): refusing to delete "
                f"its files; set output.dir to a new or empty folder")
    hit = _written_path_matching_data(recipe.data.path, out_dir)
    if hit is not None:
        raise RecipeError(
            f"recipe key `output.dir` = {str(out_dir)!r}: it lies inside the data (`data.path` = "
            f"{recipe.data.path!r} would read {hit} as rows); put the output outside the data")


def _written_path_matching_data(data_path: str, out_dir: Path) -> Path | None:
    """A file the run writes under `out_dir` that `data_path` (a folder or a glob) would read, or None."""
    import fnmatch

    data = Path(data_path).expanduser()
    out_dir = out_dir.resolve()
    written = [out_dir / n for n in (SKIPPED_NAME, FAILED_NAME, SUMMARY_NAME, PLAN_NAME, STATE_NAME, MANIFEST_NAME,
                                     "index/rank-00000.jsonl", "index/rank-00000.done.json",
                                     "shards/rank-00000/shard-000000.tar")]
    if not any(c in data_path for c in "*?["):
        return written[0] if data.is_dir() and out_dir.is_relative_to(data.resolve()) else None

    def matches(parts: list[str], pattern: list[str]) -> bool:
        if not pattern:
            return not parts
        if pattern[0] == "**":
            return any(matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and matches(parts[1:], pattern[1:])

    pattern = Path(os.path.abspath(data)).parts
    return next((w for w in written if matches(list(w.parts), list(pattern))), None)


def _open_output(out_dir: Path, recipe: Recipe, identity: dict) -> None:
    """Main process, holding the run lock, before the data is read: start afresh (`output.overwrite`) or check
    that the output is this job's (all but the data rows, which are not tokenized yet)."""
    if recipe.output.overwrite and out_dir.exists():
        for child in out_dir.iterdir():
            if child.name in ("logs", LOCKS_DIR):
                continue  # the live log handlers of this run write there; this run holds its lock there
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_identity(out_dir, identity)


def _prepare_output(out_dir: Path, recipe: Recipe, identity: dict) -> None:
    """Main process, once the rows are tokenized: check the data rows, clean up a crashed run, drop committed
    shards whose file is missing or damaged (their batches are redone), save the recipe and the run state."""
    _check_identity(out_dir, identity)
    for index in repair_indexes(out_dir):
        log.warning("%s ended in a torn line (a crash while appending): cut back to its last complete line", index)
    committed = read_committed(out_dir)
    damaged = damaged_shards(out_dir, committed)
    for path, why in damaged.items():
        log.warning("committed shard %s is damaged (%s): its batches are redone", path, why)
    if damaged:
        drop_records(out_dir, set(damaged))
        committed = read_committed(out_dir)
    removed = remove_uncommitted(out_dir, committed)
    if removed:
        log.info("removed %d uncommitted file(s) left by an interrupted run", len(removed))
    (out_dir / RECIPE_NAME).write_text(recipe.to_yaml())
    state_path = out_dir / STATE_NAME
    runs = read_state_json(state_path).get("runs", []) if state_path.exists() else []
    runs.append({"started_at": time.time(), "dflash_prep_version": __version__,
                 "attn_implementation": recipe.model.attn_implementation})
    atomic_write_json(state_path, {"identity": identity, "dflash_prep_version": __version__, "runs": runs})


# ----------------------------------------------------------------------------------------------------- plan
def _load_or_make_plan(out_dir: Path, lengths: list[int], recipe: Recipe, is_main: bool, state) -> list[PlannedBatch]:
    """The global plan: made once by the main process and frozen in OUT/plan.json (so resumes run the same
    batches whatever the number of ranks); every rank reads it back."""
    path = out_dir / PLAN_NAME
    if is_main:
        if path.exists():
            stored = read_state_json(path)
            if stored["num_samples"] != len(lengths):
                raise OutputMismatchError(f"{path} plans {stored['num_samples']} samples but the data has "
                                          f"{len(lengths)}: the dataset changed; use --set output.overwrite=true")
            if stored["batching"] != _plan_settings(recipe):
                log.warning("batching settings differ from the stored plan; resuming with the stored plan %s",
                            stored["batching"])
        else:
            plan = make_plan(lengths, recipe)
            atomic_write_json(path, {"batching": _plan_settings(recipe), "num_samples": len(lengths),
                                     "batches": [[p.padded_length, list(p.sample_indices)] for p in plan]})
    state.wait_for_everyone()
    stored = read_state_json(path)
    return [PlannedBatch(batch_id=i, sample_indices=tuple(idx), padded_length=T,
                         num_real_tokens=sum(lengths[j] for j in idx))
            for i, (T, idx) in enumerate(stored["batches"])]


def make_plan(lengths: list[int], recipe: Recipe) -> list[PlannedBatch]:
    """The global batch plan of `recipe` for the kept samples' `lengths` (what OUT/plan.json freezes; also what
    `dflash-prep plan` reports, so its figures are the run's)."""
    b = recipe.batching
    buckets = ShapeBuckets(b.length_multiple, b.length_growth, recipe.data.max_length)
    return plan_batches(lengths, max_tokens_per_batch=b.max_tokens_per_batch, max_batch_size=b.max_batch_size,
                        buckets=buckets)


def _plan_settings(recipe: Recipe) -> dict:
    b = recipe.batching
    return {"max_tokens_per_batch": b.max_tokens_per_batch, "max_batch_size": b.max_batch_size,
            "length_multiple": b.length_multiple, "length_growth": b.length_growth,
            "max_length": recipe.data.max_length}


def _check_free_space(out_dir: Path, lengths: list[int], todo: list[PlannedBatch], layer_ids: list[int],
                      hidden_size: int, recipe: Recipe) -> int:
    """Log the bytes the batches left to do will write (the writer's own record sizes, `meta.json` taken as one
    block), and warn, before the model loads, when they exceed the free space of the output's filesystem (the
    run would stop, cleanly and resumably, when the disk fills). Returns the estimate."""
    from .plan import RecordSizer

    sizer = RecordSizer(layer_ids, hidden_size, recipe.layers.capture_final)
    dtype = recipe.output.dtype
    need = sum(sizer.record_bytes(lengths[i], 1, dtype) for p in todo for i in p.sample_indices)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        log.warning("this run will write about %.1f GB into %s but only %.1f GB are free there: it will stop "
                    "(cleanly, resumable) when the disk is full; free space first%s", need / 1e9, out_dir,
                    free / 1e9, "" if dtype == "fp8_e4m3" else ", or store fp8 (output.dtype: fp8_e4m3, half the bytes)")
    else:
        log.info("output: about %.1f GB to write, %.1f GB free", need / 1e9, free / 1e9)
    return need


# ----------------------------------------------------------------------------------------------------- loop
def _to_host(out, device: torch.device):
    """One asynchronous copy of a forward's packed states and per-sample non-finite flags into pinned host
    memory; returns (states, final states, flags, event). What is already on the host (CPU runs, a batch joined
    after an OOM split) passes through with event None. (bench/run_bench.py wraps this function.)"""
    tensors = (out.hidden_states_NK, out.final_NH, out.nonfinite_B)
    if device.type != "cuda" or out.hidden_states_NK.device.type != "cuda":
        return (*tensors, None)
    host = []
    for t in tensors:
        if t is not None:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            t = pinned
        host.append(t)
    event = torch.cuda.Event()
    event.record()
    return (*host, event)


class _GpuTimer:
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


def run_extraction(recipe: Recipe) -> dict | None:
    """Run the job of `recipe` on this process's rank. Returns the summary on the main process.

    The output folder is locked for the run (locks.py): a second run into it stops before touching anything."""
    held: list = []
    try:
        return _run_extraction(recipe, held)
    finally:
        for lock in reversed(held):
            lock.release()


def _run_extraction(recipe: Recipe, held: list) -> dict | None:
    from accelerate import PartialState

    t_start = time.perf_counter()
    # Without GPUs, accelerate only forms a process group when told it is a CPU job (gloo).
    state = PartialState(cpu=not torch.cuda.is_available())
    rank, world, is_main = state.process_index, state.num_processes, state.is_main_process
    device = state.device
    out_dir = Path(recipe.output.dir)
    _refuse_unsafe_output_dir(recipe)
    out_dir.mkdir(parents=True, exist_ok=True)
    _setup_logging(out_dir, rank, is_main)
    log.info("dflash-prep %s: rank %d of %d on %s", __version__, rank, world, device)

    # 1. Everything that can be wrong with the recipe fails here, before any weights load.
    config = load_config(recipe.model)
    num_layers = num_decoder_layers(config)
    layer_ids = resolve_layer_ids(recipe.layers, num_layers)
    kernels = select_kernels(recipe.model.kernels, config, device.type)
    recipe, budget_how = resolve_token_budget(
        recipe, config, layer_ids, num_layers,
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    if budget_how and is_main:
        log.info("batching.max_tokens_per_batch: auto = %d (%s)", recipe.batching.max_tokens_per_batch, budget_how)
    tokenizer = load_tokenizer(recipe.model)
    check_data_source(recipe.data)
    hidden_size = hidden_size_of(config)
    identity = _run_identity(recipe, config, layer_ids, tokenizer, is_main)
    faults = Faults.from_env()  # test-only fault injection (faults.py); None unless DFLASH_PREP_FAULTS is set
    if faults is not None:
        log.warning("fault injection active (DFLASH_PREP_FAULTS): %s", faults)
    if is_main:
        held.append(lock_run(out_dir))  # before anything in the folder is touched
        check_no_rank_writing(out_dir)  # no orphaned worker of an earlier run still writes
        _open_output(out_dir, recipe, identity)
    state.wait_for_everyone()
    held.append(lock_rank(out_dir, rank))

    # 2. Tokenize (cached by datasets; the main process fills the cache, the others then read it).
    with state.main_process_first():
        rows = load_rows(recipe.data)
        data = tokenize_dataset(rows, tokenizer, recipe.data, vocab_size_of(config))
    check_data_verdict(data, recipe.data)  # nothing kept, or too much skipped: exit 2, before the output is claimed
    if is_main:
        identity["data_rows"] = rows_fingerprint(data.kept)
        _prepare_output(out_dir, recipe, identity)  # refuses rows that differ from the output's
        atomic_write_jsonl(out_dir / SKIPPED_NAME, data.skipped_rows)
        log.info("data: %d rows, %d kept, %d skipped%s", data.num_rows, len(data.kept),
                 sum(data.skipped_counts.values()), f" {data.skipped_counts}" if data.skipped_counts else "")
    lengths = [int(n) for n in data.kept["num_tokens"]]

    # 3. Global plan, minus what is committed, split over this run's ranks.
    plan = _load_or_make_plan(out_dir, lengths, recipe, is_main, state)
    committed = read_committed(out_dir)
    done_batches = {b for r in committed for b in r.batch_ids}
    todo = [p for p in plan if p.batch_id not in done_batches]
    mine = split_across_ranks(todo, world)[rank]
    stats = plan_stats(plan)
    if is_main:
        log.info("plan: %d batches, %d shapes, batch size %s-%s (mean %.1f), padded length %s-%s, "
                 "padding efficiency %.3f", stats["num_batches"], stats["num_shapes"], stats["batch_size_min"],
                 stats["batch_size_max"], stats["batch_size_mean"] or 0, stats["padded_length_min"],
                 stats["padded_length_max"], stats["padding_efficiency"] or 0)
        if done_batches:
            log.info("resume: %d of %d batches already committed, %d left over %d rank(s)",
                     len(plan) - len(todo), len(plan), len(todo), world)
        _check_free_space(out_dir, lengths, todo, layer_ids, hidden_size, recipe)

    # 4-5. The model and the loop; nothing to do (a finished output re-run): the model is not even loaded.
    if todo:
        rank_report = _run_batches(recipe, config, device, state, out_dir, layer_ids, num_layers, committed, mine,
                                   data, tokenizer, faults, tuple(lock.fd for lock in held if lock.fd is not None),
                                   kernels)
    else:
        log.info("every batch of the plan is committed: nothing to run, the model is not loaded")
        rank_report = _idle_rank_report(rank)
    atomic_write_json(out_dir / "index" / f"{rank_name(rank)}.done.json", rank_report)
    log.info("rank %d done: %d samples, %d tokens in %.1fs", rank, rank_report["num_samples"],
             rank_report["num_real_tokens"], rank_report["loop_seconds"])
    state.wait_for_everyone()
    if not is_main:
        return None

    # 6. The main process merges: manifest last.
    reports = [json.loads(p.read_text()) for p in sorted((out_dir / "index").glob("rank-*.done.json"))]
    reports = [r for r in reports if r["rank"] < world]
    records = read_committed(out_dir)
    info = {
        "dflash_prep_version": __version__,
        "model": describe_source(recipe.model),
        "model_fingerprint": identity["model"],
        "tokenizer_fingerprint": identity["tokenizer"],
        "weights_fingerprint": identity["weights"],
        "data_rows_fingerprint": identity["data_rows"],
        "attn_implementation": recipe.model.attn_implementation,
        "recipe_fingerprint": recipe.fingerprint(),
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": num_layers,
        "layer_ids": layer_ids,
        "layer_id_convention": "after-layer, 0-based (id i = HF hidden_states[i+1])",
        "hidden_size": hidden_size,
        "dtype": recipe.output.dtype,
        "capture_final": recipe.layers.capture_final,
        "final_norm": _final_norm_entry(out_dir, recipe),
        "num_rows": data.num_rows,
        "num_skipped": sum(data.skipped_counts.values()),
        "skipped": data.skipped_counts,
        "num_failed": 0,
        "failed": {},
        "kernels": _last_kernels_record(out_dir),
        "kernels_history": _kernels_history(out_dir),
    }
    # Failed samples are recorded in the index line of the shard that committed their batch.
    failed_rows = sorted((f for r in records for f in r.failed), key=lambda f: f["sample_id"])
    info["num_failed"] = len(failed_rows)
    info["failed"] = dict(sorted(Counter(f["reason"] for f in failed_rows).items()))
    manifest = build_manifest(records, info)
    accounted = {s for r in records for s in r.sample_ids} | {f["sample_id"] for f in failed_rows}
    if accounted != set(data.kept["sample_id"]):
        raise ExtractionError(
            f"{len(lengths)} samples planned, {manifest['num_samples']} committed and {len(failed_rows)} recorded "
            f"as failed: {len(set(data.kept['sample_id']) - accounted)} missing; re-run the same command to finish")
    # The draft vocabulary's input: supervised-token frequencies over exactly the samples the manifest lists.
    written = {s for r in records for s in r.sample_ids}
    manifest["token_freq"] = write_token_freq(
        out_dir, count_supervised_tokens(data.kept, vocab_size_of(config), written), len(written))
    real = sum(r["num_real_tokens"] for r in reports)
    padded = sum(r["num_padded_tokens"] for r in reports)
    wall = time.perf_counter() - t_start
    summary = {
        "output_dir": str(out_dir),
        "num_rows": data.num_rows,
        "num_samples_written": manifest["num_samples"],
        "num_tokens_written": manifest["num_tokens"],
        "num_samples_this_run": sum(r["num_samples"] for r in reports),
        "num_tokens_this_run": real,
        "num_skipped": info["num_skipped"],
        "skipped": data.skipped_counts,
        "num_failed": info["num_failed"],
        "failed": info["failed"],
        "num_failed_this_run": sum(r.get("num_failed", 0) for r in reports),
        "num_oom": sum(r.get("num_oom", 0) for r in reports),
        "num_batches": stats["num_batches"],
        "num_shapes_planned": stats["num_shapes"],
        "padding_efficiency": real / padded if padded else None,
        "planned_padding_efficiency": stats["padding_efficiency"],
        "num_ranks": world,
        "wall_seconds": wall,
        "tokens_per_second": real / max(max((r["loop_seconds"] for r in reports), default=0.0), 1e-9),
        "bytes_written_this_run": sum(r["bytes_written"] for r in reports),
        "bytes_total": manifest["num_bytes"],
        "num_shards": len(manifest["shards"]),
        "kernels": kernels.record() if todo else {**kernels.record(), "applied": [],
                                                  "reason": "nothing to run: the model was not loaded"},
        "ranks": reports,
    }
    manifest["summary"] = {k: summary[k] for k in ("num_batches", "padding_efficiency", "num_ranks")}
    try:
        atomic_write_jsonl(out_dir / FAILED_NAME, failed_rows)
        atomic_write_json(out_dir / SUMMARY_NAME, summary)
        write_manifest(out_dir, manifest)
    except OSError as e:
        raise ExtractionError(f"writing the manifest failed ({e}); every shard is committed: re-run the same "
                              f"command (nothing is recomputed) to write it") from e
    log.info("done: %d samples, %d tokens written (%d skipped%s, %d failed%s), padding efficiency %s, %.1f GB in "
             "%d shards, %.1fs wall, %.0f tok/s -> %s", summary["num_samples_written"], summary["num_tokens_written"],
             summary["num_skipped"], f" {data.skipped_counts}" if data.skipped_counts else "",
             summary["num_failed"], f" {summary['failed']}" if summary["failed"] else "",
             f"{summary['padding_efficiency']:.3f}" if summary["padding_efficiency"] else "n/a",
             summary["bytes_total"] / 1e9, summary["num_shards"], wall, summary["tokens_per_second"],
             out_dir / "manifest.json")
    return summary


def _run_batches(recipe: Recipe, config, device, state, out_dir: Path, layer_ids: list[int], num_layers: int,
                 committed: list, mine: list[PlannedBatch], data, tokenizer, faults, lock_fds: tuple,
                 kernels: KernelChoice) -> dict:
    """Load the model and run this rank's batches `mine` through it into the writer; returns the rank's report.
    Raises ExtractionError when the run stops cleanly (write error, fatal NaN, SIGTERM/Ctrl-C)."""
    rank, world, is_main = state.process_index, state.num_processes, state.is_main_process
    # The model: load, keep only the layers we read from, apply the fused kernels (after the final norm is described:
    # that runs the norm on the CPU).
    t0 = time.perf_counter()
    model = load_model(recipe.model, config, device)
    last_needed = num_layers - 1 if recipe.layers.capture_final != "none" else layer_ids[-1]
    layers_run = drop_layers_after(model, last_needed)
    # Before-norm final states + the norm's parameters give the after-norm ones at read time (norms.py).
    if is_main and recipe.layers.capture_final == "before_norm":
        write_final_norm(out_dir, describe_final_norm(find_decoder(model).norm))
    log.info("model loaded in %.1fs: %s, %d of %d decoder layers run; hooks on layers %s%s",
             time.perf_counter() - t0, describe_source(recipe.model), layers_run, num_layers, layer_ids,
             f" + final ({recipe.layers.capture_final})" if recipe.layers.capture_final != "none" else "")
    apply_kernels(model, kernels)  # before the capture hooks are registered
    if is_main:
        _append_kernels_record(out_dir, kernels.record(), world)

    # The loop.
    writer = AsyncShardWriter(
        lanes(out_dir, rank, recipe.output.max_shard_bytes, next_shard_number(committed, rank_name(rank)),
              recipe.output.num_writer_threads, faults), nan_policy=recipe.output.nan_policy,
        max_pending_bytes=recipe.output.max_pending_bytes)
    runner = None
    loader = torch.utils.data.DataLoader(
        PlannedBatches(data.kept, mine, padding_token_id(tokenizer, vocab_size_of(config))), batch_size=None,
        shuffle=False, num_workers=recipe.batching.num_workers, pin_memory=device.type == "cuda",
        persistent_workers=False, prefetch_factor=4 if recipe.batching.num_workers else None,
        worker_init_fn=functools.partial(_init_worker, lock_fds))
    rank_stats = RankStats()
    progress = _progress(is_main, sum(len(p.sample_indices) for p in mine), world)
    storage_dtype = STORAGE_TORCH_DTYPES[recipe.output.dtype]
    gpu_timer = _GpuTimer() if device.type == "cuda" else None
    t_loop = time.perf_counter()
    stop, stopped_early = _StopRequest(), False
    try:
        with LayerCapture(model, layer_ids, capture_final=recipe.layers.capture_final,
                          storage_dtype=storage_dtype, padding_mask=recipe.model.padding_mask) as capture:
            runner = BatchRunner(capture, faults)  # OOM: split and retry, learn per-length batch caps
            t_wait = time.perf_counter()
            for batch in loader:
                rank_stats.data_wait_seconds += time.perf_counter() - t_wait
                t_fwd = time.perf_counter()
                tensors = batch.tensors_on(device)
                if gpu_timer is not None:
                    gpu_timer.start()
                out = runner.run(batch, tensors)
                if gpu_timer is not None:
                    gpu_timer.stop()
                hs, final, nonfinite, event = _to_host(out, device)
                rank_stats.forward_seconds += time.perf_counter() - t_fwd
                writer.submit(PendingBatch(batch.batch_id, out.samples, hs, final, event, layer_ids,
                                           failed=out.failed, nonfinite_B=nonfinite))
                rank_stats.num_batches += 1
                rank_stats.num_samples += len(batch.samples)
                rank_stats.num_real_tokens += batch.num_real_tokens
                rank_stats.num_padded_tokens += batch.num_padded_tokens
                rank_stats.shapes_seen.add(tuple(batch.input_ids.shape))
                if progress is not None:
                    progress.update(len(batch.samples))
                    elapsed = time.perf_counter() - t_loop
                    progress.set_postfix(tok_s=f"{rank_stats.num_real_tokens * world / elapsed:,.0f}", refresh=False)
                if stop.requested and not stopped_early:
                    stopped_early = True  # the batches captured so far are written and committed below
                    break
                t_wait = time.perf_counter()
        writer.close()
    except BaseException as e:
        try:
            writer.abort()  # drains the queue, drops the open shard (its .tmp)
        except Exception as abort_error:  # noqa: BLE001 - the original error is the one to report
            log.error("could not clean up the open shard: %s", abort_error)
        if e is writer.error or isinstance(e, NonFiniteStatesError):
            message = _stopped_message(out_dir, rank, writer, e)
            log.error("%s", message, exc_info=e, extra={"console": False})
            raise ExtractionError(message) from e
        log.exception("extraction failed on rank %d; committed shards are intact, re-run the same command "
                      "to resume", rank)
        raise
    finally:
        stop.restore()
        if progress is not None:
            progress.close()
    if stopped_early:  # (a signal after the last batch just lets the run finish)
        committed_now = read_committed(out_dir)
        message = (f"rank {rank} stopped on {stop.signal_name}: {rank_stats.num_batches} batch(es) of this run were "
                   f"written and committed ({sum(r.num_samples for r in committed_now)} samples committed in all); "
                   f"re-run the same command to resume")
        log.warning("%s", message, extra={"console": False})
        raise ExtractionError(message)
    rank_stats.writer_wait_seconds = writer.wait_seconds
    loop_seconds = time.perf_counter() - t_loop
    gpu_forward_seconds = gpu_timer.total_seconds() if gpu_timer is not None else None

    rank_report = {
        "rank": rank, "num_batches": rank_stats.num_batches, "num_samples": rank_stats.num_samples,
        "num_real_tokens": rank_stats.num_real_tokens, "num_padded_tokens": rank_stats.num_padded_tokens,
        "num_shapes": len(rank_stats.shapes_seen), "loop_seconds": loop_seconds,
        "forward_seconds": rank_stats.forward_seconds, "gpu_forward_seconds": gpu_forward_seconds,
        "gpu_idle_seconds": None if gpu_forward_seconds is None else max(loop_seconds - gpu_forward_seconds, 0.0),
        "data_wait_seconds": rank_stats.data_wait_seconds,
        "writer_wait_seconds": rank_stats.writer_wait_seconds, "write_seconds": writer.write_seconds,
        "num_writer_threads": len(writer.writers), "peak_pending_bytes": writer.peak_pending_bytes,
        "bytes_written": writer.bytes_written, "shards_committed": len(writer.committed),
        "decoder_params_run": decoder_params_in(model),
        "peak_gpu_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "num_failed": len(writer.failed),
        "failed": dict(sorted(Counter(f["reason"] for f in writer.failed).items())),
        "num_oom": runner.num_ooms if runner is not None else 0,
        "num_split_batches": runner.num_split_batches if runner is not None else 0,
        "oom_batch_caps": {str(T): n for T, n in sorted(runner.caps.items())} if runner is not None else {},
        "kernels": list(kernels.names),
    }
    return rank_report


def _final_norm_entry(out_dir: Path, recipe: Recipe) -> dict | None:
    """The manifest's `final_norm` ({path, form, eps}) from OUT/final_norm.safetensors, written by the run that
    loaded the model (a finished output re-run does not load it); None unless capture_final is before_norm."""
    if recipe.layers.capture_final != "before_norm":
        return None
    try:
        norm = read_final_norm(out_dir)
    except FileNotFoundError:
        return None
    return {"path": FINAL_NORM_NAME, "form": norm["form"], "eps": norm["eps"]}


def _idle_rank_report(rank: int) -> dict:
    """The report of a rank that had nothing to run."""
    report = {key: 0 for key in ("num_batches", "num_samples", "num_real_tokens", "num_padded_tokens", "num_shapes",
                                 "num_failed", "num_oom", "num_split_batches", "bytes_written", "shards_committed",
                                 "num_writer_threads", "peak_pending_bytes", "decoder_params_run")}
    report.update({key: 0.0 for key in ("loop_seconds", "forward_seconds", "data_wait_seconds",
                                        "writer_wait_seconds", "write_seconds")})
    report.update(rank=rank, gpu_forward_seconds=None, gpu_idle_seconds=None, peak_gpu_memory_bytes=None,
                  failed={}, oom_batch_caps={}, kernels=[])
    return report


def _append_kernels_record(out_dir: Path, record: dict, world: int) -> None:
    """One line per run that loads the model into OUT/kernels.jsonl (main process): the kernels it applied. A resume
    may apply another set (its shards' states then differ from the earlier ones by rounding): the manifest lists
    them all."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "num_ranks": world, **record}
    with open(out_dir / KERNELS_NAME, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _kernels_lines(out_dir: Path) -> list[dict]:
    path = out_dir / KERNELS_NAME
    lines = []
    for text in path.read_text().splitlines() if path.exists() else []:
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue  # a torn last line (a crash while appending)
    return lines


def _last_kernels_record(out_dir: Path) -> dict | None:
    """The manifest's `kernels`: the record of the latest run that computed states into this output (None for an
    output of a version before kernels were recorded)."""
    lines = _kernels_lines(out_dir)
    return {k: lines[-1][k] for k in ("requested", "applied", "libraries", "reason")} if lines else None


def _kernels_history(out_dir: Path) -> list[dict]:
    """The distinct kernel sets (applied names and library versions) of the runs that computed states into this
    output, in first-use order (OUT/kernels.jsonl)."""
    seen: list[dict] = []
    for line in _kernels_lines(out_dir):
        entry = {"applied": line["applied"], "libraries": line["libraries"]}
        if entry not in seen:
            seen.append(entry)
    return seen


def _stopped_message(out_dir: Path, rank: int, writer: AsyncShardWriter, error: BaseException) -> str:
    """One paragraph for a run that stopped cleanly: what went wrong, what is committed, how to go on."""
    if isinstance(error, NonFiniteStatesError):
        what, fix = str(error), "fix the cause (or set output.nan_policy: fail_sample), then re-run the same command"
    else:
        what = f"writing shards failed: {type(error).__name__}: {error}"
        fix = ("free disk space under the output folder, then re-run the same command"
               if isinstance(error, OSError) and error.errno == errno.ENOSPC else
               "fix the cause, then re-run the same command")
    try:
        committed = read_committed(out_dir)
        done = (f"{sum(r.num_samples for r in committed)} samples in {len(committed)} shards are committed and "
                f"intact ({len(writer.committed)} of those shards by rank {rank} in this run)")
    except OSError:
        done = "the shards committed so far are intact"
    return (f"rank {rank} stopped: {what}. {done}; the shards being written were discarded, nothing partial is "
            f"visible. To resume: {fix} (committed batches are not redone).")


def _progress(is_main: bool, total_samples: int, world: int):
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total_samples, desc=f"extract (rank 0 of {world})", unit="sample", dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def main(argv: list[str] | None = None) -> int:
    """`extract.py` / `dflash-prep extract`: [--recipe PATH] [--set key=value ...]. Returns the exit code."""
    code = _main(argv)
    if code in (EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES) and _under_plain_accelerate_launch():
        print(f"note: `accelerate launch` reports exit code {code} as 1 (\"stopped, resumable\"); `dflash-prep launch` "
              f"takes the same arguments and keeps it", file=sys.stderr)
    return code


def _under_plain_accelerate_launch() -> bool:
    """Started by `accelerate launch` (it sets ACCELERATE_MIXED_PRECISION), not by `dflash-prep launch`; rank 0."""
    from .launch import LAUNCHER_ENV

    return ("ACCELERATE_MIXED_PRECISION" in os.environ and LAUNCHER_ENV not in os.environ
            and os.environ.get("RANK", "0") == "0")


def _main(argv: list[str] | None) -> int:
    import argparse

    from .recipe import load_recipe

    parser = argparse.ArgumentParser(prog="dflash-prep extract", description=__doc__.splitlines()[0])
    add_extract_args(parser)
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summary = run_extraction(recipe)
    except (RecipeError, OutputMismatchError, OutputBusyError, OutputStateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    except ExtractionError as e:
        print(f"error: {e} (details in {Path(recipe.output.dir) / 'logs'})", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:  # Ctrl-C outside the loop (which handles it at a batch boundary)
        print(f"error: stopped by Ctrl-C; committed shards are intact, re-run the same command to resume",
              file=sys.stderr)
        return EXIT_STOPPED
    except OSError as e:
        if log.handlers:
            log.error("stopped: %s", e, exc_info=e, extra={"console": False})
        print(f"error: {type(e).__name__}: {e}. Committed shards are intact; fix the cause and re-run the same "
              f"command to resume (details in {Path(recipe.output.dir) / 'logs'})", file=sys.stderr)
        return EXIT_STOPPED
    limit = recipe.output.max_failed_samples
    if summary is not None and limit is not None and summary["num_failed"] > limit:
        print(f"error: {summary['num_failed']} sample(s) failed {summary['failed']}, more than "
              f"output.max_failed_samples={limit}; they are listed in {Path(recipe.output.dir) / FAILED_NAME} and "
              f"the output is otherwise complete (set output.max_failed_samples to accept them)", file=sys.stderr)
        return EXIT_FAILED_SAMPLES
    return 0


def add_extract_args(parser) -> None:
    parser.add_argument("--recipe", default=None,
                        help="recipe YAML (default: recipes/tiny-demo.yaml, the embedded CPU demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set output.dir=/data/out (repeatable)")

"""The extraction loop: recipe -> tokenized rows -> global plan -> this rank's batches -> hooks -> shards.

Run under `accelerate launch` (any number of processes, nodes) or plain `python`: each process is one rank
with its own model copy and its own shards; the batch plan is global and deterministic, so ranks agree on it
without communicating, and the main process merges the rank indexes into `OUT/manifest.json` at the end. With
`model.gpus_per_replica` N > 1 a rank is a replica of N GPUs (replica.py: N tensor-parallel processes of which the
first writes, or one process holding N GPUs).

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

from dflash_prep import __version__  # noqa: E402
from dflash_prep.commands.cost import batch_cost_model  # noqa: E402
from dflash_prep.commands.finish import DISK_BOUND_FRACTION, finish_run  # noqa: E402
from dflash_prep.commands.job import (  # noqa: E402
    FAILED_NAME,
    SKIPPED_NAME,
    OutputMismatchError,
    RankPlan,
    Run,
    load_or_make_plan,
    manifest_readable,
    open_output,
    prepare_output,
    refuse_unsafe_output_dir,
    run_identity,
)
from dflash_prep.data.rows import (  # noqa: E402
    check_data_source,
    check_data_verdict,
    check_recipe_chat_template,
    load_rows,
    tokenize_dataset,
)
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES, EXIT_STOPPED, ExtractionError  # noqa: E402
from dflash_prep.faults import Faults  # noqa: E402
from dflash_prep.io import atomic_write_json, atomic_write_jsonl  # noqa: E402
from dflash_prep.plan.batches import PlannedBatches  # noqa: E402
from dflash_prep.plan.planner import plan_stats, rank_finish_seconds, split_across_ranks  # noqa: E402
from dflash_prep.recipe.fingerprints import rows_fingerprint  # noqa: E402
from dflash_prep.recipe.schema import Recipe, RecipeError, add_recipe_args  # noqa: E402
from dflash_prep.store.locks import OutputBusyError, check_no_rank_writing, lock_rank, lock_run  # noqa: E402
from dflash_prep.store.manifest import OutputStateError, next_shard_number, read_committed  # noqa: E402
from dflash_prep.store.sizes import check_free_space  # noqa: E402
from dflash_prep.store.writer import (  # noqa: E402
    AsyncShardWriter,
    DiscardingWriter,
    NonFiniteStatesError,
    PendingBatch,
    lanes,
    rank_name,
)
from dflash_prep.target.backoff import BatchRunner  # noqa: E402
from dflash_prep.target.budget import resolve_token_budget  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import append_kernels_record, apply_kernels, configure_triton_cache, select_kernels  # noqa: E402
from dflash_prep.target.layers import decoder_layers, find_decoder, num_decoder_layers, resolve_layer_ids  # noqa: E402
from dflash_prep.target.model import (  # noqa: E402
    STORAGE_TORCH_DTYPES,
    decoder_params_in,
    describe_source,
    drop_layers_after,
    hidden_size_of,
    load_config,
    load_model,
    load_replica_model,
    load_tokenizer,
    padding_token_id,
    vocab_size_of,
)
from dflash_prep.target.norms import describe_final_norm, write_final_norm  # noqa: E402
from dflash_prep.target.packing import replay_stored_layout, select_packing, use_packed_attention  # noqa: E402
from dflash_prep.target.replica import TENSOR_PARALLEL, ReplicaAgreement, replica_of_process  # noqa: E402

log = logging.getLogger("dflash_prep")



class _StopRequest:
    """SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) asks the run to stop at the next batch
    boundary: the batches already captured are written and their shards committed, so a resume redoes nothing
    that was computed; a second signal stops at once (the default handlers are back), except the same signal within
    DUPLICATE_SECONDS of the first: one request delivered twice (a SIGTERM to the job's process group reaches the
    script and the launcher, which forwards it). Installed only in the main thread (signal handlers can only be
    set there)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    DUPLICATE_SECONDS = 2.0

    def __init__(self):
        self.signal_name: str | None = None
        self._first: tuple[int, float] | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.signal_name = (signum, now), signal.Signals(signum).name
            log.warning("%s received: finishing the batches in flight and committing their shards; send it again "
                        "to stop at once (a resume is safe either way)", self.signal_name)
            return
        if signum == self._first[0] and now - self._first[1] < self.DUPLICATE_SECONDS:
            return  # the same request, delivered twice
        self.restore()  # a second signal acts at once: the default action
        signal.raise_signal(signum)

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
    writer_wait_seconds: float = 0.0  # the loop blocked on writers (pending batches at their bound)
    writer_drain_seconds: float = 0.0  # after the last forward, until the writers had written everything
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


# ----------------------------------------------------------------------------------------------------- loop
def _to_host(out, device: torch.device):
    """One asynchronous copy of a forward's packed states and per-sample non-finite flags into pinned host
    memory; returns (states, final states, flags, event). What is already on the host (CPU runs, a batch joined
    after an OOM split) passes through with event None. (bench/run_bench.py wraps this function.)

    The copy runs on a stream of its own (`_copy_stream`), after the forward that made the states: the next forward
    does not wait for it (on the compute stream it cost 0.24 s of a 21.9 s benchmark loop of the 27B hybrid and
    0.38 s of 18.0 s of the 8B shape, bench/RESULTS.md, fifth round). `record_stream` keeps the caching allocator
    from reusing the states' GPU memory before the copy is done; `event` completes when the host copy is."""
    tensors = (out.hidden_states_NK, out.final_NH, out.nonfinite_B)
    if device.type != "cuda" or out.hidden_states_NK.device.type != "cuda":
        return (*tensors, None)
    stream = _copy_stream(out.hidden_states_NK.device)
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


def _copy_stream(device: torch.device):
    """The device-to-host copy stream of `device` (one per device and process, made on first use)."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(device=key)
    return _COPY_STREAMS[key]


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
    thread of its own while the rows are tokenized and the plan made (`_TargetLoad`)."""
    run = _start(recipe)                       # process group, logging; every recipe check before any weights
    _claim_output(run, held)                   # locks; an output of another job refused
    run.startup_seconds["start"] = time.perf_counter() - run.t_start
    load = _TargetLoad.start_if_safe(run)      # the weights load while this thread tokenizes and plans
    try:
        t0 = time.perf_counter()
        data = _tokenize(run)                  # rows -> token ids + loss masks (datasets cache), skips counted
        t1 = time.perf_counter()
        rank_plan = _plan(run, data)           # the frozen global plan minus what is committed, this rank's share
        run.startup_seconds.update(tokenize=t1 - t0, plan=time.perf_counter() - t1)
    except BaseException:
        if load is not None and not own_process:
            load.wait()  # in-process callers get no thread left behind; a process of its own exits at once (main)
        raise
    lock_fds = tuple(lock.fd for lock in held if lock.fd is not None)
    report = _run_rank(run, data, rank_plan, lock_fds, load)  # model + kernels + hooks + loop -> committed shards
    # one process per replica writes; a finished output keeps its run's figures
    if run.is_writer and (rank_plan.todo or not manifest_readable(run.out_dir)):
        atomic_write_json(run.out_dir / "index" / f"{rank_name(run.rank)}.done.json", report)
    log.info("rank %d done: %d samples, %d tokens in %.1fs (predicted %s); start-up %s", run.rank,
             report["num_samples"], report["num_real_tokens"], report["loop_seconds"],
             "n/a" if report.get("predicted_seconds") is None else f"{report['predicted_seconds']:.1f}s",
             ", ".join(f"{k} {v:.1f}s" for k, v in run.startup_seconds.items() if not isinstance(v, bool)))
    run.state.wait_for_everyone()
    return finish_run(run, data, rank_plan) if run.is_main else None  # manifest last


def _start(recipe: Recipe) -> Run:
    """This process's rank and logging; then everything that can be wrong with the recipe fails here, before any
    weights load (config, layer ids, kernels, token budget, tokenizer, data source, identity)."""
    from accelerate import PartialState

    t_start = time.perf_counter()
    # Without GPUs, accelerate only forms a process group when told it is a CPU job (gloo).
    state = PartialState(cpu=not torch.cuda.is_available())
    out_dir = Path(recipe.output.dir)
    refuse_unsafe_output_dir(recipe)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, a read-only or virtual filesystem: no run can fix that
        raise RecipeError(f"recipe key `output.dir` = {str(out_dir)!r}: cannot create it ({e.strerror or e})") \
            from None
    _setup_logging(out_dir, state.process_index, state.is_main_process)
    log.info("dflash-prep %s: rank %d of %d on %s", __version__, state.process_index, state.num_processes,
             state.device)
    try:
        return _checked_run(recipe, state, out_dir, t_start)
    except Exception:
        if created:  # a refused job leaves no folder behind (the console said why)
            _remove_if_only_logs(out_dir)
        raise


def _remove_if_only_logs(out_dir: Path) -> None:
    """Delete `out_dir` when it holds nothing but what `_start` made (logs, lock folder): a run refused before it
    claimed the folder."""
    from dflash_prep.store.locks import LOCKS_DIR

    for h in list(log.handlers):  # the rank log file is inside
        if isinstance(h, logging.FileHandler):
            log.removeHandler(h)
            h.close()
    if out_dir.is_dir() and {p.name for p in out_dir.iterdir()} <= {"logs", LOCKS_DIR}:
        shutil.rmtree(out_dir, ignore_errors=True)


def _checked_run(recipe: Recipe, state, out_dir: Path, t_start: float) -> Run:
    """`_start`'s checks and the Run they give (RecipeError and the data errors on a bad job)."""
    # Before anything imports Triton: compiled kernels and autotuning shared by the node's ranks and later runs.
    triton_cache = configure_triton_cache(recipe.model.triton_cache_dir) if state.device.type == "cuda" else None
    if triton_cache is not None and state.is_main_process:
        log.info("triton cache: %s (autotuning cached: %s; from the %s)", triton_cache["dir"],
                 triton_cache["autotuning"], triton_cache["source"])
    config = load_config(recipe.model)
    num_layers = num_decoder_layers(config)
    layer_ids = resolve_layer_ids(recipe.layers, num_layers)
    replica = replica_of_process(state, recipe, config)
    kernels = select_kernels(recipe.model.kernels, config, state.device.type,
                             tensor_parallel=replica.parallelism == TENSOR_PARALLEL)
    packing = select_packing(recipe.batching.packing, config, state.device.type, kernels.names,
                             several_gpus=replica.gpus_per_replica > 1, compute_dtype=recipe.model.dtype)
    recipe, budget_how = resolve_token_budget(
        recipe, config, layer_ids, num_layers,
        torch.cuda.get_device_properties(state.device).total_memory if state.device.type == "cuda" else None)
    if budget_how and state.is_main_process:
        log.info("batching.max_tokens_per_batch: auto = %d (%s)", recipe.batching.max_tokens_per_batch, budget_how)
    tokenizer = load_tokenizer(recipe.model)
    check_data_source(recipe.data)
    check_recipe_chat_template(recipe.data)
    faults = Faults.from_env()  # test-only fault injection (faults.py); None unless DFLASH_PREP_FAULTS is set
    if faults is not None:
        log.warning("fault injection active (DFLASH_PREP_FAULTS): %s", faults)
    return Run(recipe=recipe, state=state, out_dir=out_dir, config=config, num_layers=num_layers,
               layer_ids=layer_ids, kernels=kernels, tokenizer=tokenizer, faults=faults, t_start=t_start,
               replica=replica, identity=run_identity(recipe, config, layer_ids, tokenizer, state.is_main_process),
               triton_cache=triton_cache, packing=packing, agreement=ReplicaAgreement.for_layout(replica),
               # the split's cost numbers (a meta-device build: before the model loads on a thread of its own)
               cost_model=batch_cost_model(recipe, config, layer_ids, num_layers))


def _claim_output(run: Run, held: list) -> None:
    """The main process locks the folder and checks it is this job's before anything in it is touched; then
    every rank holds its own lock (released by the kernel when its process dies)."""
    if run.is_main:
        held.append(lock_run(run.out_dir))
        check_no_rank_writing(run.out_dir)  # no orphaned worker of an earlier run still writes
        open_output(run.out_dir, run.recipe, run.identity)
    run.state.wait_for_everyone()
    if run.is_writer:  # the other processes of a replica write nothing
        held.append(lock_rank(run.out_dir, run.rank))


def _tokenize(run: Run):
    """Rows -> tokenized data (cached by datasets: the main process fills the cache, the others read it). The data
    verdict (nothing kept, too much skipped: exit 2) comes before the output is prepared."""
    with run.state.main_process_first():
        rows = load_rows(run.recipe.data)
        data = tokenize_dataset(rows, run.tokenizer, run.recipe.data, vocab_size_of(run.config))
    check_data_verdict(data, run.recipe.data)
    if run.is_main:
        run.identity["data_rows"] = rows_fingerprint(data.kept)
        finished = prepare_output(run.out_dir, run.recipe, run.identity)  # refuses rows that differ
        if not finished:
            atomic_write_jsonl(run.out_dir / SKIPPED_NAME, data.skipped_rows)
        log.info("data: %d rows, %d kept, %d skipped%s", data.num_rows, len(data.kept),
                 sum(data.skipped_counts.values()), f" {data.skipped_counts}" if data.skipped_counts else "")
    return data


def _plan(run: Run, data) -> RankPlan:
    """The global plan (frozen in OUT/plan.json by the first run), minus the committed batches, split over this
    run's ranks by predicted time (cost.py: the forward's FLOPs and the write's bytes of each batch)."""
    lengths = [int(n) for n in data.kept["num_tokens"]]
    plan = load_or_make_plan(run.out_dir, lengths, run.recipe, run.is_main, run.state, packed=run.packing.packed)
    run.packing = replay_stored_layout(run.packing, bool(plan) and plan[0].packed, run.config, run.device.type,
                                       run.kernels.names)
    committed = read_committed(run.out_dir)
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
        check_free_space(run.out_dir, lengths, todo, run.layer_ids, hidden_size_of(run.config), run.recipe)
    return rank_plan


def _run_rank(run: Run, data, rank_plan: RankPlan, lock_fds: tuple, load: _TargetLoad | None) -> dict:
    """This rank's batches through the model into the writer; the rank's report. A finished output re-run has
    nothing to do: the model is not even loaded (a load already under way is waited for and dropped)."""
    if not rank_plan.todo:
        if load is not None:
            load.wait()
        log.info("every batch of the plan is committed: nothing to run, the model is not loaded")
        return {**_idle_rank_report(run.rank), "startup_seconds": dict(run.startup_seconds)}
    model = _load_target(run, load)
    run.agreement.watch(model)  # a tensor-parallel replica's OOM splits compare its collectives (replica.py)
    writer = DiscardingWriter() if not run.is_writer else AsyncShardWriter(
        lanes(run.out_dir, run.rank, run.recipe.output.max_shard_bytes,
              next_shard_number(rank_plan.committed, rank_name(run.rank)), run.recipe.output.num_writer_threads,
              run.faults), nan_policy=run.recipe.output.nan_policy,
        max_pending_bytes=run.recipe.output.max_pending_bytes)
    loader = torch.utils.data.DataLoader(
        PlannedBatches(data.kept, rank_plan.mine, padding_token_id(run.tokenizer, vocab_size_of(run.config))),
        batch_size=None, shuffle=False, num_workers=run.recipe.batching.num_workers,
        pin_memory=run.device.type == "cuda", persistent_workers=False,
        prefetch_factor=4 if run.recipe.batching.num_workers else None,
        worker_init_fn=functools.partial(_init_worker, lock_fds))
    loop = _forward_loop(run, model, loader, writer, sum(len(p.sample_indices) for p in rank_plan.mine))
    report = _rank_report(run, model, writer, loop)
    report["predicted_seconds"] = rank_plan.predicted_seconds[run.rank] if rank_plan.predicted_seconds else None
    return report


class _TargetLoad:
    """The target's weights loading on a thread of their own (`_build_target`), started once the output is
    claimed, while this process's main thread tokenizes (the main process) or waits for the tokenized rows (the
    others) and plans; `result()` joins it before the forward loop. Start-up was tokenize, then load, then plan.

    Started only where it is safe (`start_if_safe`): one GPU per replica (a tensor-parallel load runs collectives
    that would interleave with the main thread's barriers), `data.num_proc` 1 or unset (tokenizing in forked processes
    while a thread holds locks inside the loader could leave a child waiting forever), and an output that may
    have work left (a finished one loads nothing). Random weights stay identical on every rank: the thread seeds
    and draws them as the main thread did, and nothing else draws random numbers meanwhile; torch's default
    dtype, which transformers sets while it builds a model, is not touched by the main thread meanwhile (the
    cost model's meta-device build is done before the thread starts).

    Threads share the GIL. Measured on 2 CPU cores, 4,200 demo rows beside the CPU-bound random init of a
    150M-parameter model (the worst case: both compete for the cores; on a GPU the load is mostly file reads and
    host-to-device copies, which release the GIL): tokenizing took 4.1-7.2 s beside the load instead of 2.3-4.6 s
    alone, the load 3.4-5.7 s; the two took 5.7-10 s one after the other, 4.1-7.2 s overlapped."""

    THREAD_NAME = "dflash-prep-load"

    def __init__(self, run: Run):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would cut through the tokenizing one
        self.run = run
        self.model = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        # The current CUDA device is per thread: the load thread takes this one's (`cuda` has no index of its own).
        self._cuda_index = None
        if run.device.type == "cuda":
            self._cuda_index = run.device.index if run.device.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._load, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    def start_if_safe(cls, run: Run) -> _TargetLoad | None:
        if (run.replica.gpus_per_replica != 1 or (run.recipe.data.num_proc or 1) > 1
                or (not run.recipe.output.overwrite and manifest_readable(run.out_dir))):
            return None
        return cls(run)

    @classmethod
    def in_flight(cls) -> bool:
        """A load thread of this process is still running."""
        return any(t.name == cls.THREAD_NAME and t.is_alive() for t in threading.enumerate())

    def _load(self) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            t0 = time.perf_counter()
            self.model = _build_target(self.run)
            self.seconds = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised in the main thread by result()
            self.error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> torch.nn.Module:
        """The loaded model (the load's own error raised here, in the main thread)."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.model


def _build_target(run: Run) -> torch.nn.Module:
    """Load the model and keep only the layers read from (on the load thread, or the main thread)."""
    if run.faults is not None:
        run.faults.before_load()
    model = (load_model(run.recipe.model, run.config, run.device) if run.replica.gpus_per_replica == 1 else
             load_replica_model(run.recipe.model, run.config, run.replica))
    capture_final = run.recipe.layers.capture_final
    drop_layers_after(model, run.num_layers - 1 if capture_final != "none" else run.layer_ids[-1])
    return model


def _load_target(run: Run, load: _TargetLoad | None) -> torch.nn.Module:
    """The model (loaded here, or by `load` during start-up), then in the main thread: describe the final norm
    (before the kernels patch it: that runs the norm on the CPU), apply the fused kernels (before the capture
    hooks are registered). Start-up seconds: `model_load` (the load itself), `model_load_wait` (how long the
    main thread waited for it after planning: 0 when the overlap hid it)."""
    t0 = time.perf_counter()
    model = load.result() if load is not None else _build_target(run)
    waited = time.perf_counter() - t0
    run.startup_seconds.update(model_load=load.seconds if load is not None else waited, model_load_wait=waited,
                               model_load_overlapped=load is not None)
    capture_final = run.recipe.layers.capture_final
    layers_run = len(decoder_layers(find_decoder(model)))
    if run.is_main and capture_final == "before_norm":  # + the norm = the after-norm states at read time
        write_final_norm(run.out_dir, describe_final_norm(find_decoder(model).norm))
    log.info("model loaded in %.1fs%s: %s, %d of %d decoder layers run; hooks on layers %s%s",
             run.startup_seconds["model_load"], f" (during start-up; waited {waited:.1f}s for it)" if load else "",
             describe_source(run.recipe.model), layers_run, run.num_layers, run.layer_ids,
             f" + final ({capture_final})" if capture_final != "none" else "")
    apply_kernels(model, run.kernels)
    if run.is_main:
        append_kernels_record(run.out_dir, run.kernels.record(), run.world)
    log.info("batching.packing: %s (%s)", "packed rows" if run.packing.packed else "padded batches",
             run.packing.reason)
    if run.packing.packed:  # our varlen attention; per-segment Gated DeltaNet where fla's kernels are not used
        log.info("packed rows: %s", use_packed_attention(model, run.device.type))
    return model


@dataclass
class _LoopResult:
    stats: RankStats
    runner: BatchRunner | None
    loop_seconds: float
    gpu_forward_seconds: float | None


def _forward_loop(run: Run, model, loader, writer: AsyncShardWriter, num_samples: int) -> _LoopResult:
    """Batches -> forward with the capture hooks -> one async copy to the host -> the writer, until the loader is
    done or a stop signal arrives (then the batches captured so far are committed and ExtractionError raised).
    A write error or a fatal NaN stops the run cleanly (ExtractionError); the open shards are dropped. The
    processes of a tensor-parallel replica agree after every batch whether any of them stops or failed
    (replica.ReplicaAgreement), so they leave the loop together."""
    progress = _progress(run.is_main, num_samples, run.world)
    gpu_timer = _GpuTimer() if run.device.type == "cuda" else None
    stats, runner, stop, stopped_early = RankStats(), None, _StopRequest(), False
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
                if stats.num_batches == 1:  # its DataLoader start, collate, first-seen shape, hooks
                    run.startup_seconds["first_batch"] = time.perf_counter() - t_loop
                _show_progress(progress, len(batch.samples), stats.num_real_tokens * run.world, t_loop,
                               writer.wait_seconds)
                if stop.requested:
                    stopped_early = True  # the batches captured so far are written and committed below
                    break
                t_wait = time.perf_counter()
        t_drain = time.perf_counter()
        writer.close()
        stats.writer_drain_seconds = time.perf_counter() - t_drain
    except BaseException as e:
        _abort_writer(run, writer, e)
        raise
    finally:
        stop.restore()
        if progress is not None:
            progress.close()
    if stopped_early:
        _stop_after_commit(run, stop.signal_name, stats.num_batches)
    stats.writer_wait_seconds = writer.wait_seconds
    return _LoopResult(stats, runner, time.perf_counter() - t_loop,
                       gpu_timer.total_seconds() if gpu_timer is not None else None)


def _forward_agreed(run: Run, batch, runner: BatchRunner, writer: AsyncShardWriter, stats: RankStats,
                    gpu_timer: _GpuTimer | None, stop: _StopRequest) -> None:
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
                 gpu_timer: _GpuTimer | None) -> None:
    """One planned batch: forward (with OOM backoff), the async host copy, handed to the writer; stats counted."""
    t_fwd = time.perf_counter()
    tensors = batch.tensors_on(run.device)
    if gpu_timer is not None:
        gpu_timer.start()
    out = runner.run(batch, tensors)
    if gpu_timer is not None:
        gpu_timer.stop()
    hs, final, nonfinite, event = _to_host(out, run.device)
    stats.forward_seconds += time.perf_counter() - t_fwd
    writer.submit(PendingBatch(batch.batch_id, out.samples, hs, final, event, run.layer_ids,
                               failed=out.failed, nonfinite_B=nonfinite))
    stats.num_batches += 1
    stats.num_samples += len(batch.samples)
    stats.num_real_tokens += batch.num_real_tokens
    stats.num_padded_tokens += batch.num_padded_tokens
    stats.shapes_seen.add(tuple(batch.input_ids.shape))


def _show_progress(progress, num_samples: int, num_tokens_all_ranks: int, t_loop: float,
                   writer_wait_seconds: float) -> None:
    """tok/s over all ranks, and, once the loop has spent over 10% of its time waiting on the writers, that share
    (`disk_wait`: the disk, not the GPU, sets the pace)."""
    if progress is not None:
        progress.update(num_samples)
        elapsed = max(time.perf_counter() - t_loop, 1e-9)
        postfix = {"tok_s": f"{num_tokens_all_ranks / elapsed:,.0f}"}
        if writer_wait_seconds > DISK_BOUND_FRACTION * elapsed:
            postfix["disk_wait"] = f"{writer_wait_seconds / elapsed:.0%}"
        progress.set_postfix(refresh=False, **postfix)


def _abort_writer(run: Run, writer: AsyncShardWriter, error: BaseException) -> None:
    """The loop failed: drop the open shards; a write error or a fatal NaN becomes a clean ExtractionError."""
    try:
        writer.abort()  # drains the queue, drops the open shard (its .tmp)
    except Exception as abort_error:  # noqa: BLE001 - the original error is the one to report
        log.error("could not clean up the open shard: %s", abort_error)
    if error is writer.error or isinstance(error, NonFiniteStatesError):
        message = _stopped_message(run.out_dir, run.rank, writer, error)
        log.error("%s", message, exc_info=error, extra={"console": False})
        raise ExtractionError(message) from error
    log.exception("extraction failed on rank %d; committed shards are intact, re-run the same command "
                  "to resume", run.rank)


def _stop_after_commit(run: Run, signal_name: str | None, num_batches: int) -> None:
    """A stop signal arrived: every batch captured was written and committed; say so and raise ExtractionError."""
    committed_now = read_committed(run.out_dir)
    message = (f"rank {run.rank} stopped on {signal_name}: {num_batches} batch(es) of this run were written and "
               f"committed ({sum(r.num_samples for r in committed_now)} samples committed in all); re-run the same "
               f"command to resume")
    log.warning("%s", message, extra={"console": False})
    raise ExtractionError(message)


def _rank_report(run: Run, model, writer: AsyncShardWriter, loop: _LoopResult) -> dict:
    """This rank's figures for the run (OUT/index/rank-R.done.json; the summary lists them)."""
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
        "decoder_params_run": decoder_params_in(model),
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


def _idle_rank_report(rank: int) -> dict:
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


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """`extract.py` / `dflash-prep extract`: [--recipe PATH] [--set key=value ...]. Returns the exit code.

    `own_process` (the launched script): an error while the model was still loading on its thread (a data verdict,
    an output of another job) ends the process at once with its exit code, after the error line, instead of
    waiting for the load (a model load cannot be interrupted, and the other ranks are stopped by the launcher
    only once this process exits)."""
    code = _main(argv, own_process)
    if code in (EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES) and _under_plain_accelerate_launch():
        print(f"note: `accelerate launch` reports exit code {code} as 1 (\"stopped, resumable\"); `dflash-prep launch` "
              f"takes the same arguments and keeps it", file=sys.stderr)
    if own_process and code != 0 and _TargetLoad.in_flight():
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with `code` without waiting for the load thread: flush what was printed and logged, then
    os._exit (nothing else is running yet: no writer, no DataLoader worker; the locks are released by the
    kernel)."""
    for handler in log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _under_plain_accelerate_launch() -> bool:
    """Started by `accelerate launch` (it sets ACCELERATE_MIXED_PRECISION), not by `dflash-prep launch`; rank 0."""
    from dflash_prep.commands.launch import LAUNCHER_ENV

    return ("ACCELERATE_MIXED_PRECISION" in os.environ and LAUNCHER_ENV not in os.environ
            and os.environ.get("RANK", "0") == "0")


def _main(argv: list[str] | None, own_process: bool = False) -> int:
    import argparse

    from dflash_prep.recipe.schema import load_recipe

    parser = argparse.ArgumentParser(prog="dflash-prep extract", description=__doc__.splitlines()[0])
    add_recipe_args(parser)
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dflash_prep.commands.regenerate import regenerate_first

    recipe, code = regenerate_first(recipe)  # a `regenerate:` section: the target's answers first, then their states
    if code is not None:
        return code
    try:
        summary = run_extraction(recipe, own_process)
    except (RecipeError, OutputMismatchError, OutputBusyError, OutputStateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    except ExtractionError as e:
        print(f"error: {e} (details in {Path(recipe.output.dir) / 'logs'})", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:  # Ctrl-C outside the loop (which handles it at a batch boundary)
        print("error: stopped by Ctrl-C; committed shards are intact, re-run the same command to resume",
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

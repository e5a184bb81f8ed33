"""The regeneration loop of one rank: its chunks of rows -> conversations -> engine calls -> committed shards.

Rows are started in chunk order, up to `max_rows_in_flight` at once; the next request of every started row that
is waiting goes to the engine in calls of at most `batch_size` requests, `parallel_calls` calls at a time, each on a
daemon thread of its own (a call blocks until all its answers are in; several calls keep a server's slots busy
while one waits for its slowest answer; the in-process engine takes one large call and groups it by length
itself). An answered row moves on to its next turn or is done; a chunk whose rows are all done is committed at
once (output.ChunkCommitter). The engine is never called from two threads unless `parallel_calls` > 1 (the
`openai` engine is thread-safe).

Stops: a stop request (SIGTERM, Ctrl-C: StopRequest) or an engine that is gone (EngineUnavailable) ends the loop:
every chunk completed so far is already committed, the rows of the other chunks in flight are dropped (the next
run asks for them again). HTTP requests in flight are left to their daemon threads (the process exits at once);
an in-process engine's batch is waited for (`finish_calls_on_stop`): a process that exits while a thread runs torch
code aborts (SIGABRT, "terminate called without an active exception"). A second signal stops at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from dflash_prep.data import rows as data_rows
from dflash_prep.regen.conversation import Conversation, RegenSettings, RowSkip
from dflash_prep.regen.engine import EngineUnavailable
from dflash_prep.regen.output import ChunkCommitter, chunk_rows
from dflash_prep.signals import StopRequest

REGEN_STOP_MESSAGE = "%s received: stopping; the chunks committed so far stay, the rest is asked again on resume"

log = logging.getLogger("dflash_prep")


class LoopStopped(Exception):
    """The loop stopped on a signal (exit code 1, resumable)."""


class EngineFailed(RuntimeError):
    """The engine raised something other than EngineUnavailable (exit code 1, resumable once the cause is fixed)."""


@dataclass
class LoopStats:
    """What this rank did in this run (its report; the summary adds up the committed chunks instead)."""

    rows_done: int = 0
    rows_written: int = 0
    chunks_committed: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_seconds: float = 0.0
    loop_seconds: float = 0.0
    skipped: Counter = field(default_factory=Counter)


@dataclass
class _Chunk:
    chunk: int
    remaining: int
    rows: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    counts: dict = field(default_factory=lambda: {"num_requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                                  "finish_reasons": {}, "tool_calls": {}, "ended_early": {}})


def row_at(batch: dict, columns: list[str], j: int) -> tuple[dict, str]:
    """Row j of a column batch -> (row, "") or ({}, skip reason: a RowSkip with the extraction's detail) for a line
    data/rows.py read as raw JSON text that is not a JSON object or not UTF-8 (the extraction's reasons)."""
    row, reason, detail = data_rows.row_of(batch, columns, j)
    return row, (RowSkip(reason, detail) if reason else "")


class RegenLoop:
    """One rank's chunks through the engine (the module docstring says how).

    rows: the `datasets.Dataset` of data/rows.load_rows; chunks: this rank's chunk ids; provenance: the `regen`
    fields every row shares (engine, model, sampling JSON, max_tokens); on_progress(rows, requests, completion
    tokens): called after every engine call with this rank's totals; thread_init: called first in each call's thread
    (e.g. `torch.cuda.set_device`: the current CUDA device is per thread, and kernels such as Triton's use it)."""

    def __init__(self, engine, rows, chunks: list[int], rows_per_shard: int, settings: RegenSettings,
                 committer: ChunkCommitter, provenance: dict, id_column: str | None, max_rows_in_flight: int,
                 batch_size: int, parallel_calls: int, stop: StopRequest | None = None, on_progress=None,
                 finish_calls_on_stop: bool = False, thread_init=None):
        self.engine, self.rows, self.rows_per_shard, self.settings = engine, rows, rows_per_shard, settings
        self.committer, self.provenance, self.id_column = committer, provenance, id_column
        self.max_rows_in_flight, self.batch_size, self.parallel_calls = max_rows_in_flight, batch_size, parallel_calls
        self.stop, self.on_progress, self.finish_calls_on_stop = stop, on_progress, finish_calls_on_stop
        self.thread_init = thread_init  # run first in each call's thread (the CUDA device is per thread)
        self._chunks = deque(chunks)
        self._open: dict[int, _Chunk] = {}
        self._pending_rows: deque = deque()  # (chunk, position, row or skip reason) not started yet
        self._ready: deque[tuple[int, Conversation]] = deque()
        self._active = 0
        self._results: queue.Queue = queue.Queue()
        self._calls_in_flight = 0
        self.stats = LoopStats()

    def run(self) -> LoopStats:
        """Raises EngineUnavailable (the engine is gone), EngineFailed (it raised) or LoopStopped (a stop
        request); committed chunks stay."""
        t0 = time.perf_counter()
        try:
            while True:
                self._admit()
                self._dispatch()
                if self._calls_in_flight == 0 and not self._ready and not self._pending_rows and not self._chunks:
                    break
                self._collect()
        finally:
            self.stats.loop_seconds = time.perf_counter() - t0
        return self.stats

    # -------------------------------------------------------------------------------------------- rows in
    def _admit(self) -> None:
        """Start rows (chunk order) until `max_rows_in_flight` are being answered."""
        while self._active < self.max_rows_in_flight and (self._pending_rows or self._chunks):
            if not self._pending_rows:
                self._open_chunk(self._chunks.popleft())
                continue
            chunk, position, row, reason = self._pending_rows.popleft()
            conv = reason or Conversation.of_row(row, position, self.settings, self.id_column)
            if isinstance(conv, str):
                source = row.get(self.id_column or "id") if row else None
                self._open[chunk].skipped.append({"sample_id": f"{position:010d}", "source_row": position,
                                                  "source_id": None if source is None else str(source),
                                                  "reason": str(conv), "detail": getattr(conv, "detail", None)})
                self._row_done(chunk)
            else:
                self._active += 1
                self._ready.append((chunk, conv))

    def _open_chunk(self, chunk: int) -> None:
        positions = chunk_rows(chunk, self.rows_per_shard, len(self.rows))
        batch = self.rows[positions.start: positions.stop]
        columns = list(batch)
        self._open[chunk] = _Chunk(chunk, remaining=len(positions))
        for j, position in enumerate(positions):
            row, reason = row_at(batch, columns, j)
            self._pending_rows.append((chunk, position, row, reason))
        if not len(positions):
            self._commit(chunk)

    # -------------------------------------------------------------------------------------------- engine calls
    def _dispatch(self) -> None:
        while self._ready and self._calls_in_flight < self.parallel_calls:
            members = [self._ready.popleft() for _ in range(min(self.batch_size, len(self._ready)))]
            requests = [conv.next_request() for _, conv in members]
            self._calls_in_flight += 1
            threading.Thread(target=self._call, args=(members, requests), daemon=True,
                             name="dflash-prep-regen-call").start()

    def _call(self, members: list, requests: list) -> None:
        t0 = time.perf_counter()
        try:
            if self.thread_init is not None:
                self.thread_init()
            answers = self.engine.answer(requests)
            self._results.put((members, answers, None, time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001 - raised in the loop's thread (_collect)
            self._results.put((members, None, e, time.perf_counter() - t0))

    def _collect(self) -> None:
        """Wait for one call's answers (checking for a stop request twice a second) and apply them."""
        while True:
            if self.stop is not None and self.stop.requested:
                if self.finish_calls_on_stop:
                    for _ in range(self._calls_in_flight):  # their answers are dropped: asked again on resume
                        self._results.get()
                raise LoopStopped(f"stopped on {self.stop.signal_name}")
            try:
                members, answers, error, seconds = self._results.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        self._calls_in_flight -= 1
        self.stats.engine_seconds += seconds
        if error is not None:
            if isinstance(error, EngineUnavailable):
                raise error
            log.error("the engine failed", exc_info=error, extra={"console": False})
            raise EngineFailed(f"the engine failed: {type(error).__name__}: {error}") from error
        if len(answers) != len(members):
            raise EngineFailed(f"the engine returned {len(answers)} answers to {len(members)} requests")
        for (chunk, conv), answer in zip(members, answers):
            self._count_answer(chunk, answer)
            conv.accept(answer)
            if conv.done:
                self._finish(chunk, conv)
            else:
                self._ready.append((chunk, conv))
        if self.on_progress is not None:
            self.on_progress(self.stats)

    def _count_answer(self, chunk: int, answer) -> None:
        counts, stats = self._open[chunk].counts, self.stats
        counts["num_requests"] += 1
        stats.requests += 1
        if answer.rejected is None:
            counts["prompt_tokens"] += answer.prompt_tokens
            counts["completion_tokens"] += answer.completion_tokens
            counts["finish_reasons"][answer.finish_reason] = counts["finish_reasons"].get(answer.finish_reason, 0) + 1
            stats.prompt_tokens += answer.prompt_tokens
            stats.completion_tokens += answer.completion_tokens

    # -------------------------------------------------------------------------------------------- rows out
    def _finish(self, chunk: int, conv: Conversation) -> None:
        state = self._open[chunk]
        self._active -= 1
        for outcome, n in conv.tool_calls.items():
            state.counts["tool_calls"][outcome] = state.counts["tool_calls"].get(outcome, 0) + n
        if conv.ended_early is not None:
            state.counts["ended_early"][conv.ended_early] = state.counts["ended_early"].get(conv.ended_early, 0) + 1
        if conv.skip_reason is not None:
            state.skipped.append({"sample_id": f"{conv.position:010d}", "source_row": conv.position,
                                  "source_id": conv.source_id,
                                  "reason": conv.skip_reason, "detail": conv.skip_detail})
        else:
            state.rows.append(conv.result(self.provenance))
        self._row_done(chunk)

    def _row_done(self, chunk: int) -> None:
        state = self._open[chunk]
        state.remaining -= 1
        self.stats.rows_done += 1
        if state.remaining == 0:
            self._commit(chunk)

    def _commit(self, chunk: int) -> None:
        state = self._open.pop(chunk)
        self.committer.commit(chunk, state.rows, state.skipped, state.counts)
        self.stats.chunks_committed += 1
        self.stats.rows_written += len(state.rows)
        self.stats.skipped.update(s["reason"] for s in state.skipped)

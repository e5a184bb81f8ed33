"""The points where every process of a run waits for the others (the output claimed, the rows tokenized, the plan
made, the end of the run), bounded: a peer that stopped (a node frozen, cut off, or killed) ends the wait with one
line naming it (PeerLostError, exit code 1: the output is resumable) instead of torch's 30-minute barrier timeout
and a gloo traceback.

How: on a gloo group of its own (made once by every process at start-up), each process but the main one sends
"arrived" to the main process (rank 0) and waits for its answer; the main process waits for every arrival, then
answers each (`go`, or "rank K was lost"). Each wait runs on a thread (a receive from a process that died fails at
once: its connection closes; a receive from a frozen one never ends), while the calling thread logs who it waits for
every LOG_EVERY_SECONDS ("waiting for rank 1 since 12:03:04: ...") and gives up on a peer that showed no sign of life
for `output.peer_timeout_seconds`. Signs of life, all of them files of the output (the clocks of other hosts are
never compared: a change is timed by this process when it sees it):
- of a rank, for the main process: its progress file changing (progress.py: its loop commits batches), and, until
  its loop has ended, its rank lease's heartbeat (locks.py: a thread renews it while the process runs; a stopped
  or frozen process renews nothing). Once its loop has ended the rank is due within seconds: a heartbeat without
  an arrival is a node cut off from the others, and is given up on;
- of the main process, for the others: its run lease's heartbeat (it may tokenize the rows for everyone for an
  hour); a released run lease means it has ended.
An object-store output (`remote`): every node stages in a folder of its own, so the signs are objects of the store,
read without a cache: of a rank, its rank lease object (renewed at most 10 s apart while it runs, store/lease.py)
and its index object (rewritten at each commit); of the main process, its run lease object (deleted when it ends).

Our own code rather than `torch.distributed.monitored_barrier` (gloo only as well): that one neither logs while it
waits nor lets a peer that is still working (its progress moving) extend the wait; its timeout is one number.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from pathlib import Path

from dflash_prep.commands.extract.progress import progress_path
from dflash_prep.errors import ExtractionError
from dflash_prep.store.locks import LOCKS_DIR, RUN_NAME, Lease
from dflash_prep.store.records import INDEX_DIR, rank_name

log = logging.getLogger("dflash_prep")

LOG_EVERY_SECONDS = 30.0
POLL_SECONDS = 0.2
SIGNS_EVERY_SECONDS = 2.0  # signs of life are files: read them at most this often
GLOO_TIMEOUT = datetime.timedelta(days=7)  # the group's own; our deadlines decide (a stuck receive is left behind)
GO = 0
ABORT = -100  # an answer of ABORT - exit code: the main process stopped the run outside a wait (`abort`)


class PeerLostError(ExtractionError):
    """A process of the run died or stopped answering at a point where every process waits for the others."""

    def __init__(self, rank: int, why: str, what: str):
        self.rank = rank
        super().__init__(f"rank {rank} was lost while {what}: {why}. The output is resumable: every committed "
                         f"shard is kept; re-run the same command (on nodes that are up) to finish the job")


class MainStopped(ExtractionError):
    """The main process stopped the run (it said why: a refusal, a failure) while this process went on: this one
    ends with the same exit code, without a line of its own."""

    def __init__(self, exit_code: int):
        self.exit_code = exit_code
        super().__init__(f"the main process stopped the run (exit code {exit_code}); its console says why")


class Peers:
    """This process's view of the run's other processes (module docstring). One process: every wait returns."""

    def __init__(self, state, out_dir: Path, timeout_seconds: float, processes_per_replica: int = 1, remote=None):
        self.rank, self.world, self.is_main = state.process_index, state.num_processes, state.is_main_process
        self.out_dir = Path(out_dir)
        self.remote = remote  # an object-store output (store/remote.RemoteOutput): the signs are its objects
        self.timeout_seconds = float(timeout_seconds)
        self.processes_per_replica = processes_per_replica
        self._seq = 0
        self._sent: list = []  # this process's sends of the current wait (their buffers stay alive)
        self.group = None
        if self.world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)  # every process, at start-up

    def wait(self, what: str, payload: int = 0) -> int:
        """Wait until every process got here; -> the main process's `payload` (e.g. the run id). `what`: what the
        wait is for, in the log lines. Raises PeerLostError."""
        self._seq += 1
        if self.group is None:
            return payload
        if self.is_main:
            return self._gather_then_answer(what, payload)
        return self._arrive_then_listen(what)

    def abort(self, exit_code: int) -> None:
        """The main process stops the run outside a wait (a refusal, a failure): every other process reads, at its
        next wait, that it is to end with `exit_code` (MainStopped) instead of waiting for the main process."""
        if self.group is None or not self.is_main:
            return
        self._seq += 1
        self._answer(skip=set(), code=ABORT - exit_code)

    def wait_for_everyone(self) -> None:
        """`accelerate.PartialState.wait_for_everyone`'s name (job.load_or_make_plan calls it): the plan written."""
        self.wait("the main process writes the plan")

    def _rank_of(self, process: int) -> int:
        return process // self.processes_per_replica

    # -- the main process ----------------------------------------------------------------------------------------

    def _gather_then_answer(self, what: str, payload: int) -> int:
        import torch
        import torch.distributed as dist

        pending = {p: _Pending(dist.irecv, torch.zeros(2, dtype=torch.int64), src=p, group=self.group,
                               tag=self._seq) for p in range(1, self.world)}
        signs = {p: _StoreRankSigns(self.remote, self._rank_of(p)) if self.remote is not None else
                 _PeerSigns(self.out_dir, self._rank_of(p)) for p in pending}
        since, next_log = time.time(), time.monotonic() + LOG_EVERY_SECONDS / 3
        while pending:
            for p, receive in list(pending.items()):
                if receive.error is not None:
                    self._answer(skip={p}, code=p + 1)
                    raise PeerLostError(p, _why_closed(receive.error), what)
                if receive.done:
                    del pending[p]
                elif signs[p].silent_seconds() > self.timeout_seconds:
                    self._answer(skip={p}, code=p + 1)
                    raise PeerLostError(p, f"no sign of it for {self.timeout_seconds:.0f} s "
                                           f"(output.peer_timeout_seconds; a frozen or cut-off node)", what)
            if pending and time.monotonic() >= next_log:
                log.warning("waiting for rank %s since %s: %s", ", ".join(map(str, sorted(pending))),
                            _clock(since), what)
                next_log = time.monotonic() + LOG_EVERY_SECONDS
            if pending:
                time.sleep(POLL_SECONDS)
        self._answer(skip=set(), code=GO, payload=payload)
        return payload

    def _answer(self, skip: set, code: int, payload: int = 0) -> None:
        """Send every other process but `skip` the outcome (`GO`, or rank+1 of a lost one: a process that has not
        arrived yet reads it when it does); waits a little for the sends, never for a process that died."""
        import torch
        import torch.distributed as dist

        sends = [_Pending(dist.isend, torch.tensor([code, payload], dtype=torch.int64), dst=p, group=self.group,
                          tag=self._seq) for p in range(1, self.world) if p not in skip]
        deadline = time.monotonic() + (min(self.timeout_seconds, 60.0) if code == GO else 5.0)
        while any(not s.done and s.error is None for s in sends) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS / 4)

    # -- every other process --------------------------------------------------------------------------------------

    def _arrive_then_listen(self, what: str) -> int:
        import torch
        import torch.distributed as dist

        self._sent = [_Pending(dist.isend, torch.tensor([self.rank, 0], dtype=torch.int64), dst=0,
                               group=self.group, tag=self._seq)]
        if self._sent[0].error is not None:
            raise PeerLostError(0, _why_closed(self._sent[0].error), what)
        answer = torch.zeros(2, dtype=torch.int64)
        receive = _Pending(dist.irecv, answer, src=0, group=self.group, tag=self._seq)
        main = _StoreMainSigns(self.remote) if self.remote is not None else _MainSigns(self.out_dir)
        since, next_log = time.time(), time.monotonic() + LOG_EVERY_SECONDS / 3
        while not receive.done:
            if receive.error is not None:
                raise PeerLostError(0, _why_closed(receive.error), what)
            if main.ended():
                raise PeerLostError(0, "the main process ended the run without answering (its log says why)", what)
            if main.silent_seconds() > self.timeout_seconds:
                raise PeerLostError(0, f"no sign of the main process for {self.timeout_seconds:.0f} s "
                                       f"(output.peer_timeout_seconds; a frozen or cut-off node)", what)
            if time.monotonic() >= next_log:
                log.warning("waiting for rank 0 since %s: %s", _clock(since), what)
                next_log = time.monotonic() + LOG_EVERY_SECONDS
            time.sleep(POLL_SECONDS)
        code, payload = (int(x) for x in answer.tolist())
        if code <= ABORT:
            raise MainStopped(ABORT - code)
        if code != GO:
            raise PeerLostError(code - 1, "the main process found it gone", what)
        return payload


class _Pending:
    """A point-to-point operation (`post(tensor, **kwargs)`: dist.isend or dist.irecv) waited for on a thread of its
    own: `done`, or `error` (its exception; posting to a peer whose connection already closed raises at once)."""

    def __init__(self, post, tensor, **kwargs):
        self.tensor, self.done, self.error = tensor, False, None
        try:
            self.work = post(tensor, **kwargs)
        except RuntimeError as e:
            self.error = e
            return
        threading.Thread(target=self._wait, daemon=True, name="peer-wait").start()

    def _wait(self) -> None:
        try:
            self.work.wait()
            self.done = True
        except Exception as e:  # noqa: BLE001 - a closed connection or gloo's own timeout: the peer is lost
            self.error = e


class _Signs:
    """When a peer was last seen doing something: what `_look` returns changing, timed by this process's clock
    when seen (read every SIGNS_EVERY_SECONDS; the start of the wait counts as a sign)."""

    def __init__(self):
        self.last_change = self._last_look = time.monotonic()
        self._seen = self._look()

    def _look(self):
        raise NotImplementedError

    def silent_seconds(self) -> float:
        now = time.monotonic()
        if now - self._last_look >= SIGNS_EVERY_SECONDS:
            self._last_look = now
            seen = self._look()
            if seen != self._seen:
                self._seen, self.last_change = seen, now
        return now - self.last_change


class _PeerSigns(_Signs):
    """A rank's signs of life: its progress file, and its rank lease's heartbeat until its loop has ended (then it
    is due here within seconds: a heartbeat without an arrival is a node cut off from the others)."""

    def __init__(self, out_dir: Path, rank: int):
        self.progress = progress_path(out_dir, rank)
        self.lease = Lease(Path(out_dir) / LOCKS_DIR, rank_name(rank), "probe")
        super().__init__()

    def _look(self):
        try:
            progress = self.progress.read_bytes()
        except OSError:
            progress = b""
        if b'"final": true' in progress:
            return progress, None
        return progress, _heartbeat(self.lease)


class _MainSigns(_Signs):
    """The main process's signs of life: its run lease's heartbeat (its thread beats while the process runs)."""

    def __init__(self, out_dir: Path):
        self.lease = Lease(Path(out_dir) / LOCKS_DIR, RUN_NAME, "probe")
        self._live_generation: int | None = None  # of a lease seen held during this wait: this run's
        self._released = False
        super().__init__()

    def _look(self):
        found = self.lease.current()
        if found is None or found[1] is None:
            return None
        generation, record = found
        if record.get("released_at") is None:
            self._live_generation = generation
        self._released = generation == self._live_generation and record.get("released_at") is not None
        return generation, record.get("heartbeat_at"), record.get("released_at")

    def ended(self) -> bool:
        """The main process released the run lease it held during this wait: it has ended (refused, stopped or
        failed). (A lease released before, an earlier run's, says nothing.)"""
        return self._released


class _StoreRankSigns(_Signs):
    """A rank's signs of life in an object-store output: its rank lease object's content (the holder's renewals
    rewrite it) and its index object (a commit rewrites it), both read from the store (no listing cache)."""

    def __init__(self, remote, rank: int):
        self.lease, self.remote = remote.lease(rank_name(rank)), remote
        self.index_rel = f"{INDEX_DIR}/{rank_name(rank)}.jsonl"
        super().__init__()

    def _look(self):
        try:
            content, _ = self.lease.read()
            index = self.remote.cat(self.index_rel)
        except OSError:  # the store did not answer this time: no sign, no verdict
            return self._seen if hasattr(self, "_seen") else None
        return (content or {}).get("renewed_at"), len(index) if index is not None else None


class _StoreMainSigns(_Signs):
    """The main process's signs of life in an object-store output: its run lease object's renewals; the object
    deleted after it was seen held during this wait: the main process has ended."""

    def __init__(self, remote):
        self.lease = remote.lease(RUN_NAME)
        self._held_seen = False
        self._released = False
        super().__init__()

    def _look(self):
        try:
            content, _ = self.lease.read()
        except OSError:
            return self._seen if hasattr(self, "_seen") else None
        if content is not None:
            self._held_seen = True
        self._released = self._held_seen and content is None
        return (content or {}).get("renewed_at")

    def ended(self) -> bool:
        return self._released


def _heartbeat(lease: Lease):
    found = lease.current()
    if found is None or found[1] is None:
        return None
    return found[1].get("heartbeat_at"), found[1].get("released_at")


def _why_closed(error: BaseException) -> str:
    text = str(error)
    if "Connection closed" in text or "Connection reset" in text or "Broken pipe" in text:
        return "its connection closed (the process died or its node went down)"
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))

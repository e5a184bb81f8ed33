"""Locks that keep two extractions from writing into one output folder at the same time, on one host or many.

Two runs into one folder would overwrite each other's index lines; a new run would also remove, as "uncommitted",
the temporary shard another live run is writing. So:

- the main process of a run holds `OUT/locks/run.*` from before it touches the folder until it ends;
- each writing rank holds `OUT/locks/rank-RRRRR.*` while it writes; before it removes uncommitted files, the main
  process checks that no rank of another run holds one (orphaned workers of a killed launcher would otherwise keep
  writing).

Each of those is two locks, both taken:

- a `flock` on `NAME.lock`: released by the kernel when its process dies (SIGKILL included), so a crashed run never
  blocks its own resume; it names the holder (`host pid`, written into the file). It excludes processes of one
  host, and of several hosts only where the filesystem makes flock global (NFS mounted with `local_lock=all` or
  `nolock`, and some parallel filesystems, keep it local to each client: a second host sees no lock);
- a lease (`Lease`) that works across hosts on any shared filesystem: a file `NAME.lease-GGGGGG` created atomically
  (written under a name of its own, then `link`ed to its final name: the link fails when the name exists, on NFS
  too, where it is the classic lock-file primitive), holding the holder's host, pid, run id and a heartbeat that a
  thread of the holder rewrites every `lease_seconds / 10` (at most 10 s apart). The highest generation G is the
  lease. Another run finding it refuses (OutputBusyError, exit code 2) while its heartbeat is fresh (younger than
  the `lease_seconds` it states), unless its holder is a process of this host that is gone; a stale or released
  lease is taken over by creating generation G+1 (only one run can; the loser sees it and refuses). Generations only
  grow, so a run that read an old state can never take a lease someone else took since. A holder that finds a higher
  generation than its own (it was frozen past its lease and another run took over) has lost the lease (`lost`): the
  extraction then stops at its next batch.

How a lease is judged (`LeaseRecord.is_live`): by the folder's own clock, not the reader's nor the holder's: a
heartbeat's age is the time since its file was last written, both read on the filesystem (the modification time of
the lease file against that of a probe file written now), so hosts whose clocks differ judge it alike and a live
holder is told by its heartbeats' progress; a heartbeat time in the future of this host's clock is named as clock
skew, both clocks printed. A lease naming this host is judged by its flock (the kernel drops it when its process
dies) and its run id, not by its pid: a pid alive again (reused, a restarted container) is not the dead run. A lease
file that does not read as a record (garbage, wrong types) is damaged: named so, and taken over `lease_seconds` after
it was last written.

Fencing (`OutputFence`): the run lease's generation is the run's fencing token; every commit (store/record_store.py)
checks under the index's lock that the run lease is still at that generation and names this run, so a run that lost
the output (frozen past its lease, then taken over) commits nothing more.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from pathlib import Path

from dflash_prep.errors import ExtractionError

LOCKS_DIR = "locks"
RUN_LOCK = "run.lock"
RUN_NAME = "run"
DEFAULT_LEASE_SECONDS = 300.0
HEARTBEATS_PER_LEASE = 10
MAX_HEARTBEAT_SECONDS = 10.0  # a heartbeat at least this often (peers.py reads it as a sign of life)

log = logging.getLogger("dflash_prep")

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputBusyError(RuntimeError):
    """Another live extraction holds a lock of this output folder."""


def rank_lock_name(rank: int) -> str:
    return f"rank-{rank:05d}.lock"


def new_run_id() -> str:
    """8 random hex digits: a run's id, in its lease and in the names of the shards it writes."""
    return secrets.token_hex(4)


def _flock_nonblocking(fd: int) -> str:
    """Try an exclusive flock on `fd`: "taken", "held" (by another open file, i.e. another process or holder) or
    "unsupported" (the filesystem has no flock)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return "held"
        if e.errno in _UNSUPPORTED:
            return "unsupported"
        raise
    return "taken"


EXITING_HOLDER_WAIT_SECONDS = 30.0  # the longest a killed process's last threads may take to end


class FileLock:
    """An exclusive, non-blocking `flock` on one file, with the holder written into it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None
        self.supported = True  # False once try_acquire found a filesystem without flock

    def try_acquire(self) -> bool:
        """Take the lock if it is free (True), False if another process holds it. Unsupported: warns, True.

        A lock file may be removed by its holder on release (`release(remove=True)`): a lock taken on a file that
        is no longer the one at `path` is dropped and taken again on the new file, so two processes never both
        hold `path`'s lock (one on the removed file, one on its successor)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            outcome = _flock_nonblocking(fd)
            if outcome == "taken" and not _same_file(fd, self.path):
                os.close(fd)  # its holder removed it after we opened it: lock the file that is there now
                continue
            break
        if outcome != "taken":
            os.close(fd)
            self.supported = outcome != "unsupported"
            if outcome == "unsupported":
                log.warning("%s: the filesystem does not support file locks; the lease alone excludes other runs",
                            self.path)
            return outcome == "unsupported"
        os.ftruncate(fd, 0)
        os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        self._fd = fd
        return True

    @property
    def fd(self) -> int | None:
        """The descriptor holding the lock (None when not held); a forked child must close its copy."""
        return self._fd

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock now (a probe: takes and drops it, writes nothing)."""
        return self.probe() == "held"

    def probe(self) -> str:
        """"held" (another open file holds the flock), "free" (no file, or nobody holds it) or "unsupported"."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return "free"
        try:
            outcome = _flock_nonblocking(fd)
            if outcome == "taken":
                fcntl.flock(fd, fcntl.LOCK_UN)
            return "free" if outcome == "taken" else outcome
        finally:
            os.close(fd)

    def held_after_exit(self, wait_seconds: float = EXITING_HOLDER_WAIT_SECONDS) -> bool:
        """`held_elsewhere`, waiting up to `wait_seconds` while the holder is a process of this host that is
        exiting (a zombie: see `try_acquire_after_exit`; a killed worker's flock outlives its main thread by its last
        thread). A holder named by a pid that runs, or that this host does not show, is answered at once."""
        deadline = time.monotonic() + wait_seconds
        while self.held_elsewhere():
            pid = self._holder_pid_here()
            if pid is None or not _is_zombie(pid) or time.monotonic() >= deadline:
                return True
            time.sleep(0.05)
        return False

    def try_acquire_after_exit(self, wait_seconds: float = EXITING_HOLDER_WAIT_SECONDS) -> bool:
        """`try_acquire`, waiting up to `wait_seconds` while the lock's holder is a process of this host that is
        exiting: a process killed by SIGKILL shows as a zombie as soon as its main thread ends, but its files (and
        this flock) are closed only once its last thread has ended, which a thread in a slow fsync can delay by
        seconds. A re-run right after a kill would otherwise be refused as "another run is writing"."""
        deadline = time.monotonic() + wait_seconds
        while not self.try_acquire():
            pid = self._holder_pid_here()
            if pid is None or not _is_zombie(pid) or time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _holder_pid_here(self) -> int | None:
        """The pid the lock file names when it names this host, else None."""
        host, pid = self._written_holder()
        return int(pid) if host == socket.gethostname() and pid.isdigit() else None

    def holder(self) -> str:
        """`host pid` of the process that last took the lock (as it wrote it), or 'unknown'."""
        host, pid = self._written_holder()
        return f"pid {pid} on {host}" if host else "unknown"

    def _written_holder(self) -> tuple[str, str]:
        """(host, pid) as the last taker wrote them into the lock file; ("", "") when it is empty or unreadable."""
        try:
            host, _, pid = self.path.read_text().strip().partition(" ")
        except OSError:
            return "", ""
        return host, pid

    def release(self, remove: bool = False) -> None:
        """Drop the lock; `remove`: delete the lock file first, while still holding it (nothing left behind; a
        process waiting on the old file sees it is gone, `try_acquire`)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                if remove:
                    self.path.unlink(missing_ok=True)
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the file at `path` now (not removed or replaced since it was opened)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def _is_zombie(pid: int) -> bool:
    """Whether process `pid` of this host is a zombie (killed, its main thread ended, not yet reaped): the one state
    in which a flock it held can still be held by its last threads. A pid with no process here (gone, or a holder
    in another PID namespace under the same host name) or a live one is not; nor is any pid without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError, ValueError):
        return False


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed and not yet reaped, does not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no /proc (not Linux), or gone meanwhile
        return True


def heartbeat_seconds(lease_seconds: float) -> float:
    """How often a holder renews a lease of `lease_seconds`."""
    return min(lease_seconds / HEARTBEATS_PER_LEASE, MAX_HEARTBEAT_SECONDS)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


class LeaseLostError(ExtractionError):
    """This run no longer holds the output (another run took its lease over: it was frozen or cut off past its
    lease): it must not commit anything more (exit code 1; what is committed is intact)."""


def folder_clock(folder: Path) -> float | None:
    """The folder's filesystem clock now: the modification time of a file created there (on a network filesystem,
    the server's clock), or None when nothing can be written there (a read-only output)."""
    path = Path(folder) / f".clock-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return None
    try:
        os.write(fd, b".")
        return os.fstat(fd).st_mtime
    except OSError:
        return None
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass


_FIELDS = {"host": str, "pid": int, "run_id": str, "heartbeat_at": (int, float), "lease_seconds": (int, float)}
MAX_UNIX_SECONDS = 2.0 ** 32  # 2106: a later (or NaN, Infinity) time in a lease file is damage, not a clock
MAX_LEASE_SECONDS = 7 * 86400.0  # the recipe's own bound on output.lease_seconds


def _why_not_a_record(obj) -> str | None:
    """Why a lease file's JSON is not a lease record (a field missing or of a wrong type), None when it is one."""
    if not isinstance(obj, dict):
        return f"a JSON {type(obj).__name__}, not an object"
    for name, kind in _FIELDS.items():
        value = obj.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is {value!r}"
    if not 0 < obj["lease_seconds"] <= MAX_LEASE_SECONDS:  # NaN and Infinity fail too (JSON reads them)
        return f"lease_seconds is {obj['lease_seconds']!r}"
    if not isinstance(obj.get("released_at"), (int, float, type(None))) or isinstance(obj.get("released_at"), bool):
        return f"released_at is {obj.get('released_at')!r}"
    for name in ("heartbeat_at", "started_at", "released_at"):  # a time the clock functions can print and compare
        value = obj.get(name)
        if value is not None and isinstance(value, (int, float)) and not 0 <= value < MAX_UNIX_SECONDS:
            return f"{name} is {value!r}"
    return None


class LeaseRecord(dict):
    """A lease file's content: host, pid, run_id, generation, lease_seconds, started_at, heartbeat_at (unix times
    of the holder's clock), released_at (None while held). Read from a file (`read_lease`), it also knows the file's
    modification time (`mtime`) and folder, by which its age is judged (module docstring); `damaged`: why the file
    does not read as a record (None for a good one)."""

    mtime: float | None = None
    folder: Path | None = None
    damaged: str | None = None
    _age: float | None = None

    def age_seconds(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat, by the folder's clock (never negative); `now` (this host's clock)
        judges by the record's own heartbeat time instead (a record not read from a file)."""
        if now is None and self.mtime is not None:
            if self._age is None:
                folder_now = folder_clock(self.folder) if self.folder is not None else None
                self._age = max(0.0, (folder_now if folder_now is not None else time.time()) - self.mtime)
            return self._age
        return max(0.0, (time.time() if now is None else now) - float(self.get("heartbeat_at", 0)))

    def lease(self, default: float = DEFAULT_LEASE_SECONDS) -> float:
        return default if self.damaged else float(self.get("lease_seconds", default))

    def is_live(self, now: float | None = None, flock: str | None = None, lease_seconds: float | None = None) -> bool:
        """Held by a process that may be running: not released, and a heartbeat younger than its lease. A record
        naming this host is judged by its lock file's flock instead when that says something (`flock`: "held" ->
        live, "free" or "ours" -> its process is gone; the kernel drops a dead process's flock), else by its pid.
        A damaged record is judged by its file's age against `lease_seconds` (the reader's)."""
        if self.damaged:
            return self.age_seconds(now) < (lease_seconds or DEFAULT_LEASE_SECONDS)
        if self.get("released_at") is not None:
            return False
        if self.get("host") == socket.gethostname():
            if flock in ("free", "ours"):
                return False
            if flock != "held" and not _pid_alive(int(self.get("pid", 0))):
                return False
        return self.age_seconds(now) < self.lease()

    def describe(self) -> str:
        if self.damaged:
            return f"a damaged lease file ({self.damaged})"
        return f"pid {self.get('pid')} on {self.get('host')}, run {self.get('run_id')}"

    def skew(self) -> str:
        """'' when the holder's heartbeat time agrees with this host's clock, else a sentence naming both clocks
        (the holder's clock is ahead of or behind this host's)."""
        if self.damaged or self.mtime is None:
            return ""
        ours = time.time() - self.age_seconds()  # this host's clock at the holder's last heartbeat
        theirs = float(self.get("heartbeat_at", ours))
        if abs(theirs - ours) <= max(2.0, heartbeat_seconds(self.lease())):
            return ""
        way = "ahead of" if theirs > ours else "behind"
        return (f"; its clock is {abs(theirs - ours):.0f} s {way} this host's (clock skew: its last heartbeat says "
                f"{_clock(theirs)}, this host's clock said {_clock(ours)}); the lease is judged by the folder's "
                f"clock")

    def how_it_ends(self, lease_seconds: float | None = None) -> str:
        """How the lease ends, for a message to someone who cannot reach the holder."""
        age = self.age_seconds()
        if self.damaged:
            lease = lease_seconds or DEFAULT_LEASE_SECONDS
            return (f"it does not read as a lease record (edited, or damaged); it is taken over {lease:.0f} s after "
                    f"it was last written, at {_clock(time.time() + max(0.0, lease - age))}: re-running this "
                    f"command then takes the output over")
        lease = self.lease()
        return (f"its last heartbeat was {age:.0f} s ago{self.skew()}; it renews it every "
                f"{heartbeat_seconds(lease):.0f} s while it runs, and if {self.get('host')} is gone or the process "
                f"is stopped the lease ends {lease:.0f} s after the last heartbeat "
                f"({_clock(time.time() + max(0.0, lease - age))} or later): re-running this command then takes the "
                f"output over")


_GENERATION = re.compile(r"\.lease-(\d{6,})$")


class Lease:
    """A lease on `folder/NAME.lease-GGGGGG` (module docstring): `acquire` takes it or raises OutputBusyError;
    while held, a thread renews the heartbeat; `release` marks it released (the file stays: generations only grow).
    `lost` turns True when another run took it over (this process was frozen past its lease)."""

    def __init__(self, folder: Path, name: str, run_id: str, lease_seconds: float = DEFAULT_LEASE_SECONDS):
        self.folder, self.name, self.run_id = Path(folder), name, run_id
        self.lease_seconds = float(lease_seconds)
        self.generation: int | None = None
        self.lost = False
        self.took_over: LeaseRecord | None = None
        self._record: LeaseRecord | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def path_of(self, generation: int) -> Path:
        return self.folder / f"{self.name}.lease-{generation:06d}"

    def _highest(self) -> int:
        """The highest generation there is (-1: none). The listing may lag on a network filesystem; names above it
        are probed one by one (an open of a name asks the server)."""
        listed = [int(m.group(1)) for p in (self.folder.iterdir() if self.folder.is_dir() else [])
                  if p.name.startswith(self.name + ".lease-") and (m := _GENERATION.search(p.name))]
        generation = max(listed, default=-1)
        while self.path_of(generation + 1).exists():
            generation += 1
        return generation

    def current(self) -> tuple[int, LeaseRecord | None] | None:
        """(generation, record) of the highest generation, or None when there is none; a file that does not read
        as a record gives a damaged record (LeaseRecord.damaged), None only when it vanished meanwhile."""
        generation = self._highest()
        if generation < 0:
            return None
        return generation, read_lease(self.path_of(generation))

    def acquire(self, min_generation: int = 0, own_flock: bool = False) -> None:
        """Take the lease (a generation above the highest and at least `min_generation`), or raise
        OutputBusyError naming its live holder. `own_flock`: this process holds the flock of the same name, so a
        lease naming this host is not live (its process is gone: the kernel dropped its flock)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            found = self.current()
            if found is not None and found[1] is not None:
                generation, record = found
                if record.is_live(flock="ours" if own_flock else None, lease_seconds=self.lease_seconds):
                    raise OutputBusyError(_busy(record, self.path_of(generation), self.lease_seconds))
                stale = record if record.get("released_at") is None else None
            else:
                generation, stale = (found[0] if found is not None else -1), None
            if self._create(max(generation + 1, min_generation)):
                self.took_over = stale
                self._start_heartbeat()
                self._remove_older(self.generation)
                return
            time.sleep(0.05)  # another run made that generation first: judge it
        raise OutputBusyError(f"{self.folder / self.name}: could not take the lease (other runs keep taking it)")

    def fence(self, flock: str | None = None) -> bool:
        """Take a stale lease (not live, not released) over and release it at once, so that its holder, should it
        run again (a frozen process resumed), finds it lost and stops; -> whether it was taken. `flock`: the state
        of the lock file of the same name (FileLock.probe), which judges a lease of this host."""
        found = self.current()
        if found is None or found[1] is None or found[1].get("released_at") is not None \
                or found[1].is_live(flock=flock, lease_seconds=self.lease_seconds):
            return False
        if not self._create(found[0] + 1):
            return False
        self.release()
        return True

    def check_held(self) -> None:
        """Raise LeaseLostError unless this lease is still held: no higher generation exists (a take-over makes
        one). Reads the folder's listing (one call)."""
        if self.generation is None:
            raise LeaseLostError(f"{self.folder / self.name}: this run holds no lease")
        if self.lost or self._highest() != self.generation:
            self.lost = True
            raise LeaseLostError(_lost_message(self.folder, self.name, self.generation))

    def _record_now(self, generation: int) -> LeaseRecord:
        now = time.time()
        started = self._record["started_at"] if self._record else now
        return LeaseRecord(host=socket.gethostname(), pid=os.getpid(), run_id=self.run_id, generation=generation,
                           lease_seconds=self.lease_seconds, started_at=started, heartbeat_at=now, released_at=None)

    def _create(self, generation: int) -> bool:
        """Create generation `generation` with this holder's record, atomically (link); False when it exists or a
        higher generation appeared meanwhile (then ours is removed again)."""
        record = self._record_now(generation)
        tmp = self.folder / f".{self.name}.{self.run_id}.{os.getpid()}.tmp"
        _write_record(tmp, record)  # removes its tmp when the write fails (a full disk)
        final = self.path_of(generation)
        try:
            os.link(tmp, final)
            made = True
        except FileExistsError:
            made = False
        except OSError:  # a lost reply on a network filesystem: the link may still have been made
            made = os.stat(tmp).st_nlink == 2
        finally:
            tmp.unlink(missing_ok=True)
        if made and self._highest() > generation:
            final.unlink(missing_ok=True)
            return False
        if made:
            self.generation, self._record = generation, record
        return made

    def _remove_older(self, generation: int) -> None:
        for p in list(self.folder.iterdir()):
            m = _GENERATION.search(p.name)
            if p.name.startswith(self.name + ".lease-") and m and int(m.group(1)) < generation:
                p.unlink(missing_ok=True)

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        interval = heartbeat_seconds(self.lease_seconds)
        while not self._stop.wait(interval):
            try:
                self.renew()
            except OSError as e:  # the next beat tries again; a lease that lapses is the holder's loss only
                log.warning("could not renew the lease %s: %s", self.path_of(self.generation), e)

    def renew(self) -> None:
        """Rewrite the heartbeat (atomically: a reader sees the old record or the new one); notice a takeover."""
        if self.generation is None or self.lost:
            return
        highest = self._highest()
        if highest > self.generation:
            self.lost = True
            taker = read_lease(self.path_of(highest))
            log.error("the lease %s was taken over by %s: this process stopped renewing it for longer than %.0f s "
                      "(frozen or cut off)", self.path_of(self.generation),
                      taker.describe() if taker else "another run", self.lease_seconds)
            return
        self._record = self._record_now(self.generation)
        _replace_record(self.path_of(self.generation), self._record)

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released (a later run takes the next generation at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.generation is not None and not self.lost and self._record is not None:
            try:
                _replace_record(self.path_of(self.generation), LeaseRecord(self._record, released_at=time.time()))
            except OSError as e:
                log.warning("could not release the lease %s: %s (it lapses by itself)",
                            self.path_of(self.generation), e)
        self.generation = None


def _write_record(path: Path, record: dict) -> None:
    """A lease record into the tmp file `path`; a failed write (a full disk, a quota) removes it and raises."""
    try:
        with open(path, "w") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink_quietly(path)
        raise


def _replace_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_record(tmp, record)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


STALE_TMP_SECONDS = 60.0  # a lease record's tmp file lives milliseconds (write, link or rename): older is left over


def remove_stale_tmp(folder: Path, older_than_seconds: float = STALE_TMP_SECONDS) -> list[Path]:
    """Remove the lease records' tmp files (`.NAME....tmp`) in `folder` older than `older_than_seconds`: what a
    process killed between writing one and linking or renaming it leaves (a failed write removes its own). Called
    by a run that ends holding the output; -> the files removed."""
    removed, now = [], time.time()
    for p in Path(folder).glob(".*.tmp"):
        try:
            if now - p.stat().st_mtime > older_than_seconds:
                p.unlink()
                removed.append(p)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
    return removed


def read_lease(path: Path) -> LeaseRecord | None:
    """The record of a lease file, with its modification time; a file that does not read as a record (not JSON,
    a field of a wrong type) gives a damaged record (its `damaged` says why), a file that is gone None."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        return _damaged_record(path, None, f"unreadable: {e.strerror or e}")
    try:
        obj = json.loads(data)
        why = _why_not_a_record(obj)
    except (ValueError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
        obj, why = None, f"not JSON: {data[:40]!r}"
    if why is not None:
        return _damaged_record(path, mtime, why)
    record = LeaseRecord(obj)
    record.mtime, record.folder = mtime, path.parent
    return record


def _damaged_record(path: Path, mtime: float | None, why: str) -> LeaseRecord:
    """A lease file that does not read as a record (edited by hand, damaged): judged by the age of the file."""
    record = LeaseRecord(host="an unknown host", pid=0, run_id="unknown", heartbeat_at=mtime or 0.0,
                         released_at=None)
    record.mtime, record.folder, record.damaged = mtime or 0.0, path.parent, f"{path.name}: {why}"
    return record


def _busy(record: LeaseRecord, path: Path, lease_seconds: float) -> str:
    """Why a live lease refuses a run, one sentence."""
    if record.damaged:
        return f"its lease file is damaged ({record.damaged}); {record.how_it_ends(lease_seconds)}"
    return f"{record.describe()} holds it ({record.how_it_ends()})"


def _lost_message(folder: Path, name: str, generation: int) -> str:
    taker = Lease(folder, name, "probe").current()
    who = taker[1].describe() if taker is not None and taker[1] is not None else "another run"
    return (f"{folder / name}: this run no longer holds the output: {who} took it over while this process was "
            f"stopped or cut off past its lease (generation {generation} -> "
            f"{taker[0] if taker is not None else '?'}); it commits nothing more, and what is committed is intact")


class OutputFence:
    """A run's fencing token, its run lease's generation, and the check every commit makes (store/record_store.py):
    the output's run lease is still at that generation and names this run. `token` goes into every record this run
    commits: a run that takes over gets a higher one."""

    def __init__(self, out_dir: Path, token: int, run_id: str):
        self.folder, self.token, self.run_id = Path(out_dir) / LOCKS_DIR, int(token), run_id

    @classmethod
    def of_holder(cls, out_dir: Path) -> "OutputFence":
        """The fence of the run that holds the output's run lease now (a rank of it learns it so)."""
        found = Lease(Path(out_dir) / LOCKS_DIR, RUN_NAME, "probe").current()
        if found is None or found[1] is None or found[1].damaged:
            raise LeaseLostError(f"{Path(out_dir) / LOCKS_DIR}: no run holds the output")
        return cls(out_dir, found[0], found[1]["run_id"])

    def check(self) -> None:
        """Raise LeaseLostError unless this run still holds the output."""
        found = Lease(self.folder, RUN_NAME, "probe").current()
        if found is None or found[0] != self.token or found[1] is None or found[1].get("run_id") != self.run_id:
            raise LeaseLostError(_lost_message(self.folder, RUN_NAME, self.token))


class OutputLock:
    """One lock of an output folder (the run's or a rank's): a flock and a lease, both held (module docstring)."""

    def __init__(self, out_dir: Path, name: str, run_id: str, lease_seconds: float):
        folder = Path(out_dir) / LOCKS_DIR
        self.flock = FileLock(folder / f"{name}.lock")
        self.lease = Lease(folder, name, run_id, lease_seconds)
        self.run_id = run_id

    @property
    def fd(self) -> int | None:
        return self.flock.fd

    @property
    def lost(self) -> bool:
        return self.lease.lost

    def release(self) -> None:
        self.lease.release()
        if self.flock.fd is not None and self.flock.path.name == "run.lock":  # the run's end: tmp files left over
            remove_stale_tmp(self.flock.path.parent)
        self.flock.release()


def _take(out_dir: Path, name: str, run_id: str, lease_seconds: float, busy: str,
          min_generation: int = 0) -> OutputLock:
    """Take `name`'s flock, then its lease; OutputBusyError (`busy` + the holder) when either is held."""
    lock = OutputLock(out_dir, name, run_id, lease_seconds)
    if not lock.flock.try_acquire_after_exit():
        raise OutputBusyError(f"{busy} ({lock.flock.holder()}): wait for it to end (or stop it), then re-run this "
                              f"command to resume; or use another output.dir")
    try:
        lock.lease.acquire(min_generation, own_flock=lock.flock.supported)
    except OutputBusyError as e:
        lock.flock.release()
        raise OutputBusyError(f"{busy}: {e}; or use another output.dir") from None
    if lock.lease.took_over is not None:
        log.warning("took over the lease of %s %s", name, _why_taken(lock.lease.took_over))
    return lock


def _why_taken(record: LeaseRecord) -> str:
    """How a stale lease was found, after "took over the lease of NAME"."""
    if record.damaged:
        return f"({record.damaged}): it was not renewed within the lease"
    if record.get("host") == socket.gethostname():
        return (f"from {record.describe()}: its process no longer runs on this host (its lock is free; its last "
                f"heartbeat {record.age_seconds():.0f} s ago)")
    return (f"from {record.describe()}: its last heartbeat was {record.age_seconds():.0f} s ago, past its lease of "
            f"{record.lease():.0f} s (a host that is gone, or a process stopped){record.skew()}")


def lock_run(out_dir: Path, run_id: str | None = None, lease_seconds: float = DEFAULT_LEASE_SECONDS,
             min_generation: int = 0) -> OutputLock:
    """The main process's lock of `out_dir` (raises OutputBusyError when another run holds it). `min_generation`:
    the lowest generation (fencing token) it may take: above every token the output's records carry."""
    return _take(out_dir, RUN_NAME, run_id or new_run_id(), lease_seconds,
                 f"another run is writing into {out_dir}", min_generation)


def lock_rank(out_dir: Path, rank: int, run_id: str | None = None,
              lease_seconds: float = DEFAULT_LEASE_SECONDS) -> OutputLock:
    """Rank `rank`'s lock of `out_dir` for the time it writes (raises OutputBusyError when held elsewhere)."""
    return _take(out_dir, rank_lock_name(rank).removesuffix(".lock"), run_id or new_run_id(), lease_seconds,
                 f"rank {rank} of another run is writing into {out_dir}")


def _lease_names(folder: Path) -> list[str]:
    """The names of the leases in `folder` (`run`, `rank-00003`)."""
    return sorted({_GENERATION.split(p.name)[0] for p in (folder.iterdir() if folder.is_dir() else [])
                   if _GENERATION.search(p.name) and not p.name.startswith(".")})


def _live_leases(out_dir: Path) -> dict[str, LeaseRecord]:
    """Lock name -> the record of its live lease (held by a process that may be running)."""
    folder = Path(out_dir) / LOCKS_DIR
    live = {}
    for name in _lease_names(folder):
        found = Lease(folder, name, "probe").current()
        if found is not None and found[1] is not None and found[1].is_live(flock=_flock_state(folder, name)):
            live[name] = found[1]
    return live


def _flock_state(folder: Path, name: str) -> str:
    """FileLock.probe of the lock file beside lease `name`: how a lease of this host is judged."""
    return FileLock(folder / f"{name}.lock").probe()


def check_no_rank_writing(out_dir: Path, run_id: str | None = None) -> None:
    """Raise OutputBusyError when a process (e.g. an orphaned worker of a killed run), on this host or another,
    still holds a rank lock; `run_id`: this run's (its own ranks are not in the way)."""
    folder = Path(out_dir) / LOCKS_DIR
    for path in sorted(folder.glob("rank-*.lock")) if folder.is_dir() else []:
        probe = FileLock(path)
        if probe.held_after_exit():
            raise OutputBusyError(
                f"{path.stem} of an earlier run into {out_dir} is still running ({probe.holder()}), e.g. a "
                f"worker left behind when its launcher was killed: stop it, then re-run this command to resume")
    for name, record in _live_leases(out_dir).items():
        if name.startswith("rank-") and record.get("run_id") != run_id:
            raise OutputBusyError(
                f"{name} of an earlier run into {out_dir} is still running ({record.describe()}), e.g. a "
                f"worker left behind when its launcher was killed: stop it, then re-run this command to resume "
                f"({record.how_it_ends()})")
    for name in _lease_names(folder):
        if name.startswith("rank-") and Lease(folder, name, run_id or new_run_id()).fence(_flock_state(folder, name)):
            log.warning("%s: a rank of an earlier run had stopped renewing its lease (a host gone, or a process "
                        "stopped); the lease now names this run, so that rank stops before writing should it run "
                        "again", name)


def running_holders(out_dir: Path) -> dict[str, str]:
    """Lock name (`run`, `rank-00003`) -> holder, for each lock of `out_dir` a live process holds now (a flock
    held, or a live lease)."""
    folder = Path(out_dir) / LOCKS_DIR
    held = {}
    for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
        lock = FileLock(path)
        if lock.held_after_exit():
            held[path.stem] = lock.holder()
    for name, record in _live_leases(out_dir).items():
        held.setdefault(name, record.describe() if record.damaged else f"pid {record.get('pid')} on {record.get('host')}")
    return held


def held_by_a_run(out_dir: Path) -> bool:
    """Whether a live lease of `out_dir` (its run's or a rank's) exists now. Reads the lease records only: no flock
    probe, which would take the lock for an instant and could make a run starting beside it refuse as busy (a
    follower asks this while runs come and go)."""
    return bool(_live_leases(out_dir))

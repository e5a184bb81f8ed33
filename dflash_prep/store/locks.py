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
  extraction then stops at its next batch. Hosts' clocks must agree to well within the lease (NTP does); the lease
  is judged on the holder's heartbeat time, so a host that is gone is taken over `lease_seconds` after its last
  heartbeat.
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


class FileLock:
    """An exclusive, non-blocking `flock` on one file, with the holder written into it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

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
        if not self.path.exists():
            return False
        fd = os.open(self.path, os.O_RDONLY)
        try:
            outcome = _flock_nonblocking(fd)
            if outcome == "taken":
                fcntl.flock(fd, fcntl.LOCK_UN)
            return outcome == "held"
        finally:
            os.close(fd)

    def holder(self) -> str:
        """`host pid` of the process that last took the lock (as it wrote it), or 'unknown'."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            text = ""
        if not text:
            return "unknown"
        host, _, pid = text.partition(" ")
        return f"pid {pid} on {host}"

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


class LeaseRecord(dict):
    """A lease file's content: host, pid, run_id, generation, lease_seconds, started_at, heartbeat_at (unix times
    of the holder's clock), released_at (None while held)."""

    def age_seconds(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - float(self.get("heartbeat_at", 0))

    def is_live(self, now: float | None = None) -> bool:
        """Held by a process that may be running: not released, a heartbeat younger than its lease, and not a
        process of this host that is gone."""
        if self.get("released_at") is not None:
            return False
        if self.get("host") == socket.gethostname() and not _pid_alive(int(self.get("pid", 0))):
            return False
        return self.age_seconds(now) < float(self.get("lease_seconds", DEFAULT_LEASE_SECONDS))

    def describe(self) -> str:
        return f"pid {self.get('pid')} on {self.get('host')}, run {self.get('run_id')}"

    def how_it_ends(self) -> str:
        """How the lease ends, for a message to someone who cannot reach the holder."""
        lease = float(self.get("lease_seconds", DEFAULT_LEASE_SECONDS))
        ends = float(self.get("heartbeat_at", 0)) + lease
        return (f"its last heartbeat was {self.age_seconds():.0f} s ago; it renews it every "
                f"{heartbeat_seconds(lease):.0f} s while it runs, and if {self.get('host')} is gone or the process "
                f"is stopped the lease ends {lease:.0f} s after the last heartbeat ({_clock(ends)} or later): "
                f"re-running this command then takes the output over")


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

    def current(self) -> tuple[int, LeaseRecord | None] | None:
        """(generation, record) of the highest generation, or None when there is none. The listing may lag on a
        network filesystem; names above it are probed one by one (an open of a name asks the server)."""
        listed = [int(m.group(1)) for p in (self.folder.iterdir() if self.folder.is_dir() else [])
                  if p.name.startswith(self.name + ".lease-") and (m := _GENERATION.search(p.name))]
        generation = max(listed, default=-1)
        while self.path_of(generation + 1).exists():
            generation += 1
        if generation < 0:
            return None
        return generation, read_lease(self.path_of(generation))

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            found = self.current()
            if found is not None:
                generation, record = found
                if record is None:  # unreadable: a torn copy, or a file made by hand; judged by its age
                    record = _record_of_unreadable(self.path_of(generation))
                if record.is_live():
                    raise OutputBusyError(f"{record.describe()} holds it ({record.how_it_ends()})")
                stale = record if record.get("released_at") is None else None
            else:
                generation, stale = -1, None
            if self._create(generation + 1):
                self.took_over = stale
                self._start_heartbeat()
                self._remove_older(generation + 1)
                return
            time.sleep(0.05)  # another run made that generation first: judge it
        raise OutputBusyError(f"{self.folder / self.name}: could not take the lease (other runs keep taking it)")

    def fence(self) -> bool:
        """Take a stale lease (not live, not released) over and release it at once, so that its holder, should it
        run again (a frozen process resumed), finds it lost and stops; -> whether it was fenced."""
        found = self.current()
        if found is None or found[1] is None or found[1].is_live() or found[1].get("released_at") is not None:
            return False
        if not self._create(found[0] + 1):
            return False
        self.release()
        return True

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
        _write_record(tmp, record)
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
        if made and self.path_of(generation + 1).exists():
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
        if self.path_of(self.generation + 1).exists():
            self.lost = True
            taker = read_lease(self.path_of(self.generation + 1))
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
    with open(path, "w") as f:
        f.write(json.dumps(record))
        f.flush()
        os.fsync(f.fileno())


def _replace_record(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_record(tmp, record)
    os.replace(tmp, path)


def read_lease(path: Path) -> LeaseRecord | None:
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return LeaseRecord(record) if isinstance(record, dict) else None


def _record_of_unreadable(path: Path) -> LeaseRecord:
    """A lease file that does not read (edited by hand, damaged): live for DEFAULT_LEASE_SECONDS after its
    modification time, so it is never taken over sooner than a real one."""
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = 0.0
    return LeaseRecord(host="an unknown host", pid=0, run_id="unknown", heartbeat_at=mtime,
                       lease_seconds=DEFAULT_LEASE_SECONDS, released_at=None)


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
        self.flock.release()


def _take(out_dir: Path, name: str, run_id: str, lease_seconds: float, busy: str) -> OutputLock:
    """Take `name`'s flock, then its lease; OutputBusyError (`busy` + the holder) when either is held."""
    lock = OutputLock(out_dir, name, run_id, lease_seconds)
    if not lock.flock.try_acquire():
        raise OutputBusyError(f"{busy} ({lock.flock.holder()}): wait for it to end (or stop it), then re-run this "
                              f"command to resume; or use another output.dir")
    try:
        lock.lease.acquire()
    except OutputBusyError as e:
        lock.flock.release()
        raise OutputBusyError(f"{busy}: {e}; or use another output.dir") from None
    if lock.lease.took_over is not None:
        record = lock.lease.took_over
        age, lease = record.age_seconds(), float(record.get("lease_seconds", DEFAULT_LEASE_SECONDS))
        why = (f"its last heartbeat was {age:.0f} s ago, past its lease of {lease:.0f} s (a host that is gone, or a "
               f"process stopped)" if age > lease else
               f"its process no longer runs on this host (its last heartbeat {age:.0f} s ago)")
        log.warning("took over the lease of %s from %s: %s", name, record.describe(), why)
    return lock


def lock_run(out_dir: Path, run_id: str | None = None,
             lease_seconds: float = DEFAULT_LEASE_SECONDS) -> OutputLock:
    """The main process's lock of `out_dir` (raises OutputBusyError when another run holds it)."""
    return _take(out_dir, RUN_NAME, run_id or new_run_id(), lease_seconds,
                 f"another extraction is running into {out_dir}")


def lock_rank(out_dir: Path, rank: int, run_id: str | None = None,
              lease_seconds: float = DEFAULT_LEASE_SECONDS) -> OutputLock:
    """Rank `rank`'s lock of `out_dir` for the time it writes (raises OutputBusyError when held elsewhere)."""
    return _take(out_dir, rank_lock_name(rank).removesuffix(".lock"), run_id or new_run_id(), lease_seconds,
                 f"rank {rank} of another extraction is writing into {out_dir}")


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
        if found is not None and found[1] is not None and found[1].is_live():
            live[name] = found[1]
    return live


def check_no_rank_writing(out_dir: Path, run_id: str | None = None) -> None:
    """Raise OutputBusyError when a process (e.g. an orphaned worker of a killed run), on this host or another,
    still holds a rank lock; `run_id`: this run's (its own ranks are not in the way)."""
    folder = Path(out_dir) / LOCKS_DIR
    for path in sorted(folder.glob("rank-*.lock")) if folder.is_dir() else []:
        probe = FileLock(path)
        if probe.held_elsewhere():
            raise OutputBusyError(
                f"{path.stem} of an earlier extraction into {out_dir} is still running ({probe.holder()}), e.g. a "
                f"worker left behind when its launcher was killed: stop it, then re-run this command to resume")
    for name, record in _live_leases(out_dir).items():
        if name.startswith("rank-") and record.get("run_id") != run_id:
            raise OutputBusyError(
                f"{name} of an earlier extraction into {out_dir} is still running ({record.describe()}), e.g. a "
                f"worker left behind when its launcher was killed: stop it, then re-run this command to resume "
                f"({record.how_it_ends()})")
    for name in _lease_names(folder):
        if name.startswith("rank-") and Lease(folder, name, run_id or new_run_id()).fence():
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
        if lock.held_elsewhere():
            held[path.stem] = lock.holder()
    for name, record in _live_leases(out_dir).items():
        held.setdefault(name, f"pid {record.get('pid')} on {record.get('host')}")
    return held

"""Locks that keep two extractions from writing into one output folder at the same time.

Two runs into one folder would number their shards alike and overwrite each other's files; a new run would also
remove, as "uncommitted", the temporary shard another live run is writing. So:

- `OUT/locks/run.lock` is held by the main process of a run from before it touches the folder until it ends;
- `OUT/locks/rank-RRRRR.lock` is held by each rank while it writes; before it removes uncommitted files, the main
  process checks that no rank lock is held (orphaned workers of a killed launcher would otherwise keep writing).

Guarantees: the locks are `fcntl.flock` locks, released by the kernel when their process dies (SIGKILL included),
so a crashed run never blocks its own resume. Each lock file holds `host pid` of its last holder, for the message.
A filesystem without flock support (some network filesystems) gets a warning and no locking: then it is up to the
user to start one run per folder at a time.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

LOCKS_DIR = "locks"
RUN_LOCK = "run.lock"

log = logging.getLogger("dflash_prep")

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputBusyError(RuntimeError):
    """Another live extraction holds a lock of this output folder."""


def rank_lock_name(rank: int) -> str:
    return f"rank-{rank:05d}.lock"


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
                log.warning("%s: the filesystem does not support file locks; run one extraction per output "
                            "folder at a time", self.path)
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


def lock_run(out_dir: Path) -> FileLock:
    """The main process's lock of `out_dir` (raises OutputBusyError when another run holds it)."""
    lock = FileLock(Path(out_dir) / LOCKS_DIR / RUN_LOCK)
    if not lock.try_acquire():
        raise OutputBusyError(
            f"another extraction is running into {out_dir} ({lock.holder()}): wait for it to end (or stop it), "
            f"then re-run this command to resume; or use another output.dir")
    return lock


def check_no_rank_writing(out_dir: Path) -> None:
    """Raise OutputBusyError when a process (e.g. an orphaned worker of a killed run) still holds a rank lock."""
    folder = Path(out_dir) / LOCKS_DIR
    for path in sorted(folder.glob("rank-*.lock")) if folder.is_dir() else []:
        probe = FileLock(path)
        if probe.held_elsewhere():
            raise OutputBusyError(
                f"{path.stem} of an earlier extraction into {out_dir} is still running ({probe.holder()}), e.g. a "
                f"worker left behind when its launcher was killed: stop it, then re-run this command to resume")


def running_holders(out_dir: Path) -> dict[str, str]:
    """Lock name (`run`, `rank-00003`) -> holder, for each lock of `out_dir` a live process holds now."""
    folder = Path(out_dir) / LOCKS_DIR
    held = {}
    for path in sorted(folder.glob("*.lock")) if folder.is_dir() else []:
        lock = FileLock(path)
        if lock.held_elsewhere():
            held[path.stem] = lock.holder()
    return held


def lock_rank(out_dir: Path, rank: int) -> FileLock:
    """Rank `rank`'s lock of `out_dir` for the time it writes (raises OutputBusyError when held elsewhere)."""
    lock = FileLock(Path(out_dir) / LOCKS_DIR / rank_lock_name(rank))
    if not lock.try_acquire():
        raise OutputBusyError(
            f"rank {rank} of another extraction is writing into {out_dir} ({lock.holder()}): stop it, then re-run "
            f"this command to resume")
    return lock

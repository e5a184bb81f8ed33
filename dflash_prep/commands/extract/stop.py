"""Stopping a run cleanly: the stop signals (SIGTERM, SIGINT) of the rank's main thread, and the DataLoader workers,
which leave those signals to the rank and die with it."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("dflash_prep")


class StopRequest:
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


def init_worker(lock_fds: tuple[int, ...], worker_id: int) -> None:
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
    for sig in StopRequest.SIGNALS:
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

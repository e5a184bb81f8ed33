"""Stopping a run cleanly: the stop signals (SIGTERM, SIGINT) of the rank's main thread, and the DataLoader workers,
which leave those signals to the rank and die with it."""

from __future__ import annotations

import logging
import os
import signal
import sys

from dflash_prep.signals import StopRequest

log = logging.getLogger("dflash_prep")

EXTRACTION_STOP_MESSAGE = ("%s received: finishing the batches in flight and committing their shards; send it again "
                           "to stop at once (a resume is safe either way)")


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

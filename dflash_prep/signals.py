"""Stop signals (the ground floor): SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) asks a run to stop
at its next commit boundary; a second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger("dflash_prep")

# Set by `dflash-prep launch` for the script it runs (commands/launch.py): exit codes are kept, and the launcher is
# the script's parent process (the managed servers' watchdog watches it: regen/servers.py).
LAUNCHER_ENV = "DFLASH_PREP_LAUNCHER"


class StopRequest:
    """The first SIGTERM or SIGINT asks the run to stop at its next commit boundary (the caller polls `requested`:
    what was computed is committed, so a resume redoes nothing of it) and logs `message` with the signal's name; a
    second signal stops at once (the default handlers are back), except the same signal within DUPLICATE_SECONDS of
    the first: one request delivered twice (a SIGTERM to the job's process group reaches the script and the
    launcher, which forwards it). Installed only in the main thread (signal handlers can only be set there).
    Shared by the extraction loop and the regeneration loop."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    DUPLICATE_SECONDS = 2.0

    def __init__(self, message: str = "%s received: stopping at the next commit; send it again to stop at once"):
        self.signal_name: str | None = None
        self._message = message
        self._first: tuple[int, float] | None = None
        self._previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first, self.signal_name = (signum, now), signal.Signals(signum).name
            log.warning(self._message, self.signal_name)
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


_RUN_OWNS_PROCESS = False


def run_owns_process() -> None:
    """Mark this process as one started to run one command (a console script's or `python -m`'s main, given no
    argv of a caller), so that `ignore_stop_signals` acts in it; a program that calls a command in-process keeps
    its own signal handling."""
    global _RUN_OWNS_PROCESS
    _RUN_OWNS_PROCESS = True


def ignore_stop_signals() -> None:
    """Ignore SIGINT and SIGTERM for the rest of this process: called once the output is committed (its manifest
    written), when the process has only its exit left. A stop there could only turn a finished run into a failure
    report: a Ctrl-C raised KeyboardInterrupt in an exit handler (a traceback, exit code 0) or, late in the
    interpreter's exit where Python has put the signal's default action back, killed the process by SIGINT (which
    the launcher reports as "stopped", exit code 1; `regenerate` exited 130). An ignored signal stays ignored
    through that exit. SIGKILL still ends the process. Only in a process the command owns (`run_owns_process`),
    main thread only: elsewhere this does nothing."""
    if not _RUN_OWNS_PROCESS or threading.current_thread() is not threading.main_thread():
        return
    for sig in StopRequest.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)

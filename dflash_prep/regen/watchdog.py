"""`python -m dflash_prep.regen.watchdog PGID PID...`: kill process group PGID (a managed server and its workers) once
any PID (the run's process, the launcher it runs under) is gone; exit when the group is empty.

Why a process of its own: a run killed by SIGKILL runs no handler, and PR_SET_PDEATHSIG reaches only the server's
first process, not the workers it forks (vLLM, SGLang). Only the standard library is imported here (it starts in
well under a second and holds a few MB).
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_SECONDS = 0.5
GRACE_SECONDS = 10.0  # between SIGTERM and SIGKILL


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: list[str]) -> int:
    pgid, watched = int(argv[0]), [int(p) for p in argv[1:]]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the run's to handle
    while _group_alive(pgid):
        if not all(_alive(pid) for pid in watched):
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                return 0
            deadline = time.monotonic() + GRACE_SECONDS
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 0
        time.sleep(POLL_SECONDS)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

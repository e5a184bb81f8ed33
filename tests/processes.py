"""Process-tree helpers of the kill-and-resume tests: what a dead node does to a launched job."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """All processes below `pid` (torchrun starts its workers in sessions of their own, so a process group kill
    of the launcher would miss them)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started, at once (what a dead node does)."""
    pids = [proc.pid] + descendants(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    for pid in pids[1:]:  # reap-free wait: children of the launcher are re-parented; wait until they are gone
        deadline = time.time() + 30
        while time.time() < deadline:
            try:  # a zombie's main thread has ended (its other threads may still be ending: the product waits)
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:  # gone
                break
            time.sleep(0.05)

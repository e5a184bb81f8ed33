"""The job's progress while a run extracts: one count over every rank, and this run's own rate.

Each writing rank rewrites `OUT/index/rank-R.progress.json` at most once a second with what it ran in this run:
{"samples", "tokens", "seconds" (of its loop), "final" (its loop ended)}. The main process's bar reads them all: its
count is the job's (the samples done before this run + every rank's samples of this run) out of the job's samples,
and its rate is this run's (every rank's tokens of this run / the loop's seconds): after a resume the bar starts
where the job is, not at 0, and its tok/s is not diluted or inflated by earlier runs. The files are advisory:
written without fsync (a torn or lost one only delays the bar by a second) and removed by the main process when a
run claims the output, so a file is always this run's.

When the main process's own share is done first it keeps the bar going until every other rank's loop has ended
(or its rank lock is free: a rank that died), and after a stop signal it waits for them the same way (at most
STOP_WAIT_SECONDS) so that one count, every rank's commits included, is said once.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from dflash_prep.commands.extract.finish import DISK_BOUND_FRACTION
from dflash_prep.store.locks import running_holders
from dflash_prep.store.records import INDEX_DIR, rank_name

PROGRESS_SUFFIX = ".progress.json"
UPDATE_SECONDS = 1.0
STOP_WAIT_SECONDS = 60.0
POLL_SECONDS = 0.25


def progress_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / INDEX_DIR / f"{rank_name(rank)}{PROGRESS_SUFFIX}"


def clear_progress(out_dir: Path) -> None:
    """Remove the progress files of earlier runs (main process, as a run claims the output)."""
    folder = Path(out_dir) / INDEX_DIR
    for path in folder.glob(f"rank-*{PROGRESS_SUFFIX}") if folder.is_dir() else []:
        path.unlink(missing_ok=True)


def read_progress(out_dir: Path, ranks) -> dict[int, dict]:
    """{rank: its progress record} for the `ranks` whose file reads back (others: not yet written, or torn)."""
    found = {}
    for rank in ranks:
        try:
            record = json.loads(progress_path(out_dir, rank).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            found[rank] = record
    return found


def _write(path: Path, record: dict) -> None:
    """tmp + rename without fsync: advisory figures, rewritten every second (see the module docstring)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


class RankProgress:
    """This rank's figures of this run, written for the main process (`writes`: a replica's writer process)."""

    def __init__(self, out_dir: Path, rank: int, writes: bool):
        self.path = progress_path(out_dir, rank) if writes else None
        self.t_start = time.perf_counter()
        self._last = float("-inf")

    def update(self, samples: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if self.path is None or (not final and now - self._last < UPDATE_SECONDS):
            return
        self._last = now
        try:
            _write(self.path, {"samples": samples, "tokens": tokens, "seconds": now - self.t_start, "final": final})
        except OSError:
            pass  # the bar misses a second of this rank; the run itself is not concerned


class JobProgress:
    """The main process's bar over the whole job (module docstring); on the other processes it only writes their
    progress file. `total_samples`: the job's kept samples; `done_before`: those a previous run finished."""

    def __init__(self, run, total_samples: int, done_before: int):
        self.out_dir, self.rank, self.world = run.out_dir, run.rank, run.world
        self.own = RankProgress(run.out_dir, run.rank, run.is_writer)
        self.done_before = done_before
        self.others = [r for r in range(run.world) if r != run.rank]
        self.bar = None
        self._last_read = float("-inf")
        self._others: dict[int, dict] = {}
        if run.is_main:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_samples, initial=done_before, unit="sample", dynamic_ncols=True,
                            desc="extract" + (f" ({run.world} ranks)" if run.world > 1 else ""), file=sys.stderr,
                            mininterval=1.0)

    def update(self, samples: int, tokens: int, writer_wait_seconds: float = 0.0) -> None:
        """This rank ran `samples` / `tokens` so far in this run; its loop waited `writer_wait_seconds` on its
        writers (shown as `disk_wait` once over 10% of the loop: the disk, not the GPU, sets the pace)."""
        self.own.update(samples, tokens)
        if self.bar is None:
            return
        now = time.perf_counter()
        if now - self._last_read >= UPDATE_SECONDS:
            self._others, self._last_read = read_progress(self.out_dir, self.others), now
        all_samples = samples + sum(int(r.get("samples", 0)) for r in self._others.values())
        all_tokens = tokens + sum(int(r.get("tokens", 0)) for r in self._others.values())
        self.bar.update(self.done_before + all_samples - self.bar.n)
        elapsed = max(now - self.own.t_start, 1e-9)
        postfix = {"this_run_tok_s": f"{all_tokens / elapsed:,.0f}"}
        if writer_wait_seconds > DISK_BOUND_FRACTION * elapsed:
            postfix["disk_wait"] = f"{writer_wait_seconds / elapsed:.0%}"
        self.bar.set_postfix(refresh=False, **postfix)

    def finish(self, samples: int, tokens: int) -> None:
        """This rank's loop ended: its last figures, marked final."""
        self.own.update(samples, tokens, final=True)

    def follow_others(self, samples: int, tokens: int, quiet_seconds: float = 60.0) -> None:
        """The main process keeps its bar going until every other rank's loop has ended, or none of them has moved
        for `quiet_seconds` (a rank frozen or cut off: the final wait, peers.py, then decides), then closes it."""
        if self.bar is None:
            return
        seen, moved = None, time.monotonic()
        while self.wait_for_others(POLL_SECONDS) and time.monotonic() - moved < quiet_seconds:
            self._last_read = float("-inf")
            self.update(samples, tokens)
            if self._others != seen:
                seen, moved = self._others, time.monotonic()
        self._last_read = float("-inf")
        self.update(samples, tokens)
        self.bar.close()

    def wait_for_others(self, seconds: float) -> list[int]:
        """Wait up to `seconds` while another rank's loop runs; -> the ranks still running then (a rank counts as
        ended once its progress is final or its rank lock is free)."""
        deadline = time.monotonic() + seconds
        while True:
            running = self._running_others()
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(POLL_SECONDS)

    def _running_others(self) -> list[int]:
        progress = read_progress(self.out_dir, self.others)
        held = running_holders(self.out_dir)
        return [r for r in self.others if not progress.get(r, {}).get("final") and rank_name(r) in held]

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

"""What a run shows: the console (the main process only, one line per message) and each rank's log file
(`OUT/logs/rank-R.log`, tracebacks included), and the progress bar of the forward loop."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from dflash_prep.commands.extract.finish import DISK_BOUND_FRACTION
from dflash_prep.store.records import rank_name

log = logging.getLogger("dflash_prep")


class _ConsoleFormatter(logging.Formatter):
    """The console gets one line per message; tracebacks go to the rank's log file only."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def setup_logging(out_dir: Path, rank: int, is_main: bool) -> None:
    """Console from the main process only; every rank to its own log file."""
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    fh = logging.FileHandler(out_dir / "logs" / f"{rank_name(rank)}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(fh)
    if is_main:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(_ConsoleFormatter("[dflash-prep] %(message)s"))
        ch.addFilter(lambda record: getattr(record, "console", True))  # extra={"console": False}: file only
        log.addHandler(ch)
    # Known noisy library messages: keep them in the file log, off the console.
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def progress_bar(is_main: bool, total_samples: int, world: int):
    """The main process's tqdm bar over `total_samples` (None on the other processes)."""
    if not is_main:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total_samples, desc=f"extract (rank 0 of {world})", unit="sample", dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def show_progress(progress, num_samples: int, num_tokens_all_ranks: int, t_loop: float,
                  writer_wait_seconds: float) -> None:
    """tok/s over all ranks, and, once the loop has spent over 10% of its time waiting on the writers, that share
    (`disk_wait`: the disk, not the GPU, sets the pace)."""
    if progress is not None:
        progress.update(num_samples)
        elapsed = max(time.perf_counter() - t_loop, 1e-9)
        postfix = {"tok_s": f"{num_tokens_all_ranks / elapsed:,.0f}"}
        if writer_wait_seconds > DISK_BOUND_FRACTION * elapsed:
            postfix["disk_wait"] = f"{writer_wait_seconds / elapsed:.0%}"
        progress.set_postfix(refresh=False, **postfix)

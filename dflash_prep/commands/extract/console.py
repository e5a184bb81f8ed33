"""What a run shows: the console (the main process only, one line per message) and each rank's log file
(`OUT/logs/rank-R.log`, tracebacks included). The progress bar: progress.py."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

from dflash_prep.store.records import rank_name

log = logging.getLogger("dflash_prep")


class _ConsoleFormatter(logging.Formatter):
    """The console gets one line per message; tracebacks go to the rank's log file only."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text:
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)


def setup_logging(out_dir: Path, rank: int, is_main: bool) -> None:
    """Console from the main process only; every rank to its own log file, once the run has claimed the output
    (`attach_log_file`): until then the lines are held, so a run refused before its claim (the folder is another
    run's, or another job's) writes nothing into that run's log."""
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    log.addHandler(logging.handlers.MemoryHandler(capacity=1 << 16, flushLevel=logging.CRITICAL + 1, target=None))
    if is_main:
        ch = logging.StreamHandler(sys.stderr)
        ch.setFormatter(_ConsoleFormatter("[dflash-prep] %(message)s"))
        ch.addFilter(lambda record: getattr(record, "console", True))  # extra={"console": False}: file only
        log.addHandler(ch)
    # Known noisy library messages: keep them in the file log, off the console.
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def attach_log_file(out_dir: Path, rank: int) -> None:
    """The run holds the output: its rank's log file from now on (`OUT/logs/rank-R.log`), the lines held since
    `setup_logging` first."""
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(out_dir / "logs" / f"{rank_name(rank)}.log")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    for held in [h for h in log.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        held.setTarget(fh)
        held.flush()
        log.removeHandler(held)
        held.close()
    log.addHandler(fh)


def log_to_file(message: str) -> None:
    """`message` in this rank's log file when it has one (the console said it already)."""
    if any(isinstance(h, logging.FileHandler) for h in log.handlers):
        log.error("%s", message, extra={"console": False})

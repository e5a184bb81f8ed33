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


class LogFileHandler(logging.FileHandler):
    """A rank's log file whose failed writes (a full disk, a quota) are counted, never printed: logging's own
    `handleError` prints `--- Logging error ---` and a traceback to stderr for each line it cannot write, which
    buries the one line the command ends with. `failed_writes` and `first_error` say what was lost; the run's
    outcome comes from its own writes (the shards, the index, the manifest), which raise as always."""

    def __init__(self, filename, *args, **kwargs):
        super().__init__(filename, *args, **kwargs)
        self.failed_writes = 0
        self.first_error: BaseException | None = None

    def handleError(self, record: logging.LogRecord | None) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        self.failed_writes += 1
        if self.first_error is None:
            self.first_error = error

    def flush(self) -> None:
        try:
            super().flush()
        except OSError:
            self.handleError(None)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the buffered tail of the file could not be written
            self.handleError(None)


def lost_log_lines() -> str | None:
    """'N line(s) could not be written to PATH (ERROR)' when a log file failed a write this run, else None."""
    for h in log.handlers:
        if isinstance(h, LogFileHandler) and h.failed_writes:
            return f"{h.failed_writes} log line(s) could not be written to {h.baseFilename} ({h.first_error})"
    return None


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
    fh = LogFileHandler(out_dir / "logs" / f"{rank_name(rank)}.log")
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

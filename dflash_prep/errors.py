"""Errors every stage may raise, and the exit codes they map to (the ground floor: imports nothing of the package).

Exit codes of the commands: 0 done; 1 stopped, resumable (re-run the same command); 2 refused before any work
(a bad recipe, a changed job, a foreign output folder); 3 finished with more failed samples than allowed.
"""

EXIT_STOPPED, EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES = 1, 2, 3


class ExtractionError(RuntimeError):
    """The run stopped cleanly (write error, fatal NaN, a stop signal, samples missing at the merge): committed
    shards are intact; re-running resumes."""


class StopRequested(ExtractionError):
    """A stop signal (SIGTERM, Ctrl-C) ended the run at a batch boundary after every captured batch was committed.
    The main process's message speaks for every rank (one count of what is committed); the others only log theirs."""

"""`extract.py` / `dflash-prep extract` / `python -m dflash_prep.commands.extract`: the command line of the
extraction, its errors as one line each and its exit codes (0 done, 1 stopped, resumable, 2 refused, 3 done but more
samples failed than `output.max_failed_samples`)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from dflash_prep.commands.extract.preflight import (
    ChangedJobError,
    answer_finished,
    failed_samples_code,
    finished_summary,
    parse_recipe,
)
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES, EXIT_STOPPED, ExtractionError, StopRequested
from dflash_prep.recipe.schema import RecipeError
from dflash_prep.signals import ignore_stop_signals, run_owns_process

log = logging.getLogger("dflash_prep")


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """`extract.py` / `dflash-prep extract`: [--recipe PATH] [--set key=value ...]. Returns the exit code.

    `own_process` (the launched script): an error while the model was still loading on its thread (a data verdict,
    an output of another job) ends the process at once with its exit code, after the error line, instead of
    waiting for the load (a model load cannot be interrupted, and the other ranks are stopped by the launcher
    only once this process exits)."""
    if own_process:
        run_owns_process()
    try:
        code = _main(argv, own_process)
    except KeyboardInterrupt:  # Ctrl-C before the run claimed the output (the recipe, the imports): said in a line
        print("error: stopped by Ctrl-C before the extraction started; re-run the same command to go on",
              file=sys.stderr)
        ignore_stop_signals()
        code = EXIT_STOPPED
    if code in (EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES) and _under_plain_accelerate_launch():
        print(f"note: `accelerate launch` reports exit code {code} as 1 (\"stopped, resumable\"); `dflash-prep launch` "
              f"takes the same arguments and keeps it", file=sys.stderr)
    if own_process and code != 0 and "dflash_prep.commands.extract.target_load" in sys.modules:
        from dflash_prep.commands.extract.target_load import TargetLoad

        if TargetLoad.in_flight():
            _exit_now(code)
    return code


def _logs_folder(recipe) -> Path:
    """Where the rank logs are: OUT/logs, or the staging folder's of an object-store output (uploaded at the end)."""
    from dflash_prep.recipe.location import is_remote

    if not is_remote(recipe.output.dir):
        return Path(recipe.output.dir) / "logs"
    from dflash_prep.store.remote import default_staging_dir

    staging = recipe.output.staging_dir or default_staging_dir(recipe.output.dir)
    return Path(staging).expanduser() / "logs"


def _exit_now(code: int) -> None:
    """End the process with `code` without waiting for the load thread: flush what was printed and logged, then
    os._exit (nothing else is running yet: no writer, no DataLoader worker; the locks are released by the
    kernel)."""
    for handler in log.handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _under_plain_accelerate_launch() -> bool:
    """Started by `accelerate launch` (it sets ACCELERATE_MIXED_PRECISION), not by `dflash-prep launch`; rank 0."""
    from dflash_prep.commands.launch import LAUNCHER_ENV

    return ("ACCELERATE_MIXED_PRECISION" in os.environ and LAUNCHER_ENV not in os.environ
            and os.environ.get("RANK", "0") == "0")


def _main(argv: list[str] | None, own_process: bool = False) -> int:
    try:
        recipe = parse_recipe(argv)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    from dflash_prep.commands.regenerate import regenerate_first

    recipe, code = regenerate_first(recipe)  # a `regenerate:` section: the target's answers first, then their states
    if code is not None:
        return code
    try:  # before the heavy imports: a re-run of a finished job answers at once
        finished = finished_summary(recipe)
    except ChangedJobError as e:  # a finished output whose inputs changed in content
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    if finished is not None:
        return answer_finished(recipe, finished)
    from dflash_prep.commands.extract.console import log_to_file
    from dflash_prep.commands.extract.peers import MainStopped, PeerLostError
    from dflash_prep.commands.extract.run import run_extraction
    from dflash_prep.commands.job import OutputMismatchError
    from dflash_prep.store.locks import OutputBusyError
    from dflash_prep.recipe.location import StoreRefusedError, StoreUnreachableError
    from dflash_prep.store.manifest import OutputStateError

    try:
        summary = run_extraction(recipe, own_process)
    except (RecipeError, OutputMismatchError, OutputBusyError, OutputStateError, StoreRefusedError) as e:
        if not getattr(e, "reported", False):  # run.py says a refusal on the main process before the others end
            print(f"error: {e}", file=sys.stderr)
        log_to_file(f"refused (exit code {EXIT_BAD_RECIPE}): {e}")  # a claimed output's log says why it stopped
        return EXIT_BAD_RECIPE
    except MainStopped as e:  # the main process said why; this one ends with its exit code, quietly
        log_to_file(f"stopped (exit code {e.exit_code}): {e}")
        if own_process:
            _exit_now(e.exit_code)
        return e.exit_code
    except PeerLostError as e:  # a process of the run is gone: one line, and no wait on its connection at exit
        print(f"error: {e} (details in {_logs_folder(recipe)})", file=sys.stderr)
        log_to_file(f"stopped (exit code {EXIT_STOPPED}): {e}")
        if own_process:
            _exit_now(EXIT_STOPPED)
        return EXIT_STOPPED
    except ExtractionError as e:
        if not (isinstance(e, StopRequested) and os.environ.get("RANK", "0") != "0"):  # the main one speaks for all
            print(f"error: {e} (details in {_logs_folder(recipe)})", file=sys.stderr)
        if isinstance(e, StopRequested):
            ignore_stop_signals()  # stopped as asked and said so: a further Ctrl-C must not add a second report
        return EXIT_STOPPED
    except KeyboardInterrupt:  # Ctrl-C outside the loop (which handles it at a batch boundary)
        print("error: stopped by Ctrl-C; committed shards are intact, re-run the same command to resume",
              file=sys.stderr)
        ignore_stop_signals()  # said once; the process only exits from here
        return EXIT_STOPPED
    except StoreUnreachableError as e:  # its line names the endpoint; nothing was written
        print(f"error: {e}", file=sys.stderr)
        log_to_file(f"stopped (exit code {EXIT_STOPPED}): {e}")
        return EXIT_STOPPED
    except OSError as e:
        if log.handlers:
            log.error("stopped: %s", e, exc_info=e, extra={"console": False})
        print(f"error: {type(e).__name__}: {e}. Committed shards are intact; fix the cause and re-run the same "
              f"command to resume (details in {_logs_folder(recipe)})", file=sys.stderr)
        return EXIT_STOPPED
    from dflash_prep.commands.extract.console import lost_log_lines

    if (lost := lost_log_lines()) is not None and os.environ.get("RANK", "0") == "0":
        print(f"warning: {lost}", file=sys.stderr)  # the run's own writes succeeded; its log is incomplete
    return failed_samples_code(recipe, summary)

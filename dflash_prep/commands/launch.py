"""`dflash-prep launch`: accelerate's own launcher, run in this process, keeping the script's exit code.

    dflash-prep launch [accelerate launch options] -m dflash_prep.commands.extract [--recipe PATH] [--set key=value ...]
    dflash-prep launch [accelerate launch options] extract.py [--recipe PATH] [--set key=value ...]   (a checkout)

takes exactly the arguments of `accelerate launch` and calls accelerate's `launch_command` with them. Why not
`accelerate launch` itself (accelerate 1.x, `commands/launch.py`): its single-process launcher raises
`CalledProcessError` and its multi-process one (torch elastic) `ChildFailedError` when the script exits non-zero;
both end the launcher with a traceback and exit code 1. Exit code 2 (refused: bad recipe or input, an output of
another job) and 3 (too many failed samples) then read as 1 ("stopped, resumable"), and a retry-on-1 wrapper
loops forever on a permanent refusal. Here:

- the exit code of the script reaches the shell: with several processes the most telling one of the ranks
  (2 before 3 before 1; a rank killed by a signal counts as 1), and no launcher traceback is printed;
- Ctrl-C is left to the script (it stops at a batch boundary, commits what it captured and exits 1): the
  launcher waits for it instead of printing a KeyboardInterrupt traceback; SIGTERM to the launcher (a
  preemption notice) is passed on to the script, which stops the same way (accelerate's single-process launcher
  would die at once and leave the script running, orphaned); a rank killed by a signal is named in one line;
- without `--config_file` and without a default accelerate config, the values accelerate would warn about
  (`--num_processes`, `--num_machines`, `--mixed_precision`, `--dynamo_backend`) are set to what accelerate would
  choose (one process per GPU, one without GPUs), so the console shows no warning block.

- for the extraction (`-m dflash_prep.commands.extract`, or `extract.py`), a recipe that does not read and an
  output already finished with its inputs untouched are answered before accelerate and torch are imported
  (commands/extract/preflight.py): a typo costs no launcher start-up.

Errors: a launcher argument accelerate rejects is one line and exit code 2; nodes of a multi-node launch that do
not all join within the rendezvous timeout (`--rdzv_conf timeout=SECONDS`, 900 by default: torch elastic's static
rendezvous) are one line and exit code 1 (nothing ran).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys

from dflash_prep.signals import LAUNCHER_ENV  # noqa: F401 - set for the script: it runs under this launcher
from dflash_prep.signals import ignore_stop_signals, run_owns_process

EXIT_STOPPED, EXIT_REFUSED, EXIT_FAILED_SAMPLES = 1, 2, 3


def rank_exit_code(codes: list[int]) -> int:
    """One exit code for the ranks' `codes` (negative: killed by that signal): 2 before 3 before 1, 0 if all 0."""
    for wanted in (EXIT_REFUSED, EXIT_FAILED_SAMPLES):
        if wanted in codes:
            return wanted
    return EXIT_STOPPED if any(c != 0 for c in codes) else 0


def _fill_quiet_defaults(args) -> None:
    """Without an accelerate config, set what accelerate would otherwise set with a warning block."""
    from accelerate.commands.config import default_config_file

    if args.config_file is not None or os.path.isfile(default_config_file):
        return
    if args.num_processes is None:
        import torch

        args.num_processes = max(torch.cuda.device_count(), 1)
        if args.num_processes > 1:
            args.multi_gpu = True
    if args.num_machines is None:
        args.num_machines = 1
    if args.mixed_precision is None:
        args.mixed_precision = "no"
    if args.dynamo_backend is None:
        args.dynamo_backend = "no"


def _child_pids() -> list[int]:
    """This process's direct children (Linux /proc; elsewhere none)."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # the field after the state: the parent's pid
            children.append(int(entry))
    return children


def _forward_terminate(signum, frame) -> None:
    """SIGTERM to the launcher (a scheduler's preemption notice, `kill PID`): pass it on to the script's process,
    which stops at the next batch boundary after committing what it captured; keep waiting for it. Without this
    the launcher dies at once and the script runs on, orphaned, holding the output's locks. (With several
    processes torch elastic installs its own handler, which forwards the signal to the ranks itself.) Before the
    script started (the launcher's own imports take a second or more): stop with exit code 1, nothing written."""
    children = _child_pids()
    if not children:
        print(f"error: stopped by {signal.Signals(signum).name} before the extraction started; nothing was written, "
              f"re-run the same command", file=sys.stderr)
        raise SystemExit(EXIT_STOPPED)
    for pid in children:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _killed_message(codes: dict[int, int]) -> None:
    """One line per rank (`codes`: rank -> exit code, negative: killed by that signal) killed by a signal, which
    could print nothing itself, e.g. SIGKILL from the kernel's OOM killer. A SIGTERM or SIGINT is not named when
    another rank exited with a code of its own: torch elastic then stops the others with SIGTERM, and that code's
    own line says what happened."""
    own_code = any(c > 0 for c in codes.values())
    for rank, code in sorted(codes.items()):
        if code >= 0 or (own_code and -code in (signal.SIGTERM, signal.SIGINT)):
            continue
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        who = "the extraction process" if len(codes) == 1 else f"rank {rank}"
        # the first Ctrl-C stops the script at a batch boundary (its own line); SIGINT as the cause of death is a
        # Ctrl-C before its handler was set or a second one while it stopped
        how = " (a Ctrl-C before it could stop at a batch boundary, or a second one while it stopped)" \
            if -code == signal.SIGINT else ""
        print(f"error: {who} was killed by {name}{how}; committed shards are intact, re-run the same command to "
              "resume", file=sys.stderr)


def _ignore_interrupt(signum, frame) -> None:
    """The launcher's Ctrl-C: the terminal sent it to the script too, which stops cleanly; keep waiting for it.
    (A Python handler, not SIG_IGN: children start with the default disposition again.)"""


EXTRACTION_MODULE = "dflash_prep.commands.extract"


def extraction_script_args(argv: list[str]) -> list[str] | None:
    """The arguments of the extraction when `argv` launches it (`-m dflash_prep.commands.extract ...`, or a script
    `extract.py ...` that runs it), else None. The script is the first argument that is the module or such a file;
    what follows it is the script's (accelerate passes it on unparsed)."""
    for i, arg in enumerate(argv):
        if arg == EXTRACTION_MODULE:
            return argv[i + 1:]
        if not arg.startswith("-") and os.path.basename(arg) == "extract.py" and os.path.isfile(arg):
            try:
                with open(arg) as f:
                    runs_ours = EXTRACTION_MODULE in f.read(100_000)
            except (OSError, UnicodeDecodeError):
                runs_ours = False
            return argv[i + 1:] if runs_ours else None
    return None


def _preflight(argv: list[str]) -> int | None:
    """For a launch of the extraction: its recipe checked and a finished output answered before accelerate (and
    torch) is imported (commands/extract/preflight.py); the exit code when that decides the run, else None."""
    script_args = extraction_script_args(argv)
    if script_args is None:
        return None
    from dflash_prep.commands.extract.preflight import preflight

    try:
        return preflight(script_args)
    except SystemExit as e:  # argparse: --help, or an argument the script does not take (as the script would exit)
        return e.code if isinstance(e.code, int) else EXIT_REFUSED


NOTHING_TO_RUN = ("name what to run: `dflash-prep launch [accelerate options] -m dflash_prep.commands.extract "
                  "[--recipe R] [--set key=value ...]` (`dflash-prep launch --help` lists accelerate's options)")


def script_problem(module: bool, script: str) -> str | None:
    """Why accelerate would fail to start what the launch names (`module`: `-m`), in one line, before it starts a
    process per rank to print a traceback each (exit code 1, "stopped, resumable"); None when it exists. The
    modules are looked up without being imported (their parent packages are)."""
    if module:
        try:
            found = importlib.util.find_spec(script) is not None
        except (ImportError, ValueError):
            found = False
        return None if found else f"-m {script}: no such module (the extraction is -m {EXTRACTION_MODULE})"
    if os.path.isfile(script):
        return None
    hint = f" (the extraction is -m {EXTRACTION_MODULE}, or extract.py in a checkout)"
    return f"{script}: no such script file{hint}"


def _parse(parser, argv: list[str]):
    """accelerate's launch parser on `argv`. Its help formatter shows only the option groups the command line names,
    read from `sys.argv` (after `accelerate launch`, else after the program): under `dflash-prep launch --help`
    that is `launch --help`, two words, and it hid every group. It reads the launch arguments alone here."""
    saved = sys.argv
    sys.argv = ["dflash-prep-launch", *argv]
    try:
        return parser.parse_args(argv)
    finally:
        sys.argv = saved


def missing_config_file(argv: list[str]) -> str | None:
    """The launcher's `--config_file` (the arguments before the script or `-m MODULE`) when no file is there, else
    None. accelerate would raise FileNotFoundError with a traceback, exit code 1 ("stopped, resumable")."""
    for i, arg in enumerate(argv):
        if arg == "-m" or arg == "--module" or arg.endswith(".py"):
            return None
        value = argv[i + 1] if arg == "--config_file" and i + 1 < len(argv) else \
            arg.split("=", 1)[1] if arg.startswith("--config_file=") else None
        if value is not None:
            return None if os.path.isfile(value) else value
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # `python -m`: this process is the command's
        run_owns_process()
    # first: a preemption notice during the imports below is an orderly stop (exit code 1), not a death by SIGTERM
    previous_term = signal.signal(signal.SIGTERM, _forward_terminate)
    missing = missing_config_file(sys.argv[1:] if argv is None else argv)
    if missing is not None:
        signal.signal(signal.SIGTERM, previous_term)
        print(f"error: dflash-prep launch: --config_file {missing}: no such file (accelerate's configs of this "
              f"project are in its checkout's accelerate_configs/; `accelerate config` writes your own)",
              file=sys.stderr)
        return EXIT_REFUSED
    code = _preflight(sys.argv[1:] if argv is None else argv)
    if code is not None:
        signal.signal(signal.SIGTERM, previous_term)
        return code
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    parser = launch_command_parser()
    parser.prog = "dflash-prep launch"
    launch_argv = sys.argv[1:] if argv is None else argv
    problem = NOTHING_TO_RUN if not launch_argv else None  # accelerate would print its whole usage
    if problem is None:
        args = _parse(parser, launch_argv)
        problem = script_problem(bool(args.module), args.training_script)
    if problem is not None:
        signal.signal(signal.SIGTERM, previous_term)
        print(f"error: dflash-prep launch: {problem}", file=sys.stderr)
        return EXIT_REFUSED
    _fill_quiet_defaults(args)
    os.environ[LAUNCHER_ENV] = "1"
    # torch elastic logs each failed rank with its own block; the ranks printed their one-line errors already.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    previous = signal.signal(signal.SIGINT, _ignore_interrupt)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:
        _killed_message({0: e.returncode})
        return rank_exit_code([e.returncode])
    except ChildFailedError as e:
        _killed_message({rank: f.exitcode for rank, f in e.failures.items()})
        return rank_exit_code([f.exitcode for f in e.failures.values()])
    except (SignalException, KeyboardInterrupt):
        return EXIT_STOPPED
    except DistError as e:  # the nodes' rendezvous, before any script ran (torch elastic's static TCPStore)
        print(f"error: the nodes did not all join the launch ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
              f"nothing ran: start the same command on every node (its --machine_rank); the launcher waits "
              f"`--rdzv_conf timeout=SECONDS` for them (torch elastic: 900 by default)", file=sys.stderr)
        return EXIT_STOPPED
    except ValueError as e:  # accelerate's own argument checks
        print(f"error: dflash-prep launch: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except SystemExit as e:  # the `--quiet` path of accelerate's simple launcher: sys.exit(1)
        if e.code in (128 + signal.SIGTERM, 128 + signal.SIGINT):
            # accelerate >= 1.16 answers a SIGTERM to its launcher itself (it stops the script's processes, then
            # exits 128 + the signal, in place of torch elastic's SignalException): the same orderly stop
            return EXIT_STOPPED
        return e.code if isinstance(e.code, int) else EXIT_STOPPED
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
        # the scripts have exited and their code is decided: a Ctrl-C now (the terminal's, sent to the group as
        # the script finished) must not end the launcher by the signal instead (signals.py)
        ignore_stop_signals()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The README's launch command keeps the script's exit codes and a clean console: a refusal is exit code 2 in the
shell (not accelerate's 1, "stopped, resumable"), Ctrl-C is a one-line stop with exit code 1, and the quick start
prints no accelerate warning block."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cpu_2proc_config, interrupt_group_until_exit, processes_writing, read_stderr_until

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("DFLASH_PREP_FAULTS", None)
LAUNCH = [sys.executable, "-m", "dflash_prep.commands.cli", "launch"]  # what `dflash-prep launch` runs
CPU_2PROC = ["--config_file", cpu_2proc_config()]


@pytest.mark.parametrize("launcher_args", [[], CPU_2PROC], ids=["1 process", "2 processes"])
@pytest.mark.slow
def test_a_refusal_reaches_the_shell_as_exit_code_2_in_one_line(tmp_path, launcher_args):
    """A refusal only the ranks can make (a layer id the model's config does not have: the config is loaded by the
    ranks, after the launcher started them) is exit code 2 in the shell, one line, no output folder left."""
    proc = subprocess.run([*LAUNCH, *launcher_args, "extract.py", "--set", f"output.dir={tmp_path / 'a' / 'out'}",
                           "--set", "layers.preset=explicit", "--set", "layers.ids=[1,999]"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # each rank that got that far prints the line (torch elastic may stop rank 1 once rank 0 has exited)
    assert 1 <= len(errors) <= (2 if launcher_args else 1), proc.stderr[-3000:]
    assert all("layers.ids" in line and "999" in line and "out of range" in line for line in errors)
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr
    assert "were not passed to `accelerate launch`" not in proc.stderr  # no warning block
    assert list(tmp_path.iterdir()) == [], "a refused run left folders behind"


def test_inputs_that_cannot_load_are_refused_before_the_launcher_starts(tmp_path):
    """Typed from a folder of the user's: a missing `./rows.jsonl` is named under that folder (not under the
    recipe's), a `models/my-llama` beside a `models/` folder is a missing folder (not a hub id to retry for half a
    minute), and a hub id whose hub does not answer (a closed port on loopback as HF_ENDPOINT) is refused naming
    it. Each is one line with exit code 2, before accelerate or torch is imported, and leaves no folder."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    (tmp_path / "models").mkdir()
    env = {k: v for k, v in ENV.items() if k not in ("HF_HUB_OFFLINE", "HF_ENDPOINT")}
    env.update({"HF_ENDPOINT": f"http://127.0.0.1:{closed}", "PYTHONPATH": str(REPO),
                "HF_HOME": str(tmp_path / "hf-home")})  # an empty hub cache
    cases = [(["--set", "data.path=./rows.jsonl"], f"`data.path` = '{tmp_path / 'rows.jsonl'}': no such file"),
             (["--set", "model.config=null", "--set", "model.name_or_path=models/my-llama"],
              f"`model.name_or_path` = 'models/my-llama': no such file or folder ({tmp_path / 'models' / 'my-llama'})"),
             (["--set", "model.config=null", "--set", "model.name_or_path=someorg/some-model"],
              f"'someorg/some-model': not a local folder, and the hub that would serve it, http://127.0.0.1:{closed}, "
              f"cannot be reached")]
    for sets, expected in cases:
        probe = ("import runpy, sys; sys.argv = ['dflash-prep', 'launch', '-m', 'dflash_prep.commands.extract', "
                 f"*{sets!r}]; from dflash_prep.commands.cli import main; code = main(sys.argv[1:]); "
                 "print('heavy imports:', sorted(m for m in ('torch', 'accelerate', 'transformers') "
                 "if m in sys.modules)); sys.exit(code)")
        proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
        assert "heavy imports: []" in proc.stdout and "Traceback" not in proc.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-home", "models"] or \
            sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_a_missing_accelerate_config_is_one_line_and_exit_code_2(tmp_path):
    """The README's launch line typed outside the checkout: `--config_file accelerate_configs/multi_gpu.yaml` is not
    there. One line naming the file, exit code 2 (refused, not 1: nothing to resume), no traceback, nothing
    created (it is checked before the extraction's own start-up checks)."""
    for form in (["--config_file", "accelerate_configs/multi_gpu.yaml"], ["--config_file=nowhere.yaml"]):
        proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "launch", *form, "-m",
                               "dflash_prep.commands.extract", "--set", f"output.dir={tmp_path / 'out'}"],
                              cwd=tmp_path, env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and f"--config_file {form[-1].split('=')[-1]}: no such file" in errors[0]
        assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_too_many_failed_samples_reach_the_shell_as_exit_code_3(tmp_path):
    env = {**ENV, "DFLASH_PREP_FAULTS": json.dumps({"nan_samples": ["0000000002"]})}
    proc = subprocess.run([*LAUNCH, "extract.py", "--set", f"output.dir={tmp_path / 'out'}", "--set",
                           "data.max_samples=8", "--set", "batching.num_workers=0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "more than output.max_failed_samples=0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_ctrl_c_under_the_launcher_stops_cleanly_with_exit_code_1(tmp_path):
    """Ctrl-C reaches the launcher and the script (one process group): the script commits what it captured and
    exits 1 with one line; the launcher prints no KeyboardInterrupt traceback and passes the 1 on."""
    out = tmp_path / "out"
    proc = _start_and_wait_for_a_commit(out, num_workers=0)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "stopped on SIGINT" in err and "re-run the same command to resume" in err
    assert not (out / "manifest.json").exists() and not list(Path(out).rglob("*.tmp"))


@pytest.mark.slow
def test_ctrl_c_once_the_manifest_is_written_leaves_a_finished_run_exit_code_0(tmp_path):
    """From the `done:` line on, the output is finished: Ctrl-C (the terminal's, to the whole group, here again
    every 50 ms until the launcher exits) neither reports a stop (exit code 1), nor kills a process by the signal,
    nor prints a KeyboardInterrupt from an exit handler."""
    out = tmp_path / "out"
    proc = subprocess.Popen([*LAUNCH, "extract.py", "--set", f"output.dir={out}", "--set", "data.max_samples=40"],
                            cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    lines = read_stderr_until(proc, "] done: ")
    assert any("] done: " in line for line in lines), "".join(lines)[-3000:]
    err = "".join(lines) + interrupt_group_until_exit(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "error:" not in err, err[-3000:]
    assert (out / "manifest.json").exists()


@pytest.mark.slow
def test_ctrl_c_again_once_the_stop_is_reported_adds_no_second_report(tmp_path):
    """Ctrl-C, then Ctrl-C again (every 50 ms) once the script said it stopped: still its one line and exit code 1,
    no "killed by SIGINT" line from the launcher, no traceback."""
    proc = _start_and_wait_for_a_commit(tmp_path / "out", num_workers=0)
    os.killpg(proc.pid, signal.SIGINT)
    lines = read_stderr_until(proc, "error:")
    assert any(line.startswith("error:") for line in lines), "".join(lines)[-3000:]
    err = "".join(lines) + interrupt_group_until_exit(proc)
    assert proc.returncode == 1, err[-3000:]
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def test_ctrl_c_while_the_script_still_imports_is_one_line_and_exit_code_1(tmp_path):
    """Ctrl-C 0.3 s after the start, while the extraction is still reading its recipe and importing torch: one
    line and exit code 1 (stopped), not a KeyboardInterrupt traceback and a death by the signal."""
    proc = subprocess.Popen([sys.executable, "extract.py", "--set", f"output.dir={tmp_path / 'out'}"], cwd=REPO,
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1, err[-3000:]


@pytest.mark.parametrize("argv, expected", [
    ([], "name what to run: `dflash-prep launch [accelerate options] -m dflash_prep.commands.extract"),
    (["extract"], "extract: no such script file (the extraction is -m dflash_prep.commands.extract"),
    (["-m", "dflash_prep.commands.extrct"], "-m dflash_prep.commands.extrct: no such module"),
    (["--num_processes", "1", "-m", "nosuchpackage.extract", "--set", "x=1"],
     "-m nosuchpackage.extract: no such module"),
])
def test_a_launch_of_nothing_or_of_what_is_not_there_is_one_line_and_exit_code_2(tmp_path, argv, expected):
    """First tries: no script, `extract` without `-m`, a module name with a typo: one line naming the extraction's
    launch, exit code 2 (refused), nothing started; accelerate alone prints its usage, or starts the process to
    fail with a traceback and exit code 1 ("stopped, resumable")."""
    proc = subprocess.run([*LAUNCH, *argv], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dflash-prep launch: ") and expected in lines[0], lines


@pytest.mark.slow
def test_plain_accelerate_launch_says_that_it_reports_a_refusal_as_1(tmp_path):
    """accelerate's own launcher turns exit code 2 into 1 (its CalledProcessError); the script says so and names
    the launcher that keeps the code."""
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "extract.py",
                           "--set", f"output.dir={tmp_path / 'out'}", "--set", f"data.path={tmp_path / 'missing.jsonl'}"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1  # accelerate's, whatever the script's
    assert "note: `accelerate launch` reports exit code 2 as 1" in proc.stderr and "dflash-prep launch" in proc.stderr


def _start_and_wait_for_a_commit(out: Path, num_workers: int = 1) -> subprocess.Popen:
    """A slowed-down extraction under the launcher, in a process group of its own, once it committed a shard."""
    env = {**ENV, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.3})}
    proc = subprocess.Popen([*LAUNCH, "extract.py", "--set", f"output.dir={out}", "--set", "data.max_samples=150",
                             "--set", "batching.max_tokens_per_batch=4096", "--set", f"batching.num_workers={num_workers}",
                             "--set", "output.max_shard_bytes=1MB"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not any(
            p.read_bytes().count(b"\n") for p in out.glob("index/rank-*.jsonl")):  # a shard committed
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the signal: the test proved nothing"
    return proc



@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_the_script_cleanly_and_leaves_nothing_running(tmp_path):
    """A preemption notice goes to the launcher's pid only: the script must still stop at a batch boundary
    (committing what it captured, exit 1, one line) and no process may stay behind holding the output."""
    out = tmp_path / "out"
    proc = _start_and_wait_for_a_commit(out)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, not its process group
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "stopped on SIGTERM" in err and "Traceback" not in err, err[-3000:]
    deadline = time.time() + 10
    while processes_writing(out) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_writing(out) == []
    assert not (out / "manifest.json").exists() and not list(Path(out).rglob("*.tmp"))


@pytest.mark.slow
def test_sigterm_to_the_whole_job_stops_at_a_batch_boundary(tmp_path):
    """A scheduler that signals every process of the job: the script gets the SIGTERM and the launcher's forward of
    it, one request; it still stops at a batch boundary, commits what it captured and exits 1."""
    out = tmp_path / "out"
    proc = _start_and_wait_for_a_commit(out)
    os.killpg(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "stopped on SIGTERM" in err and "killed by SIGTERM" not in err and "Traceback" not in err, err[-3000:]
    assert not list(Path(out).rglob("*.tmp"))


@pytest.mark.slow
def test_a_script_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """What the OOM killer does: SIGKILL to the script alone. It can print nothing; the launcher says what
    happened, exit 1 (resumable)."""
    out = tmp_path / "out"
    proc = _start_and_wait_for_a_commit(out)
    script = [int(p) for p in processes_writing(out) if int(p) != proc.pid]
    assert script
    for pid in script:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, err[-3000:]
    assert "killed by SIGKILL" in err and "re-run the same command to resume" in err and "Traceback" not in err


def test_a_rank_killed_by_a_signal_is_named_even_when_another_rank_exited_with_a_code(capsys):
    """Two processes: rank 1 killed by the OOM killer (SIGKILL), rank 0 then stopped with exit code 1; the SIGTERM
    torch elastic sends the other ranks after a refusal (exit code 2) is not news."""
    from dflash_prep.commands.launch import _killed_message

    _killed_message({0: 1, 1: -int(signal.SIGKILL)})
    assert capsys.readouterr().err.strip() == ("error: rank 1 was killed by SIGKILL; committed shards are intact, "
                                               "re-run the same command to resume")
    _killed_message({0: 2, 1: -int(signal.SIGTERM)})
    assert capsys.readouterr().err == ""
    _killed_message({0: -int(signal.SIGTERM)})
    assert "the extraction process was killed by SIGTERM;" in capsys.readouterr().err
    _killed_message({0: -int(signal.SIGINT)})  # after the script's own stop line: a second Ctrl-C, said so
    assert "killed by SIGINT (a Ctrl-C before it could stop at a batch boundary, or a second one while it stopped)" \
        in capsys.readouterr().err


def test_sigterm_before_the_script_started_is_an_orderly_stop(monkeypatch, capsys):
    """The launcher's imports take a second or more: a preemption notice then ends it with exit code 1 (resumable)
    and one line, not a death by SIGTERM (exit 143, not a documented code)."""
    from dflash_prep.commands import launch

    monkeypatch.setattr(launch, "_child_pids", lambda: [])
    with pytest.raises(SystemExit) as stop:
        launch._forward_terminate(signal.SIGTERM, None)
    assert stop.value.code == 1
    assert capsys.readouterr().err.strip() == ("error: stopped by SIGTERM before the extraction started; nothing was "
                                               "written, re-run the same command")


def test_launch_help_lists_every_option_group_as_accelerate_launch_help_does():
    """`dflash-prep launch --help` (the installed command, as a user types it) shows accelerate's whole launch help:
    the config file, the module flag and the hardware and resource options, as `accelerate launch --help` does;
    accelerate's formatter had hidden every group it did not see named on the command line."""
    import shutil

    ours = subprocess.run([shutil.which("dflash-prep") or "dflash-prep", "launch", "--help"], capture_output=True,
                          text=True, timeout=120)
    theirs = subprocess.run([shutil.which("accelerate") or "accelerate", "launch", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert ours.returncode == 0 and theirs.returncode == 0, ours.stderr[-500:]
    for option in ("--config_file", "--module", "--cpu", "--multi_gpu", "--num_processes", "--main_process_port"):
        assert option in theirs.stdout and option in ours.stdout, option
    assert abs(len(ours.stdout.splitlines()) - len(theirs.stdout.splitlines())) < 40  # the same help, another prog

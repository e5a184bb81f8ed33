"""One extraction per output folder at a time: a second run (or a worker orphaned by a killed launcher) is refused
before it touches anything, naming the holder; a dead holder never blocks the resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, demo_overrides, raw_records

from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main
from dflash_prep.commands.inspect import check_output
from dflash_prep.store.locks import LOCKS_DIR, FileLock, OutputBusyError, check_no_rank_writing, running_holders

SETTINGS = {"data.max_samples": 24, "batching.num_workers": 0, "output.max_shard_bytes": "1MB"}


def argv(out: Path, **extra) -> list[str]:
    return [a for kv in demo_overrides(out, **{**SETTINGS, **extra}) for a in ("--set", kv)]


def hold_lock(path: Path) -> subprocess.Popen:
    """Another live process holding `path` (what a running extraction's main process or rank does)."""
    code = (f"import sys, time; sys.path.insert(0, {str(REPO)!r}); from dflash_prep.store.locks import FileLock; "
            f"assert FileLock({str(path)!r}).try_acquire(); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_lock_on_the_same_file_is_refused_until_released(tmp_path):
    a, b = FileLock(tmp_path / "x.lock"), FileLock(tmp_path / "x.lock")
    assert a.try_acquire()
    assert not b.try_acquire()
    assert b.holder() == f"pid {os.getpid()} on {os.uname().nodename}"
    a.release()
    assert b.try_acquire()
    b.release()


SYS_EXIT = {"x86_64": 60, "aarch64": 93}.get(os.uname().machine)  # exit(2) of one thread, not the process


def exiting_holder(path: Path) -> subprocess.Popen:
    """A process holding `path` whose main thread has ended by the exit system call (a zombie, what SIGKILL leaves
    first) while another thread keeps the descriptor open for 1.5 s more."""
    code = (f"import ctypes, os, sys, threading, time; sys.path.insert(0, {str(REPO)!r}); "
            f"from dflash_prep.store.locks import FileLock; assert FileLock({str(path)!r}).try_acquire(); "
            f"threading.Thread(target=lambda: (time.sleep(1.5), os._exit(0))).start(); "
            f"print('held', flush=True); ctypes.CDLL(None).syscall({SYS_EXIT}, 0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    deadline = time.time() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline
        time.sleep(0.01)
    assert Path(f"/proc/{proc.pid}/task").is_dir() and len(os.listdir(f"/proc/{proc.pid}/task")) == 2
    return proc


@pytest.mark.skipif(SYS_EXIT is None or not Path("/proc").is_dir(), reason="Linux x86_64/aarch64 thread exit")
def test_a_lock_whose_holder_is_exiting_is_taken_once_its_last_thread_ends(tmp_path):
    """A process killed by SIGKILL is a zombie once its main thread ends; its flock is dropped only when its last
    thread ends (a thread in a slow fsync delays that). Made real here (`exiting_holder`). A plain try_acquire is
    refused; the lock taken for a run waits for the exit and succeeds; a holder that is alive is refused at once."""
    path = tmp_path / "run.lock"
    proc = exiting_holder(path)
    lock = FileLock(path)
    assert not lock.try_acquire()  # the zombie's other thread still holds it
    start = time.monotonic()
    assert lock.try_acquire_after_exit(wait_seconds=20)
    assert 0.2 < time.monotonic() - start < 10
    lock.release()
    proc.wait(timeout=10)

    alive = hold_lock(path)
    try:
        start = time.monotonic()
        assert not FileLock(path).try_acquire_after_exit(wait_seconds=20)
        assert time.monotonic() - start < 1
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.skipif(SYS_EXIT is None or not Path("/proc").is_dir(), reason="Linux x86_64/aarch64 thread exit")
def test_a_rank_lock_whose_holder_is_exiting_does_not_refuse_the_resume(tmp_path):
    """The resume right after a launcher and its workers were killed: a worker's rank lock still held by its last
    thread is waited out, not reported as "still running"; a live holder of a rank lock is refused."""
    out = tmp_path / "out"
    (out / LOCKS_DIR).mkdir(parents=True)
    path = out / LOCKS_DIR / "rank-00001.lock"
    proc = exiting_holder(path)
    assert FileLock(path).held_elsewhere()
    check_no_rank_writing(out)  # waits for the exit instead of raising
    assert not FileLock(path).held_elsewhere() and running_holders(out) == {}
    proc.wait(timeout=10)

    alive = hold_lock(path)
    try:
        with pytest.raises(OutputBusyError, match=f"rank-00001 of an earlier run .* is still running \\(pid {alive.pid} "):
            check_no_rank_writing(out)
        assert list(running_holders(out)) == ["rank-00001"]
        # A live holder whose file names a pid this host does not show (a process in another PID namespace under
        # the same host name: two containers of one pod): refused at once, not waited for as if exiting.
        path.write_text(f"{os.uname().nodename} 4000000\n")
        assert not Path("/proc/4000000").exists()
        start = time.monotonic()
        with pytest.raises(OutputBusyError, match="is still running \\(pid 4000000 "):
            check_no_rank_writing(out)
        assert list(running_holders(out)) == ["rank-00001"] and time.monotonic() - start < 2
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow
def test_a_run_into_a_folder_another_run_holds_is_refused_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    stray = out / "shards" / "rank-00000" / "shard-000000.tar.tmp"  # the other run's shard in the making
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x" * 100)
    holder = hold_lock(out / "locks" / "run.lock")
    try:
        assert main(argv(out)) == EXIT_BAD_RECIPE
        err = capsys.readouterr().err
        assert f"another run is writing into {out} (pid {holder.pid} on " in err
        assert stray.read_bytes() == b"x" * 100  # not cleaned up as "uncommitted"
        assert not (out / "plan.json").exists() and not (out / "index").exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The holder died: the kernel dropped its lock, and the same command now runs (and removes the stray file).
    assert main(argv(out)) == 0
    assert not stray.exists() and check_output(out) == []


def test_an_orphaned_rank_of_an_earlier_run_is_named_and_blocks_the_cleanup(tmp_path, capsys):
    out = tmp_path / "out"
    stray = out / "shards" / "rank-00001" / "shard-000003.tar.tmp"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"y")
    orphan = hold_lock(out / "locks" / "rank-00001.lock")
    try:
        assert main(argv(out)) == EXIT_BAD_RECIPE
        err = capsys.readouterr().err
        assert f"rank-00001 of an earlier run into {out} is still running (pid {orphan.pid} on " in err
        assert stray.exists()
    finally:
        orphan.send_signal(signal.SIGKILL)
        orphan.wait()
    assert main(argv(out)) == 0 and not stray.exists()


@pytest.mark.slow
def test_two_concurrent_extractions_one_runs_the_other_is_refused(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "extract.py", *argv(out)]
    slow = {**env, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 2.0})}  # a slow GPU: 11 batches, ~22 s
    first = subprocess.Popen(cmd, cwd=REPO, env=slow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "plan.json").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)  # the first run is past its start-up
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.poll() is None, "the first run ended before the second was refused: the test proved nothing"
    assert second.returncode == EXIT_BAD_RECIPE and "another run is writing into" in second.stderr
    assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    assert len(raw_records(out)) == 24 and check_output(out) == []
    # the refused run wrote nothing into the running one's log: one start line, no refusal
    log = (out / "logs" / "rank-00000.log").read_text()
    assert log.count(": rank 0 of 1 on cpu") == 1 and "another run is writing" not in log, log[-2000:]


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_dataloader_workers_neither_hold_the_locks_nor_outlive_a_main_process_killed_alone(tmp_path, capsys):
    """The kernel's OOM killer kills the rank's main process only: its DataLoader workers must not keep the output
    locked (every resume would be refused naming the dead pid) and must not linger."""
    from dflash_prep.store.locks import running_holders

    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.5})}
    cmd = [sys.executable, "extract.py", *argv(out, **{"batching.num_workers": 2, "batching.max_tokens_per_batch": 2048})]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        workers: list[int] = []
        while time.time() < deadline and proc.poll() is None and len(workers) < 2:
            workers = children_of(proc.pid)  # the DataLoader's workers, once the loop runs
            time.sleep(0.05)
        assert len(workers) == 2 and proc.poll() is None, "no workers seen while the run ran: nothing proved"
        os.kill(proc.pid, signal.SIGKILL)  # the main process only
        proc.wait(timeout=30)
        deadline = time.time() + 3
        while time.time() < deadline and any(alive(w) for w in workers):
            time.sleep(0.05)
        assert running_holders(out) == {}, "a worker of the killed run still holds the output's locks"
        assert not any(alive(w) for w in workers), "a worker outlived its killed main process"
    finally:
        for pid in [proc.pid, *children_of(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert main(argv(out)) == 0 and len(raw_records(out)) == 24 and check_output(out) == []  # the resume runs


def test_inspect_of_an_unfinished_output_shows_progress_and_whether_it_runs(tmp_path, monkeypatch, capsys):
    from dflash_prep.commands.extract import EXIT_STOPPED
    from dflash_prep.commands.inspect import main as inspect_main
    from dflash_prep.faults import ENV_VAR
    from dflash_prep.store.manifest import read_committed

    out = tmp_path / "out"
    monkeypatch.setenv(ENV_VAR, json.dumps({"enospc_shard": 3}))  # stops after shards 0-2 of one lane
    assert main(argv(out, **{"output.num_writer_threads": 1, "output.max_shard_bytes": "100KB"})) == EXIT_STOPPED
    monkeypatch.delenv(ENV_VAR)
    capsys.readouterr()
    committed = read_committed(out)
    batches = json.loads((out / "plan.json").read_text())["batches"]
    assert inspect_main([str(out), "--json"]) == 0  # a live view, not a failure
    progress = json.loads(capsys.readouterr().out)
    assert progress["finished"] is False and progress["running"] == {}
    assert progress["num_shards"] == len(committed) == 3
    assert progress["num_samples"] == sum(r.num_samples for r in committed) > 0
    assert progress["committed_batches"] == len({b for r in committed for b in r.batch_ids})
    assert progress["planned_batches"] == len(batches) and progress["planned_samples"] == 24
    assert progress["by_rank"]["rank-00000"]["shards"] == 3
    assert all(r.committed_at is not None for r in committed)
    assert progress["samples_per_second_recent"] > 0 and progress["eta_seconds"] is None  # not running: no ETA
    # An interrupted run's rate: its samples over the time from its start to its last commit, however long ago
    # (later inspects give the same), never a span between commits that bunched at the stop.
    stamps = sorted(r.committed_at for r in committed)
    started = json.loads((out / "run_state.json").read_text())["runs"][-1]["started_at"]
    by_hand = sum(r.num_samples for r in committed) / (stamps[-1] - started)
    assert progress["samples_per_second_recent"] == pytest.approx(by_hand)
    assert stamps[0] > started
    index = out / "index" / "rank-00000.jsonl"
    kept = index.read_text()
    lines = [json.loads(line) for line in kept.splitlines()]
    for i, line in enumerate(lines):  # the commits bunched within milliseconds (every lane committing at a stop)
        line["committed_at"] = stamps[-1] - 0.001 * (len(lines) - 1 - i)
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert inspect_main([str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["samples_per_second_recent"] == pytest.approx(by_hand)
    index.write_text(kept)
    monkeypatch.setattr("dflash_prep.commands.inspect.time.time", lambda: stamps[-1] + 600)
    assert inspect_main([str(out), "--json"]) == 0  # a live view, not a failure
    assert json.loads(capsys.readouterr().out)["samples_per_second_recent"] == pytest.approx(by_hand)
    assert inspect_main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "unfinished, not running (interrupted: re-run the same command to resume)" in text
    assert f"{progress['committed_batches']} of {len(batches)} batches committed" in text

    main_proc = hold_lock(out / "locks" / "run.lock")
    rank_proc = hold_lock(out / "locks" / "rank-00000.lock")
    try:
        assert inspect_main([str(out)]) == 0
        text = capsys.readouterr().out
        assert f"unfinished, running now (main process pid {main_proc.pid} on " in text
        assert "1 rank(s) writing)" in text
        assert re.search(r"rate +[\d,.]+ samples/s over the last 15 min of commits; ETA \d+m\d\ds", text), text
    finally:
        for proc in (main_proc, rank_proc):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert inspect_main([str(out), "--check"]) == 2  # what cannot be checked yet is not a pass
    assert "no manifest yet" in capsys.readouterr().err
    assert main(argv(out)) == 0  # the probes took nothing: the resume runs
    assert inspect_main([str(out)]) == 0


def test_inspect_of_a_folder_without_a_run_is_an_error(tmp_path, capsys):
    from dflash_prep.commands.inspect import main as inspect_main

    (tmp_path / "locks").mkdir()  # what a refused start leaves (its locks and logs folders), no run
    (tmp_path / "logs").mkdir()
    assert inspect_main([str(tmp_path)]) == 2
    assert f"manifest.json not found: no extraction has begun in {tmp_path}" in capsys.readouterr().err


# -- several hosts: a shared filesystem whose flock is local to each client ------------------------------------------

OTHER_HOST = REPO / "tests" / "other_host.py"


def on_other_host(host: str, *args: str, **popen) -> subprocess.Popen:
    """A process of `host` (tests/other_host.py: its own hostname, a flock that no other host sees)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO), **popen.pop("env", {})}
    return subprocess.Popen([sys.executable, str(OTHER_HOST), host, *args], cwd=REPO, env=env, **popen)


@pytest.mark.slow
def test_a_run_on_another_host_whose_flock_is_local_is_refused_naming_it(tmp_path, capsys):
    """The first run's flock is invisible here (NFS `local_lock=all`): its lease still refuses the second run, which
    names the other host, its pid and how the lease ends; the first run then finishes intact."""
    out = tmp_path / "out"
    slow = {"DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 1.5})}  # 11 batches, ~17 s
    first = on_other_host("gpu-node-7", "extract.py", *argv(out), env=slow, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "plan.json").exists() and time.time() < deadline and first.poll() is None:
        time.sleep(0.05)
    assert main(argv(out)) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert first.poll() is None, "the first run ended before the second was refused: the test proved nothing"
    assert f"another run is writing into {out}: pid {first.pid} on gpu-node-7" in err, err[-2000:]
    assert "if gpu-node-7 is gone or the process is stopped the lease ends 300 s after the last heartbeat" in err
    assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    assert len(raw_records(out)) == 24 and check_output(out) == []


@pytest.mark.slow
def test_the_lease_of_a_host_that_is_gone_is_taken_over_once_it_lapses(tmp_path, capsys):
    out = tmp_path / "out"
    code = (f"from dflash_prep.store.locks import lock_run; lock = lock_run({str(out)!r}, lease_seconds=4); "
            f"print('held', flush=True); import time; time.sleep(600)")
    holder = on_other_host("gpu-node-3", "-c", code, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)  # the host is gone: no one here can see or stop its pid
    holder.wait()
    died = time.time()
    assert main(argv(out, **{"output.lease_seconds": 4})) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert f"pid {holder.pid} on gpu-node-3" in err and "the lease ends 4 s after the last heartbeat" in err, err
    assert not (out / "plan.json").exists()
    time.sleep(max(0.0, died + 4.5 - time.time()))
    assert main(argv(out, **{"output.lease_seconds": 4})) == 0
    log = (out / "logs" / "rank-00000.log").read_text()
    assert f"took over the lease of run from pid {holder.pid} on gpu-node-3" in log
    assert len(raw_records(out)) == 24 and check_output(out) == []
    assert main(argv(out, **{"output.lease_seconds": 4})) == 0  # released at the end: the next run goes at once


def test_a_holder_frozen_past_its_lease_loses_it_to_the_run_that_took_over(tmp_path):
    """A process stopped longer than its lease (SIGSTOP, a hung mount) finds on its next heartbeat that another run
    took the lease over, and says so (`lost`: the extraction stops at its next batch); generations only grow."""
    from dflash_prep.store.locks import Lease, OutputBusyError

    folder = tmp_path / "locks"
    first = Lease(folder, "run", "aaaaaaaa", lease_seconds=1.0)
    first.acquire()
    first._stop.set()  # frozen: no more heartbeats
    with pytest.raises(OutputBusyError):  # fresh: refused
        Lease(folder, "run", "bbbbbbbb", lease_seconds=1.0).acquire()
    time.sleep(1.2)
    second = Lease(folder, "run", "bbbbbbbb", lease_seconds=1.0)
    second.acquire()
    assert second.generation == first.generation + 1 and second.took_over["run_id"] == "aaaaaaaa"
    assert not first.lost
    first.renew()  # the frozen process runs again
    assert first.lost
    assert json.loads(second.path_of(second.generation).read_text())["run_id"] == "bbbbbbbb"
    taken = second.generation
    second.release()
    third = Lease(folder, "run", "cccccccc", lease_seconds=1.0)
    third.acquire()  # a released lease is taken at once, without a takeover
    assert third.took_over is None and third.generation == taken + 1
    third.release()


def test_a_lease_taken_over_from_a_process_gone_from_this_host_says_so(tmp_path, caplog):
    """A holder of this host that died is taken over at once, well inside its lease: the warning says its process
    is gone, not that its heartbeat is past the lease (it is not)."""
    import logging

    from dflash_prep.store.locks import lock_run

    out = tmp_path / "out"
    code = (f"from dflash_prep.store.locks import lock_run; lock = lock_run({str(out)!r}, lease_seconds=300); "
            f"print('held', flush=True); import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING, logger="dflash_prep"):
        lock = lock_run(out, lease_seconds=300)
    lock.release()
    (line,) = [r.getMessage() for r in caplog.records if "took over the lease" in r.getMessage()]
    assert f"pid {holder.pid}" in line and "its process no longer runs on this host" in line, line
    assert "past its lease" not in line

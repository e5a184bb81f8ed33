"""Two nodes simulated on one host: two `dflash-prep launch --num_machines 2 --machine_rank R` launchers (accelerate's
launcher, the same arguments; gloo on CPU), each starting one process. A node frozen (SIGSTOP) or killed (SIGKILL)
mid-run: the survivor finishes its share, waits at the final meeting point (logging whom it waits for), and ends
with one line naming the lost rank and saying the output is resumable, exit code 1, no traceback; the same command
on the nodes that are left then finishes the job."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, raw_records

from dflash_prep.commands.inspect import check_output

pytestmark = pytest.mark.slow

NUM_SAMPLES = 40
PEER_TIMEOUT_SECONDS = 15
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO),
       "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 1.0})}  # ~12 s of loop per node


def settings(out: Path) -> list[str]:
    return ["--set", f"output.dir={out}", "--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
            "--set", "output.max_shard_bytes=1MB", "--set", "batching.max_tokens_per_batch=2048",
            "--set", f"output.peer_timeout_seconds={PEER_TIMEOUT_SECONDS}"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(out: Path, machine_rank: int, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_prep.commands.launch", "--multi_gpu", "--num_machines", "2",
           "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "extract.py", *settings(out)]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_tree(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def committed_lines(out: Path, rank: int) -> int:
    path = out / "index" / f"rank-{rank:05d}.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def run_until_node_1_commits_then(out: Path, tmp_path: Path, sig: int) -> tuple[subprocess.Popen, str]:
    """Both nodes started; once node 1 committed a shard, `sig` to every process of node 1 (a frozen or dead
    node); -> node 0's launcher, ended, and what it printed."""
    port = free_port()
    node1 = node(out, 1, port, tmp_path / "node1.log")
    node0 = node(out, 0, port, tmp_path / "node0.log")
    deadline = time.time() + 180
    while committed_lines(out, 1) == 0 and time.time() < deadline and node1.poll() is None:
        time.sleep(0.05)
    assert committed_lines(out, 1) >= 1 and node0.poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
    node1_processes = tree(node1.pid)
    assert len(node1_processes) >= 2  # the launcher and its rank
    signal_tree(node1_processes, sig)
    try:
        node0.wait(timeout=PEER_TIMEOUT_SECONDS + 120)
    finally:
        signal_tree(tree(node0.pid), signal.SIGKILL)
        signal_tree(node1_processes, signal.SIGKILL)  # a stopped process dies of SIGKILL too
        node1.wait(timeout=30)
    return node0, (tmp_path / "node0.log").read_text()


def resume_on_one_node(out: Path) -> None:
    env = {k: v for k, v in ENV.items() if k != "DFLASH_PREP_FAULTS"}
    proc = subprocess.run([sys.executable, "extract.py", *settings(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(raw_records(out)) == NUM_SAMPLES and check_output(out) == []


def test_a_frozen_node_ends_the_wait_after_the_peer_timeout_naming_it(tmp_path):
    out = tmp_path / "out"
    node0, printed = run_until_node_1_commits_then(out, tmp_path, signal.SIGSTOP)
    assert node0.returncode == 1, printed[-3000:]
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in printed, printed[-3000:]
    assert "rank 1 was lost while every rank finishes its share of the plan" in errors[0]
    assert f"no sign of it for {PEER_TIMEOUT_SECONDS} s (output.peer_timeout_seconds" in errors[0]
    assert "The output is resumable" in errors[0]
    log = (out / "logs" / "rank-00000.log").read_text()
    assert "waiting for rank 1 since " in log, log[-3000:]
    resume_on_one_node(out)


def test_a_killed_node_is_named_at_once_in_one_line(tmp_path):
    out = tmp_path / "out"
    t0 = time.time()
    node0, printed = run_until_node_1_commits_then(out, tmp_path, signal.SIGKILL)
    assert node0.returncode == 1, printed[-3000:]
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in printed, printed[-3000:]
    assert "rank 1 was lost" in errors[0] and "its connection closed (the process died or its node went down)" \
        in errors[0] and "The output is resumable" in errors[0]
    assert time.time() - t0 < 120
    resume_on_one_node(out)


def test_a_node_that_never_joins_ends_the_launch_after_the_rendezvous_timeout_in_one_line(tmp_path):
    """Node 0 alone: torch elastic's static rendezvous waits `--rdzv_conf timeout=S` (900 s by default) for the other
    node; then one line saying so, exit code 1, nothing written."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "dflash_prep.commands.launch", "--multi_gpu", "--num_machines", "2",
           "--machine_rank", "0", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
           "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--rdzv_conf", "timeout=5",
           "extract.py", *settings(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and time.time() - t0 < 120
    printed = proc.stdout + proc.stderr
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in printed, printed[-3000:]
    assert "the nodes did not all join the launch" in errors[0] and "1/2 clients joined" in errors[0]
    assert "--rdzv_conf timeout=SECONDS" in errors[0]
    assert not out.exists()

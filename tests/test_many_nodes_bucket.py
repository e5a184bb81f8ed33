"""Two nodes simulated on one host into one object-store prefix: two `dflash-prep launch --num_machines 2` launchers
(as tests/test_many_nodes.py starts them), each node with a staging folder of its own, writing into moto's S3 server
on loopback (as tests/test_object_store.py starts it). The main node's waits see the other node's signs of life in
the bucket (its rank lease, its index), so a node slower than `output.peer_timeout_seconds` is waited for; a node
killed mid-run is named in one line; the job resumed by another number of nodes (one) is equal, sample by sample,
member by member, to a local run of the same recipe."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, raw_records
from test_many_nodes import free_port, signal_tree, tree
from test_object_store import BASE_ENV, assert_clean, assert_equal_to, bucket, remote_records, server, store  # noqa: F401

pytestmark = pytest.mark.slow

NUM_SAMPLES = 40
PEER_TIMEOUT_SECONDS = 15


def settings(out: str, staging: Path) -> list[str]:
    return ["--set", f"output.dir={out}", "--set", f"output.staging_dir={staging}",
            "--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
            "--set", "output.max_shard_bytes=1MB", "--set", "batching.max_tokens_per_batch=2048",
            "--set", f"output.peer_timeout_seconds={PEER_TIMEOUT_SECONDS}"]


def env_of(endpoint: str, forward_delay_seconds: float = 0.0) -> dict:
    env = {**BASE_ENV, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(REPO)}
    if forward_delay_seconds:
        env["DFLASH_PREP_FAULTS"] = json.dumps({"forward_delay_seconds": forward_delay_seconds})
    return env


def node(out: str, tmp_path: Path, machine_rank: int, port: int, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_prep.commands.launch", "--multi_gpu", "--num_machines", "2",
           "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
           "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "extract.py",
           *settings(out, tmp_path / f"staging-node{machine_rank}")]
    with open(tmp_path / f"node{machine_rank}.log", "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("local")
    env = {k: v for k, v in BASE_ENV.items() if k != "DFLASH_PREP_FAULTS"}
    proc = subprocess.run([sys.executable, "extract.py", *settings(str(tmp / "out"), tmp / "staging")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = raw_records(tmp / "out")
    assert len(records) == NUM_SAMPLES
    return records


def test_a_node_slower_than_the_peer_timeout_is_waited_for_by_its_signs_in_the_bucket(server, bucket, tmp_path,
                                                                                     local_reference):
    """Node 1 takes ~5 s a forward, node 0 none: node 0 waits for it at the end far longer than the peer timeout;
    node 1's local files are on no folder node 0 reads, so only its lease and index objects keep the wait going."""
    out = f"s3://{bucket}/job"
    port = free_port()
    node1 = node(out, tmp_path, 1, port, env_of(server, forward_delay_seconds=5.0))
    node0 = node(out, tmp_path, 0, port, env_of(server))
    try:
        assert node0.wait(timeout=400) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        signal_tree(tree(node0.pid) + tree(node1.pid), signal.SIGKILL)
    fs = store(server)
    records, manifest = remote_records(fs, f"{bucket}/job")
    fs.invalidate_cache()
    log = fs.cat_file(f"{bucket}/job/logs/rank-00000.log").decode()
    assert "waiting for rank 1 since " in log, log[-3000:]  # it did wait, longer than the timeout, and went on
    assert manifest["num_samples"] == NUM_SAMPLES and len({s["path"].split("/")[1] for s in manifest["shards"]}) == 2
    assert_equal_to(local_reference, records)
    assert_clean(fs, f"{bucket}/job")


def test_a_node_killed_mid_run_then_the_job_resumed_on_one_node_equals_a_local_run(server, bucket, tmp_path,
                                                                                   local_reference):
    out = f"s3://{bucket}/job"
    fs = store(server)
    port = free_port()
    node1 = node(out, tmp_path, 1, port, env_of(server, forward_delay_seconds=1.0))
    node0 = node(out, tmp_path, 0, port, env_of(server, forward_delay_seconds=1.0))
    index1 = f"{bucket}/job/index/rank-00001.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and node1.poll() is None:
        fs.invalidate_cache()
        if fs.exists(index1) and fs.cat_file(index1).count(b"\n") >= 1:
            break
        time.sleep(0.2)
    assert node0.poll() is None and node1.poll() is None, (tmp_path / "node0.log").read_text()[-3000:]
    node1_processes = tree(node1.pid)
    signal_tree(node1_processes, signal.SIGKILL)
    try:
        node0.wait(timeout=PEER_TIMEOUT_SECONDS + 180)
    finally:
        signal_tree(tree(node0.pid) + node1_processes, signal.SIGKILL)
        node1.wait(timeout=30)
    printed = (tmp_path / "node0.log").read_text()
    errors = [line for line in printed.splitlines() if line.startswith("error:")]
    assert node0.returncode == 1 and len(errors) == 1 and "Traceback" not in printed, printed[-3000:]
    assert "rank 1 was lost" in errors[0] and "The output is resumable" in errors[0]
    assert f"(details in {tmp_path / 'staging-node0' / 'logs'})" in errors[0]  # a folder, not a mangled URL
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/job/manifest.json")
    # the same job on one node (one process), its own staging folder
    proc = subprocess.run([sys.executable, "extract.py", *settings(out, tmp_path / "staging-resume")], cwd=REPO,
                          env=env_of(server), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records, manifest = remote_records(fs, f"{bucket}/job")
    assert manifest["num_samples"] == NUM_SAMPLES
    assert_equal_to(local_reference, records)
    assert_clean(fs, f"{bucket}/job")

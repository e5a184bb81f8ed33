"""Kill a regeneration anywhere, re-run the same command: every row answered exactly once, the output equal to an
uninterrupted run's. SIGKILL at seeded random moments and SIGTERM (1 process), a 2-process run killed and finished
by 1 process, and a server that dies mid-run (exit code 1, then a resume against the server back completes it).
The server is a real `transformers serve` (regen_server.py); greedy decoding, so the text is a function of the
prompt."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from regen_server import (
    REPO,
    Server,
    free_port,
    kill_tree,
    rows_of,
    save_tiny_model,
    start_and_wait,
)

from dflash_prep.commands.regenerate import main as regenerate_main
from dflash_prep.regen.output import read_committed

pytestmark = pytest.mark.slow

NUM_ROWS = 30  # with one request at a time, long enough that a kill after the first commits lands mid-run
ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Say something about the number {i}."}]
         + ([{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And again?"},
             {"role": "assistant", "content": "fine"}] if i % 3 == 0 else [])} for i in range(NUM_ROWS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("regen-resume") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    server = Server(model_dir).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen-resume-data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def args(model_dir: Path, base_url: str, data: Path, out: Path, **sets) -> list[str]:
    keys = {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(model_dir),
            "data.path": str(data), "output.dir": str(out.parent / f"{out.name}-states"),
            "regenerate.output_dir": str(out), "regenerate.engine": "openai", "regenerate.base_urls": f"[{base_url}]",
            "regenerate.max_tokens": 4, "regenerate.turns": "all", "regenerate.rows_per_shard": 2,
            "regenerate.max_concurrency": 1, "regenerate.max_retries": 1, "regenerate.retry_backoff_seconds": 0.1,
            **sets}
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def regenerate_cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_prep.commands.regenerate", *argv]


def launch_2proc_cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "dflash_prep.commands.regenerate", *argv]


@pytest.fixture(scope="module")
def reference(server, model_dir, data, tmp_path_factory) -> list[dict]:
    """An uninterrupted run's rows."""
    out = tmp_path_factory.mktemp("regen-reference") / "out"
    assert regenerate_main(args(model_dir, server.base_url, data, out)) == 0
    rows = rows_of(out)
    assert [r["source_row"] for r in rows] == list(range(NUM_ROWS))
    return rows


def check_exactly_once(out: Path, reference: list[dict]) -> None:
    committed = read_committed(out)
    positions = [p for r in committed.values() for p in r.rows]
    assert sorted(positions) == list(range(NUM_ROWS))  # each row once, none lost
    assert rows_of(out) == reference
    assert not list((out / "data").glob("*.tmp"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_answered"] == NUM_ROWS and summary["num_requests"] >= NUM_ROWS


def test_sigkill_anywhere_then_resume_equals_an_uninterrupted_run(server, model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = args(model_dir, server.base_url, data, out)
    rng = random.Random(21)
    for _ in range(2):
        proc = start_and_wait(regenerate_cmd(argv), out, new_commits=rng.randint(1, 2))
        time.sleep(rng.uniform(0.0, 0.4))  # a kill mid-request, mid-write or mid-commit
        kill_tree(proc)
        committed = read_committed(out)
        assert len(committed) < NUM_ROWS // 2, "the run finished before the kill: make it longer"
        positions = [p for r in committed.values() for p in r.rows]
        assert len(positions) == len(set(positions))
    assert regenerate_main(argv) == 0  # the resume, in this process
    check_exactly_once(out, reference)


def test_sigterm_stops_with_exit_code_1_and_the_resume_completes(server, model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = args(model_dir, server.base_url, data, out)
    proc = start_and_wait(regenerate_cmd(argv), out, new_commits=1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped on SIGTERM" in errors[0] and "re-run the same command" in errors[0]
    assert not (out / "state.json").exists()  # not a dataset until it is finished
    assert regenerate_main(argv) == 0  # the resume, in this process
    check_exactly_once(out, reference)


def test_a_server_that_dies_mid_run_stops_it_resumably(model_dir, data, reference, tmp_path):
    port = free_port()
    server = Server(model_dir, port=port, log_path=tmp_path / "serve.log").start()
    out = tmp_path / "out"
    argv = args(model_dir, server.base_url, data, out)
    try:
        proc = start_and_wait(regenerate_cmd(argv), out, new_commits=1)
        server.stop()  # SIGKILL: connections refused from now on
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-2000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "every server is down" in errors[0], err[-2000:]
        assert "Traceback" not in err
        server = Server(model_dir, port=port, log_path=tmp_path / "serve.log").start()
        assert regenerate_main(argv) == 0
    finally:
        server.stop()
    check_exactly_once(out, reference)


def test_two_processes_killed_then_finished_by_one(server, model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = args(model_dir, server.base_url, data, out)
    proc = start_and_wait(launch_2proc_cmd(argv), out, new_commits=2, timeout=300)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not all(
            (out / "index" / f"rank-{r:05d}.jsonl").is_file() for r in (0, 1)):
        time.sleep(0.02)  # until each process has committed a chunk of its own
    kill_tree(proc)
    committed = read_committed(out)
    assert 0 < len(committed) < NUM_ROWS // 2
    assert {r.rank for r in committed.values()} == {0, 1}  # both processes committed chunks of their own
    assert regenerate_main(argv) == 0  # the resume, in this process
    check_exactly_once(out, reference)


def test_a_process_slow_to_read_the_index_takes_the_same_share(server, model_dir, data, reference, tmp_path):
    """A 1-process run killed after its first commits, resumed by two processes where process 1 reads the index
    6 s after process 0 (a process slow to start): both take their share of one todo list, so process 0's new
    chunks shift neither process onto the other's rows (answered twice) nor away from rows (never answered)."""
    out = tmp_path / "out"
    argv = args(model_dir, server.base_url, data, out)
    kill_tree(start_and_wait(regenerate_cmd(argv), out, new_commits=1))
    assert 0 < len(read_committed(out)) < NUM_ROWS // 2
    slow = json.dumps({"plan_delay_seconds": 6, "plan_delay_process": 1})
    proc = subprocess.run(launch_2proc_cmd(argv), cwd=REPO, env={**os.environ, "DFLASH_PREP_FAULTS": slow},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_exactly_once(out, reference)

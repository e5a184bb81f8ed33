"""A follow-mode reader under faults: DataLoader workers (3) beside a real extraction that is SIGKILLed, has
committed shards damaged (shards the follower had already yielded), and is resumed, which redoes them into new
shards; every sample is yielded exactly once across the workers, and `num_samples`/`len()` answer once the manifest
exists. A follower on an output no run holds says so and ends after `unheld_timeout_seconds` with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

NUM_SAMPLES = 40
SETTINGS = ["--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
            "--set", "batching.max_tokens_per_batch=2048", "--set", "output.max_shard_bytes=50KB",
            "--set", "output.num_writer_threads=1"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1",
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("DFLASH_PREP_FAULTS", None)

FOLLOWER = """
import json, sys
from torch.utils.data import DataLoader
from dflash_prep.consume.reader import ShardDataset
ds = ShardDataset(sys.argv[1], follow=True, poll_seconds=0.2)
loader = DataLoader(ds, batch_size=None, num_workers=3, multiprocessing_context="fork")
with open(sys.argv[2], "w") as f:
    for s in loader:
        f.write(json.dumps(s["sample_id"]) + "\\n")
        f.flush()
print(json.dumps({"num_samples": ds.num_samples, "len": len(ds)}))
"""


def extract_cmd(out: Path) -> list[str]:
    return [sys.executable, "extract.py", "--set", f"output.dir={out}", *SETTINGS]


def committed(out: Path) -> list[dict]:
    index = out / "index"
    return [json.loads(line) for p in sorted(index.glob("rank-*.jsonl")) if index.is_dir()
            for line in p.read_text().splitlines() if line.strip()] if index.is_dir() else []


def seen(path: Path) -> list[str]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_workers_yield_each_sample_once_while_a_resume_redoes_damaged_shards(tmp_path):
    out, seen_file = tmp_path / "out", tmp_path / "seen.jsonl"
    run = subprocess.Popen(extract_cmd(out), cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           env={**ENV, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.4})})
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(out), str(seen_file)], cwd=REPO, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and run.poll() is None:
            yielded = set(seen(seen_file))
            done = [r for r in committed(out) if set(r["sample_ids"]) <= yielded]
            if len(done) >= 4:
                break
            time.sleep(0.1)
        assert run.poll() is None, "the extraction ended before the kill"
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
        time.sleep(2)  # the follower's workers finish the shards they were reading
        yielded = set(seen(seen_file))
        damaged = [r for r in committed(out) if set(r["sample_ids"]) <= yielded][:4]
        assert len(damaged) == 4
        for record in damaged:  # yielded already, now damaged on disk: the resume redoes them into new shards
            path = out / record["path"]
            path.write_bytes(path.read_bytes()[:-512])
        resume = subprocess.run(extract_cmd(out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
        assert resume.returncode == 0, resume.stderr[-3000:]
        assert "is damaged" in resume.stderr  # it did redo them
        stdout, stderr = follower.communicate(timeout=300)
    finally:
        for proc in (run, follower):
            if proc.poll() is None:
                proc.kill()
    ids = seen(seen_file)
    manifest = json.loads((out / "manifest.json").read_text())
    redone = {s for r in damaged for s in r["sample_ids"]}
    twice = sorted({s for s in ids if ids.count(s) > 1})
    assert not twice, f"yielded twice: {twice} (redone: {sorted(redone)})"
    assert follower.returncode == 0, stderr[-3000:]
    assert len(ids) == manifest["num_samples"] == NUM_SAMPLES
    assert {r["path"] for r in damaged}.isdisjoint(s["path"] for s in manifest["shards"])  # new shards hold them
    assert json.loads(stdout.strip().splitlines()[-1]) == {"num_samples": NUM_SAMPLES, "len": NUM_SAMPLES}


def test_a_follower_of_an_output_no_run_holds_says_so_and_ends(tmp_path):
    """An output whose run died (a folder with its run state, committed shards and a lease whose holder is gone,
    never resumed): the follower yields what is committed, warns that no run holds it, and ends with
    OutputNotHeldError after `unheld_timeout_seconds`, one line."""
    out = tmp_path / "out"
    run = subprocess.Popen(extract_cmd(out), cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL,
                           env={**ENV, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.4})})
    try:
        deadline = time.time() + 300
        while time.time() < deadline and run.poll() is None and len(committed(out)) < 2:
            time.sleep(0.1)
        assert run.poll() is None
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=60)
    script = ("import logging, sys, time\nfrom dflash_prep.consume.reader import ShardDataset, OutputNotHeldError\n"
              "logging.basicConfig(format='%(levelname)s %(message)s')\n"
              "t = time.monotonic(); n = 0\n"
              "try:\n"
              "    for s in ShardDataset(sys.argv[1], follow=True, poll_seconds=0.2, unheld_timeout_seconds=5):\n"
              "        n += 1\n"
              "except OutputNotHeldError as e:\n"
              "    print(n, round(time.monotonic() - t), str(e), sep='|')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(out)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    n, elapsed, message = proc.stdout.strip().split("|")
    assert int(n) == sum(r["num_samples"] for r in committed(out))
    assert int(elapsed) < 60 and "no extraction has held this output" in message and "\n" not in message
    warnings = [line for line in proc.stderr.splitlines() if "no extraction holds this output" in line]
    assert len(warnings) == 1, proc.stderr


def test_a_batch_committed_by_two_runs_is_read_once(tmp_path):
    """A run frozen past its lease commits a batch late while the run that took over redoes it (two index lines of
    two fencing tokens holding the same plan batch, each its own shard, read by two different DataLoader workers
    of the follower). The batch's samples are yielded once across the workers, and the manifest ends it."""
    import shutil

    from dflash_prep.consume.follow import consumer_of

    out, seen_file = tmp_path / "out", tmp_path / "seen.jsonl"
    proc = subprocess.run(extract_cmd(out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = (out / "manifest.json").read_bytes()
    (out / "manifest.json").unlink()
    index = sorted((out / "index").glob("rank-*.jsonl"))[0]
    first = json.loads(index.read_text().splitlines()[0])
    late_path = next(p for n in range(100) if consumer_of(p := first["path"].replace(".tar", f"-late{n}.tar"), 3)
                     != consumer_of(first["path"], 3))  # another worker's shard
    late = dict(first, path=late_path, fence=(first.get("fence") or 0) + 1)
    shutil.copy(out / first["path"], out / late["path"])
    with open(index, "a") as f:
        f.write(json.dumps(late) + "\n")
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, str(out), str(seen_file)], cwd=REPO, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # every worker polls the index with both lines (every 0.2 s) before the manifest ends the iteration (what
        # the workers yielded may reach the main process only then: DataLoader takes them in worker order)
        time.sleep(8)
        (out / "manifest.json").write_bytes(manifest)
        stdout, stderr = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, stderr[-3000:]
    ids = seen(seen_file)
    twice = sorted({s for s in ids if ids.count(s) > 1})
    assert not twice, f"yielded twice: {twice}"
    assert len(ids) == NUM_SAMPLES and set(ids) == {s for r in committed(out) for s in r["sample_ids"]}


@pytest.mark.parametrize("where", ["two rank files", "one rank file, the late host's clock behind"])
def test_a_batch_committed_twice_and_met_in_one_poll_is_not_read_twice(where, tmp_path):
    """The same plan batch committed twice: first by one run, then by another (a run that froze past its lease
    committing late, or the run that took over). Two rank files: the first commit at t=100 into `rank-00001.jsonl`,
    the second at t=200 into `rank-00000.jsonl`, which sorts first. One rank file (both runs' rank 0): the second
    line stamped 150 by a host whose clock is behind, though it landed after the one stamped 200. Consumer 0 of 2
    polls between the two commits and reads the first record's shard; consumer 1 polls once after both and owns the
    second record's shard: it must meet the first commit first, leaving its own shard's copies out. Index lines and
    the run's layout only: the follower yields shards without opening them."""
    from dflash_prep.consume.follow import consumer_of, follow_shards

    out = tmp_path / "out"
    (out / "index").mkdir(parents=True)
    (out / "run_state.json").write_text(json.dumps({"identity": {"layer_ids": [1], "hidden_size": 8,
                                                                 "dtype": "bfloat16"}}))
    one_file = where.startswith("one")
    first_rank, second_rank = ("rank-00000", "rank-00000") if one_file else ("rank-00001", "rank-00000")
    first = next(p for n in range(100) if consumer_of(p := f"shards/{first_rank}/shard-{n:06d}.tar", 2) == 0)
    second = next(p for n in range(100) if consumer_of(p := f"shards/{second_rank}/shard-{n:06d}.tar", 2) == 1
                  and p != first)
    samples = [f"s{i}" for i in range(4)]

    def line(path: str, at: float, fence: int) -> str:
        return json.dumps({"path": path, "num_samples": 4, "num_tokens": 40, "num_bytes": 1000, "sha256": path,
                           "batch_ids": [7], "sample_ids": samples, "committed_at": at, "fence": fence}) + "\n"

    def read_until_quiet(consumer: int) -> list[str]:
        got = []
        try:
            for shard, _, wanted in follow_shards(out, consumer, 2, poll_seconds=0.05, timeout_seconds=0.5,
                                                  unheld_timeout_seconds=None):
                assert wanted is None  # the whole shard (nothing of it was read before)
                got.append(shard.rel_path)
        except TimeoutError:
            pass
        return got

    with open(out / "index" / f"{first_rank}.jsonl", "a") as f:
        f.write(line(first, 200.0 if one_file else 100.0, 2 if one_file else 1))
    assert read_until_quiet(0) == [first]
    with open(out / "index" / f"{second_rank}.jsonl", "a") as f:
        f.write(line(second, 150.0 if one_file else 200.0, 1 if one_file else 2))
    assert read_until_quiet(1) == []

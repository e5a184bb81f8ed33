"""Resume after hard kills: SIGKILL `python extract.py` at random (seeded) moments, re-run, and the result equals
an uninterrupted run's, sample for sample and byte for byte; the same for a 2-process run resumed as 1 process.

Each killed run leaves what a dead node leaves (committed shards, maybe a `.tmp` shard, maybe a shard renamed
but not yet in the index); the next run must discard exactly the uncommitted part and redo only what is missing.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cpu_2proc_config, raw_records
from processes import kill_tree
from safetensors.numpy import load_file

from dflash_prep.commands.inspect import check_output, unlisted_shard_files
from dflash_prep.store.manifest import read_committed

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("DFLASH_PREP_FAULTS", None)
NUM_SAMPLES = 150
# 23 batches in ~22 small shards (about one batch each, over the demo recipe's 2 writer lanes), so a kill has many
# commit points to land between, and often finds shards half written (.tmp).
COMMON = ["--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
          "--set", "batching.max_tokens_per_batch=4096", "--set", "output.max_shard_bytes=1MB"]
MEMBERS = ("input_ids.npy", "loss_mask.npy", "hidden_states.safetensors", "meta.json")


def extract_cmd(out: Path) -> list[str]:
    return [sys.executable, "extract.py", "--set", f"output.dir={out}", *COMMON]


def launch_2proc_cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            cpu_2proc_config(), "extract.py", "--set", f"output.dir={out}", *COMMON]


def count_in_logs(out_dir: Path, text: str, ranks: int) -> list[int]:
    counts = []
    for r in range(ranks):
        path = out_dir / "logs" / f"rank-{r:05d}.log"
        counts.append(path.read_text().count(text) if path.exists() else 0)
    return counts


def state_of(out_dir: Path) -> dict:
    shard_files = sorted(p for p in (out_dir / "shards").glob("rank-*/*")) if (out_dir / "shards").exists() else []
    committed = read_committed(out_dir)
    listed = {str(out_dir / r.path) for r in committed}
    return {"committed_shards": len(committed), "committed_samples": sum(r.num_samples for r in committed),
            "tmp_files": sum(p.name.endswith(".tmp") for p in shard_files),
            "unindexed_shards": sum(p.suffix == ".tar" and str(p) not in listed for p in shard_files),
            "finished": (out_dir / "manifest.json").exists()}


def index_lines(out_dir: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (out_dir / "index").glob("rank-*.jsonl"))


def run_and_kill(cmd: list[str], out_dir: Path, new_shards: int, jitter: float) -> dict:
    """Start `cmd`, wait until it has committed `new_shards` more shards (all ranks together), sleep `jitter`
    seconds (so the kill lands anywhere: in a forward, mid-write, mid-commit), then SIGKILL it and its children."""
    before = index_lines(out_dir) if (out_dir / "index").exists() else 0
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (out_dir / "index").exists() and index_lines(out_dir) >= before + new_shards:
            break
        time.sleep(0.02)
    time.sleep(jitter)
    exited = proc.poll()
    kill_tree(proc)
    return {"after_new_shards": new_shards, "jitter_s": round(jitter, 3), "exited_before_kill": exited,
            **state_of(out_dir)}


@pytest.fixture(scope="module")
def reference_out(tmp_path_factory) -> Path:
    """An uninterrupted run of the same command."""
    out = tmp_path_factory.mktemp("reference") / "out"
    proc = subprocess.run(extract_cmd(out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def reference(reference_out) -> dict[str, dict[str, bytes]]:
    records = raw_records(reference_out)
    assert len(records) == NUM_SAMPLES
    assert len(json.loads((reference_out / "manifest.json").read_text())["shards"]) >= 8
    return records


def finish_and_compare(out: Path, reference: dict, cmd: list[str] | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd or extract_cmd(out), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = raw_records(out)
    assert set(records) == set(reference), "the sample ids differ from an uninterrupted run"
    for key, members in reference.items():
        for member in MEMBERS:
            assert records[key][member] == members[member], f"{key}.{member} differs from an uninterrupted run"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == NUM_SAMPLES and manifest["num_failed"] == 0
    assert not list(out.rglob("*.tmp")), "a temporary file survived"
    assert unlisted_shard_files(out) == [], "a shard file the manifest does not list survived"
    assert check_output(out) == []  # `inspect --check`: sizes, hashes, counts, invariants
    # The draft vocabulary's frequencies cover exactly the written samples, whatever the kills and rank counts.
    stored = load_file(str(out / "token_freq.safetensors"))["token_freq"]
    expected = Counter(int(t) for m in reference.values()
                       for t in np.load(io.BytesIO(m["input_ids.npy"]))[np.load(io.BytesIO(m["loss_mask.npy"])) == 1])
    assert {int(t): int(stored[t]) for t in np.flatnonzero(stored)} == dict(expected)
    return proc


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
    """A crash in the narrowest window of a commit (fault hook: the process dies right after a shard's rename,
    before its index line), then three SIGKILLs at random (seeded) points, then a run to the end."""
    out = tmp_path / "out"
    rng = random.Random(20261129)
    crash_shard = rng.randint(1, 4)
    proc = subprocess.run(extract_cmd(out), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**ENV, "DFLASH_PREP_FAULTS": json.dumps({"exit_after_rename_shard": crash_shard})})
    crash = {"exit_after_rename_shard": crash_shard, "returncode": proc.returncode, **state_of(out)}
    # The renamed shard has no index line; the other writer lanes may hold committed shards and open .tmp ones.
    assert proc.returncode == 137 and crash["unindexed_shards"] == 1 and crash["committed_shards"] >= 0
    kills = [run_and_kill(extract_cmd(out), out, new_shards=rng.randint(1, 3), jitter=rng.uniform(0.0, 0.3))
             for _ in range(3)]
    print("\n1 process:", crash, *kills, sep="\n  ")
    assert all(not k["finished"] and k["exited_before_kill"] is None for k in kills), "a run ended before its kill"
    proc = finish_and_compare(out, reference)
    assert "resume:" in proc.stderr
    log = (out / "logs" / "rank-00000.log").read_text()
    # the first resume removed exactly what the crash left uncommitted: the renamed-but-unindexed shard + .tmp files
    first_removal = re.search(r"removed (\d+) uncommitted file\(s\)", log)
    assert first_removal and int(first_removal.group(1)) == crash["unindexed_shards"] + crash["tmp_files"]


@pytest.mark.slow
def test_two_processes_killed_then_resumed_as_one(tmp_path, reference):
    """8 -> 4 GPUs in small: `accelerate launch` with 2 processes killed mid-run, finished by plain `python`."""
    out = tmp_path / "out"
    rng = random.Random(7)
    kill = run_and_kill(launch_2proc_cmd(out), out, new_shards=rng.randint(2, 4), jitter=rng.uniform(0.0, 0.3))
    ranks_with_shards = {Path(r.path).parent.name for r in read_committed(out)}
    print("\n2 processes:", kill, "ranks with committed shards:", sorted(ranks_with_shards))
    assert not kill["finished"] and kill["exited_before_kill"] is None and kill["committed_shards"] > 0
    finish_and_compare(out, reference)
    manifest = json.loads((out / "manifest.json").read_text())
    # The shards the 2-process run committed are kept; the 1-process run added the rest under rank-00000.
    assert ranks_with_shards <= {Path(s["path"]).parent.name for s in manifest["shards"]}
    assert json.loads((out / "summary.json").read_text())["num_ranks"] == 1


@pytest.mark.slow
def test_one_process_crashed_then_resumed_as_two(tmp_path, reference):
    """4 -> 8 GPUs in small (more replicas on resume): the plan is global, so the 2-process run splits what the
    crashed 1-process run did not commit, and the result equals an uninterrupted run's."""
    out = tmp_path / "out"
    proc = subprocess.run(extract_cmd(out), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**ENV, "DFLASH_PREP_FAULTS": json.dumps({"exit_after_rename_shard": 3})})
    assert proc.returncode == 137 and not state_of(out)["finished"]
    committed_before = {r.path for r in read_committed(out)}
    assert committed_before and {Path(p).parent.name for p in committed_before} == {"rank-00000"}
    finish_and_compare(out, reference, launch_2proc_cmd(out))
    manifest = json.loads((out / "manifest.json").read_text())
    assert committed_before <= {s["path"] for s in manifest["shards"]}  # kept, not redone
    assert {Path(s["path"]).parent.name for s in manifest["shards"]} == {"rank-00000", "rank-00001"}
    assert json.loads((out / "summary.json").read_text())["replicas"]["num_replicas"] == 2


@pytest.mark.slow
def test_resuming_into_another_jobs_output_names_what_differs(tmp_path, reference_out, capsys):
    """No silent mixing: each content-deciding change is refused, naming the key, before any model loads."""
    from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main

    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(REPO / "dflash_prep" / "demo" / "tiny-demo" / "tokenizer", tokenizer)
    with open(tokenizer / "chat_template.jinja", "a") as f:
        f.write("{# another template #}")
    data = tmp_path / "data.jsonl"
    shutil.copy(REPO / "dflash_prep" / "demo" / "tiny-demo" / "data" / "conversations.jsonl", data)
    base = ["--set", f"output.dir={reference_out}", *COMMON]
    before = sorted(p.name for p in reference_out.rglob("*") if "locks" not in p.parts)
    for override, named in [
        ("data.max_length=512", "data.max_length: output has 2048, this run has 512"),
        ("layers.num_layers=2", "layer_ids: output has [1, 3, 5], this run has [1, 5]"),
        ("output.dtype=float32", "dtype: output has 'bfloat16', this run has 'float32'"),
        ("model.init_seed=1", "model fingerprint differs"),
        (f"model.tokenizer={tokenizer}", "tokenizer fingerprint differs"),
        (f"data.path={data}", "data.path: output has"),
    ]:
        assert main([*base, "--set", override]) == EXIT_BAD_RECIPE, override
        err = capsys.readouterr().err
        assert named in err and "--set output.overwrite=true" in err, (override, err[-500:])
    assert sorted(p.name for p in reference_out.rglob("*") if "locks" not in p.parts) == before  # nothing touched
    log = (reference_out / "logs" / "rank-00000.log").read_text()
    assert log.count("model loaded") == 1  # only the reference run's own


@pytest.mark.slow
def test_overwrite_starts_afresh_on_purpose(tmp_path, reference_out):
    from dflash_prep.commands.extract import main

    out = tmp_path / "out"
    shutil.copytree(reference_out, out)
    assert main(["--set", f"output.dir={out}", *COMMON, "--set", "data.max_samples=20",
                 "--set", "layers.num_layers=2", "--set", "output.overwrite=true"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer_ids"] == [1, 5] and manifest["num_samples"] == 20
    assert unlisted_shard_files(out) == [] and check_output(out) == []  # no shard of the old job is left


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_a_stop_signal_commits_the_batches_in_flight_and_the_resume_completes(tmp_path, reference, sig):
    """A scheduler's SIGTERM (or Ctrl-C) mid-run: the run stops at the next batch boundary, writes and commits what
    it captured (nothing half written is left), exits 1 with a message; re-running finishes the job exactly."""
    out = tmp_path / "out"
    cmd = extract_cmd(out) + ["--set", "batching.num_workers=2"]  # workers must not die of the signal
    slow = {**ENV, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.3})}
    proc = subprocess.Popen(cmd, cwd=REPO, env=slow, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (out / "index").exists() and index_lines(out) >= 2:
            break  # two shards committed
        time.sleep(0.02)
    time.sleep(0.4)  # mid-way through a forward
    assert proc.poll() is None, "the run ended before the signal: the test proved nothing"
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    state = state_of(out)
    assert proc.returncode == 1, err[-2000:]
    assert f"stopped on {sig.name}" in err and "re-run the same command to resume" in err and "Traceback" not in err
    assert state["tmp_files"] == 0 and state["unindexed_shards"] == 0 and not state["finished"]
    committed = read_committed(out)
    done = {b for r in committed for b in r.batch_ids}
    log = (out / "logs" / "rank-00000.log").read_text()
    written_this_run = int(re.search(r"(\d+) batch\(es\) of this run were written and committed", log).group(1))
    assert written_this_run == len(done) > 0  # every batch it captured was committed: none to redo
    finish_and_compare(out, reference)


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_cleanly(tmp_path, reference):
    """`accelerate launch` (2 processes) gets SIGTERM: it passes it to its workers, each commits what it captured
    and stops; nothing half written is left, and a 1-process re-run finishes the job exactly."""
    out = tmp_path / "out"
    slow = {**ENV, "DFLASH_PREP_FAULTS": json.dumps({"forward_delay_seconds": 0.3})}
    proc = subprocess.Popen(launch_2proc_cmd(out), cwd=REPO, env=slow, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if (out / "index").exists() and index_lines(out) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before the signal: the test proved nothing"
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode != 0
    # one line for the job, with one count: every rank's commits (rank 1 says its own in its log)
    assert err.count("stopped on SIGTERM: every rank committed the batches") == 1, err[-3000:]
    assert "rank 1 stopped on SIGTERM" in (out / "logs" / "rank-00001.log").read_text()
    (said,) = re.findall(r"(\d+) samples committed in all;", err)
    committed = sum(json.loads(line)["num_samples"] for index in sorted((out / "index").glob("rank-*.jsonl"))
                    for line in index.read_text().splitlines() if line.strip())
    assert int(said) == committed > 0
    state = state_of(out)
    assert state["tmp_files"] == 0 and state["unindexed_shards"] == 0 and not state["finished"]
    finish_and_compare(out, reference)


@pytest.mark.slow
def test_a_rank_slow_to_read_the_committed_shards_takes_the_same_share(tmp_path, reference):
    """Resumed as two processes where process 1 reads the index 6 s after process 0 (a rank slow to start): the
    shares come from one committed set, so process 0's new shards do not shift process 1's share onto batches
    process 0 is doing (duplicates) or away from batches no one then does (gaps)."""
    out = tmp_path / "out"
    proc = subprocess.run(extract_cmd(out), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**ENV, "DFLASH_PREP_FAULTS": json.dumps({"exit_after_rename_shard": 3})})
    assert proc.returncode == 137 and not state_of(out)["finished"]
    slow = {**ENV, "DFLASH_PREP_FAULTS": json.dumps({"plan_delay_seconds": 6, "plan_delay_process": 1})}
    proc = subprocess.run(launch_2proc_cmd(out), cwd=REPO, env=slow, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finish_and_compare(out, reference)  # finished: nothing left to run, and every sample once, as the reference

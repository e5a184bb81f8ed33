"""Fault injection (DFLASH_PREP_FAULTS, dflash_prep/faults.py): OOM in the forward, NaN in the states, a full
disk while a shard is written. The model, the forward, the writer and the commit all run for real; the hook only
raises the error (or writes the NaN) where the spec says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import demo_overrides, raw_records
from safetensors.torch import load as safetensors_load

from dflash_prep.commands.extract import EXIT_FAILED_SAMPLES, EXIT_STOPPED, main
from dflash_prep.commands.inspect import check_output, unlisted_shard_files
from dflash_prep.faults import ENV_VAR, Faults
from dflash_prep.store.manifest import read_committed, repair_indexes
from dflash_prep.target.backoff import FAIL_NON_FINITE, FAIL_OOM, is_oom

SETTINGS = {"data.max_samples": 64, "batching.num_workers": 0, "batching.max_tokens_per_batch": 2048,
            "output.max_shard_bytes": "1MB"}


def argv(out: Path, **extra) -> list[str]:
    return [a for kv in demo_overrides(out, **{**SETTINGS, **extra}) for a in ("--set", kv)]


def states(member: bytes) -> torch.Tensor:
    return safetensors_load(member)["hidden_states"].float()


def failed_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "failed.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A run without faults: its plan and its records (this process, so bytes compare exactly)."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(argv(out)) == 0
    plan = json.loads((out / "plan.json").read_text())["batches"]  # [[padded_length, [row indices]]]
    return {"out": out, "plan": plan, "records": raw_records(out)}


def test_no_faults_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert Faults.from_env() is None
    monkeypatch.setenv(ENV_VAR, json.dumps({"oom_batch": [1]}))  # misspelt key
    with pytest.raises(ValueError, match="oom_batches"):
        Faults.from_env()


def test_oom_detection():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(ValueError("out of memory"))


def _sid(row: int) -> str:
    return f"{row:010d}"


def test_oom_splits_the_batch_lowers_the_budget_and_fails_only_what_does_not_fit_alone(
        tmp_path, monkeypatch, capsys, clean):
    plan = clean["plan"]
    # A padded length with several batches: OOM on the first, the next one of that length must be pre-split.
    by_length: dict[int, list[int]] = {}
    for b, (T, rows) in enumerate(plan):
        by_length.setdefault(T, []).append(b)
    T, (first, second, *_) = next((T, bs) for T, bs in by_length.items()
                                  if len(bs) >= 2 and len(plan[bs[0]][1]) >= 3 and len(plan[bs[1]][1]) >= 3)
    # Samples that do not fit even alone: one in a multi-sample batch, and the only sample of a batch of one.
    multi = next(b for b, (_, rows) in enumerate(plan) if len(rows) >= 2 and b not in (first, second))
    single = next(b for b, (_, rows) in enumerate(plan) if len(rows) == 1)
    too_big = [_sid(plan[multi][1][-1]), _sid(plan[single][1][0])]
    monkeypatch.setenv(ENV_VAR, json.dumps({"oom_batches": [first], "oom_samples": too_big}))
    out = tmp_path / "out"
    assert main(argv(out)) == EXIT_FAILED_SAMPLES  # the run goes on to the end; the exit code reports failures
    err = capsys.readouterr().err
    cap = (len(plan[first][1]) + 1) // 2
    assert f"batch {first}: out of memory on {len(plan[first][1])} x {T}" in err
    assert f"later batches of padded length {T} run at most {cap} samples" in err
    assert f"batch {second} ({len(plan[second][1])} x {T}): pre-split" in err
    for sid in too_big:
        assert f"sample {sid}" in err and "does not fit in memory even alone" in err
    assert "2 sample(s) failed {'out_of_memory': 2}" in err

    manifest = json.loads((out / "manifest.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert manifest["num_failed"] == summary["num_failed"] == 2 and manifest["failed"] == {FAIL_OOM: 2}
    assert manifest["num_samples"] == manifest["num_rows"] - manifest["num_skipped"] - manifest["num_failed"] == 62
    assert sorted(f["sample_id"] for f in failed_lines(out)) == sorted(too_big)
    assert {f["reason"] for f in failed_lines(out)} == {FAIL_OOM}
    assert summary["ranks"][0]["oom_batch_caps"][str(T)] == cap
    assert check_output(out) == []
    # Every other sample is written, with the states it gets unsplit (up to the kernels' batch-size noise).
    got = raw_records(out)
    assert set(got) == set(clean["records"]) - set(too_big)
    for key, members in got.items():
        assert members["input_ids.npy"] == clean["records"][key]["input_ids.npy"]
        torch.testing.assert_close(states(members["hidden_states.safetensors"]),
                                   states(clean["records"][key]["hidden_states.safetensors"]), atol=2e-2, rtol=2e-2)
    # The batch whose only sample failed is committed too (its index line lists the failure), so a resume
    # neither redoes nor forgets the failures; accepting failed samples makes the exit code 0.
    assert single in {b for r in read_committed(out) for b in r.batch_ids}
    monkeypatch.delenv(ENV_VAR)
    assert main(argv(out, **{"output.max_failed_samples": "null"})) == 0
    summary = json.loads((out / "summary.json").read_text())
    # a finished output: nothing rerun or rewritten, the summary is the one of the run that finished it
    assert summary["num_failed"] == 2 and summary["num_samples_written"] == 62


def test_nan_sample_is_recorded_as_failed_not_written(tmp_path, monkeypatch, capsys, clean):
    bad = _sid(clean["plan"][3][1][0])
    monkeypatch.setenv(ENV_VAR, json.dumps({"nan_samples": [bad]}))
    out = tmp_path / "out"
    assert main(argv(out, **{"output.max_failed_samples": 1})) == 0  # one failure allowed by the recipe
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_failed"] == 1 and manifest["failed"] == {FAIL_NON_FINITE: 1}
    assert [(f["sample_id"], f["reason"]) for f in failed_lines(out)] == [(bad, FAIL_NON_FINITE)]
    got = raw_records(out)
    assert bad not in got and set(got) == set(clean["records"]) - {bad}
    assert all(got[k] == clean["records"][k] for k in got)  # nothing else changes, byte for byte
    assert check_output(out) == []
    assert "1 failed {'non_finite_hidden_states': 1}" in capsys.readouterr().err


@pytest.mark.slow
def test_nan_policy_fatal_stops_cleanly_and_a_resume_completes(tmp_path, monkeypatch, capsys, clean):
    bad_batch = 6
    bad = _sid(clean["plan"][bad_batch][1][0])
    monkeypatch.setenv(ENV_VAR, json.dumps({"nan_samples": [bad]}))
    out = tmp_path / "out"
    assert main(argv(out, **{"output.nan_policy": "fatal"})) == EXIT_STOPPED
    err = capsys.readouterr().err
    assert f"non-finite (NaN/Inf) hidden states in sample(s) ['{bad}'] of batch {bad_batch}" in err
    assert "output.nan_policy: fatal" in err and "Traceback" not in err
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.tmp"))
    committed = read_committed(out)
    assert bad_batch not in {b for r in committed for b in r.batch_ids}
    assert all((out / r.path).is_file() for r in committed)
    monkeypatch.delenv(ENV_VAR)
    assert main(argv(out, **{"output.nan_policy": "fatal"})) == 0
    assert raw_records(out) == clean["records"]


def shard_number(path) -> int:
    """N of `shard-NNNNNN-RUNID.tar`."""
    return int(Path(path).name.split("-")[1].removesuffix(".tar"))


def test_full_disk_stops_cleanly_with_a_clear_message_and_a_resume_completes(tmp_path, monkeypatch, capsys,
                                                                            clean):
    """One writer lane, so that shards commit in number order: 0 and 1 commit, 2 hits the full disk."""
    monkeypatch.setenv(ENV_VAR, json.dumps({"enospc_shard": 2}))
    out = tmp_path / "out"
    assert main(argv(out, **{"output.num_writer_threads": 1})) == EXIT_STOPPED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    committed = read_committed(out)
    assert [shard_number(r.path) for r in committed] == [0, 1]  # index untouched
    n = sum(r.num_samples for r in committed)
    assert ("No space left on device" in errors[0] and f"{n} samples in 2 shards are committed and intact" in errors[0]
            and "free disk space" in errors[0] and "re-run the same command" in errors[0])
    shard_dir = out / "shards" / "rank-00000"
    assert sorted(p.name for p in shard_dir.iterdir()) == [Path(r.path).name for r in committed]  # no half shard
    assert not (out / "manifest.json").exists()
    assert "Traceback" in (out / "logs" / "rank-00000.log").read_text()  # the details are in the log
    monkeypatch.delenv(ENV_VAR)
    assert main(argv(out)) == 0  # resumed with the default number of lanes
    assert raw_records(out) == clean["records"]
    assert unlisted_shard_files(out) == [] and check_output(out) == []


@pytest.mark.slow
def test_full_disk_under_several_writer_lanes_stops_cleanly_and_a_resume_completes(tmp_path, monkeypatch, capsys,
                                                                                  clean):
    """3 lanes write shards 0/3/6.., 1/4/7.., 2/5/8..; the disk fills while lane 1 writes its second shard (4)
    while the other lanes hold open shards of their own: all of those are dropped, what was committed stays."""
    monkeypatch.setenv(ENV_VAR, json.dumps({"enospc_shard": 4}))
    out = tmp_path / "out"
    assert main(argv(out, **{"output.num_writer_threads": 3})) == EXIT_STOPPED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in err
    committed = read_committed(out)
    names = sorted(Path(r.path).name for r in committed)
    assert 1 in map(shard_number, names) and 4 not in map(shard_number, names)
    shard_dir = out / "shards" / "rank-00000"
    assert sorted(p.name for p in shard_dir.iterdir()) == names  # no .tmp, nothing unlisted
    assert not (out / "manifest.json").exists()
    monkeypatch.delenv(ENV_VAR)
    assert main(argv(out, **{"output.num_writer_threads": 2})) == 0  # resumed with another number of lanes
    assert raw_records(out) == clean["records"]
    assert unlisted_shard_files(out) == [] and check_output(out) == []


def test_a_torn_index_line_is_cut_before_a_resume_appends(tmp_path, clean):
    """A crash (or a full disk) while appending an index line leaves a torn tail; later lines must stay readable."""
    index = tmp_path / "index" / "rank-00000.jsonl"
    index.parent.mkdir()
    lines = (clean["out"] / "index" / "rank-00000.jsonl").read_text().splitlines(keepends=True)
    index.write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    assert repair_indexes(tmp_path) == [(str(index), 0)]
    with open(index, "a") as f:
        f.write(lines[1])
    assert [r.path for r in read_committed(tmp_path)] == [json.loads(line)["path"] for line in lines[:2]]
    assert repair_indexes(tmp_path) == []
    # a bad line in the middle: cut there, and the readable records after it are counted (their shards redone)
    assert len(lines) >= 3
    index.write_text(lines[0] + "not a record\n" + "".join(lines[1:3]))
    assert repair_indexes(tmp_path) == [(str(index), 2)]
    assert index.read_text() == lines[0]


@pytest.mark.slow
def test_a_slow_disk_is_reported_with_the_figures_and_what_would_fix_it(tmp_path, monkeypatch, capsys):
    """A disk slower than the model (every batch write sleeps): the summary and the done line say the disk set the
    pace, with the bytes per second the model produced and the writers sustained, and the levers."""
    out = tmp_path / "out"
    monkeypatch.setenv(ENV_VAR, json.dumps({"write_delay_seconds": 0.4}))
    assert main(argv(out, **{"output.num_writer_threads": 1})) == 0
    disk = json.loads((out / "summary.json").read_text())["disk"]
    rank = json.loads((out / "summary.json").read_text())["ranks"][0]
    waited = rank["writer_wait_seconds"] + rank["writer_drain_seconds"]
    assert disk["disk_bound"] is True and disk["wait_fraction"] == pytest.approx(waited / rank["loop_seconds"])
    assert waited > 0.4  # at least one delayed write was waited for
    assert disk["achieved_bytes_per_second"] == pytest.approx(rank["bytes_written"] / rank["loop_seconds"])
    assert disk["needed_bytes_per_second"] > disk["achieved_bytes_per_second"]
    assert disk["fixes"][0].startswith("output.dtype: fp8_e4m3") and "num_writer_threads (now 1)" in disk["fixes"][1]
    err = capsys.readouterr().err
    assert "the disk set the pace" in err and "To go faster" in err


def test_an_object_store_that_sets_the_pace_is_named_with_its_own_levers():
    """Uploads to a store slower than the model: the verdict names the store and its levers (uploads in flight, an
    endpoint nearer the GPUs), not a faster local disk. Figures of the benchmark's S3 run: 6.38 GB in a 60.7 s loop,
    55.2 s of it waiting."""
    from dflash_prep.commands.extract.finish import disk_verdict

    report = {"rank": 0, "bytes_written": 6.38e9, "loop_seconds": 60.7, "writer_wait_seconds": 54.0,
              "writer_drain_seconds": 1.2, "num_writer_threads": 2}
    store = disk_verdict([report], "bfloat16", object_store=True, max_uploads_in_flight=4)
    assert store["where"] == "object store" and store["disk_bound"]
    assert store["achieved_bytes_per_second"] == pytest.approx(6.38e9 / 60.7)
    assert store["needed_bytes_per_second"] == pytest.approx(6.38e9 / (60.7 - 55.2))
    assert "max_uploads_in_flight (now 4)" in store["fixes"][1] and not any("disk" in f for f in store["fixes"])
    local = disk_verdict([report], "fp8_e4m3")
    assert local["where"] == "disk" and local["fixes"][0] == "more output.num_writer_threads (now 2)"

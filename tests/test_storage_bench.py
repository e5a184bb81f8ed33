"""The `storage` bench scenario in its CPU dry run (what the GPU round runs, with a tiny Llama and small data): the
writer against the disk in every mode, the runs into tmpfs, the disk and moto's S3 server, the S3 output read back
equal to the disk's, the report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")


@pytest.mark.slow
def test_the_storage_scenario_dry_run_records_every_figure(tmp_path, monkeypatch):
    from bench import scenarios

    monkeypatch.setenv("WHEEL_DIR", str(tmp_path / "no-wheels"))
    results = tmp_path / "results"
    assert scenarios.main(["run", "storage", str(results), "--dry-run-cpu"]) == 0
    steps = [json.loads(line) for line in (results / "steps.jsonl").read_text().splitlines()]
    assert [s["name"] for s in steps] == ["disk-vs-writer", "data", "8b-warmup", "8b-tmpfs", "8b-disk", "8b-s3",
                                          "report"] and all(s["status"] == "ok" for s in steps)
    dvw = json.loads((results / "disk_vs_writer-disk.json").read_text())
    assert set(dvw["writers"]) == {"buffered:4", "direct:4", "buffered:8", "direct:8"}
    for w in dvw["writers"].values():  # each mode against both raw figures of the same run
        assert w["ratio_to_buffered"] == pytest.approx(w["bytes_per_second"] / dvw["raw"]["bytes_per_second"])
        assert w["ratio_to_direct"] == pytest.approx(w["bytes_per_second"] / dvw["direct"]["bytes_per_second"])
    s3 = json.loads((results / "store_s3.json").read_text())
    assert s3["read_back"]["equal"] and s3["read_back"]["num_samples_s3"] == 40
    report = json.loads((results / "storage_report.json").read_text())
    assert set(report["runs"]) == {"8b-disk", "8b-tmpfs", "8b-s3"} and report["s3_to_disk"] > 0

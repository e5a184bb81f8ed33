"""The storage side of a run: bench/disk_vs_writer.py (the shard writer against a raw sequential write of the same
bytes on the same filesystem) and `dflash-prep plan`'s storage bill (the output's bytes at the disk's or store's
measured rate, beside the GPUs' time, and which one sets the pace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from dflash_prep.commands.plan import main as plan_main


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "result.json"
    proc = subprocess.run([sys.executable, "bench/disk_vs_writer.py", "--dir", str(tmp), "--gb", "0.04",
                           "--repeats", "1", "--width", "512", "--tokens", "64", "--batch-size", "8",
                           "--threads", "2", "--shard-gb", "0.01", "--label", "test", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not [p for p in tmp.iterdir() if p != out], "the bench left files behind"
    return json.loads(out.read_text())


def test_the_bench_times_the_writer_and_the_raw_write_on_the_same_bytes(bench_result):
    r = bench_result
    assert r["raw"]["bytes"] >= r["bytes_per_step"] and r["raw"]["seconds"] > 0
    # the writer wrote the same amount (whole batches: within one batch, 8 x 64 tokens x 1 KB, plus tar overhead)
    assert abs(r["writer"]["bytes"] - r["bytes_per_step"]) < 0.05 * r["bytes_per_step"] + 8 * 64 * 1024
    assert r["writer"]["shards"] >= 2
    assert r["ratio"] == pytest.approx(r["writer"]["bytes_per_second"] / r["raw_bytes_per_second_best"])
    assert r["filesystem"] != "unknown"


def plan_json(capsys, *args) -> dict:
    assert plan_main(["--json", "--set", "data.max_samples=40", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_plan_sets_the_storage_time_beside_the_gpu_time(bench_result, tmp_path, capsys):
    result_file = tmp_path / "r.json"
    result_file.write_text(json.dumps(bench_result))
    p = plan_json(capsys, "--tokens-per-second", "1000", "--storage-bench", str(result_file))
    bill, wall = p["storage"], p["wall"]
    rate = bench_result["writer"]["bytes_per_second"]
    assert bill["num_bytes"] == p["num_bytes"] and bill["bytes_per_second"] == rate
    assert bill["seconds"] == pytest.approx(p["num_bytes"] / rate)
    assert bill["gpu_seconds"] == wall["seconds"]
    assert bill["pace"] == ("storage" if p["num_bytes"] / rate > wall["seconds"] else "gpus")
    # a store slower than the GPUs' writes: the storage sets the pace
    slow = p["num_bytes"] / wall["seconds"] / 4
    p = plan_json(capsys, "--tokens-per-second", "1000", "--storage-bytes-per-second", str(slow),
                  "--set", "output.dir=s3://bucket/x")
    assert p["storage"]["target"] == "s3://bucket/x" and p["storage"]["pace"] == "storage"
    assert p["storage"]["seconds"] == pytest.approx(4 * p["wall"]["seconds"], rel=1e-3)
    assert plan_main(["--set", "data.max_samples=40", "--tokens-per-second", "1000",
                      "--storage-bytes-per-second", str(slow)]) == 0
    assert "the storage sets the pace" in capsys.readouterr().out
    assert plan_main(["--storage-bytes-per-second", "fast"]) == 2


@pytest.mark.slow
def test_plan_bills_every_dtype_bytes_objects_time_and_monthly_cost(tmp_path, capsys):
    """For each storage dtype: the bytes and objects an extraction of the recipe writes (counted on disk after the
    run, for its own dtype), the time at the given rate and the month's cost at the given price (arithmetic)."""
    out = tmp_path / "out"
    sets = ["--set", "data.max_samples=40", "--set", "output.max_shard_bytes=200KB", "--set", f"output.dir={out}"]
    p = plan_json(capsys, *sets[2:], "--storage-bytes-per-second", "2.5e8", "--storage-price-per-gb-month", "0.023")
    assert p["disk"][p["dtype"]]["num_shards"] >= 3
    for dtype, d in p["disk"].items():
        assert d["seconds_at_rate"] == pytest.approx(d["num_bytes"] / 2.5e8), dtype
        assert d["cost_per_month"] == pytest.approx(d["num_bytes"] / 1e9 * 0.023), dtype
    assert set(p["disk"]) == {"bfloat16", "float16", "float32", "fp8_e4m3"}
    assert plan_main([*sets, "--storage-bytes-per-second", "2.5e8", "--storage-price-per-gb-month", "0.023"]) == 0
    text = capsys.readouterr().out
    for dtype, d in p["disk"].items():
        line = next(line for line in text.splitlines() if f" {dtype} " in f" {line} " and "objects" in line)
        assert f"{d['num_objects']:,} objects" in line and f"{d['cost_per_month']:,.2f}/month at 0.023/GB" in line
    assert plan_main(["--storage-price-per-gb-month", "-1"]) == 2
    capsys.readouterr()
    proc = subprocess.run([sys.executable, "extract.py", *sets], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = [f for f in out.rglob("*") if f.is_file()]
    shards = [f for f in files if f.suffix == ".tar"]
    bill = p["disk"][p["dtype"]]
    assert (len(files), len(shards)) == (bill["num_objects"], bill["num_shards"])
    assert sum(f.stat().st_size for f in shards) == bill["num_bytes"]

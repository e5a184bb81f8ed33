"""Before the model loads, the run says how much it will write and warns when the output's disk cannot hold it."""

from __future__ import annotations

import json
import shutil
import tarfile
from collections import namedtuple

import pytest
from conftest import demo_overrides

from dflash_prep.commands.extract import main

SETTINGS = {"data.max_samples": 40, "batching.num_workers": 0, "output.max_shard_bytes": "1MB"}


def argv(out, **extra):
    return [a for kv in demo_overrides(out, **{**SETTINGS, **extra}) for a in ("--set", kv)]


def _record_bytes_in_shards(out) -> int:
    """Bytes of the tar members (headers + padded data) in the shards, end-of-archive blocks left out."""
    total = 0
    manifest = json.loads((out / "manifest.json").read_text())
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            members = tar.getmembers()
        if members:
            last = members[-1]
            total += last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    return total


@pytest.mark.slow
def test_the_estimate_is_the_bytes_the_shards_take_and_plans_figure(tmp_path, capsys):
    from dflash_prep.plan.planner import PlannedBatch
    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.store.sizes import check_free_space

    out = tmp_path / "out"
    assert main(argv(out)) == 0
    assert "GB free" in (out / "logs" / "rank-00000.log").read_text()
    stored = json.loads((out / "plan.json").read_text())
    recipe = load_recipe(None, [kv for kv in demo_overrides(out, **SETTINGS)])
    lengths = {}
    for shard in json.loads((out / "manifest.json").read_text())["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".meta.json"):
                    meta = json.load(tar.extractfile(m))
                    lengths[meta["sample_id"]] = meta["num_tokens"]
    # sample ids are the kept rows' indices in order here, so the plan's sample indices map onto them
    ordered = [lengths[k] for k in sorted(lengths)]
    todo = [PlannedBatch(i, tuple(idx), T, sum(ordered[j] for j in idx)) for i, (T, idx) in enumerate(stored["batches"])]
    manifest = json.loads((out / "manifest.json").read_text())
    estimate = check_free_space(out, ordered, [todo], manifest["layer_ids"], manifest["hidden_size"], recipe)
    # the shard files as written, their closing blocks and padding included: the records' bytes exactly, plus each
    # shard's closing (at most one 10 KB tar record more or less a shard: which lane closes which shard depends on
    # the lanes' timing, which the estimate replays round-robin)
    files = [(out / shard["path"]).stat().st_size for shard in manifest["shards"]]
    assert estimate > _record_bytes_in_shards(out)
    assert abs(estimate - sum(files)) <= 2 * len(files) * tarfile.RECORDSIZE
    # the run said the figure `plan` prints for the same job, before any run
    from dflash_prep.commands.plan import main as plan_main
    from dflash_prep.units import format_bytes

    capsys.readouterr()
    assert plan_main(["--json", *argv(tmp_path / "fresh")]) == 0
    planned = json.loads(capsys.readouterr().out)["disk"][recipe.output.dtype]["num_bytes"]
    said = (out / "logs" / "rank-00000.log").read_text()
    assert f"output: about {format_bytes(planned)} to write" in said


def test_a_disk_too_small_is_reported_before_the_model_loads(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr("dflash_prep.store.sizes.shutil.disk_usage",
                        lambda p: usage(*real(p)[:2], 1_000) if str(p).startswith(str(tmp_path)) else real(p))
    out = tmp_path / "out"
    assert main(argv(out, **{"data.max_samples": 8})) == 0  # a warning, not an error: the disk may be freed
    err = capsys.readouterr().err
    # 1,000 bytes free, said in the unit its size calls for (not "0.0 GB")
    assert "but only 1.00 KB are free there: it will stop (cleanly, resumable) when the disk is full" in err
    assert "output.dtype: fp8_e4m3" in err
    log = (out / "logs" / "rank-00000.log").read_text()
    assert log.index("will stop (cleanly, resumable)") < log.index("model loaded")

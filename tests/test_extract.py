"""End to end: the default job, the batched == alone invariant on written records, 2 processes, re-runs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import REPO, build, cpu_2proc_config, max_abs_diff_to_alone, tiny_llama_config, tiny_qwen35_config
from safetensors.torch import load as safetensors_load

from dflash_prep.commands.extract import OutputMismatchError, run_extraction
from dflash_prep.recipe.schema import load_recipe
from dflash_prep.target.layers import find_decoder

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
NUM_DEMO_ROWS = 704  # 700 conversations + 4 malformed edge cases


def read_records(out_dir: Path) -> dict[str, dict]:
    """Every sample of every shard the manifest lists, decoded with plain webdataset (no project code)."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    urls = [str(out_dir / s["path"]) for s in manifest["shards"]]
    records = {}
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        key = sample["__key__"]
        assert key not in records, f"sample {key} written twice"
        records[key] = {
            "input_ids": np.load(io.BytesIO(sample["input_ids.npy"]), allow_pickle=False),
            "loss_mask": np.load(io.BytesIO(sample["loss_mask.npy"]), allow_pickle=False),
            "tensors": safetensors_load(sample["hidden_states.safetensors"]),
            "meta": json.loads(sample["meta.json"]),
            "raw": sample["hidden_states.safetensors"],
        }
    return records


@pytest.fixture(scope="module")
def demo_out(tmp_path_factory) -> Path:
    """The README's first command (`python extract.py`, the embedded default), run once for this module."""
    out = tmp_path_factory.mktemp("demo") / "out"
    proc = subprocess.run([sys.executable, "extract.py", "--set", f"output.dir={out}"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_default_job_output_tree(demo_out):
    files = sorted(str(p.relative_to(demo_out)) for p in demo_out.rglob("*") if p.is_file())
    shards = [f for f in files if f.startswith("shards/")]
    assert shards and all(f.startswith("shards/rank-00000/shard-") and f.endswith(".tar") for f in shards)
    assert [f for f in files if not f.startswith("shards/")] == [
        "failed.jsonl", "index/rank-00000.done.json", "index/rank-00000.jsonl", "kernels.jsonl",
        "locks/rank-00000.lease-000000", "locks/rank-00000.lock", "locks/run.lease-000000", "locks/run.lock",
        "logs/rank-00000.log",
        "manifest.json", "plan.json", "recipe.resolved.yaml", "run_state.json", "skipped.jsonl", "summary.json",
            "token_freq.safetensors"]
    assert not any(f.endswith(".tmp") for f in files)


@pytest.mark.slow
def test_default_job_counts_and_records(demo_out):
    manifest = json.loads((demo_out / "manifest.json").read_text())
    summary = json.loads((demo_out / "summary.json").read_text())
    skipped = [json.loads(line) for line in (demo_out / "skipped.jsonl").read_text().splitlines()]
    records = read_records(demo_out)
    assert manifest["num_rows"] == NUM_DEMO_ROWS
    assert manifest["skipped"] == {"empty_conversation": 1, "no_assistant_turn": 1, "unknown_role": 1,
                                   "no_two_consecutive_supervised_tokens": 1}
    assert len(skipped) == manifest["num_skipped"] == 4
    assert len(records) == manifest["num_samples"] == summary["num_samples_written"] == NUM_DEMO_ROWS - 4
    assert {r["sample_id"] for r in skipped}.isdisjoint(records)
    assert sum(s["num_samples"] for s in manifest["shards"]) == manifest["num_samples"]
    assert len(manifest["shards"]) > 1, "max_shard_bytes must roll shards"
    assert manifest["layer_ids"] == [1, 3, 5] and manifest["hidden_size"] == 64 and manifest["dtype"] == "bfloat16"
    total_tokens = 0
    for key, r in records.items():
        T = r["input_ids"].shape[0]
        total_tokens += T
        assert r["input_ids"].dtype == np.int32 and r["loss_mask"].dtype == np.uint8
        hs = r["tensors"]["hidden_states"]
        assert hs.dtype == torch.bfloat16 and hs.shape == (T, 3 * 64), "padding must never be stored"
        assert torch.isfinite(hs.float()).all()
        assert r["meta"]["sample_id"] == key and r["meta"]["num_tokens"] == T
        assert r["loss_mask"].sum() >= 2
    assert total_tokens == manifest["num_tokens"]
    assert 0.5 < summary["padding_efficiency"] <= 1.0
    assert (demo_out / "recipe.resolved.yaml").read_text().count("max_tokens_per_batch") == 1


@pytest.mark.slow
def test_rerun_of_a_finished_job_writes_nothing_and_keeps_the_manifest(demo_out):
    before = (demo_out / "manifest.json").read_text()
    summary_before = (demo_out / "summary.json").read_text()
    shards = sorted(p.name for p in demo_out.rglob("*.tar"))
    summary = run_extraction(load_recipe(None, [f"output.dir={demo_out}", "batching.num_workers=0"]))
    # nothing rewritten: the summary is still the one of the run that finished the output
    assert (demo_out / "summary.json").read_text() == summary_before and summary == json.loads(summary_before)
    assert (demo_out / "manifest.json").read_text() == before
    assert sorted(p.name for p in demo_out.rglob("*.tar")) == shards
    after = json.loads((demo_out / "manifest.json").read_text())
    assert after["shards"] == json.loads(before)["shards"]
    with pytest.raises(OutputMismatchError, match=r"layer_ids: output has \[1, 3, 5\], this run has \[0, 2\]"):
        run_extraction(load_recipe(None, [f"output.dir={demo_out}", "layers.preset=explicit", "layers.ids=[0, 2]"]))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5_hybrid"])
def test_written_states_equal_each_sample_run_alone(arch, tmp_path, llama_config_file):
    """The core invariant, through the whole pipeline (fp32 model, fp32 storage): mixed-length batches."""
    out = tmp_path / "out"
    extra = [f"model.config={llama_config_file}"] if arch == "llama" else []
    recipe = load_recipe(None, [f"output.dir={out}", "data.max_samples=48", "output.dtype=float32",
                                "batching.max_tokens_per_batch=4096", "batching.num_workers=0",
                                "layers.capture_final=after_norm", *extra])
    summary = run_extraction(recipe)
    assert summary["num_batches"] >= 3
    records = read_records(out)
    assert len(records) == 48
    layer_ids = json.loads((out / "manifest.json").read_text())["layer_ids"]
    assert layer_ids == ([1, 2, 3] if arch == "llama" else [1, 3, 5])  # the dflash rule, k=3, for 6 and 8 layers
    model = build(tiny_llama_config() if arch == "llama" else tiny_qwen35_config(), seed=recipe.model.init_seed)
    decoder = find_decoder(model)
    worst = max_abs_diff_to_alone(decoder, records, layer_ids, 64)
    assert worst <= 1e-5, f"{arch}: max abs diff {worst}"


@pytest.mark.slow
def test_two_processes_through_accelerate_write_each_sample_once(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): same ids as one process, none twice."""
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--set", "data.max_samples=120", "--set", "batching.num_workers=0",
              "--set", "batching.max_tokens_per_batch=4096"]
    p1 = subprocess.run([sys.executable, "extract.py", "--set", f"output.dir={one}", *common], cwd=REPO, env=ENV,
                        capture_output=True, text=True, timeout=600)
    assert p1.returncode == 0, p1.stderr[-3000:]
    p2 = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                         cpu_2proc_config(), "extract.py",
                         "--set", f"output.dir={two}", *common], cwd=REPO, env=ENV, capture_output=True, text=True,
                        timeout=600)
    assert p2.returncode == 0, p2.stderr[-3000:]
    manifest = json.loads((two / "manifest.json").read_text())
    assert {Path(s["path"]).parent.name for s in manifest["shards"]} == {"rank-00000", "rank-00001"}
    summary = json.loads((two / "summary.json").read_text())
    assert summary["num_ranks"] == 2  # the default model.gpus_per_replica: 1 replica per process, each writes
    assert summary["replicas"] == {"gpus_per_replica": 1, "parallelism": "single_gpu", "num_replicas": 2,
                                   "processes_per_replica": 1}
    r1, r2 = read_records(one), read_records(two)  # read_records asserts no id twice
    assert set(r1) == set(r2) and len(r2) == 120 - 0
    # Same global plan, so the same batches: identical bytes per sample on this deterministic CPU run.
    assert all(r1[k]["raw"] == r2[k]["raw"] for k in r1)

"""The reading examples of the README, docs/STORAGE.md and docs/TRAINING.md run as written, on a real (small)
output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, demo_overrides

from dflash_prep.consume.reader import ShardDataset


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from dflash_prep.commands.extract import main

    out = tmp_path_factory.mktemp("docs") / "out"
    argv = [a for kv in demo_overrides(out, **{"data.max_samples": 120, "batching.num_workers": 0})
            for a in ("--set", kv)]
    assert main(argv) == 0
    return out


@pytest.mark.slow
def test_readme_reading_example(output, monkeypatch):
    (block,) = [b for b in python_blocks(REPO / "README.md") if "ShardDataset" in b and '"out/tiny-demo"' in b]
    assert '"out/tiny-demo"' in block and "    ...\n" in block
    # Run it as written, on this output, keeping what the loop sees.
    code = block.replace('"out/tiny-demo"', repr(str(output))).replace(
        "    ...\n", "    seen.extend(batch['sample_ids']); dropped += batch['num_dropped']\n")
    scope = {"seen": [], "dropped": 0}
    exec(compile(code, "README.md", "exec"), scope)
    manifest = json.loads((output / "manifest.json").read_text())
    assert len(scope["seen"]) == len(set(scope["seen"]))
    # every sample once: yielded in a batch, or dropped by the collator (no two supervised tokens left)
    assert len(scope["seen"]) + scope["dropped"] == manifest["num_samples"] > 100
    # cut to 2 tokens (the prompt's first two, never supervised) every batch is dropped whole: the loop as written
    # still runs to the end (it skips the None batches)
    assert "max_length=2048" in code
    scope = {"seen": [], "dropped": 0}
    exec(compile(code.replace("max_length=2048", "max_length=2"), "README.md", "exec"), scope)
    assert scope["seen"] == [] and scope["dropped"] == 0


def test_storage_page_webdataset_example_reads_every_shard_of_the_manifest(output):
    """The example that reads the shards with webdataset alone takes their paths from the manifest (shard names
    carry the id of the run that wrote them)."""
    (block,) = [b for b in python_blocks(REPO / "docs" / "STORAGE.md") if "wds.WebDataset" in b]
    code = block.replace("out/tiny-demo", str(output)).replace(
        "    hs = load(", "    seen.append(len(ids)); hs = load(")
    scope = {"seen": []}
    exec(compile(code, "docs/STORAGE.md", "exec"), scope)
    manifest = json.loads((output / "manifest.json").read_text())
    assert len(scope["seen"]) == manifest["num_samples"] and sum(scope["seen"]) == manifest["num_tokens"]


def _free_port() -> int:
    """A port no one listens on now (a fixed one collides with other test runs on the same machine)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_training_example_runs_under_torchrun_with_two_ranks(output, tmp_path):
    (block,) = [b for b in python_blocks(REPO / "docs" / "TRAINING.md") if "train_dflash.py" in b]
    script = tmp_path / "train_dflash.py"
    script.write_text(block)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(_free_port()), str(script), str(output)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dataset = ShardDataset(output, split="sample", rank=0, world_size=1)
    steps = min(dataset.num_samples_for(r, 2, 2) for r in range(2)) // 8
    assert steps > 0
    for epoch in (0, 1):
        assert f"epoch {epoch}: {steps} steps of 8 samples, last batch (1, " in proc.stdout, proc.stdout

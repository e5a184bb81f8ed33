"""The benchmark figures shipped with the package (dflash_prep/commands/bench_figures.json): equal to what the
committed reports give, and what an installed package (no bench/ folder beside it) plans with."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

from bench.figures import shipped_text


def test_the_shipped_figures_are_those_of_the_committed_reports():
    """A report committed (or a default changed) without `python3 -m bench.figures` fails here."""
    shipped = (REPO / "dflash_prep" / "commands" / "bench_figures.json").read_text()
    assert shipped == shipped_text(REPO / "bench" / "results"), \
        "dflash_prep/commands/bench_figures.json is stale: run `python3 -m bench.figures` and commit it"


def _plan_json(cwd: Path, pythonpath: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "plan", "--json", *args], cwd=cwd,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_an_installed_package_plans_a_gpu_run_with_the_benchmark_figure(tmp_path):
    """The package alone (as `pip install .` lays it out: no bench/ beside it), planning the Llama-3.1-8B benchmark
    shape for a GPU: the figure is the newest packed Llama report's warm pass, read here from that report itself;
    the checkout plans the same."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "dflash_prep", site / "dflash_prep",
                    ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    args = ["--gpu", "--set", f"output.dir={work / 'out'}", "--set", "data.max_samples=20", "--set",
            f"model.config={REPO / 'bench' / 'configs' / 'llama3.1-8b.json'}", "--set", "model.dtype=bfloat16",
            "--set", "layers.preset=eagle3"]
    installed = _plan_json(work, site, *args)["throughput"]
    ref = installed["reference"]
    assert installed["source"] == "same model" and ref["model"] == "llama3.1-8b", installed
    newest = max((p for p in (REPO / "bench" / "results").glob("llama3.1-8b-*.json")
                  if (json.loads(p.read_text())["modes"].get("dflash_prep_warm", {}).get("summary") or {})
                  .get("packing", {}).get("packed")), key=lambda p: p.name)
    assert ref["file"] == f"bench/results/{newest.name}"
    report = json.loads(newest.read_text())
    assert installed["tokens_per_second"] == report["modes"]["dflash_prep_warm"]["tokens_per_second"]
    checkout = _plan_json(work, REPO, *args)["throughput"]
    assert checkout["tokens_per_second"] == installed["tokens_per_second"]


def test_the_fp8_ratio_is_the_newest_dates_and_of_that_date_the_largest_models(tmp_path):
    """Of the `targets-*` A/B pairs: the newest date wins, and on one date the whole model's over a slice's, whatever
    the folders' names sort as; a pair over different rows is not a ratio."""
    from dflash_prep.commands.bench_figures import fp8_extraction_ratio

    def pair(name: str, fp8: float, bf16: float, params: int, tokens: tuple[int, int] = (1000, 1000)) -> None:
        folder = tmp_path / name
        folder.mkdir()
        for kind, rate, n in (("fp8", fp8, tokens[0]), ("dequantized", bf16, tokens[1])):
            (folder / f"extract-{kind}.summary.json").write_text(json.dumps(
                {"tokens_per_second": rate, "num_tokens_this_run": n, "ranks": [{"decoder_params_run": params}]}))

    assert fp8_extraction_ratio(tmp_path) is None
    pair("targets-20261203-slice", 150.0, 100.0, 6_000)
    assert fp8_extraction_ratio(tmp_path) == {"ratio": 1.5, "folder": "targets-20261203-slice"}
    pair("targets-20261204-zz-slice", 140.0, 100.0, 6_000)
    pair("targets-20261204-aa-whole", 130.0, 100.0, 24_000)
    pair("targets-20261205-other-rows", 300.0, 100.0, 24_000, tokens=(1000, 999))
    pair("targets-moe-undated", 400.0, 100.0, 24_000)  # no date: not compared by its name's letters
    got = fp8_extraction_ratio(tmp_path)
    assert got["folder"] == "targets-20261204-aa-whole" and abs(got["ratio"] - 1.3) < 1e-12

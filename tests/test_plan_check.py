"""`plan` against what the benchmark measured: the newest committed report of each benchmarked shape and layout
(packed rows, padded batches), its job planned again (bench/plan_check.py), predicted time within 15% of the
measured cold loop (the goal). Planned with only the other shapes' reports, plan takes the nearest model of the same
kind (routed experts or dense, Gated DeltaNet or attention only): where that model ran the same kernels, the
steady state is carried within 15%; a kind with no other benchmarked model is said ("of another kind")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import plan_check  # noqa: E402
from dflash_prep.commands.bench_figures import bench_references  # noqa: E402

RESULTS = REPO / "bench" / "results"
def _newest_per_model_and_layout() -> list[str]:
    """The newest bf16 reference file of each (model, layout): the figures a default plan uses (older reports stay
    references only for the kernels they ran)."""
    newest: dict[tuple, dict] = {}
    for packed in (True, False):
        for r in bench_references(RESULTS, packed):
            key = (r["model"], packed)
            if r["compute_dtype"] == "bfloat16" and (key not in newest or r["timestamp"] > newest[key]["timestamp"]):
                newest[key] = r
    return sorted({Path(r["file"]).name for r in newest.values()})


NEWEST = _newest_per_model_and_layout()


def test_every_benchmarked_shape_and_layout_has_a_newest_report():
    models = {name.rsplit("-", 2)[0] for name in NEWEST}
    assert models == {"llama3.1-8b", "qwen3.6-27b", "qwen3-8b", "qwen3-30b-a3b", "qwen3.6-35b-a3b"}, NEWEST


@pytest.mark.parametrize("name", NEWEST)
def test_plan_predicts_the_measured_time_within_15_percent(name, tmp_path):
    reports = plan_check.plannable_reports(RESULTS)
    (path, report), = [(p, r) for p, r in reports if p.name == name]
    row = plan_check.check_report(path, report, reports, tmp_path)
    cold = report["modes"]["dflash_prep"]
    same = row["same_model"]
    assert same["source"] == "same model" and same["num_real_tokens"] == cold["num_real_tokens"]
    assert same["kernels"] == cold["summary"]["kernels"]["applied"], "planned with the kernels the run applied"
    assert same["reference_kernels"] == same["kernels"], row
    assert abs(same["seconds"] / cold["loop_seconds"] - 1) <= plan_check.GOAL_RATIO, row
    other = row["other_models"]
    assert other["reference"].split("-2026")[0] != report["model"]
    if other["source"] != "nearest benchmarked model":
        assert other["source"].startswith("nearest benchmarked model of another kind"), other
        return
    # Without this shape's reports: the compute carried from a model of the same kind by parameters per token,
    # against the warm pass (the first-shape warm-up is not carried across models), where both ran the same kernels
    warm = report["modes"]["dflash_prep_warm"]["loop_seconds"]
    if row["measured"]["packed"] and other["reference_kernels"] == other["kernels"]:
        assert abs(other["seconds"] / warm - 1) <= plan_check.GOAL_RATIO, row

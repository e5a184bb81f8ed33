"""`plan` against what the benchmark measured: the newest committed report of each benchmarked shape and layout
(packed rows, padded batches), its job planned again (bench/plan_check.py), predicted time within 15% of the
measured cold loop (the goal). Planned with only the other shapes' reports (labelled as the nearest benchmarked
model), the packed rows' steady state is within 15% for dense attention and the hybrid alike (both run near 0.7 MFU
packed); padded batches are not (the hybrid's padded MFU is 0.57 against the 8B's 0.69: 0.82 and 1.22 measured)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import REPO

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import plan_check  # noqa: E402
from dflash_prep.commands.plan import bench_references  # noqa: E402

RESULTS = REPO / "bench" / "results"
NEWEST = sorted({Path(r["file"]).name for packed in (True, False) for r in bench_references(RESULTS, packed)
                 if r["compute_dtype"] == "bfloat16"})


def test_every_benchmarked_shape_and_layout_has_a_newest_report():
    models = {name.rsplit("-", 2)[0] for name in NEWEST}
    assert models == {"llama3.1-8b", "qwen3.6-27b"} and len(NEWEST) == 4


@pytest.mark.parametrize("name", NEWEST)
def test_plan_predicts_the_measured_time_within_15_percent(name, tmp_path):
    reports = plan_check.plannable_reports(RESULTS)
    (path, report), = [(p, r) for p, r in reports if p.name == name]
    row = plan_check.check_report(path, report, reports, tmp_path)
    measured = report["modes"]["dflash_prep"]["loop_seconds"]
    same = row["same_model"]
    assert same["source"] == "same model" and same["num_real_tokens"] == report["modes"]["dflash_prep"]["num_real_tokens"]
    assert abs(same["seconds"] / measured - 1) <= plan_check.GOAL_RATIO, row
    # Without this shape's reports: the compute carried from the other shape by parameters per token, against the
    # warm pass (the first-shape warm-up, fla's autotuning on the hybrid, is not carried across families).
    other = row["other_models"]
    if not row["measured"]["packed"]:
        return
    assert other["source"] == "nearest benchmarked model" and other["reference"].split("-2026")[0] != report["model"]
    warm = report["modes"]["dflash_prep_warm"]["loop_seconds"]
    assert abs(other["seconds"] / warm - 1) <= plan_check.GOAL_RATIO, row

#!/usr/bin/env python
"""How far `dflash-prep plan` is from what the benchmark measured: every committed benchmark report's job planned
again on this machine (no GPU: the plan is arithmetic) and its predicted time set beside the measured one.

    python bench/plan_check.py [--results-dir DIR ...] [--check-dir DIR] [--reports GLOB] [--json OUT.json]

For each complete report (bench/run_bench.py's JSON) the same job is rebuilt: the sample list from the report's
recorded draw (bench.samples.make_samples with its `settings.samples`), cut to the prefix the cold `dflash_prep`
mode ran, the report's config, layers, token budget and `--dflash-set` overrides, planned for the report's GPU
(`gpu=True`, its memory). Two predictions each:

- `same_model`: plan's tokens/s taken from the reports as `plan` finds them (this report's own model among
  them), the figure a user of a benchmarked shape gets;
- `other_models`: the same with every report of this model left out, so plan must carry a figure across shapes
  (what it does for any target not benchmarked: the MoE, an FP8 checkpoint, another family).

The measured time is the cold mode's loop (a fresh job: its first-shape warm-up included) and, beside it, the
warm loop (the steady state, no warm-up). `ratio` = predicted / measured; the goal is within 15% on every shape.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if sys.path and Path(sys.path[0] or ".").resolve() == BENCH_DIR:
    sys.path.pop(0)
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.models import CONFIG_DIR, MODELS, TOKENIZER_DIR  # noqa: E402
from bench.samples import make_samples, write_pretokenized  # noqa: E402

GOAL_RATIO = 0.15  # issue: plan within 15% of the measured time on every benchmarked shape


def plannable_reports(results_dir: Path, pattern: str = "*.json") -> list[tuple[Path, dict]]:
    """(path, report) of every complete benchmark report whose cold dflash_prep mode ran and whose sample draw is
    recorded."""
    from dflash_prep.commands.bench_figures import benchmark_reports

    out = []
    for path, report in benchmark_reports(results_dir, pattern):
        cold = (report.get("modes") or {}).get("dflash_prep") or {}
        if cold.get("status") != "ok" or not (report.get("settings") or {}).get("samples"):
            continue
        if report.get("model") not in MODELS:
            continue
        out.append((path, report))
    return out


def job_recipe(report: dict, work: Path):
    """The recipe of the report's cold dflash_prep mode, its rows written as parquet under `work`."""
    from dflash_prep.commands.bench_figures import applied_kernels
    from dflash_prep.recipe.schema import parse_overrides, recipe_from_dict, set_dotted

    settings, spec = report["settings"], MODELS[report["model"]]
    draw = settings["samples"]
    vocab = int(re.search(r"\[1, (\d+)\)", draw["token_ids"]).group(1))
    samples = make_samples(draw["num_samples"], draw["mu"], draw["sigma"], draw["clip"][0], draw["clip"][1],
                           vocab, draw["seed"])
    n = report["modes"]["dflash_prep"]["num_samples"]
    data_path = work / "rows.parquet"
    write_pretokenized(data_path, samples, n)
    raw = {
        "model": {"config": str(CONFIG_DIR / spec.config), "tokenizer": str(TOKENIZER_DIR),
                  "dtype": settings["dtype"], "attn_implementation": "sdpa"},
        "data": {"path": str(data_path), "format": "parquet", "max_length": draw["clip"][1], "overlong": "skip"},
        "layers": {"preset": "explicit", "ids": list(report["layer_ids"]), "capture_final": "none"},
        "batching": {"max_tokens_per_batch": int(settings["max_tokens_per_batch"])},
        "output": {"dir": str(work / "out"), "dtype": settings.get("storage_dtype", "bfloat16")},
    }
    for key, value in parse_overrides(settings.get("dflash_overrides")):  # recorded as "KEY=VALUE"
        set_dotted(raw, key, value)
    # the kernels the measured run applied (today's `auto` may apply others)
    applied = applied_kernels(report["modes"]["dflash_prep"])
    if applied is not None:
        raw["model"]["kernels"] = list(applied) or "eager"
    return recipe_from_dict(raw)


def predicted_seconds(recipe, report: dict, bench_dir: Path) -> dict:
    """plan's figures of the job with the reports of `bench_dir`."""
    from dflash_prep.commands.plan import make_run_plan

    memory = (report.get("environment") or {}).get("gpu_memory_bytes")
    p = make_run_plan(recipe, gpu=True, gpu_memory_bytes=memory, bench_dir=bench_dir)
    wall = p["wall"] or {}
    ref = (p["throughput"] or {}).get("reference") or {}
    return {"seconds": wall.get("seconds"), "warmup_seconds": wall.get("warmup_seconds"),
            "tokens_per_second": p["throughput"].get("tokens_per_second"), "source": p["throughput"].get("source"),
            "reference": Path(ref["file"]).name if ref.get("file") else None,
            "reference_mode": ref.get("mode"), "reference_kernels": list(ref.get("kernels") or ()),
            "kernels": list(p["kernels"]),
            "num_real_tokens": p["num_tokens"], "num_shapes": p["num_shapes"], "packed": p["packing"].get("packed")}


def check_report(path: Path, report: dict, reports: list[tuple[Path, dict]], tmp: Path) -> dict:
    """The row of one report: measured, predicted with its own model's reports, predicted without them."""
    work = Path(tempfile.mkdtemp(dir=tmp))
    recipe = job_recipe(report, work)
    every, others = work / "every-report", work / "other-models"
    for folder, keep in ((every, lambda r: True), (others, lambda r: r["model"] != report["model"])):
        folder.mkdir()
        for p, r in reports:
            if keep(r):
                shutil.copy(p, folder / p.name)
    cold, warm = report["modes"]["dflash_prep"], (report["modes"].get("dflash_prep_warm") or {})
    row = {"report": path.name, "model": report["model"],
           "measured": {"cold_loop_seconds": cold["loop_seconds"], "num_real_tokens": cold["num_real_tokens"],
                        "warm_loop_seconds": warm.get("loop_seconds") if warm.get("status") == "ok" else None,
                        "packed": bool(((cold.get("summary") or {}).get("packing") or {}).get("packed"))},
           "same_model": predicted_seconds(recipe, report, every),
           "other_models": predicted_seconds(recipe, report, others)}
    for key in ("same_model", "other_models"):
        s = row[key]["seconds"]
        row[key]["ratio"] = s / cold["loop_seconds"] if s and cold["loop_seconds"] > 0 else None
    shutil.rmtree(work, ignore_errors=True)
    return row


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def render(rows: list[dict]) -> str:
    lines = ["| report | layout | measured cold s (warm) | plan, same model: s / ratio / basis | "
             "plan, other models: s / ratio / basis |", "|---|---|---|---|---|"]
    for r in rows:
        m, a, b = r["measured"], r["same_model"], r["other_models"]
        lines.append(f"| {r['report']} | {'packed' if m['packed'] else 'padded'} | {m['cold_loop_seconds']:.1f} "
                     f"({_fmt(m['warm_loop_seconds'], '.1f')}) | {_fmt(a['seconds'], '.1f')} / {_fmt(a['ratio'])} / "
                     f"{a['source']} | {_fmt(b['seconds'], '.1f')} / {_fmt(b['ratio'])} / {b['source']} |")
    within = [r for r in rows if r["same_model"]["ratio"] and abs(r["same_model"]["ratio"] - 1) <= GOAL_RATIO]
    lines.append(f"\nsame model within {GOAL_RATIO:.0%}: {len(within)} of {len(rows)} reports")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results-dir", action="append", default=None,
                   help="a folder of reports (repeatable; default bench/results): all are references")
    p.add_argument("--reports", default="*.json", help="globs of the reports to check, comma-separated")
    p.add_argument("--check-dir", default=None, help="check only the reports of this folder (default: of every folder)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    import logging

    logging.getLogger("dflash_prep").setLevel(logging.WARNING)
    folders = [Path(f) for f in (args.results_dir or [BENCH_DIR / "results"])]
    reports = [found for folder in folders for found in plannable_reports(folder)]
    wanted = {p for folder in ([Path(args.check_dir)] if args.check_dir else folders)
              for glob in args.reports.split(",") for p, _ in plannable_reports(folder, glob)}
    with tempfile.TemporaryDirectory() as tmp:
        rows = [check_report(p, r, reports, Path(tmp)) for p, r in reports if p in wanted]
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"goal_ratio": GOAL_RATIO, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

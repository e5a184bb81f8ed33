"""The GPU benchmark figures `dflash-prep plan` times a run with: read from a folder of benchmark reports, or as
shipped inside the package.

`plan`'s rates come from the project's committed GPU measurements under the checkout's `bench/results/`
(bench/run_bench.py's reports, bench/regen_bench.py's `regen-bench.json`, bench/targets_check.py's FP8 /
dequantized extraction pair). An installed package has no `bench/` folder, so `bench_figures.json`, beside this
module and shipped as package data, holds exactly what `plan` reads of them:

    {"extraction": {"packed": [reference, ...], "padded": [...]},   # commands/plan.py `bench_references`
     "fp8_extraction_ratio": {"ratio": float, "folder": str} | null,  # commands/plan.py `fp8_extraction_ratio`
     "regeneration": [reference, ...]}                                # commands/regen_rate.py `regen_bench_references`

each reference's `file` relative to the project root (`bench/results/...`). `python3 -m bench.figures` writes it
from `bench/results/`; tests/test_plan_figures.py fails while it differs from what the committed reports give, so
a checkout and an installed package plan alike.

Sources (`figures(source)`): a folder (its reports, read now: `plan --bench-results DIR`), a dict (figures already
read), None (no figures), or DEFAULT: the shipped file.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

FIGURES_FILE = Path(__file__).with_name("bench_figures.json")
DEFAULT = "shipped"  # the sentinel source: the figures shipped with the package


def figures_from_reports(results_dir: Path, relative_to: Path | None = None) -> dict:
    """What `plan` reads of the reports under `results_dir`, in the shipped file's layout; with `relative_to`,
    each reference's `file` relative to that folder (the project root, for the shipped file)."""
    from dflash_prep.commands.plan import bench_references, fp8_extraction_ratio
    from dflash_prep.commands.regen_rate import regen_bench_references

    results_dir = Path(results_dir)

    def rel(refs: list[dict]) -> list[dict]:
        if relative_to is None:
            return refs
        return [{**r, "file": Path(r["file"]).resolve().relative_to(Path(relative_to).resolve()).as_posix()}
                for r in refs]

    return {"extraction": {"packed": rel(bench_references(results_dir, packed=True)),
                           "padded": rel(bench_references(results_dir, packed=False))},
            "fp8_extraction_ratio": fp8_extraction_ratio(results_dir),
            "regeneration": rel(regen_bench_references(results_dir))}


@functools.lru_cache(maxsize=1)
def _shipped_text() -> str:
    return FIGURES_FILE.read_text()


def shipped_figures() -> dict:
    """The figures shipped with the package (a fresh copy; references' `kernels` as tuples, as read from reports)."""
    return _normalized(json.loads(_shipped_text()))


def _normalized(figs: dict) -> dict:
    for layout in ("packed", "padded"):
        for ref in figs["extraction"][layout]:
            if isinstance(ref.get("kernels"), list):
                ref["kernels"] = tuple(ref["kernels"])
    return figs


def figures(source) -> dict | None:
    """The figures of `source`: DEFAULT (the shipped file), a folder of reports (read now), a dict (as it is), None
    (none)."""
    if source is None or isinstance(source, dict):
        return source
    if isinstance(source, str) and source == DEFAULT:
        return shipped_figures()
    return figures_from_reports(Path(source))


def describe(source) -> str:
    """Where `source`'s figures come from, for the plan's messages."""
    if isinstance(source, str) and source == DEFAULT:
        return "the benchmark figures shipped with dflash-prep (from the project's bench/results)"
    return "no benchmark folder" if source is None else str(source)

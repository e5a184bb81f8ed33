"""Writes dflash_prep/commands/bench_figures.json, the benchmark figures `dflash-prep plan` ships with, from the
committed reports of bench/results/ (dflash_prep/commands/bench_figures.py says what it holds and why).

    python3 -m bench.figures            # after committing a benchmark report: plan then uses it, installed or not

tests/test_plan_figures.py fails while the shipped file differs from what the committed reports give.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_prep.commands.bench_figures import FIGURES_FILE, figures_from_reports  # noqa: E402


def shipped_text(results_dir: Path = ROOT / "bench" / "results") -> str:
    """The shipped file's text for the reports of `results_dir` (files named relative to the project root)."""
    return json.dumps(figures_from_reports(results_dir, relative_to=ROOT), indent=1, sort_keys=True) + "\n"


def main() -> int:
    text = shipped_text()
    FIGURES_FILE.write_text(text)
    figs = json.loads(text)
    counts = {k: len(v) for k, v in figs["extraction"].items()}
    print(f"{FIGURES_FILE.relative_to(ROOT)}: {counts['packed']} packed and {counts['padded']} padded extraction "
          f"references, {len(figs['regeneration'])} regeneration ones, FP8 ratio "
          f"{figs['fp8_extraction_ratio']}, {len(text):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())

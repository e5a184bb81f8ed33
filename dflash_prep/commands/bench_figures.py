"""The GPU benchmark figures `dflash-prep plan` times a run with: read from a folder of benchmark reports, or as
shipped inside the package.

`plan`'s rates come from the project's committed GPU measurements under the checkout's `bench/results/`
(bench/run_bench.py's reports, bench/regen_bench.py's `regen-bench.json`, bench/targets_check.py's FP8 /
dequantized extraction pair). An installed package has no `bench/` folder, so `bench_figures.json`, beside this
module and shipped as package data, holds exactly what `plan` reads of them:

    {"extraction": {"packed": [reference, ...], "padded": [...]},   # `bench_references` below
     "fp8_extraction_ratio": {"ratio": float, "folder": str} | null,  # `fp8_extraction_ratio` below
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
import math
import re
from pathlib import Path

FIGURES_FILE = Path(__file__).with_name("bench_figures.json")
DEFAULT = "shipped"  # the sentinel source: the figures shipped with the package
BENCH_RESULTS_DIR = Path(__file__).resolve().parents[2] / "bench" / "results"  # in a checkout
BENCH_MODE = "dflash_prep_warm"


def figures_from_reports(results_dir: Path, relative_to: Path | None = None) -> dict:
    """What `plan` reads of the reports under `results_dir`, in the shipped file's layout; with `relative_to`,
    each reference's `file` relative to that folder (the project root, for the shipped file)."""
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


# ------------------------------------------------------------------------------ the reports, read
def benchmark_reports(results_dir: Path, pattern: str = "*.json") -> list[tuple[Path, dict]]:
    """(path, report) of each complete benchmark report (bench/run_bench.py's JSON, version 1) in `results_dir`
    matching `pattern`, in name order; files that do not read as one are passed over."""
    found = []
    for path in sorted(Path(results_dir).glob(pattern)):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(report, dict) and report.get("report_version") == 1 and report.get("complete"):
            found.append((path, report))
    return found


# (cold mode, warm mode) pairs of a report; the variant pair counts only where its overrides change model.kernels
BENCH_MODE_PAIRS = (("dflash_prep", BENCH_MODE), ("dflash_prep_variant", "dflash_prep_variant_warm"))


def bench_references(results_dir: Path = BENCH_RESULTS_DIR, packed: bool = False) -> list[dict]:
    """The warm dflash-prep figure of the newest complete benchmark report per (model, compute dtype, kernels),
    among the runs of the planned layout: packed rows (`packed`: what `batching.packing: auto` runs on GPUs where
    exact) or padded batches (a packed run's figure is not a padded run's, nor the reverse). A report's variant
    modes are a reference of their own where they differ from the base modes only in `model.kernels`. `kernels`:
    the names the mode applied, None where its report does not say (older reports)."""
    best: dict[tuple, dict] = {}
    for path, report in benchmark_reports(results_dir):
        for cold_name, warm_name in BENCH_MODE_PAIRS:
            ref = _reference(path, report, cold_name, warm_name, packed)
            if ref is None:
                continue
            key = (ref["model"], ref["compute_dtype"], ref["kernels"])
            if key not in best or ref["timestamp"] > best[key]["timestamp"]:
                best[key] = ref
    return sorted(best.values(), key=lambda r: (r["model"], str(r["compute_dtype"]), repr(r["kernels"])))


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def applied_kernels(mode: dict) -> tuple[str, ...] | None:
    """The kernels a benchmark mode applied (its summary's `kernels.applied`), None where not a list of names."""
    applied = _dict(_dict(_dict(mode.get("summary")).get("kernels"))).get("applied")
    if isinstance(applied, list) and all(isinstance(k, str) for k in applied):
        return tuple(applied)
    return None


def _kernels_only_variant(mode: dict) -> bool:
    """A variant mode that changed `model.kernels` and nothing else (its recorded `--variant-set` overrides)."""
    overrides = mode.get("variant_overrides")
    overrides = [overrides] if isinstance(overrides, str) else overrides
    return (isinstance(overrides, list) and bool(overrides)
            and all(isinstance(o, str) and o.startswith("model.kernels=") for o in overrides))


def _reference(path: Path, report: dict, cold_name: str, warm_name: str, packed: bool) -> dict | None:
    """One reference from a report's (cold, warm) modes, or None where the warm mode did not run, ran the other
    layout, is a variant that changed more than the kernels, or its figures are not numbers."""
    modes, info = _dict(report.get("modes")), _dict(report.get("model_info"))
    mode = _dict(modes.get(warm_name))
    tok_s, params = mode.get("tokens_per_second"), info.get("decoder_params_active_needed") or \
        info.get("decoder_params_needed")
    if mode.get("status") != "ok" or not _positive(tok_s) or not _positive(params):
        return None
    if bool(_dict(_dict(mode.get("summary")).get("packing")).get("packed")) != packed:
        return None
    if cold_name != "dflash_prep" and not _kernels_only_variant(mode):
        return None
    return {
        "model": str(report.get("model")), "file": str(path), "timestamp": str(report.get("timestamp") or ""),
        "mode": warm_name, "tokens_per_second": float(tok_s),
        "compute_dtype": _dict(report.get("settings")).get("dtype"),
        "gpu": _dict(report.get("environment")).get("gpu"),
        "model_type": info.get("model_type"), "hidden_size": info.get("hidden_size"),
        "num_hidden_layers": info.get("num_hidden_layers"),
        "kernels": applied_kernels(mode),
        # per token: an MoE report's active count (older reports of dense models have only the held count)
        "decoder_params_needed": int(params),
        "padding_efficiency": mode.get("padding_efficiency"),
        "seconds_per_new_shape": _warmup_per_shape(_dict(modes.get(cold_name)), mode),
        "host_warmup_seconds": _host_warmup(_dict(modes.get(cold_name)), mode),
    }


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _warmup_per_shape(cold: dict, warm: dict) -> float | None:
    """What a shape's first batches cost beyond their compute, in seconds a shape: the cold pass's batches of a
    first-seen shape minus the same batches in the warm pass (same samples, same plan), over their number. Their
    whole time would count their compute twice (once in tokens / warm tokens/s): 25 padded shapes of the 8B shape
    took 26.2 s cold and 18.5 s warm, 0.31 s a shape of warm-up, not 1.05. Reports without the warm pass's figure:
    the cold batches' whole time."""
    batches, first = cold.get("first_shape_batches"), cold.get("first_shape_seconds")
    if cold.get("status") != "ok" or not _positive(batches) or not isinstance(first, (int, float)):
        return None
    if isinstance(warm.get("first_shape_seconds"), (int, float)):
        first = max(first - warm["first_shape_seconds"], 0.0)
    return first / batches


def _host_warmup(cold: dict, warm: dict) -> float | None:
    """What a run's first pinned host buffers cost, once per rank, in seconds: the cold pass's device-to-host copy
    time (its breakdown's `copy_to_host_gpu`) beyond the warm pass's on the same batches. The first copies of a run
    wait for the host memory they land in to be allocated and page-locked (a packed 8B batch holds 1.3 GB of states);
    the warm pass reuses those buffers. Measured: on every committed report the cold loop's time beyond plan's
    compute and per-shape warm-up was this excess within 0.15 s (Qwen3-8B: 3.29 s against 3.27), save one padded run.
    None without both figures."""
    copies = [_dict(m.get("breakdown_seconds")).get("copy_to_host_gpu") for m in (cold, warm)]
    if cold.get("status") != "ok" or not all(isinstance(c, (int, float)) and math.isfinite(c) for c in copies):
        return None
    return max(copies[0] - copies[1], 0.0)


def fp8_extraction_ratio(bench_dir: Path) -> dict | None:
    """{ratio, folder}: the ratio of an FP8 extraction's loop tok/s to the same checkpoint's dequantized one on the
    same rows (bench/targets_check.py's `extract-fp8.summary.json` and `extract-dequantized.summary.json` in a
    `targets-YYYYMMDD*` folder of `bench_dir`): the newest date's, and of that date the largest model's (the whole
    27B before a slice of it: a real target's ratio); None where no such pair is."""
    pairs = []
    for folder in Path(bench_dir).glob("targets-*"):
        date = re.match(r"targets-(\d{8})", folder.name)
        if date is None:  # not a dated result folder
            continue
        try:
            fp8, bf16 = (json.loads((folder / f"extract-{name}.summary.json").read_text())
                         for name in ("fp8", "dequantized"))
        except (OSError, ValueError):
            continue
        if fp8.get("num_tokens_this_run") == bf16.get("num_tokens_this_run") and \
                _positive(fp8.get("tokens_per_second")) and _positive(bf16.get("tokens_per_second")):
            params = max([r.get("decoder_params_run") or 0 for r in fp8.get("ranks") or [] if isinstance(r, dict)],
                         default=0)
            pairs.append(((date.group(1), params, folder.name),
                          {"ratio": fp8["tokens_per_second"] / bf16["tokens_per_second"], "folder": folder.name}))
    return max(pairs, key=lambda p: p[0])[1] if pairs else None

"""The benchmark report: `{model}-{timestamp}.json` (every figure) and `.md` (the tables), rewritten after every
mode; the cross-mode figures (first-shape cost, consistency) are derived here from the modes' results."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.context import Ctx, environment, fs_info
from bench.models import CONFIG_DIR, REPO_ROOT
from bench.modes import VARIANT
from bench.outputs import compare
from bench.timing import GB


def new_report(ctx: Ctx, modes: list[str], timestamp: str, command: list[str], gemm: dict) -> dict:
    """The report before any mode ran (`complete: False`), with its JSON and Markdown paths under
    `--results-dir` (created)."""
    args, spec, info = ctx.args, ctx.spec, ctx.info
    report = {
        "benchmark": "dflash-prep extraction: per-sample vs fixed-batch vs dflash-prep",
        "report_version": 1, "timestamp": timestamp,
        "command": command,
        "model": args.model, "config": str((CONFIG_DIR / spec.config).relative_to(REPO_ROOT)),
        "layer_ids": ctx.layer_ids,
        "layer_rule": spec.layer_rule, "model_info": {k: v for k, v in info.items() if k != "per_layer_params"},
        "environment": environment(ctx.device),
        "settings": {"modes": modes, "device": str(ctx.device), "dtype": ctx.section.dtype,
                     "storage_dtype": args.storage_dtype, "weights": f"random, seed {args.seed}",
                     "baseline_logits": args.logits, "per_sample_max_seconds": args.per_sample_max_seconds,
                     "per_sample_max_samples": args.per_sample_max_samples,
                     "fixed_batch_max_seconds": args.fixed_batch_max_seconds,
                     "fixed_batch_max_samples": args.fixed_batch_max_samples,
                     "fixed_batch_size": args.fixed_batch_size, "dflash_max_tokens": args.dflash_max_tokens,
                     "max_tokens_per_batch": ctx.token_budget, "max_tokens_per_batch_how": ctx.token_budget_how,
                     "dflash_overrides": args.dflash_set, "variant_overrides": args.variant_set,
                     "out_dir": {**fs_info(ctx.out_root), "deleted_after_each_mode": not args.keep_outputs},
                     "samples": ctx.samples.params},
        "gemm": gemm,
        "modes": {},
        "consistency": {},
        "complete": False,
    }
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.model}-{timestamp}"
    report["json_path"] = str(results_dir / f"{stem}.json")
    report["markdown_path"] = str(results_dir / f"{stem}.md")
    return report


def warm_overheads(results: dict) -> dict:
    """For each mode run cold then warm on the same samples: the extra seconds of the cold pass's forwards
    (compilation, autotuning of first-seen shapes), in all and per distinct shape. `dflash_prep_fresh` (a new
    process with the Triton cache the earlier passes filled) is set against the in-process warm pass."""
    pairs = [(m, f"{m}_warm") for m in results if not m.endswith("_warm")]
    pairs.append(("dflash_prep_fresh", "dflash_prep_warm"))
    out = {}
    for mode, warm_mode in pairs:
        cold, warm = results.get(mode), results.get(warm_mode)
        if not cold or not warm or cold.get("status") != "ok" or warm.get("status") != "ok":
            continue
        key = "forward" if mode in ("per_sample", "fixed_batch") else "forward_gpu"
        extra = cold["breakdown_seconds"][key] - warm["breakdown_seconds"][key]
        out[mode] = {"cold_forward_seconds": cold["breakdown_seconds"][key],
                     "warm_forward_seconds": warm["breakdown_seconds"][key],
                     "first_shape_overhead_seconds": extra, "num_shapes": cold["num_shapes"],
                     "overhead_per_shape_seconds": extra / cold["num_shapes"] if cold["num_shapes"] else None,
                     "cold_tokens_per_second": cold["tokens_per_second"],
                     "warm_tokens_per_second": warm["tokens_per_second"]}
    if "dflash_prep_fresh" in out:
        fresh = out["dflash_prep_fresh"]
        fresh["cold_to_warm_ratio"] = fresh["cold_tokens_per_second"] / fresh["warm_tokens_per_second"]
    return out


def consistency_of(results: dict, states: dict, check_ids: list[str], k: int) -> dict:
    """Cross-mode check on the first samples: every pair of finished modes, and the weights checksums."""
    ok = [m for m in results if results[m].get("status") == "ok"]
    # Every mode against the first (per_sample when it ran), each warm pass against its cold pass, and the two
    # batched modes against each other.
    wanted = [(ok[0], m) for m in ok[1:]] if ok else []
    wanted += [(m.removesuffix("_warm"), m) for m in ok if m.endswith("_warm") and m.removesuffix("_warm") in ok]
    if VARIANT in ok and "dflash_prep" in ok:
        wanted.append(("dflash_prep", VARIANT))
    if "fixed_batch" in ok and "dflash_prep" in ok:
        wanted.append(("fixed_batch", "dflash_prep"))
    pairs = {f"{a}~{b}": compare(states[a], states[b], k) for a, b in dict.fromkeys(wanted)}
    checksums = {m: results[m].get("weights_checksum") for m in ok}
    return {"samples_checked": len(check_ids), "pairs": pairs, "same_weights": len(set(checksums.values())) <= 1,
            "weights_checksums": checksums}


def write_report(report: dict) -> None:
    with open(report["json_path"], "w") as f:
        json.dump(report, f, indent=2, default=_json_default)
    Path(report["markdown_path"]).write_text(render_markdown(report))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


# ----------------------------------------------------------------------------------------------- markdown
def _fmt(v, spec: str = ",.0f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


BREAKDOWN_NOTES = {
    (False, "forward"): "CausalLM forward, synchronized",
    (False, "copy_to_host"): "cat layers, unpad, .cpu()",
    (False, "write"): "serialize + write the files (no fsync)",
    (False, "other"): "batch building, loop overhead",
    (True, "setup"): "outside the loop: tokenize, plan, model build, manifest",
    (True, "data_wait"): "loop waiting on the DataLoader",
    (True, "forward_gpu"): "GPU span of the forwards (CUDA events)",
    (True, "copy_to_host_gpu"): "each forward's end to its device-to-host copy's end (own stream: overlaps the next forward)",
    (True, "idle_gpu"): "loop time with no forward on the GPU",
    (True, "forward_host"): "host time in forward + copy enqueue (overlaps the GPU)",
    (True, "writer_wait"): "loop blocked on a full writer queue",
    (True, "writer_drain"): "after the last forward, the writers finishing (part of idle_gpu)",
    (True, "write"): "writer threads, busy time summed: encode, tar, fsync (overlaps the GPU)",
}


def render_markdown(r: dict) -> str:
    """The Markdown report: settings, one table of every mode's figures, the time breakdowns, the first-shape
    cost, the profile of a profiled pass, and the consistency of the modes' states."""
    res = r["modes"]
    modes = [m for m in r["settings"]["modes"] if m in res]
    lines = _header_lines(r)
    lines += _mode_table_lines(res, modes)
    lines += _breakdown_lines(res, modes)
    lines += _warm_lines(r.get("warm_vs_cold"))
    lines += _profile_lines(res)
    lines += _consistency_lines(r["consistency"])
    return "\n".join(lines) + "\n"


def _header_lines(r: dict) -> list[str]:
    s = r["settings"]["samples"]
    info = r["model_info"]
    env = r["environment"]
    return [f"# Extraction benchmark: {r['model']} ({r['timestamp']})", "",
            f"- model: `{info['architecture']}` ({info['model_type']}), random {r['settings']['dtype']} weights, "
            f"{info['params_total'] / 1e9:.2f}B params, {info['decoder_params_all_layers'] / 1e9:.2f}B in "
            f"{info['num_hidden_layers']} decoder layers; captured after-layer ids {r['layer_ids']} "
            f"({r['layer_rule']}), stored as {r['settings']['storage_dtype']}",
            f"- device: {env.get('gpu', r['settings']['device'])}; torch {env['torch']}, transformers "
            f"{env['transformers']}, fla {env.get('fla')}, causal-conv1d {env.get('causal_conv1d')}, liger-kernel "
            f"{env.get('liger_kernel')}",
            f"- samples: lognormal(mu={s['mu']}, sigma={s['sigma']}) clipped to {s['clip']}, seed {s['seed']}: "
            f"{s['num_samples']} samples, mean {s['mean']:.0f}, median {s['median']:.0f}, p99 {s['p99']:.0f}, "
            f"max {s['max']} tokens; each mode runs a prefix of this list",
            f"- GEMM {r['gemm']['size']}^3 {r['gemm']['dtype']}: {r['gemm']['tflops']:.1f} TFLOP/s (median of "
            f"{r['gemm']['repeats']}): the MFU denominator",
            f"- outputs: {r['settings']['out_dir']['path']} ({r['settings']['out_dir']['fstype']}), deleted after "
            f"each mode: {r['settings']['out_dir']['deleted_after_each_mode']}; baselines' logits: "
            f"{r['settings']['baseline_logits']}; dflash-prep max_tokens_per_batch "
            f"{r['settings']['max_tokens_per_batch']} ({r['settings']['max_tokens_per_batch_how']})",
            f"- total wall time {r.get('wall_seconds', 0):.0f} s"
            + ("" if r.get("complete") else " (INCOMPLETE: the run stopped before its last mode)"), ""]


def _mode_rows(res: dict) -> list:
    """(row name, cell of a mode's result) of the main table, in order."""
    ref = res.get("per_sample", {}).get("tokens_per_second")
    ref_warm = res.get("per_sample_warm", {}).get("tokens_per_second")
    return [
        ("status", lambda m: m.get("status") if m.get("status") == "ok" else f"{m.get('status')}: {m.get('error')}"),
        ("samples", lambda m: _fmt(m.get("num_samples"))),
        ("real tokens", lambda m: _fmt(m.get("num_real_tokens"))),
        ("stopped by", lambda m: m.get("stopped_by", "-")),
        ("kernels (`model.kernels`)", lambda m: ", ".join(m["summary"]["kernels"]["applied"]) or "eager"
         if m.get("summary", {}).get("kernels") else "eager (baseline)"),
        ("loop seconds", lambda m: _fmt(m.get("loop_seconds"), ".1f")),
        ("**tokens/s** (real)", lambda m: _fmt(m.get("tokens_per_second"))),
        ("speed-up vs per-sample", lambda m: _fmt(m["tokens_per_second"] / ref, ".1f") + "x"
         if ref and m.get("tokens_per_second") else "-"),
        ("speed-up vs per-sample warm", lambda m: _fmt(m["tokens_per_second"] / ref_warm, ".1f") + "x"
         if ref_warm and m.get("tokens_per_second") else "-"),
        ("tokens/s excl. first-shape batches", lambda m: _fmt(m.get("tokens_per_second_excl_first_shapes"))),
        ("samples/s", lambda m: _fmt(m.get("samples_per_second"), ".2f")),
        ("MFU (executed layers)", lambda m: _fmt(m.get("mfu"), ".3f")),
        ("MFU (needed layers)", lambda m: _fmt(m.get("mfu_needed_layers"), ".3f")),
        ("decoder params executed (B)", lambda m: _fmt((m.get("decoder_params_executed") or 0) / 1e9, ".2f")),
        ("padding efficiency", lambda m: _fmt(m.get("padding_efficiency"), ".3f")),
        ("batches (batching.packing)", lambda m: "-" if not (m.get("summary") or {}).get("packing") else
         "packed rows" if m["summary"]["packing"].get("packed") else "padded"),
        ("forwards", lambda m: _fmt(m.get("num_forwards"))),
        ("distinct shapes", lambda m: _fmt(m.get("num_shapes"))),
        ("seconds in first-shape forwards", lambda m: _fmt(m.get("first_shape_seconds"), ".1f")),
        ("peak GPU memory (GB)", lambda m: _fmt((m["peak_gpu_memory_bytes"] / GB)
                                                if m.get("peak_gpu_memory_bytes") else None, ".1f")),
        ("written (GB)", lambda m: _fmt((m["bytes_written"] / GB) if m.get("bytes_written") is not None else None,
                                        ".2f")),
        ("write rate (GB/s of loop time)", lambda m: _fmt(m.get("write_gb_per_second"), ".3f")),
        ("model build (s)", lambda m: _fmt(m.get("build_seconds"), ".1f")),
        ("OOM splits", lambda m: _fmt(m.get("oom_splits"))),
        ("written ids = list prefix", lambda m: _fmt(m.get("sample_ids_are_prefix"))),
    ]


def _mode_table_lines(res: dict, modes: list[str]) -> list[str]:
    lines = ["| metric | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name, fn in _mode_rows(res):
        cells = []
        for mode in modes:
            try:
                cells.append(fn(res[mode]))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _breakdown_lines(res: dict, modes: list[str]) -> list[str]:
    """Time breakdowns: one table for the baselines, one for dflash-prep (their parts differ)."""
    lines = []
    for is_dflash, title in ((False, "Baselines"), (True, "dflash-prep")):
        group = [m for m in modes if m.startswith("dflash") == is_dflash and res[m].get("breakdown_seconds")]
        if not group:
            continue
        loops = ", ".join(f"{m} {res[m]['loop_seconds']:.1f} s" for m in group)
        lines += ["", f"{title}: time breakdown, seconds (share of the loop: {loops})", "",
                  "| part | " + " | ".join(group) + " | what |", "|---|" + "---|" * (len(group) + 1)]
        for part in res[group[0]]["breakdown_seconds"]:
            cells = []
            for m in group:
                v, loop = res[m]["breakdown_seconds"].get(part), res[m]["loop_seconds"]
                cells.append("-" if v is None else f"{v:.2f}" + (f" ({v / loop:.0%})" if loop and part != "setup" else ""))
            lines.append(f"| {part} | " + " | ".join(cells) + f" | {BREAKDOWN_NOTES.get((is_dflash, part), '')} |")
    return lines


def _warm_lines(warm_vs_cold: dict | None) -> list[str]:
    if not warm_vs_cold:
        return []
    lines = ["", "First-shape cost (cold pass minus warm pass over the same samples, same process; dflash_prep_fresh: a new process with the Triton cache the earlier passes filled):", "",
             "| mode | cold forward s | warm forward s | extra s | shapes | extra s per shape | cold tok/s | "
             "warm tok/s |", "|---|---|---|---|---|---|---|---|"]
    for mode, w in warm_vs_cold.items():
        lines.append(f"| {mode} | {w['cold_forward_seconds']:.1f} | {w['warm_forward_seconds']:.1f} | "
                     f"{w['first_shape_overhead_seconds']:.1f} | {w['num_shapes']} | "
                     f"{_fmt(w['overhead_per_shape_seconds'], '.2f')} | {_fmt(w['cold_tokens_per_second'])} | "
                     f"{_fmt(w['warm_tokens_per_second'])} |")
    return lines


def _profile_lines(res: dict) -> list[str]:
    lines = []
    for mode, m in res.items():
        prof = m.get("profile") if isinstance(m, dict) else None
        if not prof:
            continue
        unit = "GPU kernel time" if prof["device"] == "cuda" else "CPU op time"
        lines += ["", f"Where the time goes ({mode}, torch.profiler, {unit} {prof['total_seconds']:.1f} s; "
                      f"{prof['note']}):", "", "| category | seconds | share |", "|---|---|---|"]
        lines += [f"| {c} | {v['seconds']:.2f} | {v['share']:.1%} |" for c, v in prof["categories"].items()]
        lines += ["", "| top kernels | calls | seconds | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['seconds']:.2f} | {k['share']:.1%} |"
                  for k in prof["top"][:15]]
    return lines


def _consistency_lines(c: dict) -> list[str]:
    lines = ["", f"Consistency (states read back from disk, first samples; same weights in every mode: "
             f"{_fmt(c['same_weights'])}):", "",
             "| pair | samples | input_ids equal | max abs diff | max rel L2 (per captured layer) |", "|---|---|---|---|---|"]
    for pair, v in c["pairs"].items():
        per_layer = ", ".join(f"{x:.2g}" for x in v["max_rel_l2_per_layer"])
        lines.append(f"| {pair} | {v['samples_compared']} | {_fmt(v['input_ids_equal'])} | "
                     f"{v['max_abs_diff']:.3g} (ref max {v['max_abs_ref']:.3g}) | {v['max_rel_l2']:.3g} "
                     f"({per_layer}) |")
    return lines

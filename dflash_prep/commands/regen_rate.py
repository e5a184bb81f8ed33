"""The generated tokens/s `dflash-prep plan` times a regeneration with, and where that figure comes from.

- Given (`--generated-tokens-per-second X`): the user's measurement, for any engine (all servers or processes of the
  run together).
- `engine: transformers` without one: the in-process engine's benchmark (bench/regen_bench.py, the committed
  `regen-bench.json` reports under the benchmark folder, GPU runs only; not its float32 slices, run for the
  exactness check only; in a report that timed several decoder settings, the pass of the engine's defaults, and
  none where no pass ran them): of each benchmark model's newest report with a warm pass (a long job's steady
  state; a check run's cold pass alone carries its kernels' first autotuning), else its newest report,
  the one of the same architecture (`model_type`) nearest in decoder parameters, else the nearest of any (within
  BENCH_MAX_PARAM_RATIO); its static decoder's warm pass (else its cold pass), scaled by decoder parameters
  (decoding reads every weight once a step: its rate goes as 1 / parameters), times the run's GPUs (one engine
  each). The benchmark's tokens/s include the
  prefill of its own prompts (mean ~430 tokens, 128-256 new tokens each): prompts much longer than that take longer.
- `engine: openai` without one: no figure (the rate is the servers').
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

BENCH_MAX_PARAM_RATIO = 4.0


def regen_bench_references(results_dir: Path | None) -> list[dict]:
    """The static decoder's figure of every model of every GPU `regen-bench.json` under `results_dir` (any depth),
    newest report first: {model, file, started, gpu, model_type, decoder_params, generated_tokens_per_second, pass,
    prompt_tokens_mean, max_tokens, decode_path}. Reports of other versions of the benchmark are left out."""
    refs = []
    for path in sorted(Path(results_dir).rglob("regen-bench.json")) if results_dir else ():
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        gpu = (report.get("environment") or {}).get("gpu") if isinstance(report, dict) else None
        for name, r in ((report.get("models") or {}).items() if gpu else ()):
            static = _default_pass(r)
            figures, which = (static.get("warm"), "warm") if static.get("warm") else (static.get("cold"), "cold")
            if (r.get("status") != "ok" or not figures or not r.get("decoder_params") or not r.get("model_type")
                    or r.get("exactness_only")):  # a float32 slice run for the exactness check: no rate
                continue
            refs.append({"model": name, "file": str(path), "started": str(report.get("started", "")), "gpu": gpu,
                         "model_type": r["model_type"], "decoder_params": int(r["decoder_params"]),
                         "generated_tokens_per_second": float(figures["generated_tokens_per_second"]),
                         "pass": which, "prompt_tokens_mean": (r.get("prompts") or {}).get("prompt_tokens_mean"),
                         "max_tokens": r.get("max_tokens"), "decode_path": r.get("decode_path")})
    return sorted(refs, key=lambda ref: ref["started"], reverse=True)


def variant_label(prefill: str, span_cost_keys: int | None, key_limit_graphs: int,
                  decode_kernel: str = "sdpa") -> str:
    """The label of a static decoder pass in the benchmark's report (bench/regen_bench.py `variant_passes`), e.g.
    "prefill auto, span cost 8,192 keys, 1 key limit" or "prefill auto, flex attention" (spans and key limits do
    not apply to it): what `_default_pass` reads back."""
    if decode_kernel == "flex":
        return f"prefill {prefill}, flex attention"
    spans = "no row spans" if span_cost_keys is None else f"span cost {span_cost_keys:,} keys"
    return f"prefill {prefill}, {spans}, {key_limit_graphs} key limit{'s' if key_limit_graphs > 1 else ''}"


# `variant_label`'s text; reports written before key limits end after the spans ("prefill auto, no row spans")
_VARIANT_LABEL = re.compile(r"prefill (\w+), (?:(flex attention)|no row spans|span cost ([\d,]+) keys)"
                            r"(?:, (\d+) key limits?)?$")


def _default_pass(model_entry: dict) -> dict:
    """The static decoder's passes ({cold, warm}) that ran the engine's defaults: in a report of several variants
    (an A/B of decoder settings), the one whose label says `prefill auto` or `prefill packed` (auto packs wherever
    packing applies, and a packed pass runs only there) and the decode kernel `auto` takes for the model on CUDA
    (for sdpa, the default span price and key limits) (none matching: {}); else the report's own figures (one
    configuration, as the engine ran then)."""
    from dflash_prep.regen.attention import DEFAULT_SPAN_COST_KEYS
    from dflash_prep.regen.decode import DECODE_KERNEL, KEY_LIMIT_GRAPHS, resolve_decode_kernel

    # the benchmark's reports are a GPU's; older ones do not say what `auto` chose, their decode path does
    kernel = model_entry.get("default_decode_kernel") or resolve_decode_kernel(
        DECODE_KERNEL, "cuda", "Gated DeltaNet" in str(model_entry.get("decode_path") or ""))
    variants = model_entry.get("static_variants") or {}
    if len(variants) < 2:
        return model_entry.get("static") or {}
    for label, entry in variants.items():
        match = _VARIANT_LABEL.match(str(label))
        if match is None or match.group(1) not in ("auto", "packed"):
            continue
        flex, cost, graphs = match.group(2) is not None, match.group(3), int(match.group(4) or 1)
        default = (kernel == "flex") if flex else (
            kernel == "sdpa" and cost is not None and int(cost.replace(",", "")) == DEFAULT_SPAN_COST_KEYS
            and graphs == KEY_LIMIT_GRAPHS)
        if default:
            return entry if isinstance(entry, dict) else {}
    return {}


def regen_rate(engine: str, given: float | None, model_type: str | None, decoder_params: int | None,
               num_gpus: int, figures: dict | None, where: str = "the benchmark figures") -> dict:
    """{generated_tokens_per_second (None: no basis), source (in words), reference (the benchmark's entry or
    None), scale} for the regeneration of `engine` on `num_gpus` GPUs (the module docstring says which).
    `figures`: commands/bench_figures.py's (its `regeneration` references), None for none; `where`: their source,
    in words."""
    if given:
        return {"generated_tokens_per_second": given, "source": "given with --generated-tokens-per-second",
                "reference": None, "scale": None}
    if engine != "transformers":
        return {"generated_tokens_per_second": None, "reference": None, "scale": None,
                "source": "no measured basis here: the rate is the servers'; pass --generated-tokens-per-second X "
                          "measured on them"}
    refs, seen = [], set()
    # the newest warm pass of each benchmark model, else its newest cold one (a stable sort keeps newest first)
    for ref in sorted((figures or {}).get("regeneration") or [], key=lambda r: r["pass"] != "warm"):
        if ref["model"] not in seen:
            seen.add(ref["model"])
            refs.append(ref)
    same = [r for r in refs if r["model_type"] == model_type]
    pool = sorted(same or refs, key=lambda r: abs(math.log(r["decoder_params"] / max(decoder_params or 1, 1))))
    ref = pool[0] if pool and (same or decoder_params) else None
    ratio = ref["decoder_params"] / decoder_params if ref and decoder_params else 1.0
    if ref is None or not 1 / BENCH_MAX_PARAM_RATIO <= ratio <= BENCH_MAX_PARAM_RATIO:
        why = ("no GPU report of the in-process engine's benchmark (bench/regen_bench.py) in " + where
               if ref is None else f"no benchmark of the in-process engine within {BENCH_MAX_PARAM_RATIO:g}x of "
               f"this model's decoder parameters (nearest: {ref['model']})")
        return {"generated_tokens_per_second": None, "reference": ref, "scale": None,
                "source": f"{why}; pass --generated-tokens-per-second X measured on your GPUs"}
    rate = ref["generated_tokens_per_second"] * ratio * num_gpus
    source = (f"the in-process engine's benchmark {Path(ref['file']).parent.name}/{Path(ref['file']).name} "
              f"({ref['model']} shape, static decoder {ref['pass']} pass, {ref['generated_tokens_per_second']:,.0f} "
              f"generated tok/s on one {ref['gpu']}, prefill of its prompts included"
              + (f"; scaled x{ratio:.2f} by decoder parameters" if abs(ratio - 1) > 0.01 else "")
              + (f"; {'same architecture' if same else 'nearest benchmarked model'}") + f") x {num_gpus} GPU"
              + ("s" if num_gpus > 1 else ""))
    return {"generated_tokens_per_second": rate, "source": source, "reference": ref, "scale": ratio}

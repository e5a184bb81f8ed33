#!/usr/bin/env python
"""Regeneration benchmark: the in-process engine's static-cache / CUDA-graph decoder against its HF `generate`
batches, same process, same model, same prompts.

    python bench/regen_bench.py OUT_DIR [--models llama3.1-8b,qwen3.6-27b] [--deadline-seconds 450] ...
    python bench/regen_bench.py OUT_DIR --dry-run      # tiny-llama + tiny-qwen3.5 on the CPU, in seconds

For each model (random bf16 weights from bench/configs/, drawn on the device by `load_model` inside the engine; the
demo tokenizer renders the prompts) it draws a fixed list of chat prompts (one user message each; lengths
lognormal, seeded), then measures in one process, greedy, `max_tokens` new tokens each, EOS ignored
(`ignore_eos=True`):

  static     `TransformersEngine.answer(all prompts)` on its default decoder (regen/decode.py: static cache, the
             decode step replayed as a CUDA graph, chunked prefill), the token budget `static_tokens_per_batch`.
             Cold pass (first-seen shapes: Triton autotuning included), then, time permitting, a warm pass.
  generate   the same engine and prompts on `decoder=generate` (HF `generate` over the same length-sorted
             batches, the budget `max_tokens_per_batch`: the engine as it was before the static decoder), cold.
  check      the first `check_prompts` prompts one at a time through `model.generate` (no padding, no batch),
             `check_tokens` new tokens: how many leading tokens equal the static pass's (exact in float32 on the
             CPU; in bf16 a batch's other rounding can flip an argmax where two logits nearly tie, and the rest of
             that answer then differs).

Reported per model: generated tokens/s (new tokens / wall seconds, prefill included), ms per decode step (the
static decoder's own timing of its decode loop; `generate`: wall seconds per batch step, prefill included), prefill
seconds, batches, peak GPU memory, the decode path in words (which loop, and for the Gated DeltaNet hybrid which
recurrence kernel), CUDA graph captures / failures, the greedy agreement and whether the two decoders wrote the same
texts. Writes OUT_DIR/regen-bench.json and OUT_DIR/regen-bench.md, and prints timings as it goes. Random weights:
the figures measure the generation machinery, not a checkpoint's answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if sys.path and Path(sys.path[0] or ".").resolve() == BENCH_DIR:  # as run_bench.py: `bench` is a package
    sys.path.pop(0)
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench  # noqa: E402, F401 - sets PYTORCH_CUDA_ALLOC_CONF before torch is imported
from bench.context import environment  # noqa: E402
from bench.models import CONFIG_DIR, TOKENIZER_DIR  # noqa: E402
from bench.timing import free_memory, peak_memory, sync  # noqa: E402
from dflash_prep.regen.attention import DEFAULT_SPAN_COST_KEYS  # noqa: E402
from dflash_prep.regen.decode import (DECODE_KERNEL, KEY_LIMIT_GRAPHS, _has_gated_deltanet,  # noqa: E402
                                      resolve_decode_kernel)


@dataclass(frozen=True)
class RegenSpec:
    """One benchmark model and its sizes (one H200 for the big ones: about 2.5 minutes each). `layers`: the config's
    first layers only (a slice); `exactness_only`: no timed passes beyond what the check needs (the float32
    slices)."""

    config: str
    dtype: str
    num_prompts: int
    max_tokens: int
    max_tokens_per_batch: int  # the generate decoder's budget (the engine's before the static decoder)
    static_tokens_per_batch: int  # the static decoder's: KV cache and states of a batch at its end
    min_seconds: float  # what the model needs at least (build + both cold passes): kept free by the models before it
    check_prompts: int = 4  # greedy agreement with `generate` alone on these first prompts
    check_tokens: int = 32
    forced_prompts: int = 48  # the teacher-forced batch (regen_exactness.py), the check prompts first
    generate_prompts: int | None = None  # the generate pass on the first ones only (None: all)
    mu: float = 5.5  # prompt lengths ~ lognormal(mu, sigma) tokens, clipped: median ~245, mean ~340
    sigma: float = 0.8
    max_prompt_tokens: int = 2048
    layers: int | None = None
    exactness_only: bool = False
    profile_rows: int = 0  # an eager decode step of the first prompts profiled (regen_exactness.decode_step_profile)


SPECS = {
    "llama3.1-8b": RegenSpec("llama3.1-8b.json", "bfloat16", num_prompts=256, max_tokens=256,
                             max_tokens_per_batch=131072, static_tokens_per_batch=1 << 20, min_seconds=150,
                             generate_prompts=64, profile_rows=128),
    "qwen3.6-27b": RegenSpec("qwen3.6-27b.json", "bfloat16", num_prompts=64, max_tokens=128,
                             max_tokens_per_batch=65536, static_tokens_per_batch=1 << 20, min_seconds=170,
                             forced_prompts=24, generate_prompts=32, profile_rows=64),
    # float32 slices on the GPU (tf32 off, CUDA graph on): greedy must agree with `generate` alone exactly
    "llama3.1-8b-fp32": RegenSpec("llama3.1-8b.json", "float32", num_prompts=32, max_tokens=32,
                                  max_tokens_per_batch=131072, static_tokens_per_batch=131072, min_seconds=30,
                                  check_prompts=8, forced_prompts=32, layers=4, exactness_only=True),
    "qwen3.6-27b-fp32": RegenSpec("qwen3.6-27b.json", "float32", num_prompts=24, max_tokens=32,
                                  max_tokens_per_batch=65536, static_tokens_per_batch=65536, min_seconds=60,
                                  check_prompts=8, forced_prompts=24, layers=4, exactness_only=True),
    "tiny-llama": RegenSpec("tiny-llama.json", "float32", num_prompts=12, max_tokens=8, max_tokens_per_batch=4096,
                            static_tokens_per_batch=4096, min_seconds=5, check_tokens=8, forced_prompts=8, mu=4.0,
                            max_prompt_tokens=300, generate_prompts=8, profile_rows=8),
    "tiny-qwen3.5": RegenSpec("tiny-qwen3.5.json", "float32", num_prompts=12, max_tokens=8,
                              max_tokens_per_batch=4096, static_tokens_per_batch=4096, min_seconds=5,
                              check_tokens=8, forced_prompts=8, mu=4.0, max_prompt_tokens=300),
    "tiny-qwen3.5-fp32": RegenSpec("tiny-qwen3.5.json", "float32", num_prompts=8, max_tokens=8,
                                   max_tokens_per_batch=4096, static_tokens_per_batch=4096, min_seconds=5,
                                   check_tokens=8, forced_prompts=8, mu=4.0, max_prompt_tokens=300, layers=4,
                                   exactness_only=True),
}
# the 27B slice last: its first-seen flash-linear-attention shapes in float32 cost the most per figure
GPU_MODELS = ("llama3.1-8b-fp32", "llama3.1-8b", "qwen3.6-27b", "qwen3.6-27b-fp32")
DRY_RUN_MODELS = ("tiny-qwen3.5-fp32", "tiny-llama", "tiny-qwen3.5")


def config_path(spec: RegenSpec, out_dir: Path) -> Path:
    """The spec's config, or for a slice its first `layers` layers written to OUT_DIR/configs/."""
    path = CONFIG_DIR / spec.config
    if spec.layers is None:
        return path
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"] = spec.layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:spec.layers]
    sliced = out_dir / "configs" / f"{path.stem}-{spec.layers}-layers.json"
    sliced.parent.mkdir(parents=True, exist_ok=True)
    sliced.write_text(json.dumps(config, indent=2) + "\n")
    return sliced


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)


def make_prompts(tokenizer, spec: RegenSpec, seed: int) -> tuple[list[list[dict]], dict]:
    """`spec.num_prompts` one-message chats whose texts are decoded random token ids (ids 3.. of the tokenizer: no
    special tokens) of lognormal lengths; re-tokenized they come out near the drawn length."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(spec.mu, spec.sigma, spec.num_prompts)), 8, spec.max_prompt_tokens)
    prompts = [[{"role": "user", "content": tokenizer.decode(rng.integers(3, len(tokenizer), int(n)).tolist())}]
               for n in lengths]
    return prompts, {"num_prompts": spec.num_prompts, "distribution": "lognormal", "mu": spec.mu,
                     "sigma": spec.sigma, "clip": [8, spec.max_prompt_tokens], "seed": seed}


def engine_pass(engine, requests, device) -> dict:
    """One `answer` call over all requests on the engine's current decoder, timed to its last token; the generated
    ids of each prompt recorded (`_ids`: prompt ids tuple -> new ids) from the batches the decoder ran."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    decoder = engine.decoder
    before = None if decoder is None else dict(vars(decoder.stats))
    calls_before, ids, real = engine.num_generate_calls, {}, engine._generate

    def recording(input_ids, attention_mask, new_tokens, processors):
        out = real(input_ids, attention_mask, new_tokens, processors)
        for row, mask, new in zip(input_ids.tolist(), attention_mask.bool().tolist(), out.tolist()):
            ids[tuple(t for t, m in zip(row, mask) if m)] = new
        return out

    engine._generate = recording
    try:
        sync(device)
        t = time.perf_counter()
        answers = engine.answer(requests)
        sync(device)
        seconds = time.perf_counter() - t
    finally:
        del engine._generate
    generated = sum(a.completion_tokens for a in answers)
    calls = engine.num_generate_calls - calls_before
    out = {"seconds": seconds, "requests": len(requests), "rejected": sum(a.rejected is not None for a in answers),
           "generated_tokens": generated, "prompt_tokens": sum(a.prompt_tokens for a in answers),
           "generated_tokens_per_second": generated / seconds, "requests_per_second": len(requests) / seconds,
           "batches": calls, "out_of_memory_splits": engine.num_ooms, "peak_memory_bytes": peak_memory(device),
           "_answers": answers, "_ids": ids}
    if decoder is None:
        steps = calls * requests[0].max_tokens
        out["ms_per_batch_step_prefill_included"] = 1e3 * seconds / steps if steps else None
    else:
        delta = {k: v - before[k] for k, v in vars(decoder.stats).items()}
        out.update(prefill_seconds=delta["prefill_seconds"], decode_seconds=delta["decode_seconds"],
                   decode_steps=delta["decode_steps"], graph_captures=delta["graph_captures"],
                   graph_failures=delta["graph_failures"], prefill_forwards=delta["prefill_forwards"],
                   prompt_tokens_prefilled=delta["prompt_tokens_prefilled"],
                   prefill_computed_tokens=delta["prefill_computed_tokens"], decode_spans=delta["decode_spans"],
                   flex_failures=delta["flex_failures"], flex_shape_overflows=delta["flex_shape_overflows"],
                   ms_per_decode_step=1e3 * delta["decode_seconds"] / max(delta["decode_steps"], 1))
    return out


def build_engine(name: str, spec: RegenSpec, kernels: str, args, device, t0: float, result: dict):
    """The engine on `device` (EOS ignored, the static decoder) after a smoke call (2 prompts, 4 new tokens), or
    None (the error in `result["errors"]`, memory freed)."""
    from dflash_prep.recipe.schema import ModelSection
    from dflash_prep.regen.engine import Request
    from dflash_prep.regen.hf_engine import TransformersEngine
    from dflash_prep.target.model import decoder_params_in

    section = ModelSection(config=str(config_path(spec, args.out_dir)), tokenizer=str(TOKENIZER_DIR), dtype=spec.dtype,
                           init_seed=0, kernels=kernels if kernels in ("auto", "eager") else kernels.split(","))
    engine = None
    try:
        t = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        prefill, cost, graphs, kernel = decoder_variants(args)[0]
        engine = TransformersEngine(section, device, args.static_tokens_per_batch or spec.static_tokens_per_batch,
                                    ignore_eos=True, cuda_graphs=args.cuda_graphs, prefill=prefill,
                                    span_cost_keys=cost, key_limit_graphs=graphs, decode_kernel=kernel)
        sync(device)
        text = engine.config.get_text_config() if hasattr(engine.config, "get_text_config") else engine.config
        result.update(build_seconds=time.perf_counter() - t, kernels=engine.kernels, decode_path=engine.decode_path,
                      default_decode_kernel=resolve_decode_kernel("auto", device.type,
                                                                  _has_gated_deltanet(engine.model)),
                      model_type=getattr(text, "model_type", None), decoder_params=decoder_params_in(engine.model),
                      max_batch_size=engine.max_batch_size, params=sum(p.numel() for p in engine.model.parameters()),
                      weights_memory_bytes=peak_memory(device))
        log(f"{name}: built in {result['build_seconds']:.1f} s ({result['params'] / 1e9:.2f}B parameters, kernels "
            f"{engine.kernels['applied'] or 'eager'}); {engine.decode_path}", t0)
        smoke = [Request(messages=[{"role": "user", "content": text}], tools=None, sampling={}, seed=0, max_tokens=4)
                 for text in ("Hello there.", "A somewhat longer question about the weather in spring?")]
        counts = [a.completion_tokens for a in engine.answer(smoke)]
        if counts != [4, 4]:
            raise RuntimeError(f"the smoke call generated {counts} tokens, not [4, 4]")
        return engine
    except Exception as e:  # noqa: BLE001 - reported; the caller may try eager
        result.setdefault("errors", []).append(f"kernels {kernels}: {type(e).__name__}: {e}")
        log(f"{name}: FAILED with kernels {kernels}: {type(e).__name__}: {e}", t0)
        if engine is not None:
            engine.close()
        del engine
        free_memory(device)
        return None


def _public(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if not k.startswith("_")}


def _rate(figures: dict) -> str:
    return (f"{figures['generated_tokens_per_second']:.0f} generated tok/s ({figures['seconds']:.1f} s, "
            f"{figures['batches']} batches)")


def _warm_estimate(cold: dict) -> float:
    """Seconds a warm pass takes, from the cold one's figures: about its decode and a fraction of its prefill (the
    hybrid's cold prefill is mostly Triton autotuning of first-seen shapes)."""
    return 1.5 * cold["decode_seconds"] + 0.5 * cold["prefill_seconds"] + 5


def static_passes(name, engine, requests, args, device, t0, deadline, reserve, result) -> dict | None:
    """The static decoder's cold pass (then warm, time permitting) -> the cold pass's figures (with `_ids`), or
    None when it failed (the error in `result["errors"]`)."""
    try:
        cold = engine_pass(engine, requests, device)
        log(f"{name}: static cold pass {_rate(cold)}, {cold['ms_per_decode_step']:.1f} ms per decode step, prefill "
            f"{cold['prefill_seconds']:.1f} s ({cold['prefill_forwards']} forwards, {cold['prompt_tokens_prefilled']:,} "
            f"prompt tokens of {cold['prefill_computed_tokens']:,} computed), {cold['decode_spans']} decode row "
            f"spans, graph captures {cold['graph_captures']} (failed {cold['graph_failures']}), flex failures "
            f"{cold['flex_failures']}, batches past the flex shape cap {cold['flex_shape_overflows']}", t0)
        result["static"] = {"cold": _public(cold), "warm": None}
        if args.warm and not SPECS[name].exactness_only and \
                time.perf_counter() + _warm_estimate(cold) < deadline - reserve:
            warm = engine_pass(engine, requests, device)
            result["static"]["warm"] = _public(warm)
            log(f"{name}: static warm pass {_rate(warm)}, {warm['ms_per_decode_step']:.1f} ms per decode step, prefill "
                f"{warm['prefill_seconds']:.1f} s, decode {warm['decode_seconds']:.1f} s", t0)
        return cold
    except Exception as e:  # noqa: BLE001 - reported; the generate decoder is still measured
        result.setdefault("errors", []).append(f"static decoder: {type(e).__name__}: {e}")
        log(f"{name}: static decoder FAILED {type(e).__name__}: {e}", t0)
        free_memory(device)
        return None


def decoder_variants(args) -> list[tuple]:
    """[(prefill, span_cost_keys, key_limit_graphs, decode_kernel)] the static decoder runs, first to last: per
    `--decode-kernel`, per `--prefill`, sdpa's every span price and key limit count (flex takes neither; `auto`
    takes them, for where it runs sdpa)."""
    return [(p, c, g, k) for k in args.decode_kernel for p in args.prefill
            for c, g in ([(c, g) for c in args.span_cost_keys for g in args.key_limit_graphs] if k != "flex"
                         else [(None, 1)])]


def variant_passes(name, engine, requests, args, device, t0, deadline, reserve, result) -> None:
    """The static decoder again (cold, then warm) for each further variant of `decoder_variants` (`--decode-kernel`,
    `--prefill`, `--span-cost-keys`, `--key-limit-graphs`) after the first, on the same engine and prompts, into
    result["static_variants"][variant]; the engine's first decoder restored after. A variant that does not apply
    to the model (ValueError) or fails is recorded, not raised."""
    from dflash_prep.commands.regen_rate import variant_label as label
    from dflash_prep.regen.decode import StaticCacheDecoder

    first = engine.decoder
    variants = decoder_variants(args)
    # labelled by the kernel each decoder runs (`auto` resolved for the model and device): what regen_rate reads
    def ran(decoder) -> str:
        return "flex" if decoder.flex else "sdpa"  # flex only where the model's attention is ours

    result["static_variants"] = {label(*variants[0][:3], ran(first)): {"path": first.path,
                                                                       **(result.get("static") or {})}}
    gated_deltanet = _has_gated_deltanet(engine.model)
    for mode, cost, graphs, kernel in variants[1:]:
        entry, tag = {}, label(mode, cost, graphs, resolve_decode_kernel(kernel, device.type, gated_deltanet))
        try:
            engine.decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=first.prefill_tokens,
                                                cuda_graphs=args.cuda_graphs, prefill=mode, span_cost_keys=cost,
                                                key_limit_graphs=graphs, decode_kernel=kernel)
            tag = label(mode, cost, graphs, ran(engine.decoder))
            if tag in result["static_variants"]:
                continue  # `auto` named a kernel timed already
            entry["path"] = engine.decoder.path
            cold = engine_pass(engine, requests, device)
            entry["cold"] = _public(cold)
            log(f"{name}: {tag}: cold {_rate(cold)}, prefill {cold['prefill_seconds']:.1f} s "
                f"({cold['prefill_forwards']} forwards), {cold['decode_spans']} decode row spans", t0)
            if args.warm and time.perf_counter() + _warm_estimate(cold) < deadline - reserve:
                warm = entry["warm"] = _public(engine_pass(engine, requests, device))
                log(f"{name}: {tag}: warm {_rate(warm)}, prefill {warm['prefill_seconds']:.1f} "
                    f"s, decode {warm['decode_seconds']:.1f} s, {warm['ms_per_decode_step']:.1f} ms per step", t0)
        except Exception as e:  # noqa: BLE001 - one variant's failure is a figure of the report
            entry["error"] = f"{type(e).__name__}: {e}"
            log(f"{name}: {tag} FAILED {type(e).__name__}: {e}", t0)
            free_memory(device)
        finally:
            result["static_variants"].setdefault(tag, entry)
            engine.decoder = first


def generate_pass(name, engine, requests, spec, args, device, t0) -> dict:
    """The same engine on HF `generate` batches under the generate budget, cold; the engine restored after."""
    decoder, budget = engine.decoder, engine.max_tokens_per_batch
    engine.decoder, engine.token_cap = None, None
    engine.max_tokens_per_batch = args.max_tokens_per_batch or spec.max_tokens_per_batch
    try:
        figures = engine_pass(engine, requests[:spec.generate_prompts], device)
    finally:
        engine.decoder, engine.max_tokens_per_batch, engine.token_cap = decoder, budget, None
    log(f"{name}: generate pass {_rate(figures)}, "
        f"{figures['ms_per_batch_step_prefill_included']:.1f} ms per batch step (prefill included)", t0)
    return figures


def check_and_compare(name, engine, requests, static, generate, spec, device, t0, result) -> None:
    """The exactness check (regen_exactness.py) and static vs generate texts into `result`, logged."""
    from bench.regen_exactness import exactness

    from bench.regen_exactness import decode_step_profile, prefill_profile

    if spec.profile_rows:
        try:
            prof = result["decode_step_profile"] = decode_step_profile(engine, requests, spec.profile_rows, device)
            log(f"{name}: an eager decode step of {prof['rows']} rows x width {prof['width']}: "
                f"{prof['device_ms_per_step']} device ms; top: " + "; ".join(
                    f"{k['name'][:60]} {k['ms_per_step']:.2f} ms" for k in prof["top"][:6]), t0)
        except Exception as e:  # noqa: BLE001 - a profile is a diagnosis, never the benchmark's failure
            result.setdefault("errors", []).append(f"decode step profile: {type(e).__name__}: {e}")
        try:
            prof = result["prefill_profile"] = prefill_profile(engine, requests, spec.profile_rows, device)
            log(f"{name}: the prefill of {prof['rows']} rows ({prof['prompt_tokens']} prompt tokens, width "
                f"{prof['width']}): {prof['device_ms']} device ms; top: " + "; ".join(
                    f"{k['name'][:60]} {k['ms']:.1f} ms" for k in prof["top"][:6]), t0)
        except Exception as e:  # noqa: BLE001 - a diagnosis too
            result.setdefault("errors", []).append(f"prefill profile: {type(e).__name__}: {e}")
    n = min(spec.check_tokens, requests[0].max_tokens)
    check = result["check"] = exactness(engine, requests, static["_ids"], generate["_ids"], spec.check_prompts,
                                        max(spec.forced_prompts, spec.check_prompts), n, device, spec.dtype)
    texts = [a.content for a in static["_answers"]], [a.content for a in generate["_answers"]]
    result["same_text_static_vs_generate"] = sum(a == b for a, b in zip(*texts))
    result["same_text_compared"] = len(texts[1])
    greedy, forced = check["greedy"], check["teacher_forced"]
    log(f"{name}: greedy vs generate alone ({greedy['tokens_each']} tokens of {greedy['prompts']} prompts): "
        f"static batches {greedy['static']['leading_tokens_equal']}, generate batches (control) "
        f"{greedy['generate_batched']['leading_tokens_equal']}; teacher-forced max relative logit error: static "
        f"{forced['static_batched']['max_relative_error']:.2e}, generate batched "
        f"{forced['generate_batched']['max_relative_error']:.2e}, generate alone "
        f"{forced['generate_alone']['max_relative_error']:.2e} (argmax flips {forced['static_batched']['argmax_flips']}"
        f" / {forced['generate_batched']['argmax_flips']} / {forced['generate_alone']['argmax_flips']}): "
        f"{check['verdict']}; same text static vs generate batches: {result['same_text_static_vs_generate']} of "
        f"{len(texts[1])}", t0)


def run_model(name: str, args, device, t0: float, deadline: float, reserve: float) -> dict:
    from dflash_prep.regen.engine import Request

    spec = SPECS[name]
    max_tokens = args.max_tokens or spec.max_tokens
    result = {"config": spec.config, "dtype": spec.dtype, "layers": spec.layers, "exactness_only": spec.exactness_only,
              "max_tokens": max_tokens, "kernels_requested": args.kernels,
              "static_tokens_per_batch": args.static_tokens_per_batch or spec.static_tokens_per_batch,
              "max_tokens_per_batch": args.max_tokens_per_batch or spec.max_tokens_per_batch}
    if spec.dtype == "float32":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # exact float32 GEMMs
    engine = build_engine(name, spec, args.kernels, args, device, t0, result)
    if engine is None and args.kernels != "eager":  # fused kernels that fail in generation: measure eager
        engine = build_engine(name, spec, "eager", args, device, t0, result)
    if engine is None:
        result["status"] = "failed"
        return result
    prompts, result["prompts"] = make_prompts(engine.tokenizer, spec, args.seed)
    requests = [Request(messages=m, tools=None, sampling={}, seed=i, max_tokens=max_tokens)
                for i, m in enumerate(prompts)]
    lengths = [len(engine.render(r)) for r in requests]
    result["prompts"].update(prompt_tokens_mean=float(np.mean(lengths)), prompt_tokens_min=min(lengths),
                             prompt_tokens_max=max(lengths), prompt_tokens_median=float(np.median(lengths)))
    static = static_passes(name, engine, requests, args, device, t0, deadline, reserve + spec.min_seconds / 2,
                           result)
    result["decode_path"] = engine.decode_path  # a capture that failed (in the smoke call too) shows here
    result["graph_failures_total"] = engine.decoder.stats.graph_failures
    variant_passes(name, engine, requests, args, device, t0, deadline, reserve, result)
    try:
        generate = generate_pass(name, engine, requests, spec, args, device, t0)
        result["generate"] = _public(generate)
        if static is not None:
            result["speedup_vs_generate"] = (static["generated_tokens_per_second"]
                                             / generate["generated_tokens_per_second"])
        if static is not None and args.check:
            check_and_compare(name, engine, requests, static, generate, spec, device, t0, result)
        result["status"] = "ok" if static is not None else "failed"
    except Exception as e:  # noqa: BLE001 - one model's failure is reported, the next model still runs
        result.update(status="failed")
        result.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        log(f"{name}: FAILED {type(e).__name__}: {e}", t0)
    engine.close()
    del engine
    free_memory(device)
    return result


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.1f} GB"


def _perf_row(name: str, r: dict) -> str:
    cold, warm, gen = r["static"]["cold"], r["static"]["warm"], r["generate"]
    p = r["prompts"]
    return (f"| {name} | {p['num_prompts']} ({p['prompt_tokens_mean']:.0f} / {p['prompt_tokens_max']}) x "
            f"{r['max_tokens']} | {cold['generated_tokens_per_second']:,.0f} | "
            f"{'-' if warm is None else format(warm['generated_tokens_per_second'], ',.0f')} | "
            f"{(warm or cold)['ms_per_decode_step']:.1f} | {cold['prefill_seconds']:.1f} / "
            f"{'-' if warm is None else format(warm['prefill_seconds'], '.1f')} | {cold['batches']} | "
            f"{gen['generated_tokens_per_second']:,.0f} ({gen['requests']} prompts, {gen['batches']} batches) | "
            f"{r['speedup_vs_generate']:.1f}x | {_gb(cold['peak_memory_bytes'])} / {_gb(gen['peak_memory_bytes'])} |")


def _check_row(name: str, r: dict) -> str:
    c = r["check"]
    g, f = c["greedy"], c["teacher_forced"]

    def rel(path: str) -> str:
        x = f[path]
        return f"{x['max_relative_error']:.1e} / {x['median_relative_error']:.1e} ({x['argmax_flips']})"

    return (f"| {name} | {r['dtype']} | {g['static']['leading_tokens_equal']} | "
            f"{g['generate_batched']['leading_tokens_equal']} | {rel('static_batched')} | {rel('generate_batched')} | "
            f"{rel('generate_alone')} | {f['static_batched']['rows']} x {g['tokens_each']} | **{c['verdict']}** |")


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Regeneration benchmark ({report['started']})", "",
             f"{env.get('gpu') or env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
             f"flash-linear-attention {env.get('fla')}, liger-kernel {env.get('liger_kernel')}. Random weights, "
             "greedy, EOS ignored.", "",
             "| model | prompts (mean / max tokens) x new tokens | static cold tok/s | static warm tok/s | "
             "ms / decode step | prefill s cold / warm | batches | generate tok/s | speedup | peak memory static / "
             "generate |", "|---|---|---|---|---|---|---|---|---|---|"]
    checks, paths, flips = [], [], []
    for name, r in report["models"].items():
        paths.append(f"- {name}: {r.get('decode_path', '?')}")
        timed = r.get("static") and r["static"].get("cold") and r.get("generate")
        if r.get("check") is None and not (timed and r.get("status") == "ok"):
            lines.append(f"| {name} | failed: {'; '.join(r.get('errors', []))} |||||||||")
            continue
        if not SPECS[name].exactness_only:
            lines.append(_perf_row(name, r))
        for variant, entry in list((r.get("static_variants") or {}).items()):
            figures = [f"{k} {entry[k]['generated_tokens_per_second']:,.0f} tok/s (prefill "
                       f"{entry[k]['prefill_seconds']:.1f} s, {entry[k]['ms_per_decode_step']:.1f} ms a decode step)"
                       for k in ("cold", "warm") if entry.get(k)]
            paths.append(f"  - {variant}: {entry.get('path', '?')}: " + ("; ".join(figures) or entry.get(
                "error", "not run")))
        if r.get("check") is None:
            continue
        checks.append(_check_row(name, r))
        static = r["check"]["teacher_forced"]["static_batched"]
        if static["argmax_flips"]:
            flips.append(f"- {name}: the static path's argmax flips sit at reference top-2 gaps "
                         f"{[round(m, 4) for m in static['flip_margins']]} where its logits are off by at most "
                         f"{[round(m, 4) for m in static['flip_max_abs_errors']]} (a flip where the gap is below "
                         "the error is a near tie)")
    lines += ["", "Exactness (bench/regen_exactness.py): greedy leading tokens equal to `generate` alone (of "
              "the first tokens of the first prompts), for the static decoder's batches and, as the control, for "
              "HF `generate`'s batches; teacher-forced logits of each path against a plain forward (no cache) of "
              "the same prompt + tokens: max / median relative error over steps (argmax flips against the "
              "reference). bf16 noise: ~1e-2 on every path; a bug: O(1) on the static path only.", "",
              "| model | dtype | greedy: static | greedy: generate batches | forced: static | forced: generate "
              "batched | forced: generate alone | forced rows x steps | verdict |",
              "|---|---|---|---|---|---|---|---|---|", *checks, "", *flips,
              "", "Decode paths:", *paths, "",
              "tok/s: new tokens per wall second, prefill included. static: the engine's default decoder "
              "(regen/decode.py); generate: the same engine on HF `generate` batches (its budget "
              "`max_tokens_per_batch`; on the first prompts only where said). ms / decode step: the static "
              "decoder's decode loop per step (warm pass when there is one)."]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="tiny-llama and tiny-qwen3.5 on the CPU, in seconds")
    p.add_argument("--models", help=f"comma-separated, of {sorted(SPECS)} (default: {', '.join(GPU_MODELS)})")
    p.add_argument("--device", default=None, help="default: cuda:0 (cpu with --dry-run)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: per model)")
    p.add_argument("--max-tokens-per-batch", type=int, default=None,
                   help="the generate decoder's token budget (default: per model)")
    p.add_argument("--static-tokens-per-batch", type=int, default=None,
                   help="the static decoder's token budget (default: per model)")
    p.add_argument("--deadline-seconds", type=float, default=480,
                   help="skip warm passes, and models whose min_seconds are no longer left, to end by it")
    p.add_argument("--kernels", default="auto",
                   help="model.kernels of the engine: auto, eager or a comma-separated list (eager if they fail)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="the static decoder's steps eager (no CUDA graph)")
    p.add_argument("--no-warm", dest="warm", action="store_false", help="no warm pass of the static decoder")
    p.add_argument("--prefill", type=lambda v: v.split(","), default=["auto"],
                   help="the static decoder's prefill modes, comma-separated (auto, packed, padded): the first for "
                        "every figure, the others timed after it on the same engine (an A/B in one run)")
    p.add_argument("--span-cost-keys", type=lambda v: [None if x == "off" else int(x) for x in v.split(",")],
                   default=[DEFAULT_SPAN_COST_KEYS],
                   help="the decode steps' price of one more attention row span, in cache positions, comma-separated, "
                        f"`off`: no spans (default: the engine's, {DEFAULT_SPAN_COST_KEYS}); the first for every "
                        "figure, the others timed after it")
    p.add_argument("--key-limit-graphs", type=lambda v: [int(x) for x in v.split(",")], default=[KEY_LIMIT_GRAPHS],
                   help="the decode steps' key limits a batch (1: every step reads the whole cache; default: the "
                        f"engine's, {KEY_LIMIT_GRAPHS}), comma-separated; the first for every figure, the others timed "
                        "after it")
    p.add_argument("--decode-kernel", type=lambda v: v.split(","), default=[DECODE_KERNEL],
                   help="the decode steps' attention kernels, comma-separated (sdpa: transformers' function in row "
                        "spans; flex: PyTorch's flex attention, compiled; auto: flex on CUDA for a model without Gated "
                        "DeltaNet layers, else sdpa; default: the "
                        f"engine's, {DECODE_KERNEL}); "
                        "the first for every figure, the others timed after it")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="no exactness check and no profiles (timed passes and the generate baseline only)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)
def main(argv=None) -> dict:
    import datetime

    args = parse_args(argv)
    t0 = time.perf_counter()
    names = (args.models.split(",") if args.models else list(DRY_RUN_MODELS if args.dry_run else GPU_MODELS))
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda:0"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    deadline = t0 + args.deadline_seconds
    report = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "argv": list(argv or sys.argv[1:]),
              "environment": environment(device), "models": {}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        reserve = sum(SPECS[later].min_seconds for later in names[i + 1:])
        if deadline - time.perf_counter() < SPECS[name].min_seconds:
            report["models"][name] = {"status": "skipped", "errors": ["skipped: the deadline is too near"]}
            log(f"{name}: skipped (the deadline is too near)", t0)
            continue
        report["models"][name] = run_model(name, args, device, t0, deadline, reserve)
        report["total_seconds"] = time.perf_counter() - t0
        # After every model: a round's timeout that stops a later model keeps the earlier ones' figures.
        (args.out_dir / "regen-bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (args.out_dir / "regen-bench.md").write_text(markdown(report))
    log(f"wrote {args.out_dir / 'regen-bench.json'} and regen-bench.md", t0)
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r.get("status") == "ok" for r in report["models"].values()) else 1)

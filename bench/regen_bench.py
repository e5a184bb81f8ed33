#!/usr/bin/env python
"""Regeneration benchmark: the in-process engine against one-prompt-at-a-time `generate`, same process, same model.

    python bench/regen_bench.py OUT_DIR [--models llama3.1-8b,qwen3.6-27b] [--deadline-seconds 450] ...
    python bench/regen_bench.py OUT_DIR --dry-run      # tiny-llama + tiny-qwen3.5 on the CPU, in seconds

For each model (random bf16 weights from bench/configs/, drawn on the device by `load_model` inside the engine; the
demo tokenizer renders the prompts) it draws a fixed list of chat prompts (one user message each; lengths
lognormal, seeded), then measures in one process:

  engine     `TransformersEngine.answer(all prompts)` (greedy, `max_tokens` new tokens each, EOS ignored:
             `ignore_eos=True`): batches cut under the token budget, left padded. Cold pass (first-seen shapes:
             Triton autotuning of flash-linear-attention's kernels included), then, time permitting, a warm pass on
             the same prompts.
  baseline   the naive way: the same model, one prompt at a time through `model.generate` (greedy, the same
             `max_tokens`, no EOS), on the first prompts of the list until `--baseline-seconds` is spent.

Reported per method: generated tokens/s (new tokens / wall seconds, including the prompts' prefill), requests/s,
generate calls; the engine's peak GPU memory; the baseline's agreement with the engine (same text for how many of
its prompts: exact in float32 on the CPU, bf16 batched rounding may change some on the GPU); and the batches that
extraction's length buckets (`plan_batches`, `batching` defaults) would have cut the same requests into (each batch
costs `max_tokens` decode steps). Writes OUT_DIR/regen-bench.json and OUT_DIR/regen-bench.md, and prints timings as
it goes. Random weights: the figures measure the generation machinery, not a checkpoint's answers.
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


@dataclass(frozen=True)
class RegenSpec:
    """One benchmark model and its sizes (one H200 for the big ones: about 2 and 4 minutes)."""

    config: str
    dtype: str
    num_prompts: int
    max_tokens: int
    max_tokens_per_batch: int
    baseline_seconds: float
    min_seconds: float  # what the model needs at least (build + cold pass): kept free by the models before it
    mu: float = 5.5  # prompt lengths ~ lognormal(mu, sigma) tokens, clipped: median ~245, mean ~340
    sigma: float = 0.8
    max_prompt_tokens: int = 2048


SPECS = {
    "llama3.1-8b": RegenSpec("llama3.1-8b.json", "bfloat16", num_prompts=256, max_tokens=256,
                             max_tokens_per_batch=131072, baseline_seconds=40, min_seconds=90),
    "qwen3.6-27b": RegenSpec("qwen3.6-27b.json", "bfloat16", num_prompts=128, max_tokens=128,
                             max_tokens_per_batch=65536, baseline_seconds=40, min_seconds=180),
    "tiny-llama": RegenSpec("tiny-llama.json", "float32", num_prompts=12, max_tokens=8, max_tokens_per_batch=4096,
                            baseline_seconds=30, min_seconds=5, mu=4.0, sigma=0.8, max_prompt_tokens=300),
    "tiny-qwen3.5": RegenSpec("tiny-qwen3.5.json", "float32", num_prompts=12, max_tokens=8,
                              max_tokens_per_batch=4096, baseline_seconds=30, min_seconds=5, mu=4.0, sigma=0.8,
                              max_prompt_tokens=300),
}
GPU_MODELS, DRY_RUN_MODELS = ("llama3.1-8b", "qwen3.6-27b"), ("tiny-llama", "tiny-qwen3.5")


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
    """One `answer` call over all requests, timed to its last token."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    calls_before = engine.num_generate_calls
    sync(device)
    t = time.perf_counter()
    answers = engine.answer(requests)
    sync(device)
    seconds = time.perf_counter() - t
    generated = sum(a.completion_tokens for a in answers)
    return {"seconds": seconds, "requests": len(requests), "rejected": sum(a.rejected is not None for a in answers),
            "generated_tokens": generated, "prompt_tokens": sum(a.prompt_tokens for a in answers),
            "generated_tokens_per_second": generated / seconds, "requests_per_second": len(requests) / seconds,
            "generate_calls": engine.num_generate_calls - calls_before, "out_of_memory_splits": engine.num_ooms,
            "peak_memory_bytes": peak_memory(device), "_answers": answers}


def baseline(engine, requests, answers, device, seconds_budget: float) -> dict:
    """One prompt at a time through `model.generate` (greedy, `max_tokens` new tokens, no EOS: the engine's model
    has none in its generation config), after one untimed warm-up call, until the time budget would be passed; its
    texts against the engine's."""
    done, generated, agree, per_prompt = 0, 0, 0, []
    # Untimed warm-up at batch size 1 (the engine's passes never ran that shape): first-call costs (kernel compiles,
    # autotuning, allocator growth) would otherwise be charged to the first timed prompt.
    warm_ids = torch.tensor([engine.render(requests[0])], device=device)
    with torch.inference_mode():
        engine.model.generate(input_ids=warm_ids, attention_mask=torch.ones_like(warm_ids),
                              max_new_tokens=min(16, requests[0].max_tokens), do_sample=False)
    sync(device)
    start = time.perf_counter()
    for request, answer in zip(requests, answers):
        if per_prompt and time.perf_counter() - start + max(per_prompt) > seconds_budget:
            break
        ids = torch.tensor([engine.render(request)], device=device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=request.max_tokens, do_sample=False)
        sync(device)
        per_prompt.append(time.perf_counter() - t)
        new = out[0, ids.shape[1]:].tolist()
        generated += len(new)
        agree += engine.tokenizer.decode(new, skip_special_tokens=True) == answer.content
        done += 1
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests": done, "generated_tokens": generated,
            "generated_tokens_per_second": generated / seconds, "requests_per_second": done / seconds,
            "seconds_per_request": per_prompt, "same_text_as_engine": agree}


def bucketed_batches(engine, requests, new_tokens: int) -> int:
    """How many batches extraction's planner (length buckets of `batching`'s defaults, 16 / 1.25) cuts the same
    requests into under the same budget: each batch costs `max_tokens` decode steps."""
    from dflash_prep.plan.planner import ShapeBuckets, plan_batches

    lengths = [len(engine.render(r)) + new_tokens for r in requests]
    buckets = ShapeBuckets(16, 1.25, max(lengths))
    return len(plan_batches(lengths, max_tokens_per_batch=engine.max_tokens_per_batch,
                            max_batch_size=engine.max_batch_size, buckets=buckets))


def build_engine(name: str, spec: RegenSpec, kernels: str, args, device, t0: float, result: dict):
    """The engine on `device` (EOS ignored) after a smoke call (2 prompts, 4 new tokens), or None (the error in
    `result["errors"]`, memory freed)."""
    from dflash_prep.recipe.schema import ModelSection
    from dflash_prep.regen.engine import Request
    from dflash_prep.regen.hf_engine import TransformersEngine

    section = ModelSection(config=str(CONFIG_DIR / spec.config), tokenizer=str(TOKENIZER_DIR), dtype=spec.dtype,
                           init_seed=0, kernels=kernels if kernels in ("auto", "eager") else kernels.split(","))
    engine = None
    try:
        t = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        engine = TransformersEngine(section, device, args.max_tokens_per_batch or spec.max_tokens_per_batch,
                                    ignore_eos=True)
        sync(device)
        result.update(build_seconds=time.perf_counter() - t, kernels=engine.kernels,
                      max_tokens_per_batch=engine.max_tokens_per_batch, max_batch_size=engine.max_batch_size,
                      params=sum(p.numel() for p in engine.model.parameters()),
                      weights_memory_bytes=peak_memory(device))
        log(f"{name}: built in {result['build_seconds']:.1f} s ({result['params'] / 1e9:.2f}B parameters, kernels "
            f"{engine.kernels['applied'] or 'eager'})", t0)
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


def run_model(name: str, args, device, t0: float, deadline: float, reserve: float) -> dict:
    from dflash_prep.regen.engine import Request

    spec = SPECS[name]
    max_tokens = args.max_tokens or spec.max_tokens
    result = {"config": spec.config, "dtype": spec.dtype, "max_tokens": max_tokens, "kernels_requested": args.kernels}
    engine = build_engine(name, spec, args.kernels, args, device, t0, result)
    if engine is None and args.kernels != "eager":  # fused kernels that fail in generation: measure eager
        engine = build_engine(name, spec, "eager", args, device, t0, result)
    if engine is None:
        result["status"] = "failed"
        return result
    prompts, result["prompts"] = make_prompts(engine.tokenizer, spec, args.seed)
    requests = [Request(messages=m, tools=None, sampling={}, seed=i, max_tokens=max_tokens)
                for i, m in enumerate(prompts)]
    try:
        passes = [engine_pass(engine, requests, device)]
        log(f"{name}: engine cold pass {passes[0]['generated_tokens_per_second']:.0f} generated tok/s "
            f"({passes[0]['seconds']:.1f} s, {passes[0]['generate_calls']} generate calls)", t0)
        answers = passes[0].pop("_answers")
        lengths = [a.prompt_tokens for a in answers]
        result["prompts"].update(prompt_tokens_mean=float(np.mean(lengths)), prompt_tokens_min=min(lengths),
                                 prompt_tokens_max=max(lengths), prompt_tokens_median=float(np.median(lengths)))
        result["bucketed_batches"] = bucketed_batches(engine, requests, max_tokens)
        if args.warm and time.perf_counter() + passes[0]["seconds"] < deadline - reserve - 30:
            passes.append(engine_pass(engine, requests, device))
            passes[1].pop("_answers")
            log(f"{name}: engine warm pass {passes[1]['generated_tokens_per_second']:.0f} generated tok/s "
                f"({passes[1]['seconds']:.1f} s)", t0)
        result["engine"] = {"cold": passes[0], "warm": passes[1] if len(passes) > 1 else None}
        budget = min(args.baseline_seconds or spec.baseline_seconds, deadline - reserve - time.perf_counter())
        base = baseline(engine, requests, answers, device, max(budget, 0.0))
        result["baseline"] = base
        log(f"{name}: baseline {base['generated_tokens_per_second']:.1f} generated tok/s ({base['requests']} "
            f"prompts one at a time, {base['seconds']:.1f} s, same text as the engine: {base['same_text_as_engine']})",
            t0)
        best = max(p["generated_tokens_per_second"] for p in passes)
        result["speedup_vs_baseline"] = best / base["generated_tokens_per_second"]
        result["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - one model's failure is reported, the next model still runs
        result.update(status="failed")
        result.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        log(f"{name}: FAILED {type(e).__name__}: {e}", t0)
    engine.close()
    del engine
    free_memory(device)
    return result


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Regeneration benchmark ({report['started']})", "",
             f"{env.get('gpu') or env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
             f"flash-linear-attention {env.get('fla')}, liger-kernel {env.get('liger_kernel')}. Random weights, "
             "greedy, EOS ignored.", "",
             "| model | prompts (mean / max tokens) | new tokens each | engine cold tok/s | engine warm tok/s | "
             "baseline tok/s (prompts) | speedup | generate calls (bucketed) | peak GPU memory | build |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in report["models"].items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | failed: {'; '.join(r.get('errors', []))} |||||||||")
            continue
        cold, warm, base = r["engine"]["cold"], r["engine"]["warm"], r["baseline"]
        memory = cold["peak_memory_bytes"]
        lines.append(
            f"| {name} | {r['prompts']['num_prompts']} ({r['prompts']['prompt_tokens_mean']:.0f} / "
            f"{r['prompts']['prompt_tokens_max']}) | {r['max_tokens']} | {cold['generated_tokens_per_second']:,.0f} | "
            f"{'-' if warm is None else format(warm['generated_tokens_per_second'], ',.0f')} | "
            f"{base['generated_tokens_per_second']:,.1f} ({base['requests']}) | {r['speedup_vs_baseline']:.1f}x | "
            f"{cold['generate_calls']} ({r['bucketed_batches']}) | "
            f"{'-' if memory is None else f'{memory / 1e9:.1f} GB'} | {r['build_seconds']:.0f} s |")
    lines += ["", "tok/s: new tokens per wall second (prefill included). Baseline: one prompt at a time through "
              "`model.generate`, the first prompts of the list for a bounded time. Bucketed: the batches extraction's "
              "length buckets would cut the same requests into under the same budget (each runs every decode step)."]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dry-run", action="store_true", help="tiny-llama and tiny-qwen3.5 on the CPU, in seconds")
    p.add_argument("--models", help=f"comma-separated, of {sorted(SPECS)} (default: {', '.join(GPU_MODELS)})")
    p.add_argument("--device", default=None, help="default: cuda:0 (cpu with --dry-run)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default: per model)")
    p.add_argument("--max-tokens-per-batch", type=int, default=None, help="engine token budget (default: per model)")
    p.add_argument("--baseline-seconds", type=float, default=None, help="baseline time budget (default: per model)")
    p.add_argument("--deadline-seconds", type=float, default=450, help="skip warm passes / cut baselines to end by it")
    p.add_argument("--kernels", default="auto",
                   help="model.kernels of the engine: auto, eager or a comma-separated list (eager if they fail)")
    p.add_argument("--no-warm", dest="warm", action="store_false", help="no warm engine pass")
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
    for i, name in enumerate(names):
        reserve = sum(SPECS[later].min_seconds for later in names[i + 1:])
        report["models"][name] = run_model(name, args, device, t0, deadline, reserve)
    report["total_seconds"] = time.perf_counter() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "regen-bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (args.out_dir / "regen-bench.md").write_text(markdown(report))
    log(f"wrote {args.out_dir / 'regen-bench.json'} and regen-bench.md", t0)
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    report = main()
    sys.exit(0 if all(r.get("status") == "ok" for r in report["models"].values()) else 1)

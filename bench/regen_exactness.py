"""The regeneration benchmark's exactness check: can a greedy disagreement be told from bf16 noise?

Greedy answers of random-weight models in bf16 near-tie their top logits, so "the static decoder's tokens differ
from `generate` alone" says nothing alone. Three figures, each with its control, make it conclusive:

- **Greedy agreement with a control.** The leading tokens of the first prompts that equal `generate` run on each
  prompt alone, for the static decoder's batches AND for HF `generate`'s own batches (the same engine, the same
  prompts): if batched `generate` disagrees with itself alone as often, the disagreement is the batch's rounding.
- **Teacher-forced logits.** A batch of prompts (longest first, left padded, as the engine cuts them) is run with
  every row forced to follow fixed tokens (those `generate` alone produced for the first prompts; the static pass's
  own for the rest), once through the static decoder (its chunked prefill, row views and, on CUDA, its captured
  decode step), once through `generate` on the same padded batch and once through `generate` on each prompt
  alone. Every step's logits are compared with a plain forward (no cache, one row) of the prompt + the forced
  tokens: relative error ||logits - reference|| / ||reference|| per step, and the steps whose argmax differs from
  the reference's. bf16 rounding gives ~1e-2 relative on every path; a cache, mask or position bug gives O(1)
  on the steps it touches, on the static path only.
- **float32** (the `*-fp32` slices: the first layers of each shape, tf32 off, CUDA graph on): the same figures,
  where greedy must agree exactly (errors ~1e-6; flash-linear-attention's chunk kernels may round at ~1e-4).

`verdict`: "bug" when the static path's worst step error is O(1) (> 0.1) and above 5x the worst of `generate`'s
own paths; "noise" otherwise; in float32 "exact" when every greedy token agrees.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

BUG_RELATIVE_ERROR = 0.1  # bf16 noise is ~1e-2 relative; a wrong cache / mask / position is O(1)


class ForcedTokens(LogitsProcessor):
    """Records each step's scores (float32, before any processing) and forces the step's token: every score but
    `forced[:, step]`'s is -inf, so the argmax of `generate` and of the static decoder emits it.

    forced: [B, n] long on the scores' device; prompt_width: the padded prompt's length (step = generated so far)."""

    def __init__(self, forced: torch.Tensor, prompt_width: int):
        self.forced, self.prompt_width, self.scores = forced, prompt_width, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        self.scores.append(scores.float().clone())
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, self.forced[:, step:step + 1], 0.0)

    def stacked(self) -> torch.Tensor:
        """[B, steps, V] float32."""
        return torch.stack(self.scores, dim=1)


def leading_equal(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(alone: list[list[int]], batched: list[list[int]], n: int) -> dict:
    """Leading tokens of each prompt's batched answer equal to its answer alone, of n."""
    per_prompt = [leading_equal(a[:n], b[:n]) for a, b in zip(alone, batched)]
    total = n * len(per_prompt)
    return {"leading_tokens_equal": per_prompt, "agreement": sum(per_prompt) / total if total else None,
            "all_equal": sum(x == n for x in per_prompt)}


def generate_alone(model, prompt: list[int], n: int, device, processors=None) -> list[int]:
    """Greedy `generate` on one prompt, no padding, n new tokens, no end-of-sequence stop."""
    ids = torch.tensor([prompt], device=device)
    config = GenerationConfig(max_new_tokens=n, do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=processors)
    return out[0, len(prompt):].tolist()


def padded_batch(prompts: list[list[int]], pad_id: int, multiple: int, device):
    """Left-padded ids / mask [B, W] (W: the longest prompt rounded up to `multiple`, as the engine pads)."""
    width = -(-max(map(len, prompts)) // multiple) * multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return ids.to(device), mask.to(device)


def reference_logits(model, prompt: list[int], forced: list[int], device) -> torch.Tensor:
    """[n, V] float32: a plain forward (no cache, one row) of prompt + forced[:-1], the logits that predict each
    forced token."""
    ids = torch.tensor([prompt + forced[:-1]], device=device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False, logits_to_keep=len(forced))
    return out.logits[0].float()


def step_errors(scores: torch.Tensor, reference: torch.Tensor) -> dict:
    """scores / reference [n, V] float32 -> relative error per step and the steps whose argmax differs."""
    rel = ((scores - reference).norm(dim=-1) / reference.norm(dim=-1).clamp_min(1e-30)).tolist()
    top2 = reference.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).tolist()  # the reference's top-2 gap: how near a tie the step is
    abs_err = (scores - reference).abs().amax(dim=-1).tolist()
    flips = [i for i, (a, b) in enumerate(zip(scores.argmax(-1).tolist(), reference.argmax(-1).tolist())) if a != b]
    return {"relative": rel, "flips": flips, "flip_margins": [margin[i] for i in flips],
            "flip_max_abs_errors": [abs_err[i] for i in flips]}


def summarize(per_row: list[dict]) -> dict:
    rel = [e for row in per_row for e in row["relative"]]
    ordered = sorted(rel)
    worst_row = max(range(len(per_row)), key=lambda r: max(per_row[r]["relative"]))
    steps = len(per_row[0]["relative"])
    per_step = [max(row["relative"][i] for row in per_row) for i in range(steps)]
    return {"rows": len(per_row), "steps": len(rel), "max_relative_error": ordered[-1],
            "per_step_max_relative_error": per_step,
            "median_relative_error": ordered[len(ordered) // 2],
            "worst_row": worst_row, "worst_step": max(range(len(per_row[worst_row]["relative"])),
                                                      key=lambda s: per_row[worst_row]["relative"][s]),
            "argmax_flips": sum(len(row["flips"]) for row in per_row),
            "flip_margins": [m for row in per_row for m in row["flip_margins"]][:16],
            "flip_max_abs_errors": [m for row in per_row for m in row["flip_max_abs_errors"]][:16]}


def teacher_forced(engine, prompts: list[list[int]], forced: list[list[int]], alone_rows: int, device) -> dict:
    """The three paths (static batched, generate batched, generate alone for the first `alone_rows` prompts) forced
    along `forced` [B][n], each step's logits against the plain forward -> their summaries (module docstring)."""
    order = sorted(range(len(prompts)), key=lambda r: -len(prompts[r]))  # the engine's batches: longest first
    ids, mask = padded_batch([prompts[r] for r in order], engine.pad_token_id, engine.length_multiple, device)
    forced_t = torch.tensor([forced[r] for r in order], device=device)
    n, width = forced_t.shape[1], ids.shape[1]
    references = [reference_logits(engine.model, prompts[r], forced[r], device) for r in order]
    out = {}
    static = ForcedTokens(forced_t, width)
    with torch.inference_mode():
        engine.decoder.generate(ids, mask, n, [], LogitsProcessorList([static]))
        scores = static.stacked()
    out["static_batched"] = summarize([step_errors(scores[i], references[i]) for i in range(len(order))])
    del scores, static
    batched = ForcedTokens(forced_t, width)
    config = GenerationConfig(max_new_tokens=n, do_sample=False, use_cache=True, eos_token_id=None,
                              pad_token_id=engine.pad_token_id)
    with torch.inference_mode():
        engine.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                              logits_processor=LogitsProcessorList([batched]))
        scores = batched.stacked()
    out["generate_batched"] = summarize([step_errors(scores[i], references[i]) for i in range(len(order))])
    del scores, batched
    rows = []
    for r in range(min(alone_rows, len(prompts))):
        one = ForcedTokens(torch.tensor([forced[r]], device=device), len(prompts[r]))
        generate_alone(engine.model, prompts[r], n, device, LogitsProcessorList([one]))
        rows.append(step_errors(one.stacked()[0], references[order.index(r)]))
    out["generate_alone"] = summarize(rows)
    return out


def verdict(forced: dict, greedy: dict, dtype: str) -> str:
    """'bug', 'noise' or (float32) 'exact' / 'not exact' (module docstring)."""
    static = forced["static_batched"]["max_relative_error"]
    control = max(forced["generate_batched"]["max_relative_error"], forced["generate_alone"]["max_relative_error"])
    if static > BUG_RELATIVE_ERROR and static > 5 * control:
        return "bug"
    if dtype == "float32":
        return "exact" if greedy["static"]["all_equal"] == len(greedy["static"]["leading_tokens_equal"]) \
            else "not exact"
    return "noise"


def exactness(engine, requests, static_ids: dict, generate_ids: dict, check_prompts: int, forced_prompts: int,
              n: int, device, dtype: str) -> dict:
    """The whole check on the engine (after its passes): greedy agreement of the static and generate batches with
    `generate` alone on the first `check_prompts` prompts, the teacher-forced errors on the first `forced_prompts`
    (the first `check_prompts` forced along their answers alone), the verdict. static_ids / generate_ids: prompt
    ids tuple -> the new ids each decoder's batches gave (the benchmark's passes)."""
    t = time.perf_counter()
    prompts = [engine.render(r) for r in requests[:max(check_prompts, forced_prompts)]]
    alone = [generate_alone(engine.model, p, n, device) for p in prompts[:check_prompts]]
    greedy = {"prompts": len(alone), "tokens_each": n,
              "static": agreement(alone, [static_ids.get(tuple(p), [])[:n] for p in prompts], n),
              "generate_batched": agreement(alone, [generate_ids.get(tuple(p), [])[:n] for p in prompts], n)}
    forced = alone + [list(static_ids.get(tuple(p), []))[:n] for p in prompts[check_prompts:forced_prompts]]
    forced = [f + [0] * (n - len(f)) for f in forced]  # a row the pass did not answer: any tokens serve
    figures = teacher_forced(engine, prompts[:max(forced_prompts, check_prompts)], forced, check_prompts, device)
    return {"greedy": greedy, "teacher_forced": figures, "verdict": verdict(figures, greedy, dtype),
            "seconds": time.perf_counter() - t}


class _ProfileSteps(LogitsProcessor):
    """Starts `profiler` after the logits of step `first` and stops it after those of step `last`: what it records
    is the decode forwards of steps first+1..last (and the processing between them)."""

    def __init__(self, profiler, prompt_width: int, first: int, last: int):
        self.profiler, self.prompt_width, self.first, self.last = profiler, prompt_width, first, last

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        if step == self.first:
            self.profiler.start()
        elif step == self.last:
            self.profiler.stop()
        return scores


def decode_step_profile(engine, requests, rows: int, device, steps: int = 4, top: int = 12) -> dict:
    """Where an eager decode step of the static decoder spends its device time: the first `rows` prompts (longest
    first, padded as the engine pads) through a decoder like the engine's with eager steps, `steps` steps profiled
    by torch.profiler -> the per-step total and the `top` kernels (or CPU ops on the CPU) by self time per step.
    The captured graph replays these same kernels without the host launching them."""
    from torch.profiler import ProfilerActivity, profile

    from dflash_prep.regen.decode import StaticCacheDecoder

    prompts = sorted((engine.render(r) for r in requests[:rows]), key=len, reverse=True)
    ids, mask = padded_batch(prompts, engine.pad_token_id, engine.length_multiple, device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    profiler = profile(activities=activities)
    like = engine.decoder  # its prefill and decode attention, with eager steps
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=like.prefill_tokens,
                                 cuda_graphs=False, prefill="packed" if like.packed_prefill else "padded",
                                 span_cost_keys=like.span_cost_keys, decode_kernel=like.decode_kernel)
    t = time.perf_counter()
    with torch.inference_mode():
        decoder.generate(ids, mask, steps + 3, [], LogitsProcessorList([_ProfileSteps(profiler, ids.shape[1], 1,
                                                                                       steps + 1)]))
    events, self_us, total = _events_by_self_time(profiler, device)
    return {"rows": len(prompts), "width": ids.shape[1], "steps": steps, "device_ms_per_step":
            None if total is None else total / 1e3 / steps,
            "top": [{"name": e.key[:120], "ms_per_step": self_us(e) / 1e3 / steps, "calls_per_step": e.count / steps}
                    for e in events[:top]], "seconds": time.perf_counter() - t}


def _events_by_self_time(profiler, device) -> tuple[list, object, float | None]:
    """(the profile's events by self time, most first: CUDA kernels on a GPU, CPU ops elsewhere; the self-time
    function in us; the events' total device us, None on a CPU)."""
    on_gpu = device.type == "cuda"
    events = [e for e in profiler.key_averages() if not on_gpu or e.device_type.name.lower() == "cuda"]
    self_us = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    events.sort(key=self_us, reverse=True)
    return events, self_us, (sum(self_us(e) for e in events) if on_gpu else None)


def prefill_profile(engine, requests, rows: int, device, top: int = 12) -> dict:
    """Where the static decoder's prefill of the first `rows` prompts (longest first, padded as the engine pads)
    spends its device time: one `generate` of 1 new token (its prefill forwards, then one argmax) under
    torch.profiler -> total device ms, prompt tokens, the `top` kernels by self time. Run after the timed passes:
    the shapes are warm."""
    from torch.profiler import ProfilerActivity, profile

    prompts = sorted((engine.render(r) for r in requests[:rows]), key=len, reverse=True)
    ids, mask = padded_batch(prompts, engine.pad_token_id, engine.length_multiple, device)
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    t = time.perf_counter()
    with torch.inference_mode(), profile(activities=activities) as profiler:
        engine.decoder.generate(ids, mask, 1, [])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t
    events, self_us, total = _events_by_self_time(profiler, device)
    return {"rows": len(prompts), "width": ids.shape[1], "prompt_tokens": sum(map(len, prompts)),
            "device_ms": None if total is None else total / 1e3,
            "wall_seconds_profiled": wall,
            "top": [{"name": e.key[:120], "ms": self_us(e) / 1e3, "calls": e.count} for e in events[:top]]}

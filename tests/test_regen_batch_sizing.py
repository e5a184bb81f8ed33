"""The static decoder's batch sizing (regen/batch_sizing.py): model sizes against arithmetic on the configs, the cut
against a brute force over every cut of a short list (the cost and the limits computed here, independently)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.models import CONFIG_DIR
from dflash_prep.regen.batch_sizing import ModelSizes, cut_batches


def sizes_of(name: str) -> tuple[ModelSizes, dict]:
    config = AutoConfig.from_pretrained(CONFIG_DIR / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return ModelSizes.of(model, config), json.loads((CONFIG_DIR / name).read_text())


def test_llama_8b_sizes():
    sizes, c = sizes_of("llama3.1-8b.json")
    assert sizes.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2  # layers x kv heads x head dim x (k, v) x bf16
    assert sizes.state_bytes_per_row == 0
    assert sizes.repeat_bytes_per_token == 32 * 128 * 2 * 2
    assert sizes.weights_bytes == 2 * 8_030_261_248  # the benchmark's parameter count, bf16


def test_qwen_hybrid_sizes():
    sizes, c = sizes_of("qwen3.6-27b.json")
    assert sizes.kv_bytes_per_token == 16 * 4 * 256 * 2 * 2  # every 4th of 64 layers is full attention
    conv = (2 * 16 * 128 + 48 * 128) * 4 * 2
    assert sizes.state_bytes_per_row == 48 * (48 * 128 * 128 * 4 + conv)


def brute_force(lengths, new, width_of, max_rows, budget, sizes, memory):
    best = None
    for k in range(len(lengths)):
        for points in itertools.combinations(range(1, len(lengths)), k):
            bounds = [0, *points, len(lengths)]
            cuts = list(zip(bounds, bounds[1:]))
            ok = all((b - a) <= max_rows and (b - a) * (width_of(lengths[a]) + new) <= budget
                     and (b - a) * ((width_of(lengths[a]) + new) * sizes.kv_bytes_per_token + sizes.state_bytes_per_row
                                    + width_of(lengths[a]) * sizes.repeat_bytes_per_token) <= memory
                     for a, b in cuts if b - a > 1)
            if not ok:
                continue
            cost = sum(sizes.weights_bytes + (b - a) * (width_of(lengths[a]) + new) * sizes.kv_bytes_per_token
                       for a, b in cuts)
            if best is None or cost < best[0]:
                best = (cost, cuts)
    return best


@pytest.mark.parametrize("weights", [10_000, 400_000, 10**9])
def test_the_cut_is_the_cheapest_under_the_limits(weights):
    lengths = sorted([700, 650, 300, 280, 250, 120, 100, 90, 40, 12], reverse=True)
    sizes = ModelSizes(weights_bytes=weights, kv_bytes_per_token=10, state_bytes_per_row=50, repeat_bytes_per_token=3)
    width_of = lambda n: -(-n // 64) * 64  # noqa: E731
    for max_rows, budget, memory in ((4, 10**9, 10**12), (10, 3000, 10**12), (10, 10**9, 40_000)):
        cuts = cut_batches(lengths, 16, width_of, max_rows, budget, sizes, memory)
        assert [a for a, _ in cuts] == [0] + [b for _, b in cuts[:-1]] and cuts[-1][1] == len(lengths)
        cost = sum(weights + (b - a) * (width_of(lengths[a]) + 16) * 10 for a, b in cuts)
        assert cost == brute_force(lengths, 16, width_of, max_rows, budget, sizes, memory)[0]
    # heavy weights and room for all: one batch; light weights: a batch per width
    assert len(cut_batches(lengths, 16, width_of, 10, 10**9, ModelSizes(10**12, 10, 0, 0), None)) == 1
    assert len(cut_batches(lengths, 16, width_of, 10, 10**9, ModelSizes(1, 10, 0, 0), None)) == \
        len({width_of(n) for n in lengths})


def span_read(lengths, a, b, new, width_of, span_cost):
    """The cost model's read of batch lengths[a:b] with row spans, written out: each row from its own first column
    (the batch's width minus its length, down to a multiple of 64), and the span price per distinct column, 8 at most."""
    width = width_of(lengths[a])
    columns = [(width - n) // 64 * 64 for n in lengths[a:b]]
    return sum(width + new - c for c in columns) + span_cost * min(len(set(columns)), 8)


@pytest.mark.parametrize("span_cost", [0, 64, 8192])
def test_the_cut_with_row_spans_is_the_cheapest_under_the_limits(span_cost):
    lengths = sorted([2600, 1900, 700, 650, 300, 280, 250, 120, 100, 90, 40, 12], reverse=True)
    sizes = ModelSizes(weights_bytes=100_000, kv_bytes_per_token=10, state_bytes_per_row=50, repeat_bytes_per_token=3)
    width_of = lambda n: -(-n // 64) * 64  # noqa: E731
    for max_rows, memory in ((12, 10**12), (5, 10**12), (12, 250_000)):
        cuts = cut_batches(lengths, 16, width_of, max_rows, 10**9, sizes, memory, span_cost_keys=span_cost)
        cost = sum(10_000 + span_read(lengths, a, b, 16, width_of, span_cost) for a, b in cuts)
        best = None
        for k in range(len(lengths)):
            for points in itertools.combinations(range(1, len(lengths)), k):
                bounds = [0, *points, len(lengths)]
                pairs = list(zip(bounds, bounds[1:]))
                if any(b - a > 1 and (b - a > max_rows or (b - a) * ((width_of(lengths[a]) + 16) * 10 + 50
                                                                       + width_of(lengths[a]) * 3) > memory)
                       for a, b in pairs):
                    continue
                c = sum(10_000 + span_read(lengths, a, b, 16, width_of, span_cost) for a, b in pairs)
                best = c if best is None else min(best, c)
        assert cost == best


def test_row_spans_merge_the_batches_padding_had_split():
    """The 8B shape's sizes, 256 prompts of the benchmark's lengths: without spans the long prompts get a batch of
    their own (their width would pad every short row); with spans one batch holds them all, memory allowing (the
    packed prefill's batch: no per-head key copies to hold)."""
    import dataclasses

    import numpy as np

    sizes = dataclasses.replace(sizes_of("llama3.1-8b.json")[0], repeat_bytes_per_token=0)
    rng = np.random.default_rng(0)
    lengths = sorted(np.clip(np.round(rng.lognormal(5.41, 0.9, 256)), 16, 2600).astype(int).tolist(), reverse=True)
    width_of = lambda n: -(-n // 64) * 64  # noqa: E731
    plain = cut_batches(lengths, 256, width_of, 256, 1 << 20, sizes, 97 * 2**30)
    spans = cut_batches(lengths, 256, width_of, 256, 1 << 20, sizes, 97 * 2**30, span_cost_keys=8192)
    assert len(plain) >= 2 and spans == [(0, 256)]
    # a memory limit below one batch's cache cuts it again
    tight = cut_batches(lengths, 256, width_of, 256, 1 << 20, sizes, 20 * 2**30, span_cost_keys=8192)
    assert len(tight) >= 2

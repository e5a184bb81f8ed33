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

"""The static decoder on the families the engine serves beyond Llama and the Qwen3.5 hybrid (bench/families.py's
tiny configs, random weights, float32 on the CPU): MoE families through the packed prefill the engine uses by
default (their forward passes `output_router_logits` down to every attention call), the hybrid MoE through the
packed hybrid prefill, and sliding-window families with the decode steps in row spans (their window layers' keys
are a rolling buffer, not the cache's positions). Expected ids: HF `generate` on each prompt alone."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import REPO
from test_regen_hf_engine import alone, section

from dflash_prep.regen.decode import StaticCacheDecoder
from dflash_prep.regen.hf_engine import TransformersEngine

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.families import WINDOW, family_config  # noqa: E402

NEW = 6


def engine_of(family: str, tmp_path) -> TransformersEngine:
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(family_config(family, "tiny").to_dict()))
    return TransformersEngine(section(str(path)), torch.device("cpu"), 8192, decoder="generate")


def prompts_of(vocab: int) -> list[list[int]]:
    """One prompt of 140 tokens (past the spans' 64-column alignment, many windows long: the cache outgrows a window
    layer's buffer) beside short ones."""
    assert WINDOW["tiny"] < 140
    return [[(7 * i + 11) % (vocab - 3) + 3 for i in range(140)], [5, 9, 4], [17, 3] * 5, [23]]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids, mask = torch.full((len(prompts), width), 77), torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("family,prefill,span_cost_keys", [
    ("qwen3_moe", "auto", None), ("mixtral", "auto", None), ("qwen3_5_moe", "packed", None),
    ("mistral", "auto", 0), ("gemma3", "auto", 0), ("qwen2", "auto", 0)])
def test_each_family_equals_generate_alone(family, prefill, span_cost_keys, tmp_path):
    """span_cost_keys 0: a span is free, so every run of rows with its own first column gets one."""
    engine = engine_of(family, tmp_path)
    prompts = prompts_of(engine.model.config.get_text_config().vocab_size)
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=64, prefill=prefill,
                                 span_cost_keys=span_cost_keys)
    expected = [alone(engine, p, new=NEW, eos=-1) for p in prompts]
    with torch.inference_mode():
        got = decoder.generate(*left_padded(prompts), NEW, []).tolist()
    assert got == expected, decoder.path
    if prefill == "auto" and span_cost_keys is None:
        assert "packed prefill" in decoder.path  # the MoE's default path is the packed one
    if span_cost_keys is not None:
        assert decoder.stats.decode_spans > 1 and "row spans" in decoder.path

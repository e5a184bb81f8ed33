"""The regeneration benchmark's exactness check (bench/regen_exactness.py) can fail: on the tiny Llama-style model in
float32 it calls the static decoder exact, and a decoder with a deliberate off-by-one in its decode positions (what
a cache or position bug looks like) a bug, while `generate`'s own paths stay the control."""

from __future__ import annotations

import torch
from test_regen_hf_engine import PROMPTS, llama_config, make_request, section

from bench.regen_exactness import exactness
from dflash_prep.regen.decode import StaticCacheDecoder
from dflash_prep.regen.hf_engine import TransformersEngine

CPU = torch.device("cpu")


class ShiftedPositions(StaticCacheDecoder):
    """A broken decoder: every decode step sees its position one too far."""

    def _forward(self, step_input, mask, cache):
        shifted = dict(step_input, position=step_input["position"] + 1)
        return super()._forward(shifted, mask, cache)


def ids_by_prompt(engine, requests, decoder) -> dict:
    engine.decoder = decoder
    out = {}
    for r in requests:
        prompt = engine.render(r)
        with torch.inference_mode():
            new = engine._generate(torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long), 8, None)
        out[tuple(prompt)] = new[0].tolist()
    return out


def test_the_check_calls_a_sound_decoder_exact_and_a_position_bug_a_bug(tmp_path):
    engine = TransformersEngine(section(llama_config(tmp_path / "c.json")), CPU, 8192, ignore_eos=True,
                                prefill_tokens=24)
    requests = [make_request(m, seed=i, max_tokens=8) for i, m in enumerate(PROMPTS)]
    sound = engine.decoder
    generate_ids = ids_by_prompt(engine, requests, None)
    for decoder, expected in ((sound, "exact"), (ShiftedPositions(engine.model, engine.pad_token_id), "bug")):
        static_ids = ids_by_prompt(engine, requests, decoder)
        check = exactness(engine, requests, static_ids, generate_ids, 3, 5, 8, CPU, "float32")
        forced = check["teacher_forced"]
        assert check["verdict"] == expected, check
        assert forced["generate_alone"]["max_relative_error"] < 1e-4
        assert forced["generate_batched"]["max_relative_error"] < 1e-4
        assert check["greedy"]["generate_batched"]["all_equal"] == 3  # the control: generate batched = alone
    assert forced["static_batched"]["max_relative_error"] > 0.1  # the broken decoder's steps are O(1) off

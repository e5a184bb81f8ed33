"""Hooks capture exactly HF's hidden states, and a sample's states do not depend on its batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build, tiny_llama_config, tiny_qwen35_config

from dflash_prep.plan.batches import SampleInfo, collate
from dflash_prep.plan.planner import ShapeBuckets, plan_batches
from dflash_prep.recipe.schema import LayersSection, RecipeError
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.layers import dflash_layer_ids, eagle3_layer_ids, find_decoder, resolve_layer_ids

ARCHS = {"llama": tiny_llama_config, "qwen3_5_hybrid": tiny_qwen35_config}


def _samples(lengths, vocab=1024, seed=0):
    g = np.random.default_rng(seed)
    return [SampleInfo(f"{i:010d}", i, None, g.integers(1, vocab, n).astype(np.int32), np.ones(n, np.uint8))
            for i, n in enumerate(lengths)]


def _alone(model, sample, ids):
    """HF's own hidden states of one sample run alone: after-layer id i = hidden_states[i + 1]."""
    with torch.inference_mode():
        out = find_decoder(model)(input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None],
                                  use_cache=False, output_hidden_states=True)
    return out.hidden_states


@pytest.mark.parametrize("padding_mask", [True, False], ids=["mask", "no_mask"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_capture_equals_each_sample_run_alone(arch, padding_mask):
    model = build(ARCHS[arch]())
    layer_ids = [0, 2, 4]
    lengths = [3, 70, 17, 41, 5, 64, 29, 2, 55, 33]
    samples = _samples(lengths)
    plan = plan_batches(lengths, max_tokens_per_batch=192, max_batch_size=4, buckets=ShapeBuckets(16, 1.5, 128))
    assert len(plan) > 2 and any(b.batch_size > 1 and len({lengths[i] for i in b.sample_indices}) > 1 for b in plan)
    checked = 0
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32, padding_mask=padding_mask) as cap:
        for planned in plan:
            batch = collate([samples[i] for i in planned.sample_indices], planned.padded_length, 0, planned.batch_id)
            out = cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
            H = model.config.hidden_size
            assert out.hidden_states_NK.shape == (sum(lengths[i] for i in planned.sample_indices), 3 * H)
            start = 0
            for i in planned.sample_indices:
                n = lengths[i]
                ref = _alone(model, samples[i], layer_ids)
                for slot, layer in enumerate(layer_ids):
                    got = out.hidden_states_NK[start:start + n, slot * H:(slot + 1) * H]
                    diff = (got - ref[layer + 1][0]).abs().max().item()
                    assert diff <= 1e-5, f"{arch} sample {i} layer {layer}: max abs diff {diff}"
                start += n
                checked += 1
    assert checked == len(lengths)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_hooks_equal_output_hidden_states_and_final_modes(arch):
    model = build(ARCHS[arch]())
    L = model.config.num_hidden_layers
    sample = _samples([23])[0]
    ref = _alone(model, sample, None)
    batch = collate([sample], 32, 0)
    for final in ("before_norm", "after_norm"):
        with LayerCapture(model, [1, 3], capture_final=final, storage_dtype=torch.float32) as cap:
            out = cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
        H = model.config.hidden_size
        torch.testing.assert_close(out.hidden_states_NK[:, :H], ref[2][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.hidden_states_NK[:, H:], ref[4][0], rtol=0, atol=1e-6)
        if final == "after_norm":  # transformers 5.x: hidden_states[-1] is after the final norm
            # fp32 rounding of the padded vs alone forward, scaled by the norm's (non-unit) gain: 1 ulp relative
            torch.testing.assert_close(out.final_hidden_states_NH, ref[L][0], rtol=1e-6, atol=1e-6)
        else:  # the last decoder layer's own output, before the norm
            with torch.inference_mode():
                dec = find_decoder(model)
                norm_in = {}
                h = dec.norm.register_forward_hook(lambda m, a, o: norm_in.setdefault("x", a[0].clone()))
                try:
                    dec(input_ids=batch.input_ids[:, :23], use_cache=False)
                finally:
                    h.remove()
            torch.testing.assert_close(out.final_hidden_states_NH, norm_in["x"][0], rtol=0, atol=1e-6)
            assert not torch.allclose(out.final_hidden_states_NH, ref[L][0], atol=1e-3)


def test_hooks_are_removed_on_exception_and_forward_stops_early():
    model = build(tiny_llama_config())
    dec = find_decoder(model)
    ran = []
    probes = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(dec.layers)]
    batch = collate(_samples([9]), 16, 0)
    with LayerCapture(model, [2]) as cap:
        cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
    # The capture hook runs first on layer 2 (prepend=True) and ends the forward: layers 3.. never run.
    assert ran == [0, 1], "layers after the deepest captured one must not run"
    for p in probes:
        p.remove()
    before = [len(layer._forward_hooks) for layer in dec.layers]
    with pytest.raises(RuntimeError, match="boom"):
        with LayerCapture(model, [1, 4]):
            raise RuntimeError("boom")
    assert [len(layer._forward_hooks) for layer in dec.layers] == before == [0] * len(dec.layers)


def test_vlm_class_layout():
    """Qwen3.5 VLM class: the decoder is `model.model.language_model`; capture works through it."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = tiny_qwen35_config().to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=32, intermediate_size=64,
                                                              num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    assert find_decoder(model) is model.model.language_model
    sample = _samples([19])[0]
    ref = _alone(model, sample, None)
    batch = collate([sample], 32, 0)
    for padding_mask in (True, False):
        with LayerCapture(model, [5], storage_dtype=torch.float32, padding_mask=padding_mask) as cap:
            out = cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
        torch.testing.assert_close(out.hidden_states_NK, ref[6][0], rtol=0, atol=1e-6)


def test_layer_id_rules():
    assert dflash_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert dflash_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_layer_ids(64, 8) == [1, 10, 18, 27, 35, 44, 52, 61]
    assert dflash_layer_ids(64, 1) == [32]
    assert eagle3_layer_ids(32) == [1, 15, 28]
    assert resolve_layer_ids(LayersSection(preset="dflash", num_layers=3), 8) == [1, 3, 5]
    assert resolve_layer_ids(LayersSection(preset="explicit", ids=[0, 6]), 8) == [0, 6]
    with pytest.raises(RecipeError, match=r"layers.ids.*out of range.*0\.\.6"):
        resolve_layer_ids(LayersSection(preset="explicit", ids=[2, 8]), 8)


def test_eagle3_preset_states_the_real_minimum_depth():
    """[1, L//2-1, L-4]: L = 6 gives [1, 2, 2] (ids collide), L = 7 gives [1, 2, 3]: the minimum is 7 (by hand)."""
    assert eagle3_layer_ids(7) == [1, 2, 3] and eagle3_layer_ids(8) == [1, 3, 4]
    for L in (3, 5, 6):
        with pytest.raises(ValueError, match=f"at least 7 decoder layers.*the model has {L}$"):
            eagle3_layer_ids(L)
    with pytest.raises(RecipeError, match="`layers.preset` = 'eagle3'.*at least 7 decoder layers.*has 6"):
        resolve_layer_ids(LayersSection(preset="eagle3"), 6)


def test_every_layer_id_equals_hf_hidden_states_of_id_plus_one():
    """The format's convention (id i = HF hidden_states[i+1]) has no exception: id L-1, whose hook output is before
    the final norm while hidden_states[L] is after it, is refused, pointing at capture_final."""
    L = 8
    for ids, key in (([1, 7], "layers.ids"), ([7], "layers.ids")):
        with pytest.raises(RecipeError, match=rf"`{key}`.*id 7 is the last decoder layer.*layers.capture_final"):
            resolve_layer_ids(LayersSection(preset="explicit", ids=ids), L)
    with pytest.raises(RecipeError, match=r"`layers.preset`.*id 1 is the last decoder layer"):
        resolve_layer_ids(LayersSection(preset="dflash", num_layers=1), 2)  # [L//2] = [1] = L-1
    model = build(tiny_llama_config())  # 6 layers
    # Every id the recipe accepts is hidden_states[i+1] of HF's own forward.
    sample = _samples([21])[0]
    ref = _alone(model, sample, None)
    batch = collate([sample], 32, 0)
    ids = resolve_layer_ids(LayersSection(preset="explicit", ids=list(range(6 - 1))), 6)  # 0..4: all it accepts
    with LayerCapture(model, ids, storage_dtype=torch.float32) as cap:
        out = cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
    H = model.config.hidden_size
    for slot, i in enumerate(ids):
        torch.testing.assert_close(out.hidden_states_NK[:, slot * H:(slot + 1) * H], ref[i + 1][0], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_extraction_without_the_padding_mask_writes_the_same_states(tmp_path):
    """`model.padding_mask: false` end to end: the same samples, the same states (to storage rounding)."""
    from conftest import demo_overrides, raw_records
    from safetensors.torch import load

    from dflash_prep.commands.extract import main

    records = {}
    for mask in ("true", "false"):
        out = tmp_path / mask
        argv = [a for kv in demo_overrides(out, **{"data.max_samples": 24, "batching.num_workers": 0,
                                                   "model.padding_mask": mask, "output.dtype": "float32"})
                for a in ("--set", kv)]
        assert main(argv) == 0
        records[mask] = raw_records(out)
    assert set(records["true"]) == set(records["false"]) and len(records["true"]) > 20
    for key, members in records["true"].items():
        other = records["false"][key]
        assert members["input_ids.npy"] == other["input_ids.npy"]
        a = load(members["hidden_states.safetensors"])["hidden_states"]
        b = load(other["hidden_states.safetensors"])["hidden_states"]
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4 * float(a.abs().max()))

"""Tests for dflash_prep.target.norms: real (non-unit) norm gains in random-weight models, the final norm's form found by
probing, and after-norm states derived from a before-norm extraction equal to a real after-norm extraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_qwen35_config
from torch import nn

from dflash_prep.consume.reader import ShardDataset
from dflash_prep.target.norms import (
    FINAL_NORM_NAME,
    apply_final_norm,
    describe_final_norm,
    read_final_norm,
    rms_normalize,
)

BASE = ["data.max_samples=24", "data.max_length=256", "batching.max_tokens_per_batch=1024",
        "batching.num_workers=0"]


def _extract(out_dir: Path, capture_final: str) -> Path:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    run_extraction(load_recipe(None, [f"output.dir={out_dir}", *BASE, f"layers.capture_final={capture_final}"]))
    return out_dir


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("norms")
    return {c: _extract(root / c, c) for c in ("before_norm", "after_norm")}


def test_random_weight_models_have_non_unit_norm_gains():
    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.target.model import load_model

    recipe = load_recipe(None, [])
    from dflash_prep.target.model import load_config

    model = load_model(recipe.model, load_config(recipe.model), torch.device("cpu"))
    # Qwen3.5 stores the gain as w in x_hat * (1 + w): transformers initialises w to 0 (unit gain).
    gain = 1.0 + model.model.norm.weight.float()
    assert 0.15 < gain.std() < 0.35 and (gain - 1).abs().max() > 0.3
    llama = build(tiny_llama_config())
    gain = llama.model.norm.weight.float()  # Llama: x_hat * w, initialised to 1
    assert 0.15 < gain.std() < 0.35
    # the same seed gives the same gains (every rank, every run)
    assert torch.equal(build(tiny_llama_config()).model.norm.weight, llama.model.norm.weight)


def test_the_final_norms_form_is_found_by_probing_the_module():
    llama, qwen = build(tiny_llama_config()), build(tiny_qwen35_config())
    assert describe_final_norm(llama.model.norm)["form"] == "weight"
    assert describe_final_norm(qwen.model.norm)["form"] == "one_plus_weight"
    assert describe_final_norm(qwen.model.norm)["eps"] == qwen.config.get_text_config().rms_norm_eps
    assert describe_final_norm(nn.LayerNorm(64))["form"] == "unsupported"
    x = torch.randn(3, 64)
    # by hand: x / rms(x) * gain, the gain being w (Llama) or 1 + w (Qwen3.5)
    for model, gain in ((llama, llama.model.norm.weight), (qwen, 1 + qwen.model.norm.weight)):
        eps = describe_final_norm(model.model.norm)["eps"]
        by_hand = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain
        assert torch.allclose(apply_final_norm(x, describe_final_norm(model.model.norm)), by_hand, atol=1e-6)
        assert torch.allclose(model.model.norm(x), by_hand, atol=1e-6)


def test_after_norm_states_from_a_before_norm_extraction_equal_a_real_after_norm_extraction(outputs):
    before, after = outputs["before_norm"], outputs["after_norm"]
    manifest = json.loads((before / "manifest.json").read_text())
    assert manifest["final_norm"]["path"] == FINAL_NORM_NAME and manifest["final_norm"]["form"] == "one_plus_weight"
    assert json.loads((after / "manifest.json").read_text())["final_norm"] is None
    norm = read_final_norm(before)
    stored_after = {s["sample_id"]: s["final_hidden_states"].float() for s in ShardDataset(after)}
    checked = 0
    for s in ShardDataset(before):
        want = stored_after[s["sample_id"]]
        derived = apply_final_norm(s["final_hidden_states"], norm).to(torch.bfloat16).float()
        # bf16 storage on both sides: each element within 2 roundings (2 x 2^-8 relative) of the other
        assert ((derived - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all(), s["sample_id"]
        # and the comparison can fail: the before-norm states, or the wrong form, are far off
        wrong_form = (rms_normalize(s["final_hidden_states"], norm["eps"]) * norm["weight"]).to(torch.bfloat16)
        assert (wrong_form.float() - want).abs().max() > 0.1 * want.abs().max()
        assert (s["final_hidden_states"].float() - want).abs().max() > 0.1 * want.abs().max()
        checked += 1
    assert checked == len(stored_after) == 24


def test_the_reader_derives_after_norm_final_states_on_request(outputs):
    before, after = outputs["before_norm"], outputs["after_norm"]
    stored_after = {s["sample_id"]: s["final_hidden_states"] for s in ShardDataset(after)}
    for s in ShardDataset(before, final="after_norm"):
        want = stored_after[s["sample_id"]]
        assert s["final_hidden_states"].dtype == want.dtype == torch.bfloat16
        assert ((s["final_hidden_states"].float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 1e-6).all()
    assert sum(1 for _ in ShardDataset(after, final="after_norm")) == 24  # what is stored: a no-op
    with pytest.raises(ValueError, match="cannot be undone"):
        ShardDataset(after, final="before_norm")


def test_norm_gains_are_drawn_for_norms_placed_by_a_device_map_over_several_devices():
    """A model placed by `device_map` over several GPUs (a layer split, e.g. verify's reference of a tensor-parallel
    output) carries accelerate hooks on every module holding parameters, every RMSNorm included
    (`attach_execution_device_hook`): each sends its module's inputs to the module's GPU. The gains must be drawn as
    on one device: the form probe runs on a CPU copy of the module, which the copied hook sent back to the GPU, so
    every norm was taken as unsupported and kept unit gain (the reference then differed from the tensor-parallel
    extraction at every layer). On a CPU the hooks' device is `meta` (any device but the copy's). The expected
    gains are the documented rule written out: 1 + N(0, 0.25^2) from torch.Generator().manual_seed(seed), one draw
    per RMSNorm in module order."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module
    from transformers import AutoModelForCausalLM

    from dflash_prep.target.norms import randomize_norm_gains

    model = AutoModelForCausalLM.from_config(tiny_llama_config(num_layers=2), dtype=torch.float32)
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert len(norms) == 2 * 2 + 1
    for norm in norms:
        add_hook_to_module(norm, AlignDevicesHook(execution_device=torch.device("meta")))
        norm.weight = nn.Parameter(torch.ones(64))  # the gain stays where it lives (here the CPU), as on its GPU
    assert randomize_norm_gains(model, 7) == len(norms)
    generator = torch.Generator().manual_seed(7)
    for norm in norms:
        expected = 1.0 + torch.randn(norm.weight.shape, generator=generator) * 0.25
        assert torch.equal(norm.weight.detach(), expected)

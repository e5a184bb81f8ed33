"""`batching.max_tokens_per_batch: auto`: the rule's arithmetic, the weights counted on a meta-device model, and
the resolved number used and frozen by a real extraction."""

from __future__ import annotations

import json

import pytest
from conftest import demo_overrides

from dflash_prep.recipe.schema import RecipeError, load_recipe
from dflash_prep.target.budget import (
    CPU_AUTO_TOKENS,
    auto_token_budget,
    bytes_per_padded_token,
    resident_weight_bytes,
    resolve_token_budget,
)
from dflash_prep.target.layers import num_decoder_layers, resolve_layer_ids
from dflash_prep.target.model import drop_layers_after, load_config, load_model


def test_the_rule_rounds_down_to_a_power_of_two_within_bounds():
    # 0.4 x (150 GB - 50 GB) / 300 KB = 133,333 -> 131,072
    assert auto_token_budget(150_000_000_000, 50_000_000_000, 300_000)[0] == 131072
    # 0.4 x (100 GB - 50 GB) / 300 KB = 66,667 -> 65,536
    budget, how = auto_token_budget(100_000_000_000, 50_000_000_000, 300_000)
    assert budget == 65536 and "= 66,667" in how
    assert auto_token_budget(10**15, 0, 1)[0] == 131072  # capped
    assert auto_token_budget(60_000_000_000, 59_000_000_000, 300_000)[0] == 8192  # floor
    assert auto_token_budget(None, 0, 1) == (CPU_AUTO_TOKENS, f"no GPU: {CPU_AUTO_TOKENS}")


def test_per_token_bound_follows_the_config():
    recipe = load_recipe(None)
    config = load_config(recipe.model)
    H, inter = config.hidden_size, config.intermediate_size
    assert bytes_per_padded_token(config, "bfloat16", "bfloat16", 3) == 2 * (12 * H + 4 * inter) + 2 * 3 * H
    assert bytes_per_padded_token(config, "float32", "fp8_e4m3", 2) == 4 * (12 * H + 4 * inter) + 2 * H + 2 * 4


def test_resident_weights_are_those_of_the_model_the_run_keeps():
    import torch

    recipe = load_recipe(None, ["model.dtype=float32"])
    config = load_config(recipe.model)
    model = load_model(recipe.model, config, torch.device("cpu"))
    drop_layers_after(model, 3)
    assert resident_weight_bytes(recipe, config, 3) == 4 * sum(p.numel() for p in model.parameters())


def test_auto_resolves_to_a_number_and_leaves_numbers_alone():
    recipe = load_recipe(None, ["batching.max_tokens_per_batch=auto"])
    config = load_config(recipe.model)
    n = num_decoder_layers(config)
    ids = resolve_layer_ids(recipe.layers, n)
    cpu, how = resolve_token_budget(recipe, config, ids, n, None)
    assert cpu.batching.max_tokens_per_batch == CPU_AUTO_TOKENS and how.startswith("no GPU")
    assert cpu.batching.max_batch_size == recipe.batching.max_batch_size and cpu.data == recipe.data
    gpu, how = resolve_token_budget(recipe, config, ids, n, 80_000_000_000)
    assert gpu.batching.max_tokens_per_batch == 131072 and "GPU 80 GB" in how  # a tiny model: the cap
    fixed = load_recipe(None)
    assert resolve_token_budget(fixed, config, ids, n, 80_000_000_000) == (fixed, None)


def test_the_budget_never_goes_below_max_length():
    recipe = load_recipe(None, ["batching.max_tokens_per_batch=auto", "data.max_length=20000"])
    config = load_config(recipe.model)
    n = num_decoder_layers(config)
    resolved, how = resolve_token_budget(recipe, config, resolve_layer_ids(recipe.layers, n), n, None)
    assert resolved.batching.max_tokens_per_batch == 20000 and how.endswith("raised to data.max_length")


def test_recipe_accepts_auto_or_an_integer_only():
    assert load_recipe(None, ["batching.max_tokens_per_batch=auto"]).batching.max_tokens_per_batch == "auto"
    with pytest.raises(RecipeError, match=r"`batching.max_tokens_per_batch` = 'lots'.*integer or `auto`"):
        load_recipe(None, ["batching.max_tokens_per_batch=lots"])
    with pytest.raises(RecipeError, match="`batching.max_tokens_per_batch`"):
        load_recipe(None, ["batching.max_tokens_per_batch=0"])


def test_an_extraction_with_auto_plans_and_records_the_resolved_budget(tmp_path):
    from dflash_prep.commands.extract import main

    out = tmp_path / "out"
    argv = [a for kv in demo_overrides(out, **{"data.max_samples": 16, "batching.num_workers": 0,
                                               "batching.max_tokens_per_batch": "auto"}) for a in ("--set", kv)]
    assert main(argv) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["batching"]["max_tokens_per_batch"] == CPU_AUTO_TOKENS
    assert all(T * len(idx) <= CPU_AUTO_TOKENS for T, idx in plan["batches"])
    assert "max_tokens_per_batch: 16384" in (out / "recipe.resolved.yaml").read_text()
    log_text = (out / "logs" / "rank-00000.log").read_text()
    assert "batching.max_tokens_per_batch: auto = 16384 (no GPU: 16384)" in log_text


def test_per_token_bound_of_an_moe_counts_its_active_experts():
    """MoE: the width a token runs through is k x the expert width (+ shared experts; the dense layers' where the
    model has dense layers and it is wider), plus the routed copies (2 x k x hidden) and the router's fp32 logits
    and probabilities (8 bytes x experts); counted here by hand from the configs."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    sparse = Qwen3MoeConfig(hidden_size=64, intermediate_size=1024, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)  # every layer sparse: intermediate_size is unused
    H, k, E = 64, 2, 8
    assert bytes_per_padded_token(sparse, "bfloat16", "bfloat16", 3) == (
        2 * (12 * H + 4 * (k * 32)) + 2 * 2 * k * H + 8 * E + 2 * 3 * H)
    mla = DeepseekV3Config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, n_group=2, topk_group=1)
    routed_width = k * 32 + 1 * 32  # 96, narrower than the dense layer's 128: that one sets the bound
    assert routed_width < 128
    assert bytes_per_padded_token(mla, "bfloat16", "bfloat16", 3) == (
        2 * (12 * H + 4 * 128) + 2 * 2 * k * H + 8 * E + 2 * 3 * H)

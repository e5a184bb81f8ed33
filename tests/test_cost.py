"""The cost numbers of a job (cost.batch_cost_model) against the tiny real architectures, counted here."""

from __future__ import annotations

from conftest import REPO, build, tiny_llama_config, tiny_qwen35_config

from dflash_prep.commands.cost import batch_cost_model
from dflash_prep.recipe.schema import load_recipe


def _decoder_params(model, layers_run: int) -> int:
    return sum(p.numel() for layer in list(model.model.layers)[:layers_run] for p in layer.parameters())


def test_qwen35_hybrid_costs_count_only_its_full_attention_layers_run():
    """Demo recipe: layers [1, 3, 5], no final layer, so layers 0-5 run; of those only layer 3 is full attention
    (the others are Gated DeltaNet, linear in length); 4 heads x 16 = 64 wide; bf16 states of 3 x 64 per token."""
    recipe = load_recipe(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml", [])
    config = tiny_qwen35_config()
    model = batch_cost_model(recipe, config, [1, 3, 5], 8)
    assert model.linear_flops_per_token == 2 * _decoder_params(build(config), 6)
    assert model.attention_flops_per_token_pair == 2 * 1 * 4 * 16
    assert model.write_bytes_per_token == 3 * 64 * 2 + 4 + 1  # states + int32 token id + uint8 loss mask
    # four tar members (512-byte headers, data padded to 512 bytes), npy and safetensors headers, meta.json
    assert 4 * 512 < model.write_bytes_per_sample < 4 * 512 + 4 * 512 + 1024


def test_llama_with_a_final_layer_runs_every_layer_and_stores_one_more_block():
    recipe = load_recipe(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml",
                         ["layers.capture_final=before_norm", "output.dtype=fp8_e4m3"])
    config = tiny_llama_config()
    model = batch_cost_model(recipe, config, [1, 2, 3], 6)
    assert model.linear_flops_per_token == 2 * _decoder_params(build(config), 6)
    assert model.attention_flops_per_token_pair == 2 * 6 * 4 * 16  # no layer_types: every layer is attention
    assert model.write_bytes_per_token == 4 * (64 + 4) + 5  # 3 layers + final in fp8, one fp32 scale per block


def test_predicted_write_bytes_are_the_bytes_a_run_writes(tmp_path):
    """The write side of the cost, summed over the plan, against the shard files an extraction wrote (the records
    plus each shard's tar end blocks: within 2%)."""
    import functools

    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.commands.extract.claim import load_or_make_plan
    from dflash_prep.target.model import load_config

    recipe = load_recipe(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml", [f"output.dir={tmp_path / 'out'}",
                                                                "data.max_samples=48", "batching.num_workers=0"])
    summary = run_extraction(recipe)
    lengths = _kept_lengths(recipe)
    plan = load_or_make_plan(tmp_path / "out", lengths, recipe, True, _NoBarrier())
    model = batch_cost_model(recipe, load_config(recipe.model), [1, 3, 5], 8)
    cost = functools.partial(model.cost_of, lengths=lengths)
    predicted = sum(cost(b).write_seconds for b in plan) * model.write_bytes_per_second
    written = sum(p.stat().st_size for p in (tmp_path / "out" / "shards").rglob("*.tar"))
    assert summary["bytes_written_this_run"] == written
    assert abs(predicted - written) / written < 0.02, (predicted, written)


class _NoBarrier:
    def wait_for_everyone(self):
        pass


def _kept_lengths(recipe) -> list[int]:
    from dflash_prep.data.rows import load_rows, tokenize_dataset
    from dflash_prep.target.model import load_config, load_tokenizer, vocab_size_of

    data = tokenize_dataset(load_rows(recipe.data), load_tokenizer(recipe.model), recipe.data,
                            vocab_size_of(load_config(recipe.model)))
    return [int(n) for n in data.kept["num_tokens"]]


# ---------------------------------------------------------------------------------------------------- MoE
def test_moe_costs_count_the_parameters_a_token_runs_through():
    """A Qwen3-30B-A3B-shaped config (its published config.json: 48 layers, hidden 2048, 32 q / 4 kv heads of
    128, 128 experts of width 768, 8 per token), every layer run: the linear FLOPs are 2 x the active decoder
    parameters, counted here by hand from the config; the GPU holds ~11x more."""
    from transformers import Qwen3MoeConfig

    from dflash_prep.target.model import decoder_params_run

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936)
    H, heads, kv, D = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    E, k, I_e = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
    attention = H * heads * D + 2 * H * kv * D + heads * D * H + 2 * D  # q, k, v, o, q/k norms
    per_layer = attention + 2 * H + E * H + k * 3 * I_e * H  # 2 norms, router, the token's k experts
    active = config.num_hidden_layers * per_layer
    assert active == 2_730_700_800  # 2.73B
    recipe = load_recipe(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml", ["layers.capture_final=after_norm"])
    model = batch_cost_model(recipe, config, [1, 24, 45], config.num_hidden_layers)
    assert model.linear_flops_per_token == 2 * active
    total = config.num_hidden_layers * (per_layer + (E - k) * 3 * I_e * H)
    assert decoder_params_run(recipe.model, config, 1) == 2 * per_layer  # two layers run
    assert total / active > 10  # what the former count (all experts) charged a token


def test_mla_moe_costs_count_shared_experts_fully_and_both_head_dims():
    """The tiny DeepSeek-V3-style config (bench/families.py): MLA (q/k head dim 24, v 12), layer 0 dense, then 8
    routed experts (2 per token) + 1 shared; hand count from the config."""
    import sys

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench.families import family_config

    c = family_config("deepseek_v3", "tiny")
    H, n = c.hidden_size, c.num_attention_heads
    qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    attention = (H * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * qk  # q_a, its norm, q_b
                 + H * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # kv_a (+ shared rope key), norm
                 + c.kv_lora_rank * n * (c.qk_nope_head_dim + v) + n * v * H)  # kv_b, o
    dense = attention + 2 * H + 3 * H * c.intermediate_size
    sparse = (attention + 2 * H + c.n_routed_experts * H  # router (its score-correction bias is a buffer)
              + c.num_experts_per_tok * 3 * H * c.moe_intermediate_size  # the token's routed experts
              + 3 * H * c.moe_intermediate_size * c.n_shared_experts)  # the shared expert, fully
    assert (dense, sparse) == (36_272, 30_640)
    recipe = load_recipe(REPO / "dflash_prep" / "demo" / "tiny-demo.yaml", ["layers.capture_final=after_norm"])
    model = batch_cost_model(recipe, c, [1, 2], c.num_hidden_layers)
    assert model.linear_flops_per_token == 2 * (dense + 3 * sparse)
    assert model.attention_flops_per_token_pair == c.num_hidden_layers * n * (qk + v)  # QK^T at 24, AV at 12

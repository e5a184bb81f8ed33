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
    from dflash_prep.commands.job import load_or_make_plan
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

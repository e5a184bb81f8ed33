"""The predicted time of a planned batch on one rank, from the target's shape and the storage layout, so that the
plan's split over ranks (planner.split_across_ranks) makes every rank finish together.

A rank's time is its forwards or its writes, whichever is slower (background writer threads write while the GPU
computes). Padded tokens alone (the former balance) miss both: a batch's forward grows with the square of its
samples' lengths (attention), and its write with its real tokens and samples, not its padding. Two H200s on the
Llama-3.1-8B shape (fp8, 1.5M tokens): each rank's forwards ended at ~26 s and its writers drained ~10 s more,
36.2 s per rank's loop; for the same shape and lengths this model predicts about 35 s per rank (the writes set it).

The forward's FLOPs count the parameters a token runs through, not those the GPU holds: for an MoE target the
routed experts' weights count num_experts_per_tok / num_experts (shared experts, routers and attention fully;
model.decoder_params_run): a Qwen3-30B-A3B-shaped target (128 experts, 8 active) weighs what its ~2.7B active
decoder parameters do, not its ~29B. The FLOP rate is the dense Llama shape's: an MoE forward that reaches a
lower share of the GPU's peak (transformers' experts loop: ~0.2 MFU measured) is slower than predicted, the same
factor on every rank, so the split stays balanced.

The rates are measured figures (one H200 node), used only to weigh forward against write: the split depends on
their ratio, never the states, and every rank and `dflash-prep plan` compute the same split from the same numbers.
"""

from __future__ import annotations

from dflash_prep.plan.planner import BatchCostModel
from dflash_prep.recipe.schema import Recipe
from dflash_prep.target.model import decoder_params_run, hidden_size_of

# Achieved forward FLOP/s of one GPU: the Llama-3.1-8B shape's warm run on an H200, MFU 0.473 of 989 TFLOP/s.
FORWARD_FLOPS_PER_SECOND = 4.7e14
# What one rank's writer threads sustain: two ranks of an H200 node shared ~0.7 GB/s of its disk.
WRITE_BYTES_PER_SECOND = 0.35e9
# Layer types (config.layer_types) whose attention is quadratic over the whole sample.
QUADRATIC_LAYER_TYPES = ("full_attention",)


def batch_cost_model(recipe: Recipe, config, layer_ids: list[int], num_layers: int,
                     decoder_params: int | None = None) -> BatchCostModel:
    """The cost numbers of this job (planner.BatchCostModel):

    - linear FLOPs per padded token = 2 x the parameters a token runs through in the decoder layers run
      (`decoder_params`, else counted on a meta-device model: model.decoder_params_run, routed experts at
      num_experts_per_tok / num_experts; without a count 12 x hidden^2 per layer);
    - attention FLOPs per token pair = (quadratic attention layers run) x num_heads x (q/k head dim + v head dim):
      QK^T and AV are 2 x width FLOPs each per pair, over the causal half of the pairs (the head dims differ for
      MLA: `qk_head_dim`, `v_head_dim`, DeepSeek-V3);
    - write bytes per token and per sample: the records as the writer encodes them (sizes.RecordSizer), the
      per-sample part (tar headers and padding, npy and safetensors headers, meta.json) averaged over lengths
      257-320."""
    from dflash_prep.store.sizes import RecordSizer

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = hidden_size_of(config)
    capture_final = recipe.layers.capture_final
    last_needed = num_layers - 1 if capture_final != "none" else max(layer_ids)
    layers_run = last_needed + 1
    params = decoder_params if decoder_params else decoder_params_run(recipe.model, config, last_needed)
    if not params:
        params = 12 * hidden * hidden * layers_run
    layer_types = getattr(text, "layer_types", None)
    quadratic_layers = (sum(t in QUADRATIC_LAYER_TYPES for t in layer_types[:layers_run]) if layer_types
                        else layers_run)
    heads = getattr(text, "num_attention_heads", None) or 1
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    qk_head_dim = getattr(text, "qk_head_dim", None) or head_dim  # MLA: q/k and v head dims differ
    v_head_dim = getattr(text, "v_head_dim", None) or head_dim
    sizer = RecordSizer(layer_ids, hidden, capture_final)
    dtype = recipe.output.dtype
    per_token = sizer.states_bytes_per_token(dtype) + 5  # + int32 token id + uint8 loss mask
    lengths = range(257, 321)
    per_sample = sum(sizer.record_bytes(T, 300, dtype) - T * per_token for T in lengths) / len(lengths)
    return BatchCostModel(linear_flops_per_token=2.0 * params,
                          attention_flops_per_token_pair=float(quadratic_layers * heads * (qk_head_dim + v_head_dim)),
                          forward_flops_per_second=FORWARD_FLOPS_PER_SECOND,
                          write_bytes_per_token=per_token, write_bytes_per_sample=per_sample,
                          write_bytes_per_second=WRITE_BYTES_PER_SECOND)

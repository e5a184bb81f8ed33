"""`batching.max_tokens_per_batch: auto`: a padded-token budget sized from the GPU's memory and the model config.

Rule (the one the benchmark ran on an H200 without an out-of-memory error: 65,536 for the Qwen3.6-27B shape with
a 64 GB peak, 131,072 for the Llama-3.1-8B shape with a 27.5 GB peak):

    per padded token  = (12 x hidden + 4 x intermediate) x compute bytes      (a generous bound of one decoder
                        + k x hidden x storage bytes                           layer's live activations, plus
                                                                               the capture buffer)
    budget            = 0.4 x (GPU memory - resident weights) / per padded token,
                        rounded down to a power of two, within [8,192, 131,072]

For an MoE target `intermediate` is the width a token runs through, its ACTIVE expert weights: num_experts_per_tok
x the expert width (`moe_intermediate_size`, else `intermediate_size`) + the shared experts' width
(`shared_expert_intermediate_size`, or n_shared_experts x the expert width), or the dense layers' width where
the model has dense layers and it is larger (`active_intermediate_size`); plus, per token, the routed copies
(2 x num_experts_per_tok x hidden in the compute dtype: the token's hidden state sent to each of its experts and
each expert's output) and the router's fp32 logits and probabilities (8 bytes x num_experts). The resident weights
stay ALL the parameters: every expert is held in memory whichever a token uses.

A packed row (`batching.packing`) of T tokens is one forward of batch 1 and T padded tokens: the same per-token
bound holds (its attention runs per sample, FlashAttention's varlen kernel or SDPA per segment, or for softcap and
sinks the eager computation per block of at most 2^25 scores, and never materializes a [T, T] score matrix, so no
term grows with the row's length), and the budget is the row's length.

A replica of N GPUs (`model.gpus_per_replica`) spreads the weights over its GPUs: the resident weights per GPU are
weights / N (`auto_token_budget`). Resident weights are counted on a meta-device build of the model with the layers
the run drops already dropped (no memory, no weights read). Without a GPU the budget is 16,384. The resolved
number is what the plan uses and what OUT/plan.json freezes: a resume on another GPU replays the stored plan. An
out-of-memory error is still handled (backoff.py) if the bound is ever too small.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dflash_prep.recipe.schema import Recipe
from dflash_prep.target.model import STORAGE_TORCH_DTYPES, experts_per_token
from dflash_prep.units import format_bytes

AUTO = "auto"
MIN_AUTO_TOKENS, MAX_AUTO_TOKENS, CPU_AUTO_TOKENS = 8192, 131072, 16384
MEMORY_FRACTION = 0.4


def bytes_per_padded_token(config, compute_dtype: str, storage_dtype: str, num_layers_captured: int) -> int:
    """The rule's per-padded-token bound (activations of one layer + the capture buffer), in bytes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    compute = STORAGE_TORCH_DTYPES[compute_dtype].itemsize
    storage = (STORAGE_TORCH_DTYPES[storage_dtype].itemsize
               + (4 / text.hidden_size if storage_dtype == "fp8_e4m3" else 0))
    inter = active_intermediate_size(config)
    routed = 0
    experts = num_routed_experts(config)
    if experts:  # the routed copies of the token's hidden state and the router's fp32 logits and probabilities
        routed = compute * 2 * experts_per_token(config) * text.hidden_size + 8 * experts
    return int(compute * (12 * text.hidden_size + 4 * inter) + routed
               + storage * num_layers_captured * text.hidden_size)


def num_routed_experts(config) -> int | None:
    """The routed experts of each MoE layer (`num_experts`, `num_local_experts` or `n_routed_experts`), None for
    a dense model (no `num_experts_per_tok`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not experts_per_token(config):
        return None
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def active_intermediate_size(config) -> int:
    """The feed-forward width one token runs through in the widest layer: `intermediate_size` (4 x hidden when
    absent) for a dense model; for an MoE, num_experts_per_tok x the expert width + the shared experts' width, or
    the dense layers' `intermediate_size` where some layers are dense (first_k_dense_replace, mlp_only_layers,
    decoder_sparse_step > 1) and it is wider."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dense = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    if not num_routed_experts(config):
        return dense
    expert = getattr(text, "moe_intermediate_size", None) or dense
    shared = (getattr(text, "shared_expert_intermediate_size", None)
              or (getattr(text, "n_shared_experts", None) or 0) * expert)
    moe = experts_per_token(config) * expert + shared
    has_dense = bool(getattr(text, "first_k_dense_replace", 0) or getattr(text, "mlp_only_layers", None)
                     or (getattr(text, "decoder_sparse_step", 1) or 1) > 1)
    return max(moe, dense) if has_dense else moe


def resident_weight_bytes(recipe: Recipe, config, last_needed_layer: int) -> int:
    """Bytes of the weights a rank holds during the run (layers after `last_needed_layer` dropped)."""
    from transformers import AutoModelForCausalLM

    from dflash_prep.target.model import drop_layers_after

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    drop_layers_after(model, last_needed_layer)
    return sum(p.numel() for p in model.parameters()) * STORAGE_TORCH_DTYPES[recipe.model.dtype].itemsize


def auto_token_budget(gpu_memory_bytes: int | None, weight_bytes: int, per_token_bytes: int,
                      gpus_per_replica: int = 1) -> tuple[int, str]:
    """(budget, how it was computed) by the rule above; `gpu_memory_bytes` None: no GPU. A replica of N GPUs
    (`model.gpus_per_replica`) holds the weights spread over its N x `gpu_memory_bytes`, while a batch's
    activations are whole on one GPU (layer split: the GPU running the layer; tensor parallelism: the residual
    stream is whole on every GPU), so the headroom is per GPU: GPU memory - weights / N."""
    if gpu_memory_bytes is None:
        return CPU_AUTO_TOKENS, f"no GPU: {CPU_AUTO_TOKENS}"
    n = gpus_per_replica
    raw = MEMORY_FRACTION * (gpu_memory_bytes - weight_bytes / n) / per_token_bytes
    budget = int(min(MAX_AUTO_TOKENS, max(MIN_AUTO_TOKENS, 2 ** math.floor(math.log2(max(raw, 1))))))
    weights = f"weights {format_bytes(weight_bytes)}" + (f" / {n} GPUs of the replica" if n > 1 else "")
    return budget, (f"{MEMORY_FRACTION} x (GPU {gpu_memory_bytes / 1e9:.0f} GB - {weights})"
                    f" / {per_token_bytes / 1e3:.0f} KB per padded token = {raw:,.0f}, a power of two in "
                    f"[{MIN_AUTO_TOKENS:,}, {MAX_AUTO_TOKENS:,}]")


def local_gpu_memory_bytes() -> int | None:
    """Total memory of this process's GPU (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def resolve_token_budget(recipe: Recipe, config, layer_ids: list[int], num_layers: int,
                         gpu_memory_bytes: int | None) -> tuple[Recipe, str | None]:
    """`recipe` with `max_tokens_per_batch: auto` replaced by its number, and how it was computed (None when the
    recipe already gives a number)."""
    if recipe.batching.max_tokens_per_batch != AUTO:
        return recipe, None
    last_needed = num_layers - 1 if recipe.layers.capture_final != "none" else max(layer_ids)
    k = len(layer_ids) + (1 if recipe.layers.capture_final != "none" else 0)
    weights = resident_weight_bytes(recipe, config, last_needed) if gpu_memory_bytes is not None else 0
    per_token = bytes_per_padded_token(config, recipe.model.dtype, recipe.output.dtype, k)
    budget, how = auto_token_budget(gpu_memory_bytes, weights, per_token, recipe.model.gpus_per_replica)
    if budget < recipe.data.max_length:  # the longest sample must fit in a batch of one
        budget, how = recipe.data.max_length, f"{how}; raised to data.max_length"
    batching = dataclasses.replace(recipe.batching, max_tokens_per_batch=budget)
    return dataclasses.replace(recipe, batching=batching), how

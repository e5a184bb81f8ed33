"""Benchmark models: a config JSON in bench/configs/ and defaults sized for one H200; parameter counts, the
weights checksum that proves every mode built the same random weights, and the `auto` token budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_prep.target.model import DTYPES

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
CONFIG_DIR = BENCH_DIR / "configs"
# Any tokenizer works for pre-tokenized rows (ids are checked against the model config's vocab, not the
# tokenizer's); dflash-prep only reads its pad id (0) and fingerprints it. The demo tokenizer ships offline.
TOKENIZER_DIR = REPO_ROOT / "dflash_prep" / "demo" / "tiny-demo" / "tokenizer"


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: a config JSON in bench/configs/ and the defaults sized for one H200."""

    config: str
    layer_ids: tuple[int, ...]  # after-layer, 0-based (id i = HF hidden_states[i + 1])
    layer_rule: str
    dtype: str  # compute dtype
    num_samples: int  # size of the sample list (the dflash-prep prefix is cut from it by tokens)
    per_sample_max_seconds: float
    fixed_batch_max_seconds: float
    dflash_max_tokens: int  # real tokens given to dflash-prep (bounds its disk use)
    max_length: int = 4096  # length clip (and data.max_length of the recipe)


MODELS = {
    # 27B hybrid: 51.2 KB per token stored (5 x 5120 x bf16): 250k tokens = 12.8 GB on disk.
    "qwen3.6-27b": ModelSpec("qwen3.6-27b.json", (1, 16, 31, 46, 61), "DFlash k=5 for L=64", "bfloat16",
                             num_samples=900, per_sample_max_seconds=60, fixed_batch_max_seconds=60,
                             dflash_max_tokens=250_000),
    # 8B: 24.6 KB per token (3 x 4096 x bf16): 800k tokens = 19.7 GB.
    "llama3.1-8b": ModelSpec("llama3.1-8b.json", (1, 15, 28), "EAGLE-3 for L=32", "bfloat16",
                             num_samples=3000, per_sample_max_seconds=45, fixed_batch_max_seconds=60,
                             dflash_max_tokens=800_000),
    # Qwen3-8B: 40 KB per token (5 x 4096 x bf16): 800k tokens = 32.8 GB.
    "qwen3-8b": ModelSpec("qwen3-8b.json", (1, 9, 17, 25, 33), "DFlash k=5 for L=36", "bfloat16",
                          num_samples=3000, per_sample_max_seconds=45, fixed_batch_max_seconds=60,
                          dflash_max_tokens=800_000),
    # MoE (issue: experts at engine speed): 20 KB per token (5 x 2048 x bf16); weights 61 GB / 69 GB in bf16.
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b.json", (1, 12, 23, 34, 45), "DFlash k=5 for L=48", "bfloat16",
                               num_samples=3000, per_sample_max_seconds=45, fixed_batch_max_seconds=60,
                               dflash_max_tokens=800_000),
    "qwen3.6-35b-a3b": ModelSpec("qwen3.6-35b-a3b.json", (1, 10, 19, 28, 37), "DFlash k=5 for L=40", "bfloat16",
                                 num_samples=3000, per_sample_max_seconds=45, fixed_batch_max_seconds=60,
                                 dflash_max_tokens=800_000),
    # CPU-sized (seconds): used by tests/test_bench.py. 8 layers each.
    "tiny-qwen3.5": ModelSpec("tiny-qwen3.5.json", (1, 2, 3, 4, 5), "DFlash k=5 for L=8", "float32",
                              num_samples=24, per_sample_max_seconds=120, fixed_batch_max_seconds=120,
                              dflash_max_tokens=10**9, max_length=1024),
    "tiny-llama": ModelSpec("tiny-llama.json", (1, 3, 4), "EAGLE-3 for L=8", "float32",
                            num_samples=24, per_sample_max_seconds=120, fixed_batch_max_seconds=120,
                            dflash_max_tokens=10**9, max_length=1024),
}


def model_info(config, layer_ids: list[int]) -> dict:
    """Parameter counts from a meta-device build (no memory, no time)."""
    from transformers import AutoModelForCausalLM

    from dflash_prep.target.layers import decoder_layers, find_decoder
    from dflash_prep.target.model import active_params, experts_per_token

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(find_decoder(model))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    top_k = experts_per_token(config)
    active = [active_params(layer, top_k) for layer in layers]  # what a token runs through (MoE: its experts)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    info = {"model_type": text.model_type, "architecture": type(model).__name__,
            "num_hidden_layers": len(layers), "hidden_size": int(text.hidden_size),
            "vocab_size": int(text.vocab_size), "params_total": sum(p.numel() for p in model.parameters()),
            "decoder_params_all_layers": sum(per_layer),
            "decoder_params_needed": sum(per_layer[: max(layer_ids) + 1]),
            "decoder_params_active_needed": sum(active[: max(layer_ids) + 1]),
            "decoder_params_active_all_layers": sum(active),
            "layers_needed": max(layer_ids) + 1, "per_layer_params": per_layer}
    del model
    return info


def weights_checksum(model, layer_ids: list[int]) -> float:
    """float64 sum of the embedding and of decoder layers 0 and max(layer_ids): the same in every mode iff the
    modes built the same random weights (later layers may be dropped by dflash-prep, so they are not summed)."""
    from dflash_prep.target.layers import decoder_layers, find_decoder

    decoder = find_decoder(model)
    layers = decoder_layers(decoder)
    tensors = list(decoder.get_input_embeddings().parameters())
    for i in sorted({0, max(layer_ids)}):
        tensors += list(layers[i].parameters())
    with torch.no_grad():
        return float(sum(torch.sum(t, dtype=torch.float64).item() for t in tensors))


def auto_token_budget(device: torch.device, config, info: dict, dtype_name: str, storage_dtype_name: str,
                      k: int) -> tuple[int, str]:
    """`--max-tokens-per-batch auto`: the product's own rule (`batching.max_tokens_per_batch: auto`,
    dflash_prep/target/budget.py), with the weights of the whole model (the baselines hold all of it)."""
    from dflash_prep.target import budget

    if device.type != "cuda":
        return budget.auto_token_budget(None, 0, 1)
    per_token = budget.bytes_per_padded_token(config, dtype_name, storage_dtype_name, k)
    weights = info["params_total"] * DTYPES[dtype_name].itemsize
    return budget.auto_token_budget(torch.cuda.get_device_properties(device).total_memory, weights, per_token)

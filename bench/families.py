"""Configs of every target family packed rows are checked on, at two sizes: `tiny` (CPU tests: hidden 64, 4
heads of 16, 4-6 layers, windows of 16 tokens) and `gpu` (bench/packing_check.py on a GPU: each family's real
head dims and layer kinds, hidden 1024-2048, 4-6 layers, windows of 128 tokens so the check's samples of
17-384 tokens cross them).

Each family keeps what makes it itself: sliding-window layers (mistral, qwen2 on its upper layers, phi3, gemma2,
gemma3, gpt-oss), logit softcapping and a non-default scaling (gemma2), attention sinks (gpt-oss), qk-norm (qwen3,
gemma3), MoE (qwen3_moe, qwen3_5_moe, gpt-oss, deepseek_v3; the first dense layer kept where the family has one),
MLA with q/k head dim != v head dim (deepseek_v3), Gated DeltaNet + full attention (qwen3_5, qwen3_5_moe).

    family_config("gemma2", "tiny") -> a transformers config (random weights are drawn from it)
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO_QWEN35 = Path(__file__).resolve().parent.parent / "dflash_prep" / "demo" / "tiny-demo" / "model_config.json"

# Every family packed rows are proven on (tests/test_packing_families.py, bench/packing_check.py).
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3", "phi3", "gpt_oss", "qwen3_5",
            "qwen3_5_moe", "deepseek_v3", "mixtral", "glm4_moe")
WINDOW = {"tiny": 16, "gpu": 128}
# Qwen3.5's pattern (3 Gated DeltaNet, then full attention), one more layer so that a capture of every layer but
# the last (HF's last hidden state is after the final norm) includes the attention layer
HYBRID_LAYER_TYPES = ["linear_attention"] * 3 + ["full_attention", "linear_attention"]


def _base(size: str) -> dict:
    if size == "tiny":
        return dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_hidden_layers=4, vocab_size=1024, max_position_embeddings=4096,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if size == "gpu":
        return dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=128, num_hidden_layers=6, vocab_size=32000, max_position_embeddings=8192,
                    pad_token_id=0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    raise ValueError(f"size must be tiny or gpu, got {size!r}")


def _moe(size: str, experts_key: str = "num_experts") -> dict:
    """Routed experts: 8 (tiny) / 32 (gpu), 2 / 4 active per token."""
    tiny = size == "tiny"
    return {experts_key: 8 if tiny else 32, "num_experts_per_tok": 2 if tiny else 4,
            "moe_intermediate_size": 32 if tiny else 768}


def family_overrides(family: str, size: str) -> tuple[str, dict]:
    """(model_type, config fields) of `family` at `size` ("tiny" or "gpu")."""
    base, window, tiny = _base(size), WINDOW[size], size == "tiny"
    n = base["num_hidden_layers"]
    if family == "llama":
        return "llama", base
    if family == "qwen2":  # sliding windows on the layers from max_window_layers up
        return "qwen2", {**base, "use_sliding_window": True, "sliding_window": window, "max_window_layers": n // 2}
    if family == "qwen3":  # qk-norm
        return "qwen3", base
    if family == "qwen3_moe":  # layer 0 dense (mlp_only_layers), the rest sparse
        return "qwen3_moe", {**base, **_moe(size), "mlp_only_layers": [0], "norm_topk_prob": True}
    if family == "mistral":
        return "mistral", {**base, "sliding_window": window}
    if family == "gemma2":  # sliding/full alternating, logit softcap, scaling by query_pre_attn_scalar
        return "gemma2", {**base, "sliding_window": window, "attn_logit_softcapping": 2.0 if tiny else 50.0,
                          "final_logit_softcapping": None, "query_pre_attn_scalar": 24 if tiny else 224,
                          "hidden_activation": "gelu_pytorch_tanh", "head_dim": base["head_dim"] * (1 if tiny else 2)}
    if family == "gemma3":  # 5 sliding : 1 full, qk-norm, local rope base
        return "gemma3_text", {**base, "sliding_window": window, "query_pre_attn_scalar": 24 if tiny else 256,
                               "num_hidden_layers": 6, "head_dim": base["head_dim"] * (1 if tiny else 2)}
    if family == "phi3":  # fused qkv and gate_up, sliding window
        return "phi3", {**{k: v for k, v in base.items() if k != "head_dim"}, "sliding_window": window}
    if family == "gpt_oss":  # sinks, sliding/full alternating, MoE with biases
        fields = {**base, "num_local_experts": 8 if tiny else 32, "num_experts_per_tok": 2 if tiny else 4,
                  "sliding_window": window, "head_dim": 16 if tiny else 64,
                  "intermediate_size": 32 if tiny else 1024}
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(fields["num_hidden_layers"])]
        return "gpt_oss", fields
    if family == "qwen3_5":
        if tiny:
            return "qwen3_5_text", {k: v for k, v in json.loads(DEMO_QWEN35.read_text()).items()
                                    if k not in ("model_type", "transformers_version")}
        return "qwen3_5_text", {**base, "num_hidden_layers": 5, **_linear(size), "head_dim": 256,
                                "layer_types": HYBRID_LAYER_TYPES}
    if family == "qwen3_5_moe":  # Gated DeltaNet + full attention, routed + shared expert
        return "qwen3_5_moe_text", {**base, **_moe(size), **_linear(size), "num_hidden_layers": 5,
                                    "shared_expert_intermediate_size": 32 if tiny else 768,
                                    "head_dim": base["head_dim"] if tiny else 256,
                                    "layer_types": HYBRID_LAYER_TYPES}
    if family == "deepseek_v3":  # MLA (q/k head dim 24 != v 12; gpu: 192 != 128), 1 dense layer, routed + shared
        mla = (dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12) if tiny
               else dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128))
        fields = {**base, **mla, "n_routed_experts": 8 if tiny else 32, "num_experts_per_tok": 2 if tiny else 4,
                  "moe_intermediate_size": 32 if tiny else 768, "n_shared_experts": 1, "n_group": 2,
                  "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                  "num_key_value_heads": base["num_attention_heads"], "rope_interleave": True}
        fields.pop("head_dim")
        return "deepseek_v3", fields
    if family == "mixtral":  # MoE, every layer sparse
        return "mixtral", {**base, "num_local_experts": 8 if tiny else 32, "num_experts_per_tok": 2 if tiny else 4}
    if family == "glm4_moe":  # partial rotary, routed + shared experts, first layer dense
        return "glm4_moe", {**base, "n_routed_experts": 8 if tiny else 32, "num_experts_per_tok": 2 if tiny else 4,
                            "moe_intermediate_size": 32 if tiny else 768, "n_shared_experts": 1, "n_group": 1,
                            "topk_group": 1, "first_k_dense_replace": 1, "use_qk_norm": True}
    raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")


def _linear(size: str) -> dict:
    """Gated DeltaNet heads."""
    if size == "tiny":
        return dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4)
    return dict(linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4)


def family_config(family: str, size: str = "tiny"):
    """The transformers config of `family` at `size`."""
    from transformers import AutoConfig

    model_type, fields = family_overrides(family, size)
    return AutoConfig.for_model(model_type, **fields)

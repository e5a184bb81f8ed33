"""The static decoder's attention: one function registered in transformers' AttentionInterface for the decode steps
and the padded prefill forwards of regen/decode.py, where the model's own attention is `sdpa`.

Why our own, for the padded prefill only: transformers' `sdpa` path, given a mask (a padded batch), repeats every
key and value per query head (`repeat_kv`: a copy) before SDPA. Measured on an H200 (bench/regen_bench.py's
profile of one warm prefill): 870 of 3,256 device ms on the Llama-3.1-8B shape (128 rows, 55,770 prompt tokens),
505 of 5,033 on the Qwen3.6-27B hybrid (64 rows); with this function the hybrid's copies took 259 of 4,747 ms. It
runs SDPA on the query heads packed per key/value head instead (queries [B, Hkv, G * S, D] against keys
[B, Hkv, L, D]), the mask [B, 1, S, L] repeated G times along the queries (once per forward: every layer gets the
same mask object): the same math, no key or value copied.

Decode steps (one query a row) and everything else (no mask, softcap, position bias, sinks, output_attentions) go
to transformers' `sdpa` function as they are. Measured for the decode step, and not kept: two batched GEMMs
(scores q k^T in float32, softmax, p v) took 23.7 ms of an eager 8B step (128 rows x 1,792 positions) where SDPA's
cuDNN kernel took 14.9, and 9.8 against 4.6 ms on the hybrid (64 rows x 1,664 positions); SDPA's memory-efficient
kernel was not faster either when timed per call.

Shapes: query [B, Hq, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], Hq a multiple of Hkv (the query heads of
key/value head h are h * G .. h * G + G - 1, as transformers' `repeat_kv`); mask bool (True: attend) or additive
float, broadcastable to [B, 1, S, L] (transformers' `sdpa_mask`, which is registered under this name as well).
Returns ([B, S, Hq, Dv], None) like every AttentionInterface function. The tests check it against attention
written out in float64 on the CPU, and the decoder's answers against `generate` alone.
"""

from __future__ import annotations

import torch

STATIC_ATTENTION = "regen_static"  # no "flash" or "sdpa" in the name: transformers reads such names by substring


def register() -> str:
    """Register the function and sdpa's mask under STATIC_ATTENTION (idempotent) -> the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(STATIC_ATTENTION, static_attention)
    AttentionMaskInterface.register(STATIC_ATTENTION, sdpa_mask)
    return STATIC_ATTENTION


def static_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs):
    """AttentionInterface function (the module docstring gives shapes and what runs where)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (query.shape[2] == 1 or attention_mask is None or kwargs.get("softcap") is not None
             or kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None
             or kwargs.get("output_attentions") or (dropout and module.training)
             or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1])
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _prefill(query, key, value, attention_mask, scale), None


class _RepeatedMask:
    """The last mask repeated per query group (one forward's layers all get the same mask object); the source is
    held, so an `is` check cannot match a new tensor at a reused address."""

    source: torch.Tensor | None = None
    groups: int = 0
    repeated: torch.Tensor | None = None

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int) -> torch.Tensor:
        if mask is not cls.source or groups != cls.groups:
            cls.source, cls.groups, cls.repeated = mask, groups, mask.repeat(1, 1, groups, 1)
        return cls.repeated


def _prefill(query, key, value, mask, scale: float) -> torch.Tensor:
    """Several queries a row, with a mask -> [B, S, Hq, Dv]."""
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * length, dim)  # query index g * S + s
    if mask.shape[2] == 1 or groups == 1:
        packed_mask = mask
    else:
        packed_mask = _RepeatedMask.of(mask, groups)  # [B, 1, S, L] -> [B, 1, G * S, L]
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=packed_mask, scale=scale)
    out = out.view(batch, kv_heads, groups, length, value.shape[-1]).reshape(batch, q_heads, length, -1)
    return out.transpose(1, 2).contiguous()

"""The static decoder's attention: one function registered in transformers' AttentionInterface for the decode steps
and the padded prefill forwards of regen/decode.py, where the model's own attention is `sdpa`.

Why our own: measured on an H200 (Llama-3.1-8B shape, bf16, an eager decode step of 128 rows over a 1,792-position
static cache, bench/regen_bench.py's profile): transformers' `sdpa` path sends the step's one query a row (its query
heads packed per key/value head) to cuDNN's flash kernel, 14.9 of the step's 21.0 device ms, where reading the
step's keys and values once takes ~6 ms; and in the padded prefill (a mask is given) it repeats every key and value
per query head (`repeat_kv`: a copy), 870 of 3,256 device ms. What this function computes instead is transformers'
own math, arranged so that keys and values are read once and never copied:

- **Decode** (one query a row): the fastest of a few kernels for the shapes, timed once per shape on CUDA
  (`DECODE_KERNELS`: SDPA on torch's choice of kernel or on its memory-efficient one, with the query heads packed
  per key/value head, or the two GEMMs below), the GEMMs elsewhere. The GEMMs: the query heads of each key/value
  head as the rows of one small matrix,
  scores = q k^T in float32 (on CUDA `torch.bmm(..., out_dtype=float32)` on the bf16 inputs: fp32 accumulation and
  output, no fp32 copy of the keys), the mask, softmax in float32, probabilities cast to the value dtype (as
  transformers' eager attention does), then p v. Two batched GEMMs of a few rows: bound by reading k and v. A
  query whose keys are all masked gets zeros, as SDPA gives it.
- **Prefill** (several queries, a padding mask): SDPA on the query heads packed per key/value head (queries
  [B, Hkv, G * S, D] against keys [B, Hkv, L, D]), the mask [B, 1, S, L] repeated G times along the queries (once
  per forward: every layer gets the same mask object), so no key or value is repeated.
- Anything else (no mask, softcap, position bias, sinks, output_attentions): transformers' `sdpa` function as is.

Shapes: query [B, Hq, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], Hq a multiple of Hkv (the query heads of
key/value head h are h * G .. h * G + G - 1, as transformers' `repeat_kv`); mask bool (True: attend) or additive
float, broadcastable to [B, 1, S, L] (transformers' `sdpa_mask`, which is registered under this name as well).
Returns ([B, S, Hq, Dv], None) like every AttentionInterface function. The tests check it against `sdpa` in
float32 on the CPU, and the decoder's answers against `generate` alone.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dflash_prep")

STATIC_ATTENTION = "static_decode"  # no "flash" or "sdpa" in the name: transformers reads such names by substring


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

    plain = (attention_mask is None or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
             or kwargs.get("s_aux") is not None or kwargs.get("output_attentions") or (dropout and module.training)
             or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1])
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        return DECODE_KERNELS[_decode_kernel(query, key, value, attention_mask, scale)](
            query, key, value, attention_mask, scale), None
    return _prefill(query, key, value, attention_mask, scale), None


def _decode_sdpa(query, key, value, mask, scale: float, backend=None) -> torch.Tensor:
    """One query a row, SDPA on the query heads packed per key/value head ([B, Hkv, G, D]: transformers'
    `pack_gqa`), on torch's choice of kernel or `backend` -> [B, 1, Hq, Dv]; a query whose keys are all masked
    gets zeros (the NaN some kernels give there would reach the cache)."""
    import contextlib

    from torch.nn.attention import sdpa_kernel

    batch, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale)
    return out.nan_to_num_(0.0).reshape(batch, 1, q_heads, value.shape[-1])


def _decode_efficient(query, key, value, mask, scale: float) -> torch.Tensor:
    from torch.nn.attention import SDPBackend

    return _decode_sdpa(query, key, value, mask, scale, SDPBackend.EFFICIENT_ATTENTION)


def _decode_bmm(query, key, value, mask, scale: float) -> torch.Tensor:
    """One query a row by two batched GEMMs (scores in float32) -> [B, 1, Hq, Dv]."""
    batch, q_heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = q_heads // kv_heads
    q = query.reshape(batch * kv_heads, groups, dim)  # [B, Hq, 1, D] -> heads of one kv head as rows
    k = key.reshape(batch * kv_heads, length, dim)  # a view: the static cache is contiguous
    scores = _scores(q, k.transpose(1, 2)).view(batch, kv_heads, groups, length)
    scores.mul_(scale)
    if mask.dtype == torch.bool:  # mask [B or 1, 1, 1, L] broadcasts over the heads and their groups
        scores.masked_fill_(~mask, float("-inf"))
    else:
        scores.add_(mask)
    # a query with every key masked (a padding column of a padded prefill's 1-column forward) gets zeros, as
    # SDPA gives it: a NaN there would reach the cache and, through 0 x NaN, every later step
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0).to(value.dtype).view(batch * kv_heads, groups, length)
    out = torch.bmm(probs, value.reshape(batch * kv_heads, length, value.shape[-1]))
    return out.view(batch, 1, q_heads, value.shape[-1])


_FP32_OUT = {"cuda": True}  # torch.bmm(out_dtype=) works here; set False (said once) where this torch refuses it


def _scores(q: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """q k^T in float32: on CUDA in half precision straight from the GEMM (fp32 output), else from fp32 inputs (on
    a CUDA torch without `out_dtype`: the GEMM's half-precision output, as transformers' eager attention has it)."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k_t)
    if not q.is_cuda:
        return torch.bmm(q.float(), k_t.float())
    if _FP32_OUT["cuda"]:
        try:  # the first decode step runs eagerly before any CUDA graph capture: a refusal is met there
            return torch.bmm(q, k_t, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:
            _FP32_OUT["cuda"] = False
            log.warning("regeneration attention: torch.bmm(out_dtype=float32) refused (%s); scores in %s",
                        str(e).splitlines()[0][:120] if str(e) else type(e).__name__, q.dtype)
    return torch.bmm(q, k_t).float()


# The decode step's candidates, all the same math (within the dtype's rounding). Which is fastest depends on the
# shapes and the GPU (H200, 8B shape, 128 rows x 1,792 positions, eager step: SDPA's cuDNN kernel 14.9 ms of the
# step's 21.0 ms; two batched GEMMs with float32 scores 23.7 ms): on CUDA each new shape times them once, before any
# CUDA graph capture (the first decode step runs eagerly), and keeps the fastest; elsewhere `bmm`.
DECODE_KERNELS = {"bmm": _decode_bmm, "sdpa": _decode_sdpa, "sdpa_efficient": _decode_efficient}
DECODE_CHOICES: dict[tuple, dict] = {}  # shape key -> {"kernel": name, "ms": {name: ms per call}}


def _decode_kernel(query, key, value, mask, scale: float) -> str:
    """The decode kernel for these shapes: chosen once per shape key (module comment above)."""
    if not query.is_cuda:
        return "bmm"
    shape = (tuple(query.shape), tuple(key.shape), value.shape[-1], query.dtype, mask.dtype, tuple(mask.shape))
    found = DECODE_CHOICES.get(shape)
    if found is not None:
        return found["kernel"]
    if torch.cuda.is_current_stream_capturing():  # not timed inside a capture: torch's choice
        return "sdpa"
    times = {}
    for name, kernel in DECODE_KERNELS.items():
        try:
            kernel(query, key, value, mask, scale)  # warm-up (workspaces, first-call setup)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                kernel(query, key, value, mask, scale)
            end.record()
            end.synchronize()
            times[name] = start.elapsed_time(end) / 3
        except RuntimeError as e:  # a backend that refuses these shapes
            log.debug("regeneration attention: %s refused %s: %s", name, shape, e)
    best = min(times, key=times.get)
    DECODE_CHOICES[shape] = {"kernel": best, "ms": times}
    log.info("regeneration attention: decode of %s queries over %s keys on %s (ms per call: %s)", list(query.shape),
             list(key.shape), best, ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    return best


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

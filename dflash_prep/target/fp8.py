"""fp8 (float8 e4m3) storage of hidden states: one fp32 scale per token (and layer).

Quantization of a row x (one token's H values of one layer):

    s = max(amax(|x|) / 448, 1e-12)          fp32, 448 = the largest finite e4m3 value
    q = e4m3(clamp(x / s, -448, 448))        round to nearest even (torch's cast)
    x_hat = float32(q) * s                   dequantization

The convention (amax / 448, floor 1e-12, dequantize by multiplying) is the one speculators uses for its fp8
hidden-state files, so its readers and ours agree on what a stored pair (q, s) means.

Error bound, per element, for every finite x (e4m3 has 3 mantissa bits: a normal value is rounded with a
relative error of at most 2^-4; below the smallest normal, 2^-6, the spacing is 2^-9, so the absolute error in
units of s is at most 2^-10):

    |x_hat - x| <= 2^-4 * |x| + 2^-10 * s   (+ fp32 rounding of the division and product, ~2^-23 |x|)

Since s = amax / 448, the bound is at most (2^-4 + 2^-10 / 448) * amax of the token's row: this is the figure
`verify` uses for fp8 outputs (`FP8_REL_BOUND`). Non-finite inputs give a non-finite scale (stored as is).

Re-quantizing with a coarser scale (speculators' layout has one scale per token for all K layers,
S = max over layers of s_l) rounds a second time: |x' - x| <= (2 * 2^-4 + 2^-8) * |x| + (2 + 2^-4) * 2^-10 * S
(see `requantize_error_bound`).

In the capture buffer and the writer's host buffer, the fp8 bytes and the scales of a batch travel together as
rows of one uint8 tensor, `[N, k*H + 4*k]`: the k*H e4m3 bytes of the token, then its k fp32 scales as bytes
(`pack_rows` / `unpack_rows`), so a batch still needs a single device-to-host copy.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12
SCALE_BYTES = 4
FP8_REL_BOUND = 2.0 ** -4 + 2.0 ** -10 / FP8_MAX
"""Max |x_hat - x| / amax(|x| of the row) after one e4m3 round trip."""


def quantize_rows(x_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, H] float8_e4m3fn, scale [N] float32) of each row of `x_NH`; `x_NH` is not modified."""
    y_NH = x_NH.to(torch.float32, copy=True)
    scale_N = (y_NH.abs().amax(dim=-1) / FP8_MAX).clamp_(min=MIN_SCALE)
    y_NH.div_(scale_N[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    return y_NH.to(FP8_DTYPE), scale_N


def dequantize(q_TW: torch.Tensor, scales_Tk: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[T, k*H] from e4m3 `q_TW` [T, k*H] and fp32 `scales_Tk` [T, k] (block j of H columns uses scale j).

    The product is formed in fp32 (exact up to fp32 rounding) and then cast to `dtype` (bf16 adds its own
    rounding, 2^-8 relative)."""
    T, W = q_TW.shape
    k = scales_Tk.shape[-1]
    if scales_Tk.shape != (T, k) or W % k:
        raise ValueError(f"fp8 states {list(q_TW.shape)} do not match scales {list(scales_Tk.shape)}")
    x = q_TW.to(torch.float32).view(T, k, W // k) * scales_Tk.to(torch.float32)[:, :, None]
    return x.view(T, W).to(dtype)


def quantize_blocks(x_TW: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x_TW` [T, k*H] per token and per block of H columns: (q [T, k*H], scales [T, k])."""
    T, W = x_TW.shape
    q, s = quantize_rows(x_TW.reshape(T * k, W // k))
    return q.view(T, W), s.view(T, k)


def requantize_error_bound(x_abs: torch.Tensor, coarse_scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound of |x'' - x| when x was stored as (q, s) and re-quantized with scale S >= s."""
    a, b = 2.0 ** -4, 2.0 ** -10
    return (2 * a + a * a) * x_abs + (2 + a) * b * coarse_scale


# ------------------------------------------------------------------------------------- packed buffer rows
def packed_width(k: int, hidden_size: int) -> int:
    """Bytes per token of a packed row: k*H e4m3 bytes + k fp32 scales."""
    return k * hidden_size + SCALE_BYTES * k


def store_block(packed_NW: torch.Tensor, slot: int, k: int, x_NH: torch.Tensor) -> None:
    """Quantize `x_NH` [N, H] into block `slot` of the packed uint8 rows `packed_NW` [N, k*H + 4k]."""
    N, H = x_NH.shape
    q_NH, scale_N = quantize_rows(x_NH)
    packed_NW[:, slot * H:(slot + 1) * H].copy_(q_NH.view(torch.uint8))
    start = k * H + SCALE_BYTES * slot
    packed_NW[:, start:start + SCALE_BYTES].copy_(scale_N.view(torch.uint8).view(N, SCALE_BYTES))


def unpack_rows(packed_NW: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, k*H] float8_e4m3fn, scales [N, k] float32) from packed uint8 rows (contiguous copies)."""
    if packed_NW.dtype != torch.uint8 or packed_NW.dim() != 2:
        raise TypeError(f"packed fp8 rows must be a 2-D uint8 tensor, got {packed_NW.dtype} {list(packed_NW.shape)}")
    N, W = packed_NW.shape
    width = W - SCALE_BYTES * k
    if width <= 0 or width % k:
        raise ValueError(f"packed fp8 rows of {W} bytes cannot hold {k} blocks and their scales")
    q = packed_NW[:, :width].contiguous().view(FP8_DTYPE)
    scales = packed_NW[:, width:].contiguous().view(torch.float32)
    return q, scales.view(N, k)


def finite_rows(packed_NW: torch.Tensor, k: int) -> torch.Tensor:
    """[N] bool: the row's k scales are finite, i.e. the states quantized into it held no NaN and no Inf
    (amax propagates both into the scale). For the non-finite check of a packed fp8 buffer: the uint8 bytes
    themselves are always "finite"."""
    N, W = packed_NW.shape
    width = W - SCALE_BYTES * k
    scales = packed_NW[:, width:].contiguous().view(torch.float32)
    return torch.isfinite(scales).all(dim=1)

"""The activations' 1x128 FP8 quantization as one Triton kernel (CUDA only; imported only where Triton is).

What it computes is `fp8_weights.quantize_1x128`, bit for bit (bench/targets_check.py checks it on the GPU): per
token and 128-wide block of K, s = max(amax(|x|), 1e-12) / 448 and q = e4m3(clamp(x / s, -448, 448)), both divisions
IEEE-rounded (`tl.div_rn`, as torch divides by a tensor), the cast round-to-nearest-even (as torch's), a NaN kept.
It writes what `torch.nn.functional.scaled_mm` reads, so nothing is copied around the GEMM:

- q [M_pad, K_pad] float8_e4m3fn: rows past M and columns past K are zeros (the zero padding the GEMM needs, written
  by the kernel instead of a padded copy of the activations);
- the decoding scales [M_pad, K_pad / 128] float32 outer-dim-major (strides (1, M_pad)): BlockWise1x128's layout.

Written here, not taken from a library, because it was measured: through `torch.compile(dynamic=True)` the same
function became three kernels per call (a reduction and two elementwise passes) that took 29.5% of an FP8
forward's GPU time on the Qwen3.6-27B shape, more than half as long as the FP8 GEMMs themselves
(bench/results/targets-20261204-fp8-quant/); one pass over the activations is what the format costs. The libraries
that have such a kernel (torchao's prototype blockwise FP8, DeepGEMM, vLLM, SGLang) either fetch or build kernels
at run time, pin other torch versions, or round the scale differently (x * (448 / amax)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
FP8_MAX = 448.0
MIN_AMAX = 1e-12
ROWS_PER_PROGRAM = 32


@triton.jit
def _quantize_1x128_kernel(x_ptr, q_ptr, s_ptr, M, K, M_pad, K_pad, stride_xm,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX_C: tl.constexpr,
                           MIN_AMAX_C: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = pid_k * BLOCK + tl.arange(0, BLOCK)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=inside, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX_C)
    # a NaN anywhere in the block makes its scale NaN, as torch's amax does (Triton's max would skip it), and the
    # clamp keeps NaN: a NaN activation stays NaN instead of becoming +-448
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    scale = tl.div_rn(amax, tl.full((ROWS,), FP8_MAX_C, tl.float32))
    scale = tl.where(has_nan, float("nan"), scale)
    y = tl.div_rn(x, scale[:, None])
    y = tl.clamp(y, -FP8_MAX_C, FP8_MAX_C, propagate_nan=tl.PropagateNan.ALL)
    stored = rows[:, None] < M_pad
    q = y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K_pad + cols[None, :], q, mask=stored & (cols[None, :] < K_pad))
    tl.store(s_ptr + pid_k.to(tl.int64) * M_pad + rows, scale, mask=rows < M_pad)


def quantize_1x128_padded(x_MK: torch.Tensor, m_pad: int, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (CUDA, bf16/fp16/fp32, unit stride along K) -> (q [m_pad, k_pad] float8_e4m3fn, scales [m_pad,
    k_pad / 128] float32 with strides (1, m_pad)); m_pad >= M, k_pad >= K a multiple of 128. Padded rows get the
    smallest scale (1e-12 / 448) and zeros."""
    M, K = x_MK.shape
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    q = torch.empty(m_pad, k_pad, dtype=torch.float8_e4m3fn, device=x_MK.device)
    scales_LM = torch.empty(k_pad // BLOCK_K, m_pad, dtype=torch.float32, device=x_MK.device)
    grid = (triton.cdiv(m_pad, ROWS_PER_PROGRAM), k_pad // BLOCK_K)
    _quantize_1x128_kernel[grid](x_MK, q, scales_LM, M, K, m_pad, k_pad, x_MK.stride(0), ROWS=ROWS_PER_PROGRAM,
                                 BLOCK=BLOCK_K, FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, num_warps=4)
    return q, scales_LM.t()

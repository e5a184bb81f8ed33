"""Block-scaled FP8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 format) run as FP8.

The format, as transformers' FineGrainedFP8 integration reads it (`quantization_config` of config.json):

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]}

Each converted linear layer stores `weight` as float8_e4m3fn [N, K] and `weight_scale_inv` as float32
[ceil(N/128), ceil(K/128)]: the dequantized weight is W[n, k] = fp32(weight[n, k]) * weight_scale_inv[n // 128,
k // 128]. Activations are quantized on the fly per token and 128-wide block of K ("dynamic"):
s = amax(|x_block|) / 448, x8 = e4m3(x / s).

Loading is transformers' own (`from_pretrained` builds its FP8Linear modules and reads the fp8 weights and their
scales); what runs is ours: transformers' FP8 forward fetches its kernels (DeepGEMM or a Triton kernel) from a hub
at run time, which an offline machine cannot. On a GPU, `install_scaled_mm` puts every FP8 linear layer on
PyTorch's own block-scaled GEMM (`torch.nn.functional.scaled_mm`, activations BlockWise1x128, weights
BlockWise128x128; cuBLAS, nothing downloaded): the states are the FP8 model's, never a silently dequantized one's.
On a CPU (no FP8 GEMM) transformers dequantizes the weights on load; the log says so once. `model.fp8_weights:
dequantize` loads the same checkpoint dequantized on a GPU too: the bf16 side of an A/B, and the reference of
`verify --fp8-reference dequantized` (within `FP8_COMPUTE_TOLERANCE`; by default `verify` re-runs the FP8 model).

A `quantization_config` of any other kind (another method, block size, scale format, static activation scales)
is refused (RecipeError, exit code 2) before anything is loaded.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dflash_prep.recipe.schema import RecipeError

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
# verify's allowance (relative error to each layer's max |value|) for an FP8 run against the same checkpoint's
# dequantized reference (`verify --fp8-reference dequantized`), on top of the stored and compute dtypes' own (and
# verify's noise-floor widening still applies): e4m3 activations round each element by up to 2^-4 (relative), and
# the rounding of every projection adds up along the residual stream. Measured on the CPU with the activation
# rounding emulated (tests/test_fp8_weights.py, a random 4-layer Llama of hidden size 256): 0.033, 0.041, 0.050,
# 0.060 after layers 1-4, about +0.009 a layer:
# random weights deeper than ~8 layers pass on their noise floor only. bench/targets_check.py measures the GPU's
# figure (cuBLAS, the 27B shape: 0.13 after one layer, 0.41 after 16), and bench/fp8_emulation.py shows that figure
# is the format's on random weights (the same emulation at hidden 2048: a hybrid 0.12 after one layer, 0.32 after
# 16): wide random models exceed this allowance, which only a real FP8 checkpoint can settle.
FP8_COMPUTE_TOLERANCE = 0.1
FP8_WEIGHTS_MODES = ("auto", "dequantize")


def block_fp8_format(config) -> dict | None:
    """The checkpoint's `quantization_config` as a dict when it is the block-scaled e4m3 format above; None when
    the checkpoint is not quantized. RecipeError (one line, exit code 2) for any other quantization."""
    quant = getattr(config, "quantization_config", None)
    if quant is None and hasattr(config, "get_text_config"):
        quant = getattr(config.get_text_config(), "quantization_config", None)
    if quant is None:
        return None
    q = quant.to_dict() if hasattr(quant, "to_dict") else dict(quant)
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    block = list(q.get("weight_block_size") or [])
    problems = []
    if method != "fp8":
        problems.append(f"quant_method {method!r}")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        problems.append(f"fmt {fmt!r}")
    if block != [BLOCK, BLOCK]:
        problems.append(f"weight_block_size {q.get('weight_block_size')!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {q.get('activation_scheme')!r}")
    if q.get("scale_fmt", "float") not in (None, "float"):
        problems.append(f"scale_fmt {q.get('scale_fmt')!r}")
    if q.get("expert_dtype", "fp8") != "fp8" or q.get("modules_to_convert"):
        problems.append("fp4 experts or fp8 embeddings")
    if problems:
        raise RecipeError(
            f"the checkpoint's quantization_config is not a format dflash-prep runs ({', '.join(problems)}); "
            f"supported: block-scaled FP8 (quant_method fp8, e4m3, weight_block_size [128, 128], dynamic "
            f"activations, float scales), or an unquantized checkpoint")
    return q


def from_pretrained_kwargs(config, mode: str, device: torch.device) -> dict:
    """Extra `from_pretrained` keywords for a block-FP8 checkpoint: with `mode` dequantize (or on a device that
    cannot run FP8 GEMMs), transformers' FineGrainedFP8Config(dequantize=True): weights W = fp8 x scale in the
    compute dtype. Nothing for an unquantized checkpoint."""
    q = block_fp8_format(config)
    if q is None:
        return {}
    if mode == "dequantize" or not fp8_gemm_available(device):
        from transformers import FineGrainedFP8Config

        return {"quantization_config": FineGrainedFP8Config(
            weight_block_size=tuple(q["weight_block_size"]), modules_to_not_convert=q.get("modules_to_not_convert"),
            dequantize=True)}
    return {}


def fp8_gemm_available(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 (Hopper): cuBLAS's block-scaled FP8 GEMM (1x128 x 128x128)."""
    return (device.type == "cuda" and hasattr(torch.nn.functional, "scaled_mm")
            and torch.cuda.get_device_capability(device) == (9, 0))


def quantize_1x128(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] (K a multiple of 128) -> (e4m3 [M, K], fp32 decoding scales [M, K/128]): per token and
    128-wide block, s = max(amax(|x|), 1e-12) / 448, q = e4m3(clamp(x / s, -448, 448)); x ~ q * s."""
    M, K = x_MK.shape
    blocks = x_MK.float().reshape(M, K // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=1e-12)
    # divided by a tensor: CUDA divides by a Python number as a product with its rounded reciprocal, one unit in
    # the last place off amax / 448 for about half the scales (and off the CPU's and the Triton kernel's result)
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(M, K), scale


_QUANTIZE = {"fn": None, "failed": False, "triton": None}


def _quantize_fused(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_1x128` through torch.compile on CUDA (fewer kernels than eager's five and its fp32 copy); the eager
    function where compilation fails (said once). The fallback of `quantize_for_gemm` where Triton is missing."""
    if x_MK.device.type != "cuda" or _QUANTIZE["failed"]:
        return quantize_1x128(x_MK)
    if _QUANTIZE["fn"] is None:
        _QUANTIZE["fn"] = torch.compile(quantize_1x128, dynamic=True)
    try:
        return _QUANTIZE["fn"](x_MK)
    except Exception as e:  # noqa: BLE001 - the same values eagerly: slower, not different
        _QUANTIZE["failed"] = True
        log.warning("FP8 activation quantization: torch.compile failed (%s); quantizing eagerly",
                    " ".join(str(e).split())[:200])
        return quantize_1x128(x_MK)


def _triton_quantizer():
    """fp8_quant_triton.quantize_1x128_padded, or False where Triton cannot be imported (said once)."""
    if _QUANTIZE["triton"] is None:
        try:
            from dflash_prep.target.fp8_quant_triton import quantize_1x128_padded
        except Exception as e:  # noqa: BLE001 - ImportError, or Triton's own errors on an odd install
            log.warning("FP8 activation quantization: no Triton (%s); torch.compile's kernels instead",
                        " ".join(str(e).split())[:200])
            quantize_1x128_padded = False
        _QUANTIZE["triton"] = quantize_1x128_padded
    return _QUANTIZE["triton"]


def quantize_for_gemm(x_MK: torch.Tensor, m_pad: int, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [m_pad, k_pad] e4m3, scales [m_pad, k_pad / 128] fp32 outer-dim-major), zero-padded: the
    operand and BlockWise1x128 scales of `scaled_mm`, values as `quantize_1x128` of x padded with zeros. One Triton
    pass on CUDA (fp8_quant_triton.py); elsewhere, or without Triton, a padded copy quantized by `_quantize_fused`."""
    quantize = _triton_quantizer() if x_MK.is_cuda else False
    if quantize:
        return quantize(x_MK, m_pad, k_pad)
    M, K = x_MK.shape
    if (m_pad, k_pad) != (M, K):
        x_MK = nn.functional.pad(x_MK, (0, k_pad - K, 0, m_pad - M))
    q, scale = _quantize_fused(x_MK)
    return q, scale.t().contiguous().t()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class BlockFP8Linear(nn.Module):
    """A block-FP8 linear layer on `torch.nn.functional.scaled_mm` (CUDA, compute capability 9.0).

    Holds the weight as e4m3 [N', K'] and its decoding scales in the layout cuBLAS reads (scale_b: [L4, N'/128]
    with L4 = K'/128 rounded up to 4, K-major), N' and K' padded with zeros to multiples of 128 (a partial block of
    the format: zeros add nothing to the products; a copy is made only then). forward(x [..., K]) -> [..., N] in x's dtype: x is quantized
    per token and 128-block (`quantize_1x128`), multiplied in FP8 with fp32 accumulation, the bias added."""

    # Each token's row is quantized (1x128 blocks along K) and multiplied on its own: no position reads another, so
    # packed rows stay exact through it (target/mixers.py reads this).
    POSITIONWISE = True

    def __init__(self, weight_NK: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        N, K = weight_NK.shape
        self.in_features, self.out_features = K, N
        Np, Kp = _round_up(N, BLOCK), _round_up(K, BLOCK)
        if (Np, Kp) == (N, K):  # whole blocks (every 27B projection): the checkpoint's tensor itself, no copy
            w = weight_NK.contiguous().view(torch.uint8)
        else:
            w = torch.zeros(Np, Kp, dtype=torch.uint8, device=weight_NK.device)
            w[:N, :K] = weight_NK.view(torch.uint8)  # zero bytes are e4m3 zeros
        L, L4 = Kp // BLOCK, _round_up(Kp // BLOCK, 4)
        s = torch.ones(Np // BLOCK, L4, dtype=torch.float32, device=weight_NK.device)
        s[: scale_inv.shape[0], : scale_inv.shape[1]] = scale_inv.float()
        self.register_buffer("weight", w.view(FP8_DTYPE), persistent=False)
        self.register_buffer("scale_b", s, persistent=False)  # [N'/128, L4] contiguous; used transposed
        self.register_buffer("bias", bias, persistent=False)
        self._kp, self._l = Kp, L

    def weights_in_buffers(self) -> int:
        """The weights this layer holds as buffers, not parameters (N x K, plus the bias): what a parameter count
        (model.active_params, the MFU's and plan's FLOPs per token) counts for it."""
        return self.in_features * self.out_features + (self.bias.numel() if self.bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.functional import ScalingType, scaled_mm

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        Mp = _round_up(max(x2.shape[0], 1), 16)  # the scales' leading dimension must be 16-byte aligned
        q, scale_a = quantize_for_gemm(x2, Mp, self._kp)
        out = scaled_mm(q, self.weight.t(), scale_a, ScalingType.BlockWise1x128, self.scale_b.t(),
                        ScalingType.BlockWise128x128, output_dtype=x.dtype)
        out = out[: x2.shape[0], : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block FP8 on scaled_mm"


def fp8_linear_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers' FP8 linear layers of `model` holding e4m3 weights (none after a dequantized load)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__ == "FP8Linear" and getattr(m, "weight", None) is not None
            and m.weight.dtype == FP8_DTYPE]


def install_scaled_mm(model: nn.Module, config, mode: str, device: torch.device) -> str | None:
    """After `from_pretrained` of a block-FP8 checkpoint: every FP8 linear layer replaced by a `BlockFP8Linear`
    (GPU), or the dequantized load said (CPU, `mode` dequantize). -> one line for the log, None for an unquantized
    checkpoint. RecipeError where FP8 weights are left that nothing here can run (FP8 experts, or FP8 layers on a
    device without the GEMM), rather than a forward that fails or fetches kernels."""
    if block_fp8_format(config) is None:
        return None
    layers = fp8_linear_modules(model)
    experts = [n for n, m in model.named_modules() if type(m).__name__.startswith("FP8Experts")
               or (type(m).__name__.endswith("Experts") and any(p.dtype == FP8_DTYPE for p in m.parameters()))]
    if experts:
        raise RecipeError(f"the FP8 checkpoint has FP8 routed experts ({experts[0]}, ...): not supported yet; "
                          f"set model.fp8_weights: dequantize to run it dequantized")
    if not layers:
        why = ("model.fp8_weights: dequantize" if mode == "dequantize" else
               f"{device.type} has no block-scaled FP8 GEMM (needs a CUDA GPU of compute capability 9.0)")
        return f"FP8 checkpoint (block 128x128 e4m3) run DEQUANTIZED to {_dtype_of(model)}: {why}"
    if not fp8_gemm_available(device):
        raise RecipeError(f"FP8 weights loaded on {device}, which has no block-scaled FP8 GEMM")
    # One layer at a time, holding no other: a replaced layer's weights are freed before the next is built (a
    # list of every old layer would keep the whole model's FP8 weights twice at the end: 2x 27 GB for the 27B).
    names = [name for name, _ in layers]
    del layers
    for name in names:
        m = model.get_submodule(name)
        model.set_submodule(name, BlockFP8Linear(m.weight.data, m.weight_scale_inv.data,
                                                 None if m.bias is None else m.bias.data))
        del m
    return (f"FP8 checkpoint (block 128x128 e4m3): {len(names)} linear layers run as FP8 on torch scaled_mm "
            f"(activations quantized per token and 128 block, weights 128x128)")


def _dtype_of(model: nn.Module) -> str:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return str(p.dtype).replace("torch.", "") if p is not None else "?"

"""Packed (varlen) batches: several whole samples back to back in ONE row per forward (`batching.packing`).

A padded batch wastes the padding of every row (efficiency 0.89 on the benchmark's lengths) and has ~20 distinct
shapes; a packed row is filled to the token budget (planner.plan_packed_rows: >= 0.99 on the same lengths) and
padded only to one of a few fixed row lengths. The row's layout (`plan.batches.collate_packed`):

    input_ids     int64 [1, T]   sample 0, sample 1, ..., then the tail padding
    position_ids  int64 [1, T]   0..len-1 for each sample, and 0..pad-1 for the tail (its own segment)
    cu_seqlens    int32 [S + 1]  segment starts (samples, then the tail when T > real tokens), 0 first, T last
    max_length    int            the longest segment
    flat_index    int64 [N]      0..N-1: the samples' tokens are the row's first N (the capture's gather)

The forward gets `attention_mask=None`, the position ids and transformers' flash-attention kwargs (`cu_seq_lens_q`,
`cu_seq_lens_k`, `max_length_q`, `max_length_k`: the names of transformers 5.17 and 5.24), which every decoder layer
passes on to its attention and Gated DeltaNet modules. Each sample's states then equal its states run alone:

- attention layers: our attention function (`varlen_attention`, registered in transformers' AttentionInterface as
  PACKED_ATTENTION, set on the loaded model for packed runs only) attends within each segment, causally:
  torch's `varlen_attn` (FlashAttention) on CUDA for fp16/bf16 where this torch has it, else SDPA with
  `is_causal=True` on each segment (exact; CPU, fp32 and the fallback). No [T, T] mask is built: transformers
  builds none for an attention implementation its AttentionMaskInterface does not know (both versions return
  early); registering a mask function there would make it scan the position ids for packed sequences with a
  device-to-host sync every forward, so none is registered;
- Gated DeltaNet layers (Qwen3.5 hybrid): on CUDA with flash-linear-attention, transformers' own path: its GDN
  layer pops `cu_seq_lens_q` for fla's chunk kernel, and kernels.py's `fla_conv` adapter hands it to fla's causal
  conv. Elsewhere the torch fallbacks ignore `cu_seqlens` (transformers 5.17; 5.24 raises) and the conv would
  carry 3 tokens across a boundary, so each GDN module runs once per segment (`run_linear_attention_per_segment`).

Why our own attention function: transformers' packed-sequence support (position ids restarting, no mask) runs
through its `flash_attention_*` backends, which need the flash-attn package (not installed on our GPU machines),
or, with `sdpa`/`eager`, builds a dense block-diagonal [T, T] mask (a 65,536-token row: 4.3e9 mask elements, and
every forward scans the position ids on the host). The function here is a thin dispatch to torch's own kernels.

`select_packing` decides per run (recipe key, device, architecture, kernels) and says why.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dflash_prep.plan.batches import Batch, SampleInfo
from dflash_prep.recipe.schema import RecipeError

log = logging.getLogger("dflash_prep")

PACKED_ATTENTION = "packed_varlen"  # no "flash" in the name: transformers reads any such name as FlashAttention
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# model types whose decoder layers are attention (through transformers' AttentionInterface) and, for the hybrid,
# Gated DeltaNet modules: the packed path is exact for these (tests/test_packing.py asserts it on both)
ATTENTION_ONLY = ("llama",)
GATED_DELTANET_HYBRID = ("qwen3_5", "qwen3_5_text")
# calls of each attention path of `varlen_attention` in this process (what ran, for bench/packing_check.py)
ATTENTION_CALLS = {"varlen_attn": 0, "sdpa_per_segment": 0}


@dataclass(frozen=True)
class PackingChoice:
    """Whether a run packs (`packed`), what the recipe asked for and why (`reason`)."""

    requested: str | bool
    packed: bool
    reason: str

    def record(self) -> dict:
        """What the summary and the manifest keep."""
        return {"requested": self.requested, "packed": self.packed, "reason": self.reason}


def _model_type(config) -> str | None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None)


def not_exact_reason(config, device_type: str, kernel_names, assume_fla: bool = False) -> str | None:
    """None when packed rows give each sample its states run alone on this device with these kernels; else why
    not, in words. `assume_fla`: take flash-linear-attention as installed (`dflash-prep plan` for GPUs, from a
    machine without one)."""
    model_type = _model_type(config)
    if model_type in ATTENTION_ONLY:
        return None
    if model_type not in GATED_DELTANET_HYBRID:
        return f"packing is not known to be exact for model type {model_type!r}"
    if device_type != "cuda":
        return None  # each Gated DeltaNet module runs per segment (run_linear_attention_per_segment)
    if not assume_fla and (importlib.util.find_spec("fla") is None or _fla_chunk_in_use(model_type) is False):
        return "the Gated DeltaNet layers need flash-linear-attention's chunk kernel to keep samples apart on CUDA"
    if "fla_conv" not in kernel_names:
        return "the Gated DeltaNet layers need model.kernels' fla_conv (the torch conv leaks 3 tokens across samples)"
    return None


def _fla_chunk_in_use(model_type: str) -> bool | None:
    """Whether transformers' `torch_chunk_gated_delta_rule` of the architecture resolved to fla's chunk kernel (its
    hub-kernel wrapper records it at import: `is_new_implementation`, transformers 5.17 and 5.24); None when this
    transformers does not say. Its torch fallback ignores `cu_seqlens` in 5.17: packed rows would mix samples."""
    from dflash_prep.target.kernels import ARCHITECTURES

    modeling = importlib.import_module(ARCHITECTURES[model_type][0])
    try:
        found = inspect.getclosurevars(modeling.torch_chunk_gated_delta_rule).nonlocals
    except (AttributeError, TypeError):
        return None
    return bool(found["is_new_implementation"]) if "is_new_implementation" in found else None


def select_packing(requested, config, device_type: str, kernel_names, assume_fla: bool = False,
                   several_gpus: bool = False, compute_dtype: str = "bfloat16") -> PackingChoice:
    """`batching.packing` resolved for this run: `true` packs where exact (else RecipeError naming the key: exit 2),
    `false` never packs, `auto` packs on CUDA where exact, on replicas of one GPU (`several_gpus`: a replica of
    several GPUs, tensor parallel or split by layers, where packed rows have not run yet). Why `auto` packs there:
    exact at the padded batch's own noise (bench/results/packing_check.json) and faster end to end on an H200 with
    rows of up to 32,768 tokens (planner.PACKED_ROW_TOKENS_AUTO: warm, same samples, 8B shape 43,224 real tok/s
    against 42,042 padded, 27B hybrid 9,645 against 9,275). `auto` runs padded batches on a CPU (each Gated
    DeltaNet module would run once per sample there, and nothing was measured) and for a `compute_dtype`
    (model.dtype) other than bfloat16 / float16, or a torch without `varlen_attn`: attention would then run once
    per sample (SDPA), not as one FlashAttention call."""
    why_not = not_exact_reason(config, device_type, kernel_names, assume_fla)
    if requested is False:
        return PackingChoice(False, False, "batching.packing: false")
    if requested is True:
        if why_not:
            raise RecipeError(f"recipe key `batching.packing` = true: not exact here ({why_not}); use auto or false")
        return PackingChoice(True, True, "batching.packing: true")
    if device_type != "cuda":
        return PackingChoice("auto", False, f"no CUDA device ({device_type}): padded batches")
    if why_not:
        return PackingChoice("auto", False, f"{why_not}: padded batches")
    if several_gpus:
        return PackingChoice("auto", False, "a replica of several GPUs: packed rows not run there yet: padded "
                                            "batches")
    if compute_dtype not in ("bfloat16", "float16") or _varlen_attn() is None:
        return PackingChoice("auto", False, f"no varlen FlashAttention for {compute_dtype} with torch "
                                            f"{torch.__version__} (attention would run per sample): padded batches")
    return PackingChoice("auto", True, "exact here and measured faster than padded batches: packed rows")


def replay_stored_layout(choice: PackingChoice, stored_packed: bool, config, device_type: str,
                         kernel_names) -> PackingChoice:
    """A resume runs the stored plan's batches as they were planned (packed rows or padded batches), whatever this
    run's choice; a packed plan where packing is not exact is refused (RecipeError, exit 2)."""
    if stored_packed == choice.packed:
        return choice
    if not stored_packed:
        log.warning("batching.packing: the stored plan has padded batches: resuming with them")
        return PackingChoice(choice.requested, False, "resumed a plan of padded batches")
    why_not = not_exact_reason(config, device_type, kernel_names)
    if why_not:
        raise RecipeError(f"recipe key `batching.packing`: the output's plan (plan.json) is of packed rows, and "
                          f"packing is not exact here ({why_not}); resume where it is, or start afresh with "
                          f"--set output.overwrite=true")
    log.warning("batching.packing: the stored plan has packed rows: resuming with them")
    return PackingChoice(choice.requested, True, "resumed a plan of packed rows")


# ------------------------------------------------------------------------------------------------ pieces
def packed_piece(tensors: dict, a: int, b: int, offsets: list[int], lengths: list[int]) -> dict:
    """Samples [a, b) of a packed row's device tensors as a row of their own (no tail padding): an OOM split.
    `offsets[i]` = the first token of sample i in the row."""
    start, stop = offsets[a], offsets[b]
    return {"input_ids": tensors["input_ids"][:, start:stop], "attention_mask": None,
            "position_ids": tensors["position_ids"][:, start:stop],
            "flat_index": tensors["flat_index"][start:stop] - start,
            "cu_seqlens": tensors["cu_seqlens"][a:b + 1] - tensors["cu_seqlens"][a],
            "max_length": max(lengths[a:b])}


def flash_kwargs(cu_seqlens: torch.Tensor, max_length: int) -> dict:
    """The kwargs transformers passes from the decoder to every layer's attention and Gated DeltaNet module."""
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_length,
            "max_length_k": max_length}


# ---------------------------------------------------------------------------------------------- attention
class _Bounds:
    """The segment bounds as Python ints, read once per forward (one device-to-host copy on a GPU): every layer
    gets the same `cu_seqlens` tensor object."""

    tensor: torch.Tensor | None = None
    bounds: list[int] = []

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor) -> list[int]:
        if cu_seqlens is not cls.tensor:
            cls.tensor, cls.bounds = cu_seqlens, [int(x) for x in cu_seqlens.tolist()]
        return cls.bounds


@functools.lru_cache(maxsize=1)
def _varlen_attn():
    """torch.nn.attention.varlen.varlen_attn and its keyword parameters, or None (an older torch)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _use_flash(query: torch.Tensor, scaling: float | None) -> tuple | None:
    """varlen_attn where it computes this attention: CUDA, fp16/bf16, head dim a multiple of 8 up to 256, and
    the module's scaling (torch 2.11's varlen_attn has no `scale`: then only the default 1/sqrt(D))."""
    found = _varlen_attn() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    D = query.shape[-1]
    if found is None or D % 8 or D > 256:
        return None
    if "scale" not in found[1] and scaling is not None and abs(scaling - D ** -0.5) > 1e-12:
        return None
    return found


def _flash_attention(found, q_THD, k_THD, v_THD, cu: torch.Tensor, max_length: int, scaling) -> torch.Tensor:
    """[T, Hq, D] by torch's varlen FlashAttention, causal within each segment."""
    varlen_attn, params = found
    kwargs = {}
    if k_THD.shape[1] != q_THD.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # as transformers' repeat_kv: each kv head serves a consecutive group of query heads
            groups = q_THD.shape[1] // k_THD.shape[1]
            k_THD, v_THD = k_THD.repeat_interleave(groups, dim=1), v_THD.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scaling
    cu = cu.to(torch.int32)
    return varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_length, max_length, **kwargs)


def _segment_sdpa(q, k, v, bounds: list[int], scaling) -> torch.Tensor:
    """[1, Hq, T, D] -> [1, T, Hq, D]: SDPA with is_causal=True on each segment (exact; a loop)."""
    gqa = k.shape[1] != q.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa)
        for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function (AttentionInterface) for a packed row: query [1, Hq, T, D], key/value
    [1, Hkv, T, D] -> ([1, T, Hq, D], None), causal within each segment of `cu_seq_lens_q` (int32 [S + 1]).
    Raises ValueError without `cu_seq_lens_q`, with an attention mask, or for a sliding-window layer."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION} attention runs packed rows only (batch 1, cu_seq_lens_q, no mask)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{PACKED_ATTENTION} attention: sliding-window layers are not supported")
    found = _use_flash(query, scaling)
    if found is None:
        ATTENTION_CALLS["sdpa_per_segment"] += 1
        return _segment_sdpa(query, key, value, _Bounds.of(cu), scaling), None
    ATTENTION_CALLS["varlen_attn"] += 1
    # [T, H, D], contiguous as transformers' own varlen flash path passes them (FlashAttention's layout)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = _flash_attention(found, q, k, v, cu, int(kwargs["max_length_q"]), scaling)
    return out.unsqueeze(0), None


# ------------------------------------------------------------------------------------------- the model
def _is_gated_deltanet(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def run_linear_attention_per_segment(model: nn.Module) -> int:
    """Make every Gated DeltaNet module of `model` run once per segment of a packed row (its forward split at
    `cu_seq_lens_q`, the pieces concatenated back), so its recurrence and causal conv never cross a sample
    boundary with transformers' torch fallbacks. Forwards without `cu_seq_lens_q` are unchanged. Returns the
    modules wrapped. Costs one forward per segment: used where fla's kernels are not (CPU)."""
    count = 0
    for module in model.modules():
        if _is_gated_deltanet(module):
            module.forward = _per_segment(module.forward)
            count += 1
    return count


def _per_segment(forward):
    def per_segment(hidden_states: torch.Tensor, *args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            return forward(hidden_states, *args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k not in FLASH_KWARGS}
        bounds = _Bounds.of(cu)
        return torch.cat([forward(hidden_states[:, a:b], *args, **rest) for a, b in zip(bounds, bounds[1:])], dim=1)

    return per_segment


def use_packed_attention(model: nn.Module, device_type: str) -> dict:
    """Switch the loaded `model` to packed rows: our attention function, and on a non-CUDA device the Gated
    DeltaNet modules per segment. Returns what was done (for the log)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, varlen_attention)
    model.set_attn_implementation(PACKED_ATTENTION)
    wrapped = run_linear_attention_per_segment(model) if device_type != "cuda" else 0
    return {"attention": PACKED_ATTENTION, "linear_attention_per_segment": wrapped}

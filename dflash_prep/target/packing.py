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
passes on to its attention and Gated DeltaNet modules. Each sample's states then equal its states run alone.

Which models pack is decided from their modules, not from a list of model types (`mixers.token_mixers`: the
module docstring there says what is checked and what is trusted): every token mixer must be attention through
transformers' AttentionInterface or a Gated DeltaNet; any other mixer (a Mamba layer, remote code, a module of
the user's own) refuses `packing: true` (RecipeError naming the module) and sends `auto` to padded batches, with
the reason. Before the model is loaded the modules are those of a meta-device build of the config (no memory, no
weights); `use_packed_attention` checks the loaded model again. Each mixer's packed path:

- attention (full, sliding-window, GQA, qk-norm, logit softcapping, attention sinks, MLA): our attention function
  (`varlen_attention`, registered in transformers' AttentionInterface as PACKED_ATTENTION, set on the loaded model
  for packed runs only) attends within each segment, causally, within the module's sliding window, with its
  scaling, softcap and sinks exactly as transformers' eager attention defines them. On CUDA in fp16/bf16 torch's
  `varlen_attn` (FlashAttention) where it computes the module's attention (no softcap, no sinks; a window where
  this torch's varlen_attn takes `window_size`; q/k head dim a multiple of 8 up to 256, a smaller v head dim
  zero-padded to it (MLA), the output cut back); else per segment: SDPA with `is_causal=True` (a segment within
  the window), SDPA with a causal window mask per block of queries (longer), or, for softcap and sinks, the eager
  computation per block of queries (matmul, softcap, mask, sinks, fp32 softmax). No [T, T] mask is built:
  transformers builds none for an attention implementation its AttentionMaskInterface does not know (5.17 and
  5.24 return early); registering a mask function there would make it scan the position ids for packed sequences
  with a device-to-host sync every forward, so none is registered;
- Gated DeltaNet (Qwen3.5 / Qwen3.6 hybrids, dense and MoE): on CUDA with flash-linear-attention's chunk kernel in
  use and kernels.py's `fla_conv` applied, transformers' own path: its GDN layer pops `cu_seq_lens_q` for fla's
  chunk kernel, and the `fla_conv` adapter hands it to fla's causal conv. Otherwise (a CPU, no fla, no fla_conv
  for the architecture) the torch fallbacks ignore `cu_seqlens` (transformers 5.17; 5.24 raises) and the conv
  would carry 3 tokens across a boundary, so each GDN module runs once per segment
  (`run_linear_attention_per_segment`: exact, one forward per sample).

Why our own attention function: transformers' packed-sequence support (position ids restarting, no mask) runs
through its `flash_attention_*` backends, which need the flash-attn package (not installed on our GPU machines),
or, with `sdpa`/`eager`, builds a dense block-diagonal [T, T] mask (a 65,536-token row: 4.3e9 mask elements, and
every forward scans the position ids on the host). The function here is a thin dispatch to torch's own kernels.

`select_packing` decides per run (recipe key, device, the model's mixers, kernels, dtype) and says why.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
from dataclasses import dataclass

import torch
from torch import nn

from dflash_prep.recipe.schema import RecipeError
from dflash_prep.target.mixers import (
    ATTENTION,
    FLASH_KWARGS,
    GATED_DELTANET,
    TokenMixer,
    fla_chunk_in_use,
    token_mixers,
)

log = logging.getLogger("dflash_prep")

PACKED_ATTENTION = "packed_varlen"  # no "flash" in the name: transformers reads any such name as FlashAttention
VARLEN, PER_SEGMENT = "varlen", "per_segment"
FLASH_DTYPES = ("bfloat16", "float16")
# calls of each attention path of `varlen_attention` in this process (what ran, for bench/packing_check.py)
ATTENTION_CALLS = {"varlen_attn": 0, "sdpa_per_segment": 0, "eager_per_segment": 0}


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


# ------------------------------------------------------------------------------------------------ choice
_MIXERS: dict[str, tuple[TokenMixer, ...] | str] = {}  # config JSON -> its mixers (the latest few configs)


def model_mixers(config, model: nn.Module | None = None) -> tuple[TokenMixer, ...] | str:
    """The token mixers of `model`, or of a meta-device build of `config` when no model is given (no memory, no
    weights; cached per config); a string says why they cannot be found."""
    if model is not None:
        return tuple(token_mixers(model))
    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if key not in _MIXERS:
        if len(_MIXERS) >= 8:
            _MIXERS.pop(next(iter(_MIXERS)))
        _MIXERS[key] = _meta_mixers(config)
    return _MIXERS[key]


def _meta_mixers(config) -> tuple[TokenMixer, ...] | str:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # a copy: from_config sets the attention implementation on the config it gets
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except Exception as e:  # noqa: BLE001 - remote code, a class transformers does not have: not inspectable
        why = " ".join(str(e).split())[:300]
        return f"the model cannot be built from its config to inspect its modules ({type(e).__name__}: {why})"
    return tuple(token_mixers(model))


def mixer_path(mixer: TokenMixer, device_type: str, kernel_names=(), compute_dtype: str = "bfloat16",
               assume_fla: bool = False, model_type: str | None = None) -> tuple[str | None, str | None]:
    """How packed rows run this mixer here: (VARLEN, None) as one kernel call over the row, (PER_SEGMENT, why)
    once per sample (exact), or (None, why) when not exact. `assume_fla`: take flash-linear-attention as installed
    (`dflash-prep plan` for GPUs, from a machine without one)."""
    where = f"{mixer.path} ({mixer.class_name})"
    if mixer.why_not:
        return None, f"{where}: {mixer.why_not}"
    if device_type != "cuda":
        return PER_SEGMENT, f"{where}: once per sample on {device_type}"
    if mixer.kind == GATED_DELTANET:
        if not assume_fla and fla_chunk_in_use(mixer.modeling) is False:
            return PER_SEGMENT, f"{where}: flash-linear-attention's chunk kernel is not in use: once per sample"
        if "fla_conv" not in kernel_names or not _fla_conv_applies(model_type):
            return PER_SEGMENT, (f"{where}: without model.kernels' fla_conv the torch conv would leak 3 tokens "
                                 f"across samples: once per sample")
        return VARLEN, None
    why = _flash_unsupported(mixer, compute_dtype)
    return (PER_SEGMENT, f"{where}: {why}: once per sample") if why else (VARLEN, None)


def _fla_conv_applies(model_type: str | None) -> bool:
    from dflash_prep.target.kernels import ARCHITECTURES

    return "fla_conv" in ARCHITECTURES.get(model_type, (None, ()))[1]


def _flash_unsupported(mixer: TokenMixer, compute_dtype: str) -> str | None:
    """Why torch's varlen FlashAttention cannot compute this attention module (None: it can)."""
    found = _varlen_attn()
    if compute_dtype not in FLASH_DTYPES or found is None:
        return f"no varlen FlashAttention for {compute_dtype} with torch {torch.__version__}"
    for feature in ("softcap", "sinks"):
        if feature in mixer.features:
            return f"{feature}: torch's varlen_attn has none"
    if "sliding_window" in mixer.features and "window_size" not in found[1]:
        return f"a sliding window: torch {torch.__version__}'s varlen_attn has no window_size"
    qk, v = mixer.head_dims
    if qk is not None and (qk % 8 or qk > 256 or (v or 0) > qk):
        return f"head dims {qk}/{v}: varlen_attn takes a multiple of 8 up to 256 (v no larger)"
    if "scale" not in found[1] and qk and mixer.scaling is not None and abs(mixer.scaling - qk ** -0.5) > 1e-12:
        return f"scaling {mixer.scaling:.4g}: torch {torch.__version__}'s varlen_attn has no `scale`"
    return None


def packing_verdict(config, device_type: str, kernel_names=(), compute_dtype: str = "bfloat16",
                    assume_fla: bool = False, model: nn.Module | None = None) -> tuple[str | None, list[str]]:
    """(why packed rows are not exact here, or None; the mixers that would run once per sample, with why)."""
    mixers = model_mixers(config, model)
    if isinstance(mixers, str):
        return mixers, []
    paths = [mixer_path(m, device_type, kernel_names, compute_dtype, assume_fla, _model_type(config))
             for m in mixers]
    blockers = [why for path, why in paths if path is None]
    if blockers:
        more = f" (and {len(blockers) - 1} more modules)" if len(blockers) > 1 else ""
        return f"packing is not exact for this model: {blockers[0]}{more}", []
    if not mixers:
        return "no token mixer found in the model (nothing known to pack)", []
    return None, sorted({why for path, why in paths if path == PER_SEGMENT})


def not_exact_reason(config, device_type: str, kernel_names, assume_fla: bool = False,
                     model: nn.Module | None = None) -> str | None:
    """None when packed rows give each sample its states run alone on this device with these kernels; else why
    not, in words."""
    return packing_verdict(config, device_type, kernel_names, assume_fla=assume_fla, model=model)[0]


def select_packing(requested, config, device_type: str, kernel_names, assume_fla: bool = False,
                   several_gpus: bool = False, compute_dtype: str = "bfloat16",
                   model: nn.Module | None = None) -> PackingChoice:
    """`batching.packing` resolved for this run: `true` packs where exact (else RecipeError naming the key and
    the module: exit 2), `false` never packs, `auto` packs on CUDA where exact and every token mixer runs as one
    varlen kernel call over the row (varlen FlashAttention, fla's Gated DeltaNet kernels), on replicas of one GPU
    (`several_gpus`: a replica of several GPUs, tensor parallel or split by layers, where packed rows have not run
    yet). Why `auto` packs there: exact at the padded batch's own noise (bench/results/packing_check.json) and
    faster end to end on an H200 with rows of up to 32,768 tokens (planner.PACKED_ROW_TOKENS_AUTO: warm, same
    samples, 8B shape 43,224 real tok/s against 42,042 padded, 27B hybrid 9,645 against 9,275). `auto` runs padded
    batches on a CPU and wherever a mixer would run once per sample (a `compute_dtype` other than bfloat16 /
    float16, a torch without `varlen_attn`, softcap or sinks, no fla_conv): nothing was measured faster there.
    `model`: the loaded model (default: a meta-device build of `config`)."""
    if requested is False:
        return PackingChoice(False, False, "batching.packing: false")
    why_not, per_segment = packing_verdict(config, device_type, kernel_names, compute_dtype, assume_fla, model)
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
    if per_segment:
        more = f" (and {len(per_segment) - 1} more modules)" if len(per_segment) > 1 else ""
        return PackingChoice("auto", False, f"{per_segment[0]}{more}: padded batches")
    return PackingChoice("auto", True, "exact here, every token mixer one varlen kernel over the row (measured "
                                       "faster than padded batches on the Llama and Qwen3.5 shapes): packed rows")


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


@dataclass(frozen=True)
class _Spec:
    """What one attention call computes besides causal softmax(q k^T) v: the scale (a float: the module's, else
    1/sqrt(q head dim)), the sliding window in tokens (a key j is seen from query i when i - window < j <= i, as
    transformers' `sliding_window_overlay`), the logit softcap (tanh(s / c) * c after scaling, transformers'
    eager) and the sinks ([Hq], one extra logit per head in the softmax, dropped after it: gpt-oss)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


# keywords transformers' decoders pass along that change nothing in a packed row's attention
_IGNORED_KWARGS = frozenset({*FLASH_KWARGS, "position_ids", "output_attentions", "use_cache", "cache_position",
                             "output_router_logits", "output_hidden_states"})  # the MoE block's outputs, not attention's


def varlen_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     s_aux: torch.Tensor | None = None, **kwargs):
    """transformers attention function (AttentionInterface) for a packed row: query [1, Hq, T, Dqk], key
    [1, Hkv, T, Dqk], value [1, Hkv, T, Dv] -> ([1, T, Hq, Dv], None), causal within each segment of
    `cu_seq_lens_q` (int32 [S + 1]), within `sliding_window`, with `scaling`, `softcap` and sinks (`s_aux`, [Hq])
    as transformers' eager attention. Raises ValueError without `cu_seq_lens_q`, with an attention mask, for
    dropout in training, bidirectional attention (`is_causal=False`) or a keyword it does not know."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{PACKED_ATTENTION} attention runs packed rows only (batch 1, cu_seq_lens_q, no mask)")
    unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED_KWARGS and k != "is_causal" and v is not None)
    if unknown or kwargs.get("is_causal") is False or (dropout and module.training):
        raise ValueError(f"{PACKED_ATTENTION} attention: cannot honour {unknown or 'is_causal=False or dropout'} "
                         f"of {type(module).__name__}")
    spec = _Spec(scaling if scaling is not None else query.shape[-1] ** -0.5, sliding_window, softcap, s_aux)
    found = _use_flash(query, value, spec)
    if found is None:
        ATTENTION_CALLS["sdpa_per_segment" if softcap is None and s_aux is None else "eager_per_segment"] += 1
        return _per_segment_attention(query, key, value, _Bounds.of(cu), spec), None
    ATTENTION_CALLS["varlen_attn"] += 1
    # [T, H, D], contiguous as transformers' own varlen flash path passes them (FlashAttention's layout)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = _flash_attention(found, q, k, v, cu, int(kwargs["max_length_q"]), spec)
    return out.unsqueeze(0), None


def _use_flash(query: torch.Tensor, value: torch.Tensor, spec: _Spec) -> tuple | None:
    """varlen_attn where it computes this attention: CUDA, fp16/bf16, no softcap and no sinks, a window only
    where it takes `window_size`, q/k head dim a multiple of 8 up to 256 with v's no larger, and the module's
    scale (torch 2.11's varlen_attn has no `scale`: then only the default 1/sqrt(D))."""
    found = _varlen_attn() if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) else None
    D = query.shape[-1]
    if found is None or D % 8 or D > 256 or value.shape[-1] > D or spec.softcap is not None or spec.sinks is not None:
        return None
    if spec.window is not None and "window_size" not in found[1]:
        return None
    if "scale" not in found[1] and abs(spec.scale - D ** -0.5) > 1e-12:
        return None
    return found


def _flash_attention(found, q_THD, k_THD, v_THD, cu: torch.Tensor, max_length: int, spec: _Spec) -> torch.Tensor:
    """[T, Hq, Dv] by torch's varlen FlashAttention, causal within each segment (and its window). A v head dim
    smaller than q/k's (MLA) is zero-padded to it and the output cut back: the padded columns of the output are
    zero and the others unchanged."""
    varlen_attn, params = found
    kwargs = {}
    if k_THD.shape[1] != q_THD.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # as transformers' repeat_kv: each kv head serves a consecutive group of query heads
            groups = q_THD.shape[1] // k_THD.shape[1]
            k_THD, v_THD = k_THD.repeat_interleave(groups, dim=1), v_THD.repeat_interleave(groups, dim=1)
    Dv = v_THD.shape[-1]
    if Dv < q_THD.shape[-1]:
        v_THD = torch.nn.functional.pad(v_THD, (0, q_THD.shape[-1] - Dv))
    if "window_size" in params:  # FlashAttention's (left, right) are inclusive: W - 1 keys back + the query's own
        kwargs["window_size"] = (spec.window - 1, 0) if spec.window is not None else (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = spec.scale
    cu = cu.to(torch.int32)
    out = varlen_attn(q_THD, k_THD, v_THD, cu, cu, max_length, max_length, **kwargs)
    return out[..., :Dv] if Dv < out.shape[-1] else out


def _per_segment_attention(q, k, v, bounds: list[int], spec: _Spec) -> torch.Tensor:
    """[1, Hq, T, D] (v: [1, Hkv, T, Dv]) -> [1, T, Hq, Dv]: each segment on its own (exact; a loop)."""
    outs = [_segment_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], spec) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


SCORE_ELEMENTS = 1 << 25  # the most attention scores one block of queries holds (128 MB in fp32)


def _segment_attention(q, k, v, spec: _Spec) -> torch.Tensor:
    """One segment, [1, H, L, D] -> [1, Hq, L, Dv]: SDPA is_causal when the window does not bite and there is no
    softcap and no sinks; else by blocks of queries, each against the keys it may see (its window), masked."""
    L, Hq = q.shape[2], q.shape[1]
    window = spec.window if spec.window is not None and spec.window < L else None
    if window is None and spec.softcap is None and spec.sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale,
                                                                enable_gqa=k.shape[1] != Hq)
    keys_bound = L if window is None else min(L, 2 * window)
    block = max(1, min(L, SCORE_ELEMENTS // (Hq * keys_bound), window or L))
    outs = []
    for qa in range(0, L, block):
        qb = min(L, qa + block)
        ka = 0 if window is None else max(0, qa - window + 1)
        i = torch.arange(qa, qb, device=q.device)[:, None]
        j = torch.arange(ka, qb, device=q.device)[None, :]
        seen = (j <= i) if window is None else (j <= i) & (j > i - window)
        outs.append(_block_attention(q[:, :, qa:qb], k[:, :, ka:qb], v[:, :, ka:qb], seen, spec))
    return torch.cat(outs, dim=2)


def _block_attention(q, k, v, seen: torch.Tensor, spec: _Spec) -> torch.Tensor:
    """Queries [1, Hq, B, D] against keys [1, Hkv, K, D] where `seen` [B, K] (bool) -> [1, Hq, B, Dv]. Without
    softcap and sinks: SDPA with the mask. Else transformers' eager computation: scores in the input dtype,
    softcap, masked, sinks as one more column, softmax in fp32, sinks dropped, times v."""
    Hq = q.shape[1]
    if spec.softcap is None and spec.sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=spec.scale,
                                                                enable_gqa=k.shape[1] != Hq)
    groups = Hq // k.shape[1]  # as transformers' repeat_kv: each kv head serves a consecutive group of heads
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.float().masked_fill(~seen, float("-inf"))
    if spec.sinks is not None:
        sinks = spec.sinks.float().reshape(1, Hq, 1, 1).expand(1, Hq, scores.shape[2], 1)
        scores = torch.cat([scores, sinks], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if spec.sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


# ------------------------------------------------------------------------------------------- the model
def _uses_fla_conv(module: nn.Module) -> bool:
    """Whether kernels.py's fla_conv is scoped into this module's forward (kernels._scoped_global marks it)."""
    return getattr(module.forward, "scoped_global", None) == "causal_conv1d_fn"


def run_linear_attention_per_segment(model: nn.Module, device_type: str = "cpu") -> int:
    """Make every Gated DeltaNet module of `model` run once per segment of a packed row (its forward split at
    `cu_seq_lens_q`, the pieces concatenated back), so its recurrence and causal conv never cross a sample
    boundary with transformers' torch fallbacks. On CUDA the modules that run fla's chunk kernel and its conv
    (`fla_conv`) are left as they are: they take `cu_seqlens`. Forwards without `cu_seq_lens_q` are unchanged.
    Returns the modules wrapped. Costs one forward per segment."""
    count = 0
    for mixer in token_mixers(model):
        if mixer.kind != GATED_DELTANET:
            continue
        module = model.get_submodule(mixer.path)
        if device_type == "cuda" and fla_chunk_in_use(mixer.modeling) and _uses_fla_conv(module):
            continue
        if not getattr(module.forward, "per_segment", False):  # wrapped once, however often asked
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

    per_segment.per_segment = True
    return per_segment


def register_packed_attention() -> str:
    """Our packed-row attention function in transformers' AttentionInterface under PACKED_ATTENTION (idempotent)
    -> the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, varlen_attention)
    return PACKED_ATTENTION


def use_packed_attention(model: nn.Module, device_type: str) -> dict:
    """Switch the loaded `model` to packed rows: our attention function, and the Gated DeltaNet modules per
    segment where fla's varlen kernels do not run (run_linear_attention_per_segment). Returns what was done (for
    the log). Raises ValueError when a token mixer of the model cannot be packed exactly (select_packing refuses
    such a model before it loads) and RuntimeError when transformers does not take the attention function."""
    from dflash_prep.target.layers import find_decoder

    mixers = token_mixers(model)
    blockers = [f"{m.path} ({m.class_name}): {m.why_not}" for m in mixers if m.why_not]
    if blockers:
        raise ValueError(f"packed rows are not exact for this model: {blockers[0]}")
    register_packed_attention()
    model.set_attn_implementation(PACKED_ATTENTION)
    if find_decoder(model).config._attn_implementation != PACKED_ATTENTION:
        raise RuntimeError(f"{type(model).__name__} did not take the attention implementation {PACKED_ATTENTION!r}")
    wrapped = run_linear_attention_per_segment(model, device_type)
    attention = [m for m in mixers if m.kind == ATTENTION]
    return {"attention": PACKED_ATTENTION, "attention_modules": len(attention),
            "attention_features": sorted({f for m in attention for f in m.features}),
            "linear_attention_per_segment": wrapped}

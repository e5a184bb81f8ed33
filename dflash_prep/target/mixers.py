"""The token mixers of a model, found by inspecting its modules: what packed rows (packing.py) can keep apart.

A packed row holds several samples back to back; a sample's states equal its states run alone when every module
that carries information from one position to another (a *token mixer*) keeps to the sample's own segment. This
module walks the model's module tree (a meta-device build of the config before loading, the loaded model after)
and sorts every module into one of:

- **attention**: a module whose class's `forward` takes its attention function from transformers'
  `ALL_ATTENTION_FUNCTIONS` (its code names the interface), so that packed rows swap in `varlen_attention`.
  Checked from the forward's source (`ast`): every keyword it passes to that function is one `varlen_attention`
  honours (`scaling`, `dropout`, `sliding_window`, `softcap`, `s_aux` (attention sinks), `attention_mask`,
  `is_causal`, `position_ids`, the flash-attention kwargs, `**kwargs`) and none asks for bidirectional attention
  (`is_causal=False`); the values of `sliding_window`, `softcap` and `s_aux` are read from the module where the
  source names them as `self.x` / `getattr(self.x, "y", default)` (the features: window, softcap, sinks), else
  taken as present. MLA (q/k head dim != v head dim, DeepSeek-V3) is noted from `qk_head_dim` / `v_head_dim`.
  Classes are read, not instances: a forward bound on an instance by kernels.py (liger's RMSNorm, SwiGLU and
  RoPE, fla's conv and gated norm: the same function, fused) is trusted to compute what the class's does.
  Trusted: the rest of the forward works position by position (projections, norms, rotary embeddings of the
  position ids, which restart at 0 for every packed sample) and mixes positions only through that call.
- **gated_deltanet**: a module whose class name ends in `GatedDeltaNet` (transformers' Qwen3.5 / Qwen3-Next
  linear attention). Its recurrence and causal conv run over one segment at a time (fla's kernels with
  `cu_seqlens`, or packing.run_linear_attention_per_segment); trusted: that nothing else in it crosses positions.
- **position-wise**: no mixing, by class. torch.nn's Linear, Embedding, LayerNorm, RMSNorm, Dropout, Identity,
  containers and element-wise activations; transformers' activations (`transformers.activations`); and
  transformers' own classes (defined in `transformers.*`; also `liger_kernel.*` and `fla.*`, the fused stand-ins
  kernels.py may apply) whose name ends in a role transformers gives only to per-token modules: `RMSNorm`,
  `LayerNorm`, `MLP`, `Experts`, `Router`, `SparseMoeBlock`, `MoE`, `RotaryEmbedding`, `ScaledWordEmbedding`,
  and the wiring (`DecoderLayer`, `Model`, `ForCausalLM`), provided
  their forward calls none of `conv1d`, `conv2d`, `cumsum`, `cumprod`, `roll`, `scaled_dot_product_attention`,
  `flex_attention` and does not use the attention interface. Trusted: those classes compute each token from
  that token alone (routers pick experts per token, with no capacity shared across tokens), the wiring adds
  residuals per position, and the mask helpers build no mask for an attention implementation they do not know.
- **unknown**: anything else (a Mamba mixer, a short conv, a class of remote code or of the user's own, a
  torch Conv1d or RNN outside a Gated DeltaNet): packed rows refuse the model (`why` names the module).

The subtree of an attention or Gated DeltaNet module is not walked further (its own conv and norms are part of
the mixer). Nothing here runs a forward.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import sys
import textwrap
from dataclasses import dataclass

from torch import nn

ATTENTION, GATED_DELTANET = "attention", "gated_deltanet"
INTERFACE = "ALL_ATTENTION_FUNCTIONS"
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
HONOURED_KEYWORDS = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", "attention_mask",
                               "is_causal", "position_ids", *FLASH_KWARGS})
# whose class names are read for their role: transformers, and the kernel libraries kernels.py applies (a fused
# module standing in for one of transformers' per-token modules: LigerRMSNorm, LigerSwiGLUMLP, ...)
ROLE_LIBRARIES = ("transformers.", "liger_kernel.", "fla.")
POSITIONWISE_ROLES = ("RMSNorm", "LayerNorm", "MLP", "Experts", "Router", "SparseMoeBlock", "MoE",
                      "RotaryEmbedding", "ScaledWordEmbedding", "DecoderLayer", "Model", "ForCausalLM")
MIXING_CALLS = frozenset({"conv1d", "conv2d", "cumsum", "cumprod", "roll", "scaled_dot_product_attention",
                          "flex_attention"})
POSITIONWISE_TORCH = (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Identity, nn.ModuleList,
                      nn.ModuleDict, nn.Sequential, nn.SiLU, nn.GELU, nn.ReLU, nn.Tanh, nn.Sigmoid, nn.Mish)


@dataclass(frozen=True)
class TokenMixer:
    """One module that mixes positions: its path in the model, class, kind (`attention`, `gated_deltanet`, or
    None when unknown), the attention features it uses (`sliding_window`, `softcap`, `sinks`, `mla`), its head
    dims (q/k, v; None when not read), its scaling, and `why_not` (None when packed rows can keep it exact)."""

    path: str
    class_name: str
    kind: str | None
    features: tuple[str, ...] = ()
    head_dims: tuple[int | None, int | None] = (None, None)
    scaling: float | None = None  # the module's `scaling` attribute, where it has one
    modeling: str | None = None  # the class's module (transformers' modeling file of the family)
    why_not: str | None = None


def token_mixers(model: nn.Module) -> list[TokenMixer]:
    """Every token mixer of `model` (see the module docstring), in module order; an unknown module is one with
    `kind` None and `why_not` set. Raises nothing."""
    found: list[TokenMixer] = []
    _walk(model, "", found)
    return found


def _walk(module: nn.Module, path: str, found: list) -> None:
    mixer = classify(module, path or "(model)")
    if mixer is not None:
        found.append(mixer)
        return
    for name, child in module.named_children():
        _walk(child, f"{path}.{name}" if path else name, found)


def classify(module: nn.Module, path: str) -> TokenMixer | None:
    """The module as a token mixer, or None when it is position-wise (its children are then walked)."""
    cls = type(module)
    if cls.__name__.endswith("GatedDeltaNet"):
        return TokenMixer(path, cls.__name__, GATED_DELTANET, modeling=cls.__module__)
    names = _forward_names(cls)
    if INTERFACE in names:
        return _attention(module, path)
    if isinstance(module, POSITIONWISE_TORCH) or cls.__module__ == "transformers.activations":
        return None
    if getattr(cls, "POSITIONWISE", False) is True:  # our own per-token modules say so (fp8_weights.BlockFP8Linear)
        return None
    if cls.__module__.startswith(ROLE_LIBRARIES) and cls.__name__.endswith(POSITIONWISE_ROLES):
        mixing = sorted(names & MIXING_CALLS)
        if not mixing:
            return None
        why = f"its forward calls {', '.join(mixing)}, which mixes positions outside any known varlen path"
    elif cls.__module__.startswith("torch."):
        why = f"torch's {cls.__name__} mixes positions (or is not known not to) and has no varlen path here"
    else:
        why = (f"a class of {cls.__module__} not known to keep a packed row's samples apart (neither attention "
               f"through transformers' AttentionInterface, nor a Gated DeltaNet, nor one of transformers' "
               f"per-token modules)")
    return TokenMixer(path, cls.__name__, None, modeling=cls.__module__, why_not=why)


@functools.lru_cache(maxsize=None)
def _forward_names(cls) -> frozenset:
    """Global and attribute names the class's forward code uses (co_names), nested code included."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    names: set = set()
    stack = [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_names"))
    return frozenset(names)


# ----------------------------------------------------------------------------------------------- attention
class _NotStatic(Exception):
    """A keyword value the source computes in a way not read here (then taken as present)."""


def _attention(module: nn.Module, path: str) -> TokenMixer:
    cls = type(module)
    calls = _attention_calls(cls)
    head_dims = _head_dims(module)
    scaling = getattr(module, "scaling", None)
    base = dict(path=path, class_name=cls.__name__, kind=ATTENTION, head_dims=head_dims, modeling=cls.__module__,
                scaling=float(scaling) if isinstance(scaling, (int, float)) else None)
    if isinstance(calls, str):
        return TokenMixer(**base, why_not=calls)
    features, unknown = set(), set()
    for keywords in calls:
        unknown |= set(keywords) - HONOURED_KEYWORDS - {None}
        for name, feature in (("sliding_window", "sliding_window"), ("softcap", "softcap"), ("s_aux", "sinks")):
            if name in keywords and _static_value(keywords[name], module) is not None:
                features.add(feature)
        if "is_causal" in keywords and _static_value(keywords["is_causal"], module) is not True:
            return TokenMixer(**base, why_not="it passes is_causal other than True (bidirectional attention)")
    if unknown:
        return TokenMixer(**base, why_not=f"it passes {sorted(unknown)} to the attention function, which packed "
                                          f"attention does not honour")
    if head_dims[1] is not None and head_dims[0] != head_dims[1]:
        features.add("mla")
    return TokenMixer(**base, features=tuple(sorted(features)))


def _head_dims(module: nn.Module) -> tuple[int | None, int | None]:
    qk = getattr(module, "qk_head_dim", None) or getattr(module, "head_dim", None)
    v = getattr(module, "v_head_dim", None) or qk
    return (int(qk) if isinstance(qk, int) else None, int(v) if isinstance(v, int) else None)


@functools.lru_cache(maxsize=None)
def _attention_calls(cls) -> list[dict] | str:
    """The keywords (name -> value expression; None for `**kwargs`) of every call of the attention function in
    the class's forward, or why they cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError) as e:
        return f"its forward's source cannot be read to check its attention call ({e})"
    interface_vars = set()
    for node in ast.walk(tree):  # `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and the like
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and any(
                isinstance(n, ast.Name) and n.id == INTERFACE for n in ast.walk(node.value)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            interface_vars |= {t.id for t in targets if isinstance(t, ast.Name)}
    calls = [{k.arg: k.value for k in node.keywords} for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in interface_vars]
    if not calls:
        return "its forward uses transformers' attention interface in a way not read here (no call found)"
    return calls


def _static_value(node: ast.AST, module: nn.Module):
    """The value of a keyword expression read from the module: constants, `self.a.b`, `getattr(self.a, "b", d)`,
    `not`-free; anything else counts as present (returns a marker that is not None)."""
    try:
        return _evaluate(node, module)
    except _NotStatic:
        return "unknown"


def _evaluate(node: ast.AST, module: nn.Module):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id == "self":
        return module
    if isinstance(node, ast.Attribute):
        return getattr(_evaluate(node.value, module), node.attr, None)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and 2 <= len(node.args) <= 3 and isinstance(node.args[1], ast.Constant) and not node.keywords):
        default = _evaluate(node.args[2], module) if len(node.args) == 3 else None
        return getattr(_evaluate(node.args[0], module), node.args[1].value, default)
    raise _NotStatic


# ------------------------------------------------------------------------------------------ Gated DeltaNet
def fla_chunk_in_use(modeling_name: str) -> bool | None:
    """Whether transformers' `torch_chunk_gated_delta_rule` of the modeling module resolved to fla's chunk kernel
    (its hub-kernel wrapper records it at import: `is_new_implementation`, transformers 5.17 and 5.24); None when
    this transformers does not say. Its torch fallback ignores `cu_seqlens` in 5.17 (5.24 raises)."""
    if importlib.util.find_spec("fla") is None:
        return False
    modeling = sys.modules.get(modeling_name) or importlib.import_module(modeling_name)
    try:
        found = inspect.getclosurevars(modeling.torch_chunk_gated_delta_rule).nonlocals
    except (AttributeError, TypeError):
        return None
    return bool(found["is_new_implementation"]) if "is_new_implementation" in found else None

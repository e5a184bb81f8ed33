"""Fused kernels from well-kept libraries, chosen per architecture (recipe key `model.kernels`).

Named kernels (each replaces one piece of transformers' eager forward on the loaded instance only):

| name | library | replaces | architectures |
|---|---|---|---|
| `liger_rms_norm` | liger-kernel | RMSNorm (decoder layers, final norm; Qwen3.5, Qwen3, Gemma3: also q/k norms; Gemma: the `1 + weight` form) by one Triton kernel | llama, qwen3_5, qwen3, qwen3_5_moe, qwen3_moe; listed: qwen2, mistral, phi3, gemma2, gemma3_text, mixtral |
| `liger_swiglu` | liger-kernel | `silu(gate) * up` of the MLPs by one Triton kernel (Phi-3's fused `gate_up_proj` too) | llama, qwen3_5, qwen3 (silu MLPs); listed: qwen2, mistral, phi3 |
| `liger_geglu` | liger-kernel | `gelu_tanh(gate) * up` of the MLPs by one Triton kernel | listed: gemma2, gemma3_text (`gelu_pytorch_tanh` MLPs) |
| `liger_rope` | liger-kernel | the rotary embedding of q and k (full-width rotary only) | llama, qwen3, qwen3_moe; listed: qwen2, mistral, phi3, gemma2, gemma3_text, mixtral |
| `fla_conv` | flash-linear-attention | transformers' torch fallback of the Gated DeltaNet causal conv (`conv_depthwise2d`) by fla's Triton `causal_conv1d` | qwen3_5, qwen3_5_moe |
| `fla_gated_norm` | flash-linear-attention | the Gated DeltaNet output norm (`Qwen3_5RMSNormGated`: RMSNorm, weight, times silu(z)), ten eager element-wise kernels through fp32 copies, by fla's one Triton `rms_norm_gated` | qwen3_5, qwen3_5_moe |

`auto` (the default): on CUDA, every kernel of the architecture's row above (all measured exact and faster on an
H200: bench/RESULTS.md), except for the architectures in `AUTO_NOT_MEASURED` (those marked "listed": applied when
listed, eager under `auto` until measured, bench/kernels_check.py --families); eager on CPU and for architectures
not listed (said once in the log). `eager`: none. A kernel also needs what it computes: `liger_swiglu` a silu MLP,
`liger_geglu` a `gelu_pytorch_tanh` one, `liger_rope` a rotary embedding over the whole head (a partial
`partial_rotary_factor` leaves it out).
A list applies exactly those kernels; a name that does not apply to the architecture, a list on a machine without
CUDA, or a library that is not installed is a `RecipeError` naming the key. liger-kernel needs Triton: it (and fla)
are imported only when kernels are applied, which happens only on CUDA.

Scope: liger's `apply_liger_kernel_to_*(..., model=model)` patches the instance, but also rebinds module-level
names of transformers' modeling module (the RMSNorm and MLP classes, the rotary function), which would reach
every model built later in the process (verify's reference, an eager A/B in the same benchmark process). Those
names are put back after the call; the rotary function and fla's conv, which the forwards look up as
module-level functions, are swapped in only while a patched module's forward runs (`_scoped_global`). liger's
loss patches (cross entropy, fused linear cross entropy) are never applied: extraction computes no logits.

Exactness: the fused kernels change the rounding, not the function; bench/kernels_check.py measures fused vs
eager in fp32 on the GPU (bench/RESULTS.md states the figures and the bound it asserts).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from dflash_prep.recipe.schema import KERNEL_NAMES, RecipeError

log = logging.getLogger("dflash_prep")

# model_type -> (transformers modeling module, the kernels that apply, liger's apply function)
ARCHITECTURES = {
    "llama": ("transformers.models.llama.modeling_llama", ("liger_rms_norm", "liger_swiglu", "liger_rope"),
              "apply_liger_kernel_to_llama"),
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5",
                ("liger_rms_norm", "liger_swiglu", "fla_conv", "fla_gated_norm"), "apply_liger_kernel_to_qwen3_5"),
}
ARCHITECTURES["qwen3_5_text"] = ARCHITECTURES["qwen3_5"]
ARCHITECTURES["qwen3"] = ("transformers.models.qwen3.modeling_qwen3", ("liger_rms_norm", "liger_swiglu", "liger_rope"),
                          "apply_liger_kernel_to_qwen3")
# The hybrid MoE (Qwen3.5/3.6-A3B): the same Gated DeltaNet and norm modules as qwen3_5. No `liger_swiglu`: liger's
# SwiGLU patch for it swaps the routed experts' class, which `model.moe_experts` owns (target/moe.py).
ARCHITECTURES["qwen3_5_moe"] = ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                                ("liger_rms_norm", "fla_conv", "fla_gated_norm"), "apply_liger_kernel_to_qwen3_5_moe")
ARCHITECTURES["qwen3_5_moe_text"] = ARCHITECTURES["qwen3_5_moe"]
# The Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): RMSNorm (q/k norms too) and RoPE. No `liger_swiglu`, as above: it
# would swap the routed experts' class.
ARCHITECTURES["qwen3_moe"] = ("transformers.models.qwen3_moe.modeling_qwen3_moe", ("liger_rms_norm", "liger_rope"),
                              "apply_liger_kernel_to_qwen3_moe")
# Families whose packed rows are proven exact (bench/families.py) and that liger-kernel 0.8 patches. Mixtral: no
# `liger_swiglu` (liger's patch swaps the routed experts' class, which `model.moe_experts` owns); Gemma: GeGLU, not
# SwiGLU. liger's patches for phi3 and both Gemmas cover the same modules as for llama, plus Gemma's extra norms
# (pre/post feed-forward; Gemma3's q/k norms) in their `1 + weight` form.
for _type, _module, _kernels, _apply in (
        ("qwen2", "qwen2", ("liger_rms_norm", "liger_swiglu", "liger_rope"), "qwen2"),
        ("mistral", "mistral", ("liger_rms_norm", "liger_swiglu", "liger_rope"), "mistral"),
        ("phi3", "phi3", ("liger_rms_norm", "liger_swiglu", "liger_rope"), "phi3"),
        ("gemma2", "gemma2", ("liger_rms_norm", "liger_geglu", "liger_rope"), "gemma2"),
        ("gemma3_text", "gemma3", ("liger_rms_norm", "liger_geglu", "liger_rope"), "gemma3_text"),
        ("mixtral", "mixtral", ("liger_rms_norm", "liger_rope"), "mixtral")):
    ARCHITECTURES[_type] = (f"transformers.models.{_module}.modeling_{_module}", _kernels,
                            f"apply_liger_kernel_to_{_apply}")
# Text configs whose liger patch takes the text model only (liger's gemma3_text patch raises TypeError on
# Gemma3ForConditionalGeneration): a multimodal checkpoint of the family gets no kernels.
TEXT_MODEL_ONLY = frozenset({"gemma3_text"})
# Architectures whose kernels apply when listed but that `auto` leaves eager until they are measured exact and
# faster on a GPU (exact: bench/kernels_check.py in fp32, the `targets` scenario; faster: the `shapes` scenario's
# variant). qwen3 passed both on an H200: fused vs eager 7.8e-6 in fp32, 37,755 against 30,048 tok/s warm on the
# Qwen3-8B shape (bench/results/targets-20261202, shapes-20261202). qwen3_5_moe too: 4.8e-4 in fp32 with the
# routing pinned to the eager batch's (targets-20261203-moe-pinned), and on the Qwen3.6-35B-A3B shape 50,040
# against 30,456 tok/s warm, 3,282 against 1,795 cold, packed rows against eager's padded batches
# (shapes-20261203-moe-kernels). qwen3_moe too: 6.6e-7 in fp32 with the routing pinned (targets-20261204), and on
# the Qwen3-30B-A3B shape 49,267 against 37,457 tok/s warm, 33,557 against 10,267 cold (shapes-20261204).
# The families added from liger's list: their fp32 check and speed A/B have not run on a GPU yet.
AUTO_NOT_MEASURED: frozenset[str] = frozenset({"qwen2", "mistral", "phi3", "gemma2", "gemma3_text", "mixtral"})
LIBRARIES = {"liger": ("liger_kernel", "liger-kernel"), "fla": ("fla", "flash-linear-attention")}


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a run applies: `names` (in KERNEL_NAMES order, empty = eager), what the recipe asked for, and
    why `auto` chose eager where it did (`reason`, None otherwise)."""

    requested: str | tuple[str, ...]
    names: tuple[str, ...]
    model_type: str | None
    reason: str | None = None
    libraries: dict = field(default_factory=dict)

    def record(self) -> dict:
        """What the summary and the manifest keep: requested, applied names, library versions, reason."""
        requested = self.requested if isinstance(self.requested, str) else list(self.requested)
        return {"requested": requested, "applied": list(self.names), "libraries": dict(self.libraries),
                "reason": self.reason}


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _library(kernel: str) -> str:
    return "fla" if kernel.startswith("fla_") else "liger"


def _version(library: str) -> str | None:
    module, dist = LIBRARIES[library]
    if importlib.util.find_spec(module) is None:  # looks for the package without importing it (no Triton on CPU)
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "installed"


def supported_kernels(config) -> tuple[str | None, list[str]]:
    """(model type, the kernels that apply to its architecture) for `config`."""
    text = _text_config(config)
    model_type = getattr(text, "model_type", None)
    if model_type in TEXT_MODEL_ONLY and getattr(config, "model_type", model_type) != model_type:
        model_type = config.model_type  # the multimodal wrapper: liger's text patch refuses its class
    arch = ARCHITECTURES.get(model_type)
    supported = list(arch[1]) if arch else []
    act = getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "silu")
    if act not in ("silu", "swish") and "liger_swiglu" in supported:
        supported.remove("liger_swiglu")  # liger's SwiGLU computes silu(gate) * up only
    if act != "gelu_pytorch_tanh" and "liger_geglu" in supported:
        supported.remove("liger_geglu")  # liger's GeGLU computes gelu(gate, approximate="tanh") * up only
    if partial_rotary_factor(text) != 1.0 and "liger_rope" in supported:
        supported.remove("liger_rope")  # liger's rope rotates the whole head: a partial rotary is not its function
    return model_type, supported


def partial_rotary_factor(text_config) -> float:
    """The fraction of each head's dims the rotary embedding turns (1.0 = all): transformers 5's
    `rope_parameters["partial_rotary_factor"]`, or the config attribute of earlier releases."""
    params = getattr(text_config, "rope_parameters", None)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    factor = getattr(text_config, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


# Kernels that stand in for a module-level function of the modeling module while a layer's forward runs
# (`_scope_global_in_forwards`): the function's name.
SCOPED_GLOBALS = {"fla_conv": "causal_conv1d_fn", "liger_rope": "apply_rotary_pos_emb"}


def hook_missing(kernel: str, model_type: str | None) -> str | None:
    """Why the installed transformers gives `kernel` nothing to replace in `model_type`'s modeling module (None: it
    does), read from the module's code, nothing run: fla_conv and liger_rope replace a module-level function
    (`SCOPED_GLOBALS`) that a layer's forward calls (itself or through a helper: `calls_global`), fla_gated_norm
    the forward of a `*RMSNormGated` class. A transformers release that moves one (5.25 moved the conv into a
    helper) then leaves the kernel out of `auto` with this reason, instead of failing the run after the weights
    load."""
    if kernel not in (*SCOPED_GLOBALS, "fla_gated_norm") or model_type not in ARCHITECTURES:
        return None
    import transformers

    try:
        modeling = importlib.import_module(ARCHITECTURES[model_type][0])
    except ImportError as e:
        return f"transformers {transformers.__version__} has no {ARCHITECTURES[model_type][0]} ({e})"
    classes = [c for c in vars(modeling).values() if inspect.isclass(c) and c.__module__ == modeling.__name__]
    if kernel in SCOPED_GLOBALS:
        name = SCOPED_GLOBALS[kernel]
        if any(calls_global(c.forward, modeling, name) for c in classes
               if issubclass(c, nn.Module) and "forward" in vars(c)):
            return None
        return f"no layer of transformers {transformers.__version__}'s {modeling.__name__} calls `{name}`"
    if any(c.__name__.endswith("RMSNormGated") for c in classes):
        return None
    return f"transformers {transformers.__version__}'s {modeling.__name__} has no gated RMSNorm class"


def auto_kernels_on_gpu(config, tensor_parallel: bool = False) -> tuple[str, ...]:
    """The kernels `auto` applies to a model of `config` on CUDA with the `gpu` extra installed (what `plan`
    assumes of the GPU machine it cannot see), in KERNEL_NAMES order; none on a tensor-parallel replica."""
    model_type, supported = supported_kernels(config)
    if tensor_parallel or model_type in AUTO_NOT_MEASURED:
        return ()
    return tuple(k for k in KERNEL_NAMES if k in supported and hook_missing(k, model_type) is None)


def check_listed_kernels(asked, config) -> tuple[str, ...]:
    """`model.kernels` given as a list: the names in KERNEL_NAMES order, or RecipeError (naming the key) for a name
    the architecture has no patch for."""
    model_type, supported = supported_kernels(config)
    bad = [k for k in asked if k not in supported]
    if bad:
        raise RecipeError(f"recipe key `model.kernels` = {list(asked)}: {bad} do not apply to model type "
                          f"{model_type!r} (its kernels: {supported or 'none, use eager'})")
    return tuple(k for k in KERNEL_NAMES if k in asked)


def select_kernels(requested, config, device_type: str, tensor_parallel: bool = False) -> KernelChoice:
    """Which kernels a run with `model.kernels = requested` applies to a model of `config` on `device_type`.
    `auto` on a tensor-parallel replica (replica.py) applies none: the fused kernels are not measured on sharded
    layers yet; a list is applied as asked.

    Imports nothing from the kernel libraries (checks that they are installed). Raises `RecipeError` (naming
    `model.kernels`) for a list that cannot be honoured: a name the architecture has no patch for, no CUDA device,
    a library missing. `auto` never raises: what does not apply is left out and `reason` says why.
    """
    model_type, supported = supported_kernels(config)
    if requested == "eager":
        return KernelChoice("eager", (), model_type)
    if requested == "auto":
        if device_type != "cuda":
            return KernelChoice("auto", (), model_type, f"no CUDA device ({device_type}): eager")
        if tensor_parallel:
            return KernelChoice("auto", (), model_type, "tensor parallel: not measured on sharded layers: eager")
        if not supported:
            return KernelChoice("auto", (), model_type, f"no fused kernels known for model type {model_type!r}: eager")
        if model_type in AUTO_NOT_MEASURED:
            return KernelChoice("auto", (), model_type, f"the kernels for model type {model_type!r} "
                                f"({', '.join(supported)}) are not measured on a GPU yet: list them to use them: eager")
        versions = {lib: _version(lib) for lib in {_library(k) for k in supported}}
        names = tuple(k for k in KERNEL_NAMES if k in supported and versions[_library(k)] is not None)
        missing = sorted(LIBRARIES[lib][1] for lib, v in versions.items() if v is None)
        reasons = [f"not installed: {', '.join(missing)} (pip install -e '.[gpu]')"] if missing else []
        unhooked = {k: why for k in names if (why := hook_missing(k, model_type)) is not None}
        names = tuple(k for k in names if k not in unhooked)
        reasons += [f"{k} left out: {why}" for k, why in unhooked.items()]
        reason = "; ".join(reasons) or None
        return KernelChoice("auto", names, model_type, reason,
                            {LIBRARIES[lib][1]: v for lib, v in versions.items() if v is not None})
    asked = tuple(requested)
    check_listed_kernels(asked, config)
    if device_type != "cuda":
        raise RecipeError(f"recipe key `model.kernels` = {list(asked)}: fused kernels need a CUDA device, this run "
                          f"is on {device_type}; use `auto` (eager here) or `eager`")
    versions = {lib: _version(lib) for lib in {_library(k) for k in asked}}
    missing = sorted(LIBRARIES[lib][1] for lib, v in versions.items() if v is None)
    if missing:
        raise RecipeError(f"recipe key `model.kernels` = {list(asked)}: {', '.join(missing)} not installed "
                          f"(pip install -e '.[gpu]' on the GPU machine)")
    unhooked = [f"{k}: {why}" for k in asked if (why := hook_missing(k, model_type)) is not None]
    if unhooked:
        raise RecipeError(f"recipe key `model.kernels` = {list(asked)}: {'; '.join(unhooked)} (this transformers "
                          f"version is not supported by that kernel)")
    return KernelChoice(asked, tuple(k for k in KERNEL_NAMES if k in asked), model_type,
                        libraries={LIBRARIES[lib][1]: v for lib, v in versions.items()})


def apply_kernels(model: nn.Module, choice: KernelChoice) -> None:
    """Patch the loaded (and truncated) `model` in place with `choice.names`; nothing for an empty choice.

    Call before any hook is registered. liger-kernel / fla (and so Triton) are imported here, only when a kernel of
    theirs is chosen (select_kernels chooses none without CUDA). Raises ImportError when a library fails to import.
    """
    if not choice.names:  # one line: what runs, and why (the reasons of `select_kernels` end in ": eager")
        why = (choice.reason or "").removesuffix(": eager")
        log.info("model.kernels: eager, transformers' own forward%s", f" ({why})" if why else "")
        return
    module_name, _, liger_apply = ARCHITECTURES[choice.model_type]
    modeling = importlib.import_module(module_name)
    liger = [k for k in choice.names if k.startswith("liger_")]
    if liger:
        _apply_liger(model, modeling, liger_apply, set(liger))
    if "fla_conv" in choice.names:
        _apply_fla_conv(model, modeling)
    if "fla_gated_norm" in choice.names:
        _apply_fla_gated_norm(model)
    log.info("model.kernels: %s applied (%s)%s", ", ".join(choice.names),
             ", ".join(f"{k} {v}" for k, v in sorted(choice.libraries.items())),
             f"; {choice.reason}" if choice.reason else "")


def _apply_liger(model: nn.Module, modeling, apply_name: str, names: set[str]) -> None:
    """liger's own per-architecture patch of the instance (RMSNorm, SwiGLU), its module-level rebinds undone; RoPE
    scoped to this model's attention forwards."""
    liger = importlib.import_module("liger_kernel.transformers")
    saved = dict(vars(modeling))
    params = inspect.signature(getattr(liger, apply_name)).parameters
    kwargs = dict(rms_norm="liger_rms_norm" in names, cross_entropy=False, fused_linear_cross_entropy=False,
                  model=model)
    for mlp in ("swiglu", "geglu"):  # each family's function has the one its MLP computes
        if mlp in params:
            kwargs[mlp] = f"liger_{mlp}" in names
    if "rope" in params:
        kwargs["rope"] = False  # module-global in liger: applied per instance below instead
    getattr(liger, apply_name)(**kwargs)
    for name in set(vars(modeling)) - set(saved):
        delattr(modeling, name)
    for name, value in saved.items():
        if vars(modeling).get(name) is not value:
            setattr(modeling, name, value)
    if "liger_rope" in names:
        rope = importlib.import_module("liger_kernel.transformers.rope").liger_rotary_pos_emb
        _scope_global_in_forwards(model, modeling, SCOPED_GLOBALS["liger_rope"], rope)


def _apply_fla_conv(model: nn.Module, modeling) -> None:
    """fla's Triton causal conv in the Gated DeltaNet layers of this model (transformers' `causal_conv1d_fn`)."""
    conv = importlib.import_module("fla.modules.causal_conv1d").causal_conv1d  # fla 0.6 (`convolution` before)
    _scope_global_in_forwards(model, modeling, SCOPED_GLOBALS["fla_conv"], fla_causal_conv1d_fn(conv))


def _apply_fla_gated_norm(model: nn.Module) -> None:
    """fla's fused `rms_norm_gated` as the forward of every gated RMSNorm of this model's Gated DeltaNet layers."""
    try:  # fla 0.6 (`fla.modules.fused_norm_gate` before)
        fused = importlib.import_module("fla.modules.norm.fused_norm_gate").rms_norm_gated
    except ModuleNotFoundError:
        fused = importlib.import_module("fla.modules.fused_norm_gate").rms_norm_gated
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNormGated")]
    if not norms:
        raise RuntimeError("no gated RMSNorm in this model: this transformers version is not supported by "
                           "fla_gated_norm")
    for norm in norms:
        norm.forward = fla_rms_norm_gated_forward(norm, fused)


def fla_rms_norm_gated_forward(norm: nn.Module, fused):
    """transformers' `RMSNormGated.forward(x [..., D], gate [..., D]) -> [..., D]` (x normalised in fp32, times
    its weight, times silu(gate)) on fla's `rms_norm_gated(x, g, weight, bias, activation, eps=...)`, which computes
    the same in fp32 inside one kernel and rounds once (transformers rounds to the input dtype before the weight:
    the results differ by that rounding). Raises ValueError for an activation fla does not fuse."""
    activation = getattr(norm, "activation", "silu")
    if activation not in ("silu", "swish", "sigmoid"):
        raise ValueError(f"fla_gated_norm: activation {activation!r} is not one fla fuses")
    eps = getattr(norm, "variance_epsilon", None) or norm.eps

    def forward(hidden_states, gate):
        return fused(hidden_states, gate, norm.weight, None, activation=activation, eps=eps)

    return forward


def fla_causal_conv1d_fn(fla_conv):
    """transformers' `causal_conv1d_fn(x [B, D, T], weight [D, K], bias, activation, **kwargs) -> [B, D, T]` on
    fla's `causal_conv1d(x [B, T, D], weight [D, K], ...) -> ([B, T, D], final state)`. Packed rows keep their
    boundaries: transformers' `cu_seq_lens_q` goes to fla as `cu_seqlens` (the torch fallback ignores it)."""
    def causal_conv1d_fn(hidden_states_BDT, weight_DK, bias=None, activation=None, **kwargs):
        x_BTD = hidden_states_BDT.transpose(1, 2)
        y_BTD, _ = fla_conv(x=x_BTD.contiguous().to(weight_DK.dtype), weight=weight_DK, bias=bias,
                            activation=activation, cu_seqlens=kwargs.get("cu_seq_lens_q"))
        return y_BTD.transpose(1, 2).to(hidden_states_BDT.dtype)

    return causal_conv1d_fn


def _scope_global_in_forwards(model: nn.Module, modeling, name: str, replacement) -> int:
    """Wrap the forward of every module of `model` whose class (from `modeling`) calls the module-level function
    `name`, so that `replacement` stands in for it while that forward runs. Returns the modules wrapped."""
    count = 0
    for module in model.modules():
        cls = type(module)
        if cls.__module__ == modeling.__name__ and calls_global(cls.forward, modeling, name):
            module.forward = _scoped_global(module.forward, modeling, name, replacement)
            count += 1
    if not count:
        raise RuntimeError(f"no forward of {modeling.__name__} calls `{name}`: this transformers version is not "
                           f"supported by that kernel")
    return count


def calls_global(function, modeling, name: str) -> bool:
    """Whether `function` calls the module-level `name` of `modeling`, itself or through a function of `modeling`
    it calls (one level: transformers 5.25 moved the Gated DeltaNet's conv into `causal_conv1d_forward`, which
    looks `causal_conv1d_fn` up in the same module's globals, so rebinding it there still reaches the call)."""
    names = inspect.unwrap(function).__code__.co_names
    if name in names:
        return True
    helpers = [plain_function(vars(modeling).get(n)) for n in names]
    return any(h is not None and h.__module__ == modeling.__name__ and name in inspect.unwrap(h).__code__.co_names
               for h in helpers)


def plain_function(obj):
    """`obj` itself when a function; the function a `kernels`-wrapped one calls (transformers' hub-kernel decorator
    turns a decorated function into a module whose forward calls it, from its closure); else None."""
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None) if isinstance(obj, nn.Module) else None
    cells = getattr(forward, "__closure__", None) or ()
    inner = [c.cell_contents for c in cells if inspect.isfunction(getattr(c, "cell_contents", None))]
    return inner[0] if len(inner) == 1 else None


def _scoped_global(forward, modeling, name: str, replacement):
    """`forward` with `modeling.name` rebound to `replacement` for the duration of the call (the forward runs in
    one thread; other models of the process keep transformers' function)."""
    @functools.wraps(forward)
    def scoped(*args, **kwargs):
        original = getattr(modeling, name)
        setattr(modeling, name, replacement)
        try:
            return forward(*args, **kwargs)
        finally:
            setattr(modeling, name, original)

    scoped.scoped_global = name  # what packing.py reads: fla_conv keeps a packed row's samples apart
    return scoped


# ------------------------------------------------------------------------------------ the output's record
KERNELS_NAME = "kernels.jsonl"  # OUT/: one line per run that loaded the model: the fused kernels it applied


def append_kernels_record(out_dir: Path, record: dict, world: int) -> None:
    """One line per run that loads the model into OUT/kernels.jsonl (main process): the kernels it applied. A resume
    may apply another set (its shards' states then differ from the earlier ones by rounding): the manifest lists
    them all."""
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "num_ranks": world, **record}
    with open(out_dir / KERNELS_NAME, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _kernels_lines(out_dir: Path) -> list[dict]:
    path = out_dir / KERNELS_NAME
    lines = []
    for text in path.read_text().splitlines() if path.exists() else []:
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue  # a torn last line (a crash while appending)
    return lines


def last_kernels_record(out_dir: Path) -> dict | None:
    """The manifest's `kernels`: the record of the latest run that computed states into this output (None for an
    output of a version before kernels were recorded)."""
    lines = _kernels_lines(out_dir)
    return {k: lines[-1][k] for k in ("requested", "applied", "libraries", "reason")} if lines else None


def kernels_history(out_dir: Path) -> list[dict]:
    """The distinct kernel sets (applied names and library versions) of the runs that computed states into this
    output, in first-use order (OUT/kernels.jsonl)."""
    seen: list[dict] = []
    for line in _kernels_lines(out_dir):
        entry = {"applied": line["applied"], "libraries": line["libraries"]}
        if entry not in seen:
            seen.append(entry)
    return seen


# ------------------------------------------------------------------------------------- Triton's disk cache
def configure_triton_cache(cache_dir: str | None, environ=None) -> dict:
    """Point Triton's kernel and autotuning cache at `cache_dir` (`model.triton_cache_dir`) for this process and
    its children, before Triton is imported: TRITON_CACHE_DIR = cache_dir (created), TRITON_CACHE_AUTOTUNING = 1.
    A variable the user set is left as it is; `cache_dir` None changes nothing. Returns the record for the summary:
    {"dir", "autotuning", "source"} ("recipe", "environment" or "triton default")."""
    env = os.environ if environ is None else environ
    if cache_dir is not None:
        path = Path(cache_dir).expanduser()
        if "TRITON_CACHE_DIR" not in env:
            path.mkdir(parents=True, exist_ok=True)
            env["TRITON_CACHE_DIR"] = str(path)
        env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    source = ("triton default" if "TRITON_CACHE_DIR" not in env else
              "recipe" if cache_dir is not None and env["TRITON_CACHE_DIR"] == str(Path(cache_dir).expanduser())
              else "environment")
    return {"dir": env.get("TRITON_CACHE_DIR"), "autotuning": env.get("TRITON_CACHE_AUTOTUNING") == "1",
            "source": source}

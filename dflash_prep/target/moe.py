"""Routed experts of mixture-of-experts targets (`model.moe_experts`): transformers' own forward, or the same
forward compiled.

transformers (5.x) stores a sparse block's routed experts as one module of stacked weights ([E, 2I, H] gate+up,
[E, H, I] down) whose forward is picked by `config._experts_implementation` (`eager`: a loop over the experts hit;
`batched_mm`; `grouped_mm`, its default where torch has it: tokens sorted by expert, two grouped GEMMs; `deepgemm`
and `sonicmoe` fetch kernels from a hub at run time). Around the grouped GEMMs, `grouped_mm` runs a dozen small
kernels per layer: the sort, the gather of the tokens, the gate activation and product, the routing-weight
product, the un-permute and the sum over the top-k; profiled on an H200 (Qwen3-30B-A3B shape, one [8, 4096]
batch), the grouped GEMMs were 21% of the GPU time and the elementwise, gather and copy kernels around them ~50%.

`compiled` runs that same forward (transformers' `grouped_mm_experts_forward`, unchanged) through `torch.compile`
(the token count dynamic, every other size static: one graph for every token count and layer): Inductor fuses the
elementwise work around the grouped GEMMs, which stay torch's own `grouped_mm` (bfloat16). The router (gate linear,
softmax, top-k) is not part of it and runs eagerly: the experts each token is sent to are chosen by the same kernels
as in transformers' forward. Each token's output depends on its own row only, so packed rows stay exact
(tests/test_moe.py). Written here rather than taken
from a fused-MoE library because those that exist (liger-kernel has none for qwen3_moe; transformers' `deepgemm` /
`sonicmoe` load kernels from a hub) cannot run offline; bench/targets_check.py measures it against
transformers' implementations on the GPU.

`liger`: liger-kernel's fused MoE (`LigerExperts.forward`, Triton: routing metadata, gather + grouped GEMM + SwiGLU,
down projection, weighted sum), CUDA only, on request (it is measured by bench/targets_check.py before `auto` may
pick it).

`auto`: `compiled` on CUDA in bfloat16, `transformers` elsewhere (on a CPU, and in fp32, where transformers' compiled
path falls back from grouped_mm to a loop).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

TRANSFORMERS, COMPILED, LIGER = "transformers", "compiled", "liger"
_COMPILED_FORWARD = None
# Only the token dimension dynamic (marked per call), not `dynamic=True`: with every size symbolic (the hidden size,
# the top-k, the experts) Inductor could not see the sum over the top-k as 8 rows of 2048 and made it a looped
# reduction that took 21% of the Qwen3-30B-A3B shape's forward (bench/results/profile-20261204-30b/). The benchmark
# sets it to "all" for the A/B.
DYNAMIC_DIMS = "tokens"


def routed_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules whose forward transformers dispatches by `_experts_implementation` (stacked
    weights, forward(hidden [S, H], top_k_index [S, k], top_k_weights [S, k]) -> [S, H])."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__.endswith("Experts") and hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def select_moe_experts(requested: str, model: nn.Module, device_type: str, dtype: str) -> tuple[str, str]:
    """(implementation, why) for `model.moe_experts` = `requested` (auto, transformers, compiled)."""
    if requested != "auto":
        return requested, "model.moe_experts"
    if device_type != "cuda":
        return TRANSFORMERS, f"auto: {device_type}, no grouped GEMM to fuse around"
    if dtype != "bfloat16":
        return TRANSFORMERS, f"auto: {dtype} (torch.compile runs grouped_mm in bfloat16 only)"
    return COMPILED, "auto: CUDA, bfloat16"


def _compiled_forward():
    """transformers' grouped_mm experts forward under torch.compile, compiled once per process (dynamic shapes,
    the experts module an input: every layer's module shares the graph)."""
    global _COMPILED_FORWARD
    if _COMPILED_FORWARD is None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        _COMPILED_FORWARD = torch.compile(grouped_mm_experts_forward,
                                          dynamic=True if DYNAMIC_DIMS == "all" else None)
    return _COMPILED_FORWARD


def _mark_token_dims(*tensors: torch.Tensor) -> None:
    """The token dimension (0) of each input dynamic from the first compilation on, so that a new token count
    reuses the graph; the other sizes stay static (Inductor specializes its kernels to them)."""
    if DYNAMIC_DIMS != "all":
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)


_COMPILE_FAILED: list[str] = []


class _CompiledExperts:
    """A routed-experts module's forward replaced: its own weights through the compiled grouped_mm forward. Where
    compilation fails (an Inductor or a torch version without the grouped GEMM's lowering), every layer goes back to
    transformers' own forward, said once: the same function, without the fusion."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        if not _COMPILE_FAILED:
            try:
                _mark_token_dims(hidden_states, top_k_index, top_k_weights)
                return _compiled_forward()(self.module, hidden_states, top_k_index, top_k_weights)
            except Exception as e:  # noqa: BLE001 - torch.compile's errors have no common type
                _COMPILE_FAILED.append(" ".join(str(e).split())[:300])
                log.warning("model.moe_experts: compiled: torch.compile failed (%s); transformers' experts forward "
                            "runs instead", _COMPILE_FAILED[0])
        return type(self.module).forward(self.module, hidden_states, top_k_index, top_k_weights)


def apply_moe_experts(model: nn.Module, requested: str, device_type: str, dtype: str) -> str | None:
    """Put the routed experts of `model` on the implementation `select_moe_experts` picks; -> one line for the log
    (None for a model without routed experts). `compiled` where a module is not transformers' stacked layout
    (its own experts class): that module keeps its forward, and the line says how many were compiled."""
    experts = routed_experts(model)
    if not experts:
        return None
    chosen, why = select_moe_experts(requested, model, device_type, dtype)
    if chosen == TRANSFORMERS:
        impl = getattr(getattr(experts[0][1], "config", None), "_experts_implementation", None)
        return f"model.moe_experts: transformers' experts forward ({impl}) on {len(experts)} layers ({why})"
    bad = [n for n, m in experts if getattr(m, "is_transposed", False) or getattr(m, "_is_expert_parallel", False)
           or getattr(m, "has_bias", False) or not getattr(m, "has_gate", True)]
    if chosen == LIGER:
        import types

        from dflash_prep.recipe.schema import RecipeError

        if device_type != "cuda":
            raise RecipeError("recipe key `model.moe_experts` = 'liger': liger-kernel's fused MoE needs CUDA")
        from liger_kernel.transformers.swiglu import LigerExperts

        for name, module in experts:
            if name not in bad:
                module.forward = types.MethodType(LigerExperts.forward, module)
        return (f"model.moe_experts: liger-kernel's fused MoE on {len(experts) - len(bad)} of {len(experts)} "
                f"layers ({why})")
    for name, module in experts:
        if name not in bad:
            module.forward = _CompiledExperts(module)
    return (f"model.moe_experts: compiled (torch.compile of transformers' grouped_mm experts forward, routing "
            f"eager) on {len(experts) - len(bad)} of {len(experts)} layers ({why})")

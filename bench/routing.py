"""Top-k routing of MoE targets recorded from one forward and held fixed in others (bench/kernels_check.py).

A router's top-k choice is discontinuous: a difference far below a kernel check's bound upstream flips the experts
of the tokens whose k-th and (k+1)-th router scores nearly tie, and a flipped token's state then moves by O(0.1).
Measured on one H200 (`results/targets-20261203/`): the Qwen3.6-35B-A3B-shaped slice in float32, eager, batched
against each sample alone, 0.14-0.21 relative, where the dense 27B slice gives 5.6e-4 to 1.0e-3 (flips the likely
cause; the counts below tell). A check of kernels (or of batching) on such a model compares the computations only
when every forward routes each token to the same experts with the same weights: the reference forward's routing is
recorded (`record_routing`) and every other forward's routers answer with it (`pin_routing`), which also counts the
tokens each router would have sent elsewhere (the routing's own sensitivity, reported beside the states' errors).

Routers here are transformers' convention for sparse MoE blocks (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, Mixtral,
OLMoE, ... in transformers 5.x): a block with `gate` and `experts`, its `gate` a `*TopKRouter` whose forward takes
the block's tokens flattened to [N, H] (N = batch x sequence) and returns (router_logits [N, E], router_scores
[N, k], router_indices [N, k]), called once a forward.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every sparse MoE block's router in `model` (empty for a dense model): a block's `gate` of a
    `*Router` class (a plain linear gate returns only logits: no routing to record)."""
    return [(f"{name}.gate", m.gate) for name, m in model.named_modules()
            if hasattr(m, "gate") and hasattr(m, "experts") and type(m.gate).__name__.endswith("Router")]


def _routing_of(name: str, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router_logits, router_scores, router_indices) of a router's output; TypeError for another form."""
    if not (isinstance(output, tuple) and len(output) == 3 and all(isinstance(t, torch.Tensor) for t in output)):
        raise TypeError(f"{name}: a router's output is (router_logits, router_scores, router_indices) here, got "
                        f"{type(output).__name__} of {len(output) if isinstance(output, tuple) else 1}")
    return output


@contextmanager
def record_routing(model: nn.Module):
    """Yields {router name: (router_scores [N, k], router_indices [N, k])}, filled by each forward run inside (the
    last forward's kept), on the routers' device."""
    recorded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(name):
        def hook(_module, _args, output):
            _, scores, indices = _routing_of(name, output)
            recorded[name] = (scores.detach().clone(), indices.detach().clone())
        return hook

    handles = [router.register_forward_hook(keep(name)) for name, router in routers(model)]
    try:
        yield recorded
    finally:
        for h in handles:
            h.remove()


@contextmanager
def pin_routing(model: nn.Module, reference: dict, rows: slice | None = None, real: torch.Tensor | None = None,
                pin: bool = True):
    """Each router of `model` present in `reference` (a `record_routing` result) answers with the reference's
    scores and indices (`pin`; else only counted), `rows` of the reference's N tokens (a slice: e.g. one sample of
    a right-padded batch, its tokens b x T .. b x T + n; None: all, the forward having the reference's shape).
    Yields {router name: number of this forward's real tokens (`real`: [N] bool, None: all) whose own top-k set
    differs from the reference's}, filled by each forward. RuntimeError when a forward's token count is not the
    reference rows'. The counts are read from the device when the block ends (no sync inside a timed forward)."""
    rerouted: dict[str, int] = {}
    counts: dict[str, torch.Tensor] = {}

    def answer(name):
        scores, indices = reference[name]
        scores, indices = (scores[rows], indices[rows]) if rows is not None else (scores, indices)

        def hook(_module, _args, output):
            logits, own_scores, own_indices = _routing_of(name, output)
            if own_indices.shape != indices.shape:
                raise RuntimeError(f"{name}: {tuple(own_indices.shape)} routed tokens against the reference's "
                                   f"{tuple(indices.shape)}")
            differs = (own_indices.sort(dim=-1).values != indices.sort(dim=-1).values).any(dim=-1)
            counts[name] = (differs if real is None else differs & real.to(differs.device)).sum()
            if not pin:
                return None
            return logits, scores.to(own_scores.dtype), indices
        return hook

    handles = [router.register_forward_hook(answer(name)) for name, router in routers(model) if name in reference]
    try:
        yield rerouted
    finally:
        for h in handles:
            h.remove()
        rerouted.update({name: int(count) for name, count in counts.items()})

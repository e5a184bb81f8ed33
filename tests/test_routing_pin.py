"""Routing held fixed (bench/routing.py), the basis of the GPU kernel check on MoE targets: a model whose routers
are replaced by other random ones, its routing pinned to the original's, gives the original's states, batched and
per sample alone; free, it does not."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from conftest import REPO

from dflash_prep.target.layers import find_decoder

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.families import family_config  # noqa: E402
from bench.routing import pin_routing, record_routing, routers  # noqa: E402

LENGTHS = [23, 7, 16]


def _model(family: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config(family, "tiny"), dtype=torch.float32).eval()


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and mask [B, T] of LENGTHS."""
    g = torch.Generator().manual_seed(1)
    T = max(LENGTHS)
    ids, mask = torch.zeros(len(LENGTHS), T, dtype=torch.long), torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        ids[b, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, :n] = 1
    return ids, mask


def _states(model, ids, mask=None) -> torch.Tensor:
    """The last decoder layer's input, [B, T, H] (hidden_states[-2]: before the final norm)."""
    with torch.inference_mode():
        return find_decoder(model)(input_ids=ids, attention_mask=mask, use_cache=False,
                                   output_hidden_states=True).hidden_states[-2]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_routing_pinned_to_a_reference_reproduces_its_states_batched_and_alone(family):
    model = _model(family)
    sparse_blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    assert len(sparse_blocks) >= 2 and len(routers(model)) == len(sparse_blocks)
    other = copy.deepcopy(model)
    torch.manual_seed(5)
    for _, router in routers(other):  # other routers: other experts and weights for most tokens
        router.weight.data.normal_(0.0, 1.0)
    ids, mask = _batch(model.config.vocab_size)
    real = mask.flatten().bool()
    with record_routing(model) as reference:
        batched = _states(model, ids, mask)
    assert set(reference) == {name for name, _ in routers(model)}

    free = _states(other, ids, mask)
    with pin_routing(other, reference, real=real) as rerouted:
        pinned = _states(other, ids, mask)
    for b, n in enumerate(LENGTHS):
        assert _rel(pinned[b, :n], batched[b, :n]) < 1e-5
        assert _rel(free[b, :n], batched[b, :n]) > 1e-2
    assert sum(rerouted.values()) > 0  # the other routers would have chosen other experts

    T = ids.shape[1]
    for b, n in enumerate(LENGTHS):  # each sample alone, on the rows of the batch that are its tokens
        alone = _states(model, ids[b:b + 1, :n])
        with pin_routing(other, reference, rows=slice(b * T, b * T + n)) as rerouted_alone:
            other_alone = _states(other, ids[b:b + 1, :n])
        with pin_routing(model, reference, rows=slice(b * T, b * T + n)) as own:
            model_alone = _states(model, ids[b:b + 1, :n])
        assert _rel(other_alone[0], alone[0]) < 1e-5 and _rel(model_alone[0], alone[0]) < 1e-5
        assert sum(own.values()) == 0 and sum(rerouted_alone.values()) > 0


def test_a_forward_of_another_token_count_than_the_reference_rows_is_refused():
    model = _model("qwen3_moe")
    ids, mask = _batch(model.config.vocab_size)
    with record_routing(model) as reference:
        _states(model, ids, mask)
    with pin_routing(model, reference, rows=slice(0, 5)), pytest.raises(RuntimeError, match="routed tokens"):
        _states(model, ids[:1, :6])


def test_a_router_that_returns_another_form_is_refused_by_name():
    """A router whose output is not (router_logits, router_scores, router_indices) (here the first one made to
    return its logits alone, as a plain linear gate does) is refused with its name rather than read wrongly."""
    model = _model("qwen3_moe")
    name, first = routers(model)[0]
    first.register_forward_hook(lambda _m, _a, output: output[0])
    ids, mask = _batch(model.config.vocab_size)
    with record_routing(model), pytest.raises(TypeError, match=f"{name}: a router's output is"):
        _states(model, ids, mask)

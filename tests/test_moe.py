"""Routed experts through `model.moe_experts: compiled` (dflash_prep/target/moe.py) on a tiny Qwen3-MoE (random
fp32 weights, CPU): every layer routes each token to the same top-k experts as transformers' own forward, the
states equal it within fp32 noise, and a packed row of several samples equals each sample run alone.

Tolerance (float32): max |a - b| / max |b| <= 1e-5 per layer (the compiled graph may sum in another order: a few
unit roundoffs, 2^-24, per layer), while a token sent to one wrong expert moves its state by 1e-2 or more."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from dflash_prep.plan.batches import SampleInfo, collate_packed
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.layers import find_decoder
from dflash_prep.target.moe import apply_moe_experts, routed_experts, select_moe_experts
from dflash_prep.target.norms import randomize_norm_gains
from dflash_prep.target.packing import use_packed_attention

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from bench.families import family_config  # noqa: E402

TOLERANCE = 1e-5
LENGTHS = [5, 33, 1, 20]


def _build():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("qwen3_moe", "tiny"), dtype=torch.float32)
    randomize_norm_gains(model, 0)
    return model.eval().requires_grad_(False)


def _run(model, ids: torch.Tensor):
    """(hidden states, the top-k expert ids per sparse layer) of plain transformers on `ids` [1, T]."""
    chosen = []
    hooks = [m.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2].clone()))
             for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    with torch.inference_mode():
        states = find_decoder(model)(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    return states, chosen


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _samples() -> list[SampleInfo]:
    g = np.random.default_rng(0)
    return [SampleInfo(f"{i:010d}", i, None, g.integers(1, 1000, n).astype(np.int32), np.ones(n, np.uint8))
            for i, n in enumerate(LENGTHS)]


def test_compiled_experts_route_and_compute_as_transformers():
    eager, compiled = _build(), _build()
    said = apply_moe_experts(compiled, "compiled", "cpu", "float32")
    assert said and "compiled" in said and f"on {len(routed_experts(compiled))} of" in said, said
    ids = torch.randint(1, 1000, (1, 48), generator=torch.Generator().manual_seed(1))
    want, want_experts = _run(eager, ids)
    got, got_experts = _run(compiled, ids)
    assert len(want_experts) == len(got_experts) > 0
    for layer, (w, g) in enumerate(zip(want_experts, got_experts, strict=True)):
        assert torch.equal(torch.sort(w, -1).values, torch.sort(g, -1).values), f"experts chosen, sparse layer {layer}"
    errors = [_rel(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOLERANCE, errors
    # the check can fail: one token's top-1 expert swapped for another moves the states far past the tolerance
    experts = routed_experts(compiled)[0][1]
    with torch.no_grad():
        experts.down_proj[int(want_experts[0][0, 0])].mul_(1.5)
    assert _rel(_run(compiled, ids)[0][-1], want[-1]) > 100 * TOLERANCE


def test_compiled_experts_packed_row_equals_each_sample_alone():
    model = _build()
    apply_moe_experts(model, "compiled", "cpu", "float32")
    samples = _samples()
    alone = [_run(model, torch.from_numpy(s.input_ids.astype(np.int64))[None])[0] for s in samples]
    H = model.config.hidden_size
    layer_ids = list(range(len(find_decoder(model).layers) - 1))
    use_packed_attention(model, "cpu")
    with LayerCapture(model, layer_ids, capture_final="none", storage_dtype=torch.float32) as cap:
        out = cap.run(**collate_packed(samples, 64, 0, 0).tensors_on(torch.device("cpu")))
    start = 0
    for s, ref in zip(samples, alone, strict=True):
        n = len(s.input_ids)
        for k, layer in enumerate(layer_ids):
            got = out.hidden_states_NK[start:start + n, k * H:(k + 1) * H]
            assert _rel(got, ref[layer + 1][0]) <= TOLERANCE, (s.sample_id, layer)
        start += n


@pytest.mark.parametrize("requested, device, dtype, chosen", [
    ("auto", "cuda", "bfloat16", "compiled"), ("auto", "cuda", "float32", "transformers"),
    ("auto", "cpu", "bfloat16", "transformers"), ("transformers", "cuda", "bfloat16", "transformers"),
    ("compiled", "cpu", "float32", "compiled")])
def test_auto_choice(requested, device, dtype, chosen):
    assert select_moe_experts(requested, None, device, dtype)[0] == chosen


def test_a_dense_model_has_nothing_to_choose():
    from conftest import tiny_llama_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    assert apply_moe_experts(model, "auto", "cuda", "bfloat16") is None


def test_a_failed_compilation_runs_transformers_forward_and_says_so(monkeypatch, caplog):
    from dflash_prep.target import moe

    def failing(*_args, **_kwargs):
        raise RuntimeError("no lowering for this op")

    monkeypatch.setattr(moe, "_COMPILED_FORWARD", failing)
    monkeypatch.setattr(moe, "_COMPILE_FAILED", [])
    eager, compiled = _build(), _build()
    apply_moe_experts(compiled, "compiled", "cpu", "float32")
    ids = torch.randint(1, 1000, (1, 20), generator=torch.Generator().manual_seed(3))
    with caplog.at_level("WARNING", logger="dflash_prep"):
        got = _run(compiled, ids)[0]
    assert all(torch.equal(g, w) for g, w in zip(got, _run(eager, ids)[0], strict=True))
    said = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(said) == 1 and "no lowering" in said[0], said


def test_compiled_experts_compile_once_for_every_token_count(monkeypatch):
    """The token count is the one dynamic size: samples of new lengths reuse the first graph (a recompilation per
    length would cost a real job seconds per new batch shape)."""
    from torch._dynamo.utils import counters

    from dflash_prep.target import moe

    torch._dynamo.reset()
    monkeypatch.setattr(moe, "_COMPILED_FORWARD", None)
    model = _build()
    apply_moe_experts(model, "compiled", "cpu", "float32")
    ids = torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(2))
    _run(model, ids[:, :7])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    for n in (19, 64, 33):
        _run(model, ids[:, :n])
    assert counters["stats"]["unique_graphs"] == graphs

"""Packed rows on every target family (bench/families.py's tiny configs: random weights, float32, CPU): each
sample's states in a packed row, and in a padded batch, equal its states run alone through plain transformers
(eager attention, no packing); the capability rule (target/mixers.py) refuses a model with a token mixer it
cannot pack, and says which.

Tolerance (float32): max |packed - alone| / max |alone| <= 1e-5 per captured layer. Packing changes only the
shapes the kernels run on (one [T, H] row instead of [L, H]; attention per segment), so each GEMM may sum in
another order: about sqrt(K) unit roundoffs (2^-24 ~ 6e-8; K <= 128 here) per layer, ~1e-6 after the layers of
these models (measured: 1.2e-7 to 9e-7), while a sample seeing a neighbour, a window off by one, a missing softcap
or sink changes the states by 1e-2 or more (`test_each_feature_changes_the_states` shows the features bite at
these sizes).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_llama_config
from torch import nn

from dflash_prep.plan.batches import SampleInfo, collate, collate_packed
from dflash_prep.recipe.schema import RecipeError
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.layers import find_decoder
from dflash_prep.target.norms import randomize_norm_gains
from dflash_prep.target.packing import ATTENTION_CALLS, PACKED_ATTENTION, select_packing, use_packed_attention

if str(REPO) not in sys.path:  # bench/ is a folder of the checkout, not part of the installed package
    sys.path.insert(0, str(REPO))
from bench.families import FAMILIES, WINDOW, family_config  # noqa: E402

TOLERANCE = 1e-5
LENGTHS = [1, 70, 17, 3, 64, 2, 40, 33]  # four samples longer than the tiny window (16 tokens)
ROWS = [(list(range(7)), 256), ([7], 33)]  # mixed lengths with a tail segment; one sample filling its row
WINDOWED = {"qwen2", "mistral", "gemma2", "gemma3", "phi3", "gpt_oss"}
EAGER_PER_SEGMENT = {"gemma2": "softcap", "gpt_oss": "sinks"}  # the others: SDPA per segment on the CPU
GATED_DELTANET = {"qwen3_5", "qwen3_5_moe"}


def build(family: str, **overrides) -> nn.Module:
    """The family's tiny model (config fields `overrides` changed), random fp32 weights, eager attention. The
    attention projections are drawn 8x larger than transformers' init (std 0.02) so that attention is peaked (the
    softcap then bites) and the sinks from N(0, 1), so that every feature changes the states."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = family_config(family, "tiny")
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize_norm_gains(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." in name and param.ndim == 2 and "o_proj" not in name:
                param.mul_(8)
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    return model.eval().requires_grad_(False)


def _samples(vocab: int = 1000) -> list[SampleInfo]:
    g = np.random.default_rng(0)
    return [SampleInfo(f"{i:010d}", i, None, g.integers(1, vocab, n).astype(np.int32), np.ones(n, np.uint8))
            for i, n in enumerate(LENGTHS)]


def _alone(model, sample) -> tuple:
    """Plain transformers, the sample alone: hidden_states[i + 1] is after-layer id i, [-1] after the norm."""
    with torch.inference_mode():
        return find_decoder(model)(input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None],
                                   use_cache=False, output_hidden_states=True).hidden_states


def _worst(out, indices: list[int], refs: list, layer_ids: list[int], H: int) -> float:
    """max over the samples and captured layers (and the final norm) of max |got - alone| / max |alone|."""
    worst, start = 0.0, 0
    for i in indices:
        n = LENGTHS[i]
        pairs = [(out.hidden_states_NK[start:start + n, s * H:(s + 1) * H], refs[i][layer + 1][0])
                 for s, layer in enumerate(layer_ids)]
        pairs.append((out.final_hidden_states_NH[start:start + n], refs[i][-1][0]))
        worst = max([worst] + [((got - ref).abs().max() / ref.abs().max()).item() for got, ref in pairs])
        start += n
    assert start == out.hidden_states_NK.shape[0]
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_and_padded_states_equal_each_sample_run_alone(family):
    model = build(family)
    H = model.config.get_text_config().hidden_size
    layer_ids = list(range(len(find_decoder(model).layers) - 1))  # every layer but the last, + the final norm
    samples = _samples()
    refs = [_alone(model, s) for s in samples]  # before the model is switched to packed rows
    cpu = torch.device("cpu")
    with LayerCapture(model, layer_ids, capture_final="after_norm", storage_dtype=torch.float32) as cap:
        padded = cap.run(**collate(samples, max(LENGTHS), 0).tensors_on(cpu))
    assert _worst(padded, list(range(len(samples))), refs, layer_ids, H) <= TOLERANCE, "padded"

    assert select_packing(True, model.config, "cpu", (), model=model).packed
    calls = dict(ATTENTION_CALLS)
    done = use_packed_attention(model, "cpu")
    assert find_decoder(model).config._attn_implementation == PACKED_ATTENTION
    with LayerCapture(model, layer_ids, capture_final="after_norm", storage_dtype=torch.float32) as cap:
        for indices, row_length in ROWS:
            batch = collate_packed([samples[i] for i in indices], row_length, 0, 0)
            packed = cap.run(**batch.tensors_on(cpu))
            assert _worst(packed, indices, refs, layer_ids, H) <= TOLERANCE, ("packed", indices)
    # what ran: the window, softcap and sinks were seen; the path that computes them
    ran = {k: ATTENTION_CALLS[k] - calls[k] for k in calls}
    assert ("sliding_window" in done["attention_features"]) == (family in WINDOWED)
    assert ran["eager_per_segment" if family in EAGER_PER_SEGMENT else "sdpa_per_segment"] > 0, ran
    assert ("mla" in done["attention_features"]) == (family == "deepseek_v3")
    assert (done["linear_attention_per_segment"] > 0) == (family in GATED_DELTANET)


@pytest.mark.parametrize("family, feature", [("mistral", "sliding_window"), ("gemma2", "softcap"),
                                             ("gpt_oss", "sinks"), ("qwen2", "sliding_window")])
def test_each_feature_changes_the_states(family, feature):
    """The tiny models exercise what the packed path must honour: without the feature the states of a sample
    longer than the window differ by far more than the tolerance (so a packed path that dropped it would fail)."""
    model = build(family)
    sample = _samples()[1]  # 70 tokens
    assert len(sample.input_ids) > WINDOW["tiny"]
    want = _alone(model, sample)[-1]
    if feature == "sliding_window":  # the same weights, a window wider than the sample
        wide = build(family, sliding_window=10_000)
        wide.load_state_dict(model.state_dict())
        model = wide
    for module in model.modules():
        if feature == "softcap" and hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
        if feature == "sinks" and hasattr(module, "sinks"):
            module.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink
    got = _alone(model, sample)[-1]
    assert ((got - want).abs().max() / want.abs().max()).item() > 1e-2


# ------------------------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_on_a_gpu_packs_where_every_mixer_has_one_varlen_kernel(family):
    """Decided on this CPU machine for a bf16 GPU run with flash-linear-attention (as `dflash-prep plan` does):
    `true` packs every family; `auto` packs where torch's varlen FlashAttention (with its window) and fla's
    kernels run the whole row, and says which module would run once per sample where not."""
    config = family_config(family, "tiny")
    assert select_packing(True, config, "cuda", ("fla_conv",), assume_fla=True).packed
    auto = select_packing("auto", config, "cuda", ("fla_conv",), assume_fla=True)
    once_per_sample = {"gemma2": "Gemma2Attention): softcap", "gpt_oss": "GptOssAttention): sinks"}
    if family in GATED_DELTANET:  # fla's conv keeps the samples apart; without it the torch conv would not
        eager = select_packing("auto", config, "cuda", (), assume_fla=True)
        assert not eager.packed and "GatedDeltaNet): without model.kernels' fla_conv" in eager.reason, eager.reason
    if family in once_per_sample:
        assert not auto.packed and once_per_sample[family] in auto.reason and "once per sample" in auto.reason
    else:
        assert auto.packed, auto.reason
    assert not select_packing("auto", config, "cuda", ("fla_conv",), assume_fla=True, compute_dtype="float32").packed


class CausalMeanMixer(nn.Module):
    """A token mixer of our own: each position gets the mean of v(h) over the positions up to it (a causal
    recurrence that, in a packed row, would run on into the next sample)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.v = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, *args, **kwargs):
        v = self.v(hidden_states)
        counts = torch.arange(1, v.shape[1] + 1, dtype=v.dtype, device=v.device)[None, :, None]
        return v.cumsum(dim=1) / counts, None


def test_a_model_with_a_mixer_of_its_own_is_refused_and_would_mix_samples():
    from transformers import AttentionInterface

    from dflash_prep.target.packing import varlen_attention

    model = build("llama")
    model.model.layers[1].self_attn = CausalMeanMixer(64)
    config = model.config
    with pytest.raises(RecipeError, match=r"batching.packing.*model\.layers\.1\.self_attn \(CausalMeanMixer\)"):
        select_packing(True, config, "cpu", (), model=model)
    auto = select_packing("auto", config, "cuda", (), model=model)
    assert not auto.packed and "CausalMeanMixer" in auto.reason and auto.reason.endswith("padded batches")
    with pytest.raises(ValueError, match="CausalMeanMixer"):
        use_packed_attention(model, "cpu")
    # why: packed anyway, the second sample's states are not its own
    samples = _samples()[:2]
    refs = [_alone(model, s) for s in samples]
    AttentionInterface.register(PACKED_ATTENTION, varlen_attention)
    model.set_attn_implementation(PACKED_ATTENTION)
    with LayerCapture(model, [2], storage_dtype=torch.float32) as cap:
        out = cap.run(**collate_packed(samples, 72, 0, 0).tensors_on(torch.device("cpu"))).hidden_states_NK
    second = out[1:71]
    assert ((second - refs[1][3][0]).abs().max() / refs[1][3][0].abs().max()).item() > 1e-2


def test_a_mamba_hybrid_is_refused_from_its_config():
    """Jamba (transformers' own classes): its Mamba mixer has a recurrence and a conv packed rows cannot split."""
    from transformers import JambaConfig

    config = JambaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=4, mamba_d_state=8)
    with pytest.raises(RecipeError, match=r"model\.layers\.0\.mamba \(JambaMambaMixer\)"):
        select_packing(True, config, "cpu", ())
    assert "JambaMambaMixer" in select_packing("auto", config, "cuda", ()).reason


ATTENTION_SOURCE = """from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention


class Custom(LlamaAttention):
    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                   scaling=self.scaling, KEYWORD, **kwargs)
"""


@pytest.mark.parametrize("keyword, why", [("alibi_slopes=self.scaling", r"passes \['alibi_slopes'\]"),
                                          ("is_causal=False", "bidirectional")])
def test_attention_asking_for_what_the_varlen_function_cannot_honour_is_refused(keyword, why, tmp_path):
    """An attention module through the interface that passes a keyword `varlen_attention` does not honour, or asks
    for bidirectional attention, is refused (read from its forward's source: a module file written here)."""
    import importlib.util

    path = tmp_path / "custom_attention.py"
    path.write_text(ATTENTION_SOURCE.replace("KEYWORD", keyword))
    spec = importlib.util.spec_from_file_location(f"custom_attention_{keyword.split('=')[0]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = build("llama")
    model.model.layers[0].self_attn = module.Custom(model.config, 0)
    with pytest.raises(RecipeError, match=r"model\.layers\.0\.self_attn \(Custom\): .*" + why):
        select_packing(True, model.config, "cpu", (), model=model)


def test_the_capability_rule_reads_the_config_before_the_model_loads():
    """The meta-device build of the config finds the same mixers as the loaded model (no weights)."""
    from dflash_prep.target.packing import model_mixers

    config = tiny_llama_config()
    from_config = model_mixers(config)
    assert [m.path for m in from_config] == [f"model.layers.{i}.self_attn" for i in range(6)]
    assert all(m.kind == "attention" and m.why_not is None for m in from_config)


def test_the_attention_function_equals_attention_written_out_per_segment():
    """`varlen_attention` on one row of 5 segments (1-300 tokens) of random q/k/v, against attention written out
    in bench/packing_check.py (fp64 scores, per segment): GQA, windows of 1, 4, 16 and 128 keys, MLA head dims
    (192/128), head dim 256, softcap and sinks with a window. Each window case also shows that a window one key
    wider differs by far more than the error (the GPU check runs the same cases through torch's varlen_attn)."""
    from bench.packing_check import KERNEL_CASES, attention_kernel_check

    results = attention_kernel_check(torch.device("cpu"), "float32")
    assert set(results) == {case[0] for case in KERNEL_CASES}
    for name, res in results.items():
        assert res["ok"] and res["error"] <= TOLERANCE, (name, res)
        assert res["path"] == (["eager_per_segment"] if "softcap" in name or "sinks" in name
                               else ["sdpa_per_segment"]), (name, res)
        if "window" in name:
            assert res["window_one_wider_differs_by"] > 1e-2, (name, res)

"""`model.kernels`: which fused kernels apply to which architecture, eager on CPU, the patches scoped to the
instance, and the record in the summary and the manifest.

liger-kernel and flash-linear-attention need Triton and a GPU: here fakes stand in for them at the import boundary
(`sys.modules`). Each fake computes its piece by hand (no transformers code), so a batched capture through the
patched model must equal the eager model's states of each sample run alone, in fp32.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import subprocess
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, build, tiny_llama_config, tiny_qwen35_config

from dflash_prep.commands.extract import main as extract_main
from dflash_prep.commands.extract import run_extraction
from dflash_prep.plan.batches import SampleInfo, collate
from dflash_prep.recipe.schema import RecipeError, load_recipe
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target import kernels as kernels_module
from dflash_prep.target.kernels import (KernelChoice, apply_kernels, auto_kernels_on_gpu, fla_causal_conv1d_fn,
                                        select_kernels)
from dflash_prep.target.layers import find_decoder
from dflash_prep.target.model import drop_layers_after

CALLS: dict[str, list] = {}


def _count(name, value=None):
    CALLS.setdefault(name, []).append(value)


def _rms_norm_forward(offset):
    def forward(self, x):  # RMSNorm by hand, in fp32, weight (+ offset) applied after the cast back
        _count("rms_norm")
        x32 = x.float()
        eps = getattr(self, "variance_epsilon", None) or self.eps
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return ((offset + self.weight.float()) * normed).to(x.dtype) if offset else self.weight * normed.to(x.dtype)
    return forward


def _gate_up(self, x):
    """(gate, up) projections of an MLP: separate, or Phi-3's one `gate_up_proj` (gate first, then up)."""
    if hasattr(self, "gate_up_proj"):
        return self.gate_up_proj(x).chunk(2, dim=-1)
    return self.gate_proj(x), self.up_proj(x)


def _swiglu_forward(self, x):
    _count("swiglu")
    gate, up = _gate_up(self, x)
    return self.down_proj(gate * torch.sigmoid(gate) * up)


def _geglu_forward(self, x):  # gelu with the tanh approximation written out, times up
    _count("geglu")
    gate, up = _gate_up(self, x)
    gelu = 0.5 * gate * (1.0 + torch.tanh((2.0 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3)))
    return self.down_proj(gelu * up)


def fake_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    _count("rope")
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


def fake_fla_conv(x, weight, bias=None, activation=None, cu_seqlens=None, **kwargs):
    """fla's causal_conv1d contract: x [B, T, D] -> ([B, T, D], None); a depthwise causal conv by hand."""
    _count("conv", {"shape": tuple(x.shape), "contiguous": x.is_contiguous(), "activation": activation,
                    "cu_seqlens": cu_seqlens})
    assert x.shape[-1] == weight.shape[0]
    K = weight.shape[1]
    padded = F.pad(x, (0, 0, K - 1, 0))  # zeros before the first token
    y = sum(padded[:, k:k + x.shape[1]] * weight[:, k] for k in range(K))
    if bias is not None:
        y = y + bias
    return (y * torch.sigmoid(y) if activation in ("silu", "swish") else y), None


def fake_rms_norm_gated(x, g, weight, bias, activation="swish", eps=1e-6, **kwargs):
    """fla's rms_norm_gated contract: RMSNorm of x over its last dim, times weight, times activation(g); by hand."""
    _count("gated_norm", {"activation": activation, "eps": eps, "bias": bias})
    x32, g32 = x.double(), g.double()
    normed = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return (normed * g32 * torch.sigmoid(g32)).to(x.dtype)


def _fake_apply(modeling_name, rms_offset, rebinds, mlp="swiglu"):
    """liger's `apply_liger_kernel_to_*` contract: keyword flags, the MLP's flag named for what it computes
    (`swiglu`, or `geglu` for the Gemmas), the instance patched by hand-written forwards."""
    def patch(modeling, model, rope, rms_norm, fused_mlp):
        for name in rebinds:  # what liger does to the modeling module (reaches models built later)
            setattr(modeling, name, object())
        if rope:
            modeling.apply_rotary_pos_emb = fake_rope
        for module in find_decoder(model).modules():
            cls = type(module).__name__
            if rms_norm and cls.endswith("RMSNorm"):
                module.forward = types.MethodType(_rms_norm_forward(rms_offset), module)
            if fused_mlp and cls.endswith("MLP"):
                module.forward = types.MethodType(_geglu_forward if mlp == "geglu" else _swiglu_forward, module)

    def apply(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
              model=None):
        import importlib

        _count("apply", dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                             rms_norm=rms_norm, swiglu=swiglu, model=model))
        patch(importlib.import_module(modeling_name), model, rope, rms_norm, swiglu)

    def apply_geglu(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True,
                    model=None):
        import importlib

        _count("apply", dict(rope=rope, cross_entropy=cross_entropy, fused_linear_cross_entropy=fused_linear_cross_entropy,
                             rms_norm=rms_norm, geglu=geglu, model=model))
        patch(importlib.import_module(modeling_name), model, rope, rms_norm, geglu)
    return apply_geglu if mlp == "geglu" else apply


# The families added from liger's list (kernels.py): (family in bench/families.py, modeling module, liger's apply
# suffix, RMSNorm offset, the MLP's kernel or None, what liger rebinds in the modeling module)
LISTED_FAMILIES = {
    "qwen2": ("qwen2", "qwen2", 0.0, "swiglu", ["Qwen2RMSNorm", "Qwen2MLP"]),
    "mistral": ("mistral", "mistral", 0.0, "swiglu", ["MistralRMSNorm", "MistralMLP"]),
    "phi3": ("phi3", "phi3", 0.0, "swiglu", ["Phi3RMSNorm", "Phi3MLP"]),
    "gemma2": ("gemma2", "gemma2", 1.0, "geglu", ["Gemma2RMSNorm", "Gemma2MLP"]),
    "gemma3": ("gemma3", "gemma3_text", 1.0, "geglu", ["Gemma3RMSNorm", "Gemma3MLP"]),
    "mixtral": ("mixtral", "mixtral", 0.0, None, ["MixtralRMSNorm", "MixtralExperts"]),
}


def _module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def fake_libraries(monkeypatch):
    """liger_kernel and fla.modules.causal_conv1d as fakes (transformers' modeling modules imported first, so the
    fake fla is never taken for the real one by transformers' own import-time checks)."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen3_5.modeling_qwen3_5  # noqa: F401
    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    listed = {}
    for module_name, apply_suffix, offset, mlp, rebinds in LISTED_FAMILIES.values():
        modeling_name = f"transformers.models.{module_name}.modeling_{module_name}"
        importlib.import_module(modeling_name)
        listed[f"apply_liger_kernel_to_{apply_suffix}"] = _fake_apply(modeling_name, offset, rebinds, mlp or "swiglu")
    CALLS.clear()
    liger_transformers = _module(
        "liger_kernel.transformers",
        apply_liger_kernel_to_llama=_fake_apply("transformers.models.llama.modeling_llama", 0.0,
                                                ["LlamaRMSNorm", "LlamaMLP"]),
        apply_liger_kernel_to_qwen3_5=_fake_apply("transformers.models.qwen3_5.modeling_qwen3_5", 1.0,
                                                  ["Qwen3_5RMSNorm", "Qwen3_5MLP"]),
        apply_liger_kernel_to_qwen3_5_moe=_fake_apply("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", 1.0,
                                                      ["Qwen3_5MoeRMSNorm", "Qwen3_5MoeExperts"]),
        apply_liger_kernel_to_qwen3_moe=_fake_apply("transformers.models.qwen3_moe.modeling_qwen3_moe", 0.0,
                                                    ["Qwen3MoeRMSNorm", "Qwen3MoeExperts", "apply_rotary_pos_emb"]),
        **listed)
    fakes = {"liger_kernel": _module("liger_kernel"), "liger_kernel.transformers": liger_transformers,
             "liger_kernel.transformers.rope": _module("liger_kernel.transformers.rope", liger_rotary_pos_emb=fake_rope),
             "fla": _module("fla"), "fla.modules": _module("fla.modules"),
             "fla.modules.causal_conv1d": _module("fla.modules.causal_conv1d", causal_conv1d=fake_fla_conv),
             "fla.modules.norm": _module("fla.modules.norm"),
             "fla.modules.norm.fused_norm_gate": _module("fla.modules.norm.fused_norm_gate",
                                                         rms_norm_gated=fake_rms_norm_gated)}
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield CALLS


# ------------------------------------------------------------------------------------------------ selection
def test_auto_is_eager_on_cpu_for_every_architecture():
    for config in (tiny_llama_config(), tiny_qwen35_config()):
        choice = select_kernels("auto", config, "cpu")
        assert choice.names == () and "no CUDA device" in choice.reason
    assert select_kernels("eager", tiny_llama_config(), "cuda").names == ()


def test_auto_on_cuda_picks_the_architectures_kernels(fake_libraries):
    assert select_kernels("auto", tiny_llama_config(), "cuda").names == ("liger_rms_norm", "liger_swiglu", "liger_rope")
    qwen = select_kernels("auto", tiny_qwen35_config(), "cuda")
    assert qwen.names == ("liger_rms_norm", "liger_swiglu", "fla_conv", "fla_gated_norm") and qwen.reason is None
    assert set(qwen.record()["libraries"]) == {"liger-kernel", "flash-linear-attention"}
    gelu = tiny_llama_config()
    gelu.hidden_act = "gelu"
    assert select_kernels("auto", gelu, "cuda").names == ("liger_rms_norm", "liger_rope")
    from bench.families import family_config

    other = select_kernels("auto", family_config("gpt_oss", "tiny"), "cuda")
    assert other.names == () and "no fused kernels known for model type 'gpt_oss'" in other.reason
    assert fake_libraries == {}, "selecting must not import or call the kernel libraries"


def test_qwen3_gets_liger_kernels_under_auto_and_when_listed(fake_libraries):
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1024)
    auto = select_kernels("auto", config, "cuda")  # measured exact and faster on an H200 (kernels.py)
    assert auto.names == ("liger_rms_norm", "liger_swiglu", "liger_rope") and auto.reason is None, auto
    listed = select_kernels(["liger_rms_norm", "liger_swiglu", "liger_rope"], config, "cuda")
    assert listed.names == ("liger_rms_norm", "liger_swiglu", "liger_rope")
    with pytest.raises(RecipeError, match="do not apply"):
        select_kernels(["fla_conv"], config, "cuda")


def test_the_hybrid_moe_gets_the_gated_deltanet_kernels_under_auto_never_a_swiglu_over_its_experts(fake_libraries):
    from bench.families import family_config

    config = family_config("qwen3_5_moe", "tiny")
    auto = select_kernels("auto", config, "cuda")  # measured exact and faster on an H200 (kernels.py)
    assert auto.names == ("liger_rms_norm", "fla_conv", "fla_gated_norm") and auto.reason is None, auto
    with pytest.raises(RecipeError, match="do not apply"):  # liger's swiglu there swaps the routed experts' class
        select_kernels(["liger_swiglu"], config, "cuda")
    names = ("liger_rms_norm", "fla_conv", "fla_gated_norm")
    assert select_kernels(list(names), config, "cuda").names == names
    modeling = sys.modules["transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"]
    module_before = dict(vars(modeling))
    eager, fused = build(config), build(config)
    layer_ids = [0, 1, 3]
    assert drop_layers_after(fused, layer_ids[-1]) == 4  # as the extraction: truncate, then the kernels
    apply_kernels(fused, KernelChoice(names, names, config.model_type))
    (applied,) = fake_libraries["apply"]
    assert applied["model"] is fused and applied["swiglu"] is False and applied["rms_norm"] is True
    assert {k: v for k, v in vars(modeling).items() if v is not module_before.get(k)} == {}
    calls = _capture_equals_alone(fused, eager, _samples([29, 6, 17]), layer_ids, 32)
    gated_deltanet = sum(t == "linear_attention" for t in config.layer_types[:4])
    assert calls["conv"] == gated_deltanet and calls["gated_norm"] == gated_deltanet
    assert "swiglu" not in calls


def test_the_qwen3_moe_gets_rms_norm_and_rope_under_auto_and_when_listed(fake_libraries):
    """Qwen3-30B-A3B's family: liger's RMSNorm and RoPE apply under `auto` (measured exact and faster on an H200)
    and when listed (RoPE scoped to this model's attention, never liger's module-level rebind), no SwiGLU over its
    routed experts; the states of a padded batch through them equal each sample alone through eager transformers."""
    from bench.families import family_config

    config = family_config("qwen3_moe", "tiny")
    auto = select_kernels("auto", config, "cuda")
    assert auto.names == ("liger_rms_norm", "liger_rope"), auto
    assert auto_kernels_on_gpu(config) == ("liger_rms_norm", "liger_rope")  # what `plan` assumes of the GPU
    with pytest.raises(RecipeError, match="do not apply"):  # liger's swiglu there swaps the routed experts' class
        select_kernels(["liger_swiglu"], config, "cuda")
    names = ("liger_rms_norm", "liger_rope")
    assert select_kernels(list(names), config, "cuda").names == names
    modeling = sys.modules["transformers.models.qwen3_moe.modeling_qwen3_moe"]
    module_before = dict(vars(modeling))
    eager, fused = build(config), build(config)
    layer_ids = [0, 2]
    drop_layers_after(fused, layer_ids[-1])
    apply_kernels(fused, KernelChoice(names, names, config.model_type))
    (applied,) = fake_libraries["apply"]
    assert applied["model"] is fused and applied["swiglu"] is False and applied["rms_norm"] is True
    assert applied["rope"] is False and applied["fused_linear_cross_entropy"] is False
    assert {k: v for k, v in vars(modeling).items() if v is not module_before.get(k)} == {}
    samples = _samples([23, 9, 14])
    calls = _capture_equals_alone(fused, eager, samples, layer_ids, 32)
    assert calls["rope"] == layer_ids[-1] + 1 and calls["rms_norm"] > 0 and "swiglu" not in calls
    CALLS.clear()
    _alone_states(eager, samples[0])  # another model of the family in the same process: transformers' own
    assert "rope" not in CALLS and "rms_norm" not in CALLS


@pytest.mark.parametrize("family", sorted(LISTED_FAMILIES))
def test_a_family_from_ligers_list_is_eager_under_auto_and_its_listed_kernels_keep_each_sample_alone(
        fake_libraries, family):
    """Qwen2, Mistral, Phi-3, Gemma2, Gemma3, Mixtral: not measured on a GPU yet, so eager under `auto` (and in
    `plan`); listed, liger's patch of the family gets the MLP flag its function takes (`geglu` for the Gemmas, none
    for Mixtral's routed experts), RoPE is scoped to this model, the modeling module is left as transformers made
    it, and a padded batch through the patched model gives each sample's eager states alone."""
    from bench.families import family_config

    module_name, _, _, mlp, _ = LISTED_FAMILIES[family]
    config = family_config(family, "tiny")
    auto = select_kernels("auto", config, "cuda")
    assert auto.names == () and "not measured on a GPU yet: list them to use them" in auto.reason, auto
    assert auto_kernels_on_gpu(config) == ()
    names = ("liger_rms_norm",) + ((f"liger_{mlp}",) if mlp else ()) + ("liger_rope",)
    assert select_kernels(list(names), config, "cuda").names == names
    wrong_mlp = "liger_swiglu" if mlp != "swiglu" else "liger_geglu"
    with pytest.raises(RecipeError, match="do not apply"):
        select_kernels([wrong_mlp], config, "cuda")
    modeling = sys.modules[f"transformers.models.{module_name}.modeling_{module_name}"]
    module_before = dict(vars(modeling))
    attention = "eager" if family == "gemma2" else "sdpa"  # Gemma2's logit softcap has no SDPA form
    eager, fused = build(config, attn_implementation=attention), build(config, attn_implementation=attention)
    layer_ids = [0, 2]
    drop_layers_after(fused, layer_ids[-1])
    apply_kernels(fused, KernelChoice(names, names, config.get_text_config().model_type))
    (applied,) = fake_libraries["apply"]
    assert applied["model"] is fused and applied["rope"] is False and applied["rms_norm"] is True
    assert applied["fused_linear_cross_entropy"] is False and applied["cross_entropy"] is False
    assert applied.get(mlp or "swiglu") is bool(mlp)
    assert {k: v for k, v in vars(modeling).items() if v is not module_before.get(k)} == {}
    samples = _samples([37, 5, 20])
    calls = _capture_equals_alone(fused, eager, samples, layer_ids, 48, family)
    layers_run = layer_ids[-1] + 1
    assert calls["rope"] == layers_run and calls["rms_norm"] >= 2 * layers_run
    assert calls.get(mlp, 0) == (layers_run if mlp else 0)
    CALLS.clear()
    _alone_states(eager, samples[0])
    _alone_states(build(config, attn_implementation=attention), samples[0])  # built after the patch: transformers'
    assert CALLS == {}, "the eager models must not run the fused kernels"
    # The MLP's kernel not listed: its flag is passed as False (liger's functions default every flag to True)
    norm_only = build(config, attn_implementation=attention)
    apply_kernels(norm_only, KernelChoice(("liger_rms_norm",), ("liger_rms_norm",), config.get_text_config().model_type))
    applied = fake_libraries["apply"][-1]
    assert applied["model"] is norm_only and applied.get(mlp or "swiglu", False) is False and applied["rope"] is False
    assert set(_capture_equals_alone(norm_only, eager, samples, layer_ids, 48, family)) == {"rms_norm"}


def test_rope_is_left_out_of_a_partial_rotary_and_a_multimodal_wrapper_gets_no_text_patch(fake_libraries):
    """liger's rope rotates the whole head: a Phi-3 config with `partial_rotary_factor` 0.5 (Phi-4-mini's 0.75 is
    the real case) keeps RMSNorm and SwiGLU, and listing RoPE is refused; a Gemma3 multimodal config (liger's
    text patch raises TypeError on its class) gets no kernels."""
    from transformers import Gemma3Config

    from bench.families import family_config

    config = family_config("phi3", "tiny")
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    assert select_kernels(["liger_rms_norm", "liger_swiglu"], config, "cuda").names == (
        "liger_rms_norm", "liger_swiglu")
    with pytest.raises(RecipeError, match=r"\['liger_rope'\] do not apply to model type 'phi3'"):
        select_kernels(["liger_rope"], config, "cuda")
    wrapper = select_kernels("auto", Gemma3Config(), "cuda")
    assert wrapper.names == () and "model type 'gemma3'" in wrapper.reason


def test_auto_leaves_an_architecture_not_yet_measured_eager_and_applies_its_listed_kernels(fake_libraries,
                                                                                          monkeypatch):
    """`AUTO_NOT_MEASURED`: an architecture whose kernels are not yet measured on a GPU gets none under `auto` (the
    log says why), and `plan` assumes none; a list still applies them."""
    from bench.families import family_config

    monkeypatch.setattr(kernels_module, "AUTO_NOT_MEASURED", frozenset({"qwen3_moe"}))
    config = family_config("qwen3_moe", "tiny")
    auto = select_kernels("auto", config, "cuda")
    assert auto.names == () and "not measured on a GPU yet: list them to use them" in auto.reason, auto
    assert auto_kernels_on_gpu(config) == ()
    assert select_kernels(["liger_rope"], config, "cuda").names == ("liger_rope",)


def test_auto_on_a_tensor_parallel_replica_is_eager_and_a_list_is_applied_as_asked(fake_libraries):
    tp = select_kernels("auto", tiny_llama_config(), "cuda", tensor_parallel=True)
    assert tp.names == () and tp.reason == "tensor parallel: not measured on sharded layers: eager"
    assert select_kernels(["liger_rms_norm"], tiny_llama_config(), "cuda", tensor_parallel=True).names == (
        "liger_rms_norm",)


def test_auto_on_cuda_without_the_libraries_runs_eager_and_says_so():
    choice = select_kernels("auto", tiny_qwen35_config(), "cuda")  # neither library is installed here
    assert choice.names == ()
    assert choice.reason == "not installed: flash-linear-attention, liger-kernel (pip install -e '.[gpu]')"


@pytest.mark.parametrize("requested, device, message", [
    (["liger_rope"], "cuda", "['liger_rope'] do not apply to model type 'qwen3_5_text'"),
    (["fla_conv"], "cpu", "fused kernels need a CUDA device, this run is on cpu"),
])
def test_a_named_list_that_cannot_be_honoured_is_a_recipe_error(fake_libraries, requested, device, message):
    with pytest.raises(RecipeError, match="recipe key `model.kernels`") as e:
        select_kernels(requested, tiny_qwen35_config(), device)
    assert message in str(e.value)


@pytest.mark.parametrize("value", ["[liger_conv]", "[]", "[fla_conv, fla_conv]", "fused", "1"])
def test_recipe_rejects_bad_kernel_values_naming_the_key(value):
    with pytest.raises(RecipeError, match=r"recipe key `model.kernels`"):
        load_recipe(None, [f"model.kernels={value}"])


def test_kernels_are_not_part_of_the_recipe_fingerprint():
    auto = load_recipe(None)
    assert auto.model.kernels == "auto"
    listed = load_recipe(None, ["model.kernels=[liger_rms_norm, fla_conv]"])
    assert listed.model.kernels == ["liger_rms_norm", "fla_conv"]
    assert auto.fingerprint() == listed.fingerprint() == load_recipe(None, ["model.kernels=eager"]).fingerprint()


@pytest.mark.slow
def test_importing_the_extraction_imports_no_kernel_library():
    """Our modules import neither liger-kernel nor flash-linear-attention, and no Triton module beyond what torch and
    transformers import by themselves (PyPI's CUDA build of torch imports triton at `import torch`, on a CPU machine
    too: that one is theirs, not ours)."""
    code = ("import sys, torch, transformers, transformers.modeling_utils; "
            "theirs = {m for m in sys.modules if m.split('.')[0] == 'triton'}; "
            "import dflash_prep.commands.extract, dflash_prep.target.kernels, dflash_prep.commands.verify; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('liger_kernel', 'fla') "
            "or (m.split('.')[0] == 'triton' and m not in theirs)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------- application
def _samples(lengths, seed=0):
    g = np.random.default_rng(seed)
    return [SampleInfo(f"{i:010d}", i, None, g.integers(1, 1024, n).astype(np.int32), np.ones(n, np.uint8))
            for i, n in enumerate(lengths)]


def _alone_states(model, sample):
    with torch.inference_mode():
        return find_decoder(model)(input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None],
                                   use_cache=False, output_hidden_states=True).hidden_states


def _capture_equals_alone(fused, eager, samples, layer_ids, pad_to, label=""):
    """`samples` as one right-padded batch (with its padding mask) through `fused`'s capture hooks: each sample's
    states at each after-layer id equal its run alone through `eager` within 1e-5 (float32). Returns the fake
    kernels' calls during the capture, by name."""
    batch = collate(samples, pad_to, 0)
    CALLS.clear()
    with LayerCapture(fused, layer_ids, storage_dtype=torch.float32) as cap:
        out = cap.run(batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)
    calls = {k: len(v) for k, v in CALLS.items()}
    H, start = out.hidden_states_NK.shape[1] // len(layer_ids), 0
    for sample in samples:
        n = len(sample.input_ids)
        ref = _alone_states(eager, sample)
        for slot, layer in enumerate(layer_ids):
            got = out.hidden_states_NK[start:start + n, slot * H:(slot + 1) * H]
            assert (got - ref[layer + 1][0]).abs().max().item() <= 1e-5, f"{label} layer {layer}"
        start += n
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_fused_model_captures_what_the_eager_model_gives_each_sample_alone(fake_libraries, arch):
    config = tiny_llama_config() if arch == "llama" else tiny_qwen35_config()
    modeling = sys.modules[f"transformers.models.{arch}.modeling_{arch}"]
    module_before = dict(vars(modeling))
    eager, fused = build(config), build(config)
    names = ("liger_rms_norm", "liger_swiglu") + (("liger_rope",) if arch == "llama" else ("fla_conv", "fla_gated_norm"))
    layer_ids = [0, 2, 3]
    assert drop_layers_after(fused, layer_ids[-1]) == 4  # as the extraction: truncate, then the kernels
    apply_kernels(fused, KernelChoice(names, names, config.model_type))

    (applied,) = fake_libraries["apply"]
    assert applied["model"] is fused and not applied["cross_entropy"] and not applied["fused_linear_cross_entropy"]
    assert applied["rope"] is False, "liger's rope patch is module-global: scoped to the instance instead"
    assert {k: v for k, v in vars(modeling).items() if v is not module_before.get(k)} == {}, \
        "the modeling module must be left as transformers made it"
    samples = _samples([37, 5, 20])
    fused_calls = _capture_equals_alone(fused, eager, samples, layer_ids, 48, arch)
    attention_layers = sum(t == "full_attention" for t in getattr(config, "layer_types", [])[:4])
    assert fused_calls["rms_norm"] == 2 * 4 + 2 * attention_layers  # + q/k norms; no final norm: the forward stopped
    assert fused_calls["swiglu"] == 4
    if arch == "llama":
        assert fused_calls["rope"] == 4
    else:
        conv = CALLS["conv"]
        assert len(conv) == 3 and all(c["contiguous"] and c["activation"] == "silu" for c in conv)
        assert conv[0]["shape"][:2] == (3, 48), "fla's conv takes [B, T, D]"
        gated = CALLS["gated_norm"]  # one per Gated DeltaNet layer, with the module's own eps and activation
        assert len(gated) == 3 and all(c["activation"] == "silu" and c["eps"] == config.rms_norm_eps
                                       and c["bias"] is None for c in gated)
    CALLS.clear()
    _alone_states(eager, samples[0])
    _alone_states(build(config), samples[0])  # built after the patch: eager too
    assert CALLS == {}, "the eager models must not run the fused kernels"


def test_fla_conv_gets_packed_boundaries_as_cu_seqlens():
    CALLS.clear()
    conv = fla_causal_conv1d_fn(fake_fla_conv)
    x_BDT = torch.randn(1, 8, 10)
    weight = torch.randn(8, 4)
    cu = torch.tensor([0, 4, 10])
    y = conv(x_BDT, weight, None, "silu", cu_seq_lens_q=cu)
    assert y.shape == (1, 8, 10) and CALLS["conv"][0]["cu_seqlens"] is cu
    reference = F.silu(F.conv1d(x_BDT, weight.unsqueeze(1), padding=3, groups=8)[..., :10])
    torch.testing.assert_close(conv(x_BDT, weight, None, "silu"), reference)


# ------------------------------------------------------------------------------------------- the run's record
def test_cpu_run_records_eager_and_a_resume_with_another_set_is_recorded(tmp_path):
    out = tmp_path / "out"
    base = [f"output.dir={out}", "data.max_samples=24", "batching.num_workers=0"]
    first = run_extraction(load_recipe(None, base))
    assert first["kernels"] == {"requested": "auto", "applied": [], "libraries": {},
                                "reason": "no CUDA device (cpu): eager"}
    # An interrupted run: its last shard was never committed (no index line, no manifest yet).
    index = out / "index" / "rank-00000.jsonl"
    lines = index.read_text().splitlines(keepends=True)
    assert len(lines) > 1
    index.write_text("".join(lines[:-1]))
    (out / "manifest.json").unlink()
    second = run_extraction(load_recipe(None, base + ["model.kernels=eager"]))  # allowed: not the job's identity
    assert second["kernels"]["requested"] == "eager" and second["num_samples_this_run"] > 0
    third = run_extraction(load_recipe(None, base))  # finished: the model is not loaded, nothing rewritten
    assert third == second == json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kernels"]["requested"] == "eager"
    assert manifest["kernels_history"] == [{"applied": [], "libraries": {}}]
    runs = [json.loads(line) for line in (out / "kernels.jsonl").read_text().splitlines()]
    assert [r["requested"] for r in runs] == ["auto", "eager"]
    assert json.loads((out / "index" / "rank-00000.done.json").read_text())["kernels"] == []


def test_named_kernels_on_cpu_stop_with_one_line_and_exit_code_2(tmp_path, capsys):
    code = extract_main(["--set", f"output.dir={tmp_path / 'out'}", "--set", "model.kernels=[fla_conv]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith("error: recipe key `model.kernels` = ['fla_conv']: fused kernels need a CUDA device")
    assert not (tmp_path / "out" / "run_state.json").exists(), "refused before the output was touched"


MODELING_WITH_A_HELPER = '''
import torch
from torch import nn

def conv_fn(x):
    return x + 1

def conv_forward(x):  # transformers 5.25's shape: the layer calls a helper, the helper calls the kernel's function
    return conv_fn(x) * 2

def wrap(func):  # what the `kernels` library makes of a decorated function: a module calling it
    class Func(nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)
    return Func()

wrapped_conv_forward = wrap(conv_forward)

class Direct(nn.Module):
    def forward(self, x):
        return conv_fn(x)

class ThroughHelper(nn.Module):
    def forward(self, x):
        return conv_forward(x)

class ThroughWrapped(nn.Module):
    def forward(self, x):
        return wrapped_conv_forward(x)

class Unrelated(nn.Module):
    def forward(self, x):
        return x
'''


def test_a_kernel_reaches_the_function_called_through_a_helper_of_the_modeling_module():
    """A scoped kernel finds the function it replaces in the layer's forward, in a function of the same modeling
    module that the forward calls, or in one wrapped as a module by the hub-kernel decorator; it then stands in for
    it during that forward only. Expected values are computed by hand: conv_fn(x) = x + 1, the kernel's x + 100."""
    from dflash_prep.target.kernels import _scope_global_in_forwards, calls_global

    modeling = types.ModuleType("fake_modeling_with_a_helper")
    sys.modules[modeling.__name__] = modeling
    try:
        exec(compile(MODELING_WITH_A_HELPER, modeling.__name__, "exec"), vars(modeling))
        for cls in ("Direct", "ThroughHelper", "ThroughWrapped"):
            assert calls_global(getattr(modeling, cls).forward, modeling, "conv_fn"), cls
        assert not calls_global(modeling.Unrelated.forward, modeling, "conv_fn")
        model = torch.nn.ModuleList([modeling.Direct(), modeling.ThroughHelper(), modeling.ThroughWrapped(),
                                     modeling.Unrelated()])
        assert _scope_global_in_forwards(model, modeling, "conv_fn", lambda x: x + 100) == 3
        x = torch.tensor([1.0])
        assert [m(x).item() for m in model] == [101.0, 202.0, 202.0, 1.0]
        assert modeling.conv_fn(x).item() == 2.0  # outside those forwards the module's own function
    finally:
        del sys.modules[modeling.__name__]


def test_auto_leaves_out_a_kernel_whose_hook_this_transformers_moved_and_a_list_is_refused(monkeypatch):
    """A modeling module whose Gated DeltaNet no longer calls `causal_conv1d_fn` (a transformers release that moved
    it) and has no gated RMSNorm: `auto` on CUDA (the libraries taken as installed) applies neither fla kernel and
    says why, before any weight loads; listing them is a RecipeError naming the key. The real qwen3_5 module of the
    installed transformers gives both kernels their hook."""
    import dflash_prep.target.kernels as K

    modeling = types.ModuleType("fake_modeling_moved")
    sys.modules[modeling.__name__] = modeling
    try:
        exec(compile("from torch import nn\nclass GatedDeltaNet(nn.Module):\n"
                     "    def forward(self, x):\n        return x\n", modeling.__name__, "exec"), vars(modeling))
        monkeypatch.setitem(K.ARCHITECTURES, "moved_hybrid", (modeling.__name__, ("fla_conv", "fla_gated_norm"), ""))
        monkeypatch.setattr(K, "_version", lambda library: "0.0-test")
        config = types.SimpleNamespace(model_type="moved_hybrid", hidden_act="silu")
        choice = select_kernels("auto", config, "cuda")
        assert choice.names == ()
        assert "fla_conv left out: no layer of" in choice.reason and "calls `causal_conv1d_fn`" in choice.reason
        assert "fla_gated_norm left out:" in choice.reason and "has no gated RMSNorm class" in choice.reason
        with pytest.raises(RecipeError, match="`model.kernels`"):
            select_kernels(["fla_conv"], config, "cuda")
        assert K.hook_missing("fla_conv", "qwen3_5") is None and K.hook_missing("fla_gated_norm", "qwen3_5") is None
        assert {"fla_conv", "fla_gated_norm"} <= set(select_kernels("auto", tiny_qwen35_config(), "cuda").names)
    finally:
        del sys.modules[modeling.__name__]

"""Block-scaled FP8 checkpoints (dflash_prep/target/fp8_weights.py) on the CPU: a tiny checkpoint in the
DeepSeek-V3 / Qwen3-FP8 format, built here (random fp32 weights quantized per 128x128 block with this file's own
code), loads and runs dequantized, equal to a model dequantized by hand; the FP8 activation rounding (emulated
here) stays within the tolerance verify allows; another quantization format is refused with one line (exit 2)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_prep.recipe.schema import ModelSection, RecipeError
from dflash_prep.target.fp8_weights import FP8_COMPUTE_TOLERANCE
from dflash_prep.target.model import load_config, load_model

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "dflash_prep" / "demo" / "tiny-demo" / "tokenizer"
E4M3_MAX = 448.0
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
# a Llama whose projections are whole 128x128 blocks (hidden 256, heads of 128, MLP 384) and one of partial blocks
# would not load in transformers' dequantization either (it derives the block from the grid): dims are multiples
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
         "intermediate_size": 384, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
         "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "hidden_act": "silu",
         "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale_inv = amax / 448, q = e4m3(w / scale_inv) (dims multiples of 128 here)."""
    N, K = w.shape
    blocks = w.float().reshape(N // 128, 128, K // 128, 128)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, K), scale_inv


def _dequantize_by_hand(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    N, K = q.shape
    return (q.float().reshape(N // 128, 128, K // 128, 128) * scale_inv[:, None, :, None]).reshape(N, K)


def _is_quantized(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny block-FP8 checkpoint: random fp32 Llama weights, every decoder projection quantized per block."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = tmp_path_factory.mktemp("fp8-ckpt")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
    model.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    quantized = {}
    for name, tensor in state.items():
        if _is_quantized(name):
            q, scale_inv = _quantize_blocks(tensor)
            quantized[name], quantized[name.replace(".weight", ".weight_scale_inv")] = q, scale_inv
        else:
            quantized[name] = tensor
    save_file(quantized, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = FP8_CONFIG
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _reference(folder: Path):
    """The same model in fp32 with every quantized weight dequantized by hand (no quantization_config)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    state = load_file(folder / "model.safetensors")
    weights = {n: (_dequantize_by_hand(t, state[n.replace(".weight", ".weight_scale_inv")]) if _is_quantized(n)
                   else t) for n, t in state.items() if not n.endswith("_scale_inv")}
    model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


def _states(model, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.model(input_ids=ids, output_hidden_states=True).hidden_states)


def test_fp8_checkpoint_runs_dequantized_on_cpu_and_says_so(checkpoint, caplog):
    section = ModelSection(name_or_path=str(checkpoint), tokenizer=str(TOKENIZER), dtype="float32")
    config = load_config(section)
    with caplog.at_level(logging.INFO, logger="dflash_prep"):
        model = load_model(section, config, torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage()]
    assert len(said) == 1 and "DEQUANTIZED" in said[0], said
    ids = torch.randint(1, LLAMA["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    ref = _reference(checkpoint)
    for i, (got, want) in enumerate(zip(_states(model, ids), _states(ref, ids), strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"hidden state {i}")
    # the hand-dequantized weights differ from the fp32 originals (the check would pass on an unquantized model
    # only if quantizing did nothing): e4m3 rounding of a random weight is visible
    original = load_file(checkpoint / "model.safetensors")["model.layers.0.mlp.up_proj.weight"]
    assert original.dtype == torch.float8_e4m3fn


def _emulated_fp8_activations(model) -> list:
    """Forward pre-hooks on every decoder projection: x -> its e4m3 round trip per token and 128 block (what the
    GPU's scaled_mm path feeds the GEMM), written here independently of the code under test."""
    def hook(_module, args):
        x = args[0]
        blocks = x.float().unflatten(-1, (-1, 128))
        s = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
        q = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
        return (q.flatten(-2).to(x.dtype),)

    return [m.register_forward_pre_hook(hook) for n, m in model.named_modules()
            if n.startswith("model.layers.") and n.endswith("_proj")]


def test_fp8_activation_rounding_within_verify_tolerance(checkpoint):
    ref = _reference(checkpoint)
    ids = torch.randint(1, LLAMA["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(2))
    want = _states(ref, ids)
    hooks = _emulated_fp8_activations(ref)
    got = _states(ref, ids)
    for h in hooks:
        h.remove()
    errors = [float((g - w).abs().max() / w.abs().max()) for g, w in zip(got[1:], want[1:], strict=True)]
    print("FP8 activations vs dequantized reference, relative error per layer:", [f"{e:.4f}" for e in errors])
    assert 0.01 < max(errors) < FP8_COMPUTE_TOLERANCE, errors  # rounding happened, within the allowance


@pytest.mark.parametrize("quant", [{"quant_method": "awq", "bits": 4},
                                   {**FP8_CONFIG, "weight_block_size": [64, 64]},
                                   {**FP8_CONFIG, "activation_scheme": "static"}])
def test_unknown_quantization_format_refused(checkpoint, tmp_path, quant):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    section = ModelSection(name_or_path=str(folder), tokenizer=str(TOKENIZER), dtype="float32")
    with pytest.raises(RecipeError, match="not a format dflash-prep runs"):
        load_config(section)


def test_unknown_quantization_format_cli_exit_2(checkpoint, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in checkpoint.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.extract", "--set", "model.config=null",
                           "--set", f"model.name_or_path={folder}", "--set", f"model.tokenizer={TOKENIZER}",
                           "--set", f"output.dir={tmp_path / 'out'}", "--set", "data.max_samples=4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "quantization_config" in line]
    assert len(errors) == 1 and "gptq" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_fp8_checkpoint_extracts_and_verifies_on_cpu(checkpoint, tmp_path):
    """What a user runs: `extract` of the FP8 checkpoint (dequantized on the CPU, said once in the log), then
    `verify` of the output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.extract", "--set", "model.config=null",
                           "--set", f"model.name_or_path={checkpoint}", "--set", f"model.tokenizer={TOKENIZER}",
                           "--set", f"output.dir={out}", "--set", "data.max_samples=12", "--set",
                           "layers.num_layers=1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "FP8 checkpoint" in line]
    assert len(said) == 1 and "DEQUANTIZED" in said[0], said
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(out), "--num-samples",
                           "4", "--seed", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "verify: OK" in proc.stdout + proc.stderr
    # Either FP8 reference on a CPU output: it did not run as FP8 (dequantized on load), so neither applies.
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(out), "--num-samples",
                           "2", "--fp8-reference", "dequantized", "--json", "--skip-hash"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["fp8_reference"] is None
    # The same output as a CUDA run writes it (its rank reports carry a GPU memory peak: made on a GPU, as FP8),
    # verified here, where no FP8 GEMM runs: the default reference falls back to the dequantized checkpoint, with the
    # FP8 allowance, and says so.
    for done in (out / "index").glob("rank-*.done.json"):
        done.write_text(json.dumps({**json.loads(done.read_text()), "peak_gpu_memory_bytes": 1}))
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(out), "--num-samples",
                           "2", "--json", "--skip-hash"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout)
    assert report["fp8_reference"] == "dequantized" and report["tolerance"] > FP8_COMPUTE_TOLERANCE


def test_block_fp8_linear_keeps_packed_rows_apart():
    """The GPU module that replaces each FP8 linear layer is position-wise: a model holding it still packs (the
    packing check refused it on the GPU, so every FP8 extraction there would have failed at start-up)."""
    from torch import nn

    from dflash_prep.target.fp8_weights import BlockFP8Linear
    from dflash_prep.target.mixers import token_mixers

    weight = torch.zeros(256, 128).to(torch.float8_e4m3fn)
    layer = BlockFP8Linear(weight, torch.ones(2, 1), None)
    model = nn.Sequential(nn.Linear(128, 128), layer)
    assert token_mixers(model) == []

    class Unknown(nn.Module):  # a module of ours that does not say it is per-token is still refused
        def forward(self, x):
            return x

    assert [m.why_not is not None for m in token_mixers(nn.Sequential(Unknown()))] == [True]


def test_a_block_fp8_layer_holds_whole_blocks_without_a_copy_and_pads_the_rest_with_zeros():
    """Weights of whole 128-blocks are the checkpoint's tensor itself (the conversion of a 27B holds no second copy
    of its weights); others are copied into a zero-padded one, the weight bytes unchanged."""
    from dflash_prep.target.fp8_weights import BlockFP8Linear

    aligned = torch.randn(256, 384).to(torch.float8_e4m3fn)
    layer = BlockFP8Linear(aligned, torch.rand(2, 3), None)
    assert layer.weight.data_ptr() == aligned.data_ptr() and layer.weight.shape == (256, 384)
    ragged = torch.randn(300, 200).to(torch.float8_e4m3fn)
    layer = BlockFP8Linear(ragged, torch.rand(3, 2), None)
    assert layer.weight.data_ptr() != ragged.data_ptr() and layer.weight.shape == (384, 256)
    held = layer.weight.view(torch.uint8)
    assert torch.equal(held[:300, :200], ragged.view(torch.uint8))
    assert held[300:].count_nonzero() == 0 and held[:, 200:].count_nonzero() == 0


def test_a_block_fp8_layer_counts_its_weights_as_the_linear_layer_it_replaces():
    """The FLOPs per token (the benchmark's MFU, plan's figures) count the FP8 layer's weights, held as buffers,
    unpadded (300 x 200 here: blocks of 128 pad it to 384 x 256), as the bf16 twin's parameters."""
    from torch import nn

    from dflash_prep.target.fp8_weights import BlockFP8Linear
    from dflash_prep.target.model import active_params

    layer = BlockFP8Linear(torch.zeros(300, 200).to(torch.float8_e4m3fn), torch.ones(3, 2), torch.zeros(300))
    twin = nn.Linear(200, 300)
    for top_k in (None, 2):  # dense count, and the active-parameter walk an MoE count takes
        assert active_params(nn.Sequential(nn.LayerNorm(200), layer), top_k) == 300 * 200 + 300 + 2 * 200
        assert active_params(nn.Sequential(nn.LayerNorm(200), twin), top_k) == 300 * 200 + 300 + 2 * 200

    class Block(nn.Module):  # routed experts as a ModuleList of FP8 layers: a token runs top_k of the 4
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(BlockFP8Linear(torch.zeros(300, 200).to(torch.float8_e4m3fn),
                                                        torch.ones(3, 2), None) for _ in range(4))

    assert active_params(Block(), 2) == 2 * 300 * 200 and active_params(Block(), None) == 4 * 300 * 200
    tied = nn.Sequential(nn.Linear(200, 200, bias=False), nn.Linear(200, 200, bias=False))
    tied[1].weight = tied[0].weight  # one weight run twice: held once
    assert active_params(tied, None) == 200 * 200


def test_the_fp8_emulation_bench_runs_and_rounds(tmp_path):
    """bench/fp8_emulation.py on a small width: both stacks report one error per layer, nonzero (the rounding
    happened) and far from O(1) (the hooks round, not replace)."""
    from bench.fp8_emulation import main

    out = tmp_path / "fp8.json"
    assert main([str(out), "--widths", "256", "--layers", "4", "--tokens", "32"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["kind"] for r in runs] == ["llama", "hybrid"]
    for run in runs:
        assert len(run["max_relative"]) == 4 and run["rounded_linear_layers"] > 0
        assert all(0.005 < e < 0.5 for e in run["max_relative"]), run


@pytest.mark.parametrize("m,k,m_pad,k_pad", [(5, 256, 16, 256), (16, 200, 16, 256), (0, 128, 16, 128)])
def test_quantize_for_gemm_pads_and_lays_out_scales_as_scaled_mm_reads(m, k, m_pad, k_pad):
    """The GEMM operand of `BlockFP8Linear`: zero rows and columns past the input, each 1x128 block rounded as the
    format says (written here independently), and the scales outer-dim-major (strides (1, m_pad)), the layout
    torch's BlockWise1x128 scaling reads. On a CPU this is the fallback path; the GPU's Triton kernel is held to
    the same values bit for bit by bench/targets_check.py."""
    from dflash_prep.target.fp8_weights import quantize_for_gemm

    g = torch.Generator().manual_seed(m + k)
    magnitudes = torch.logspace(-3, 3, max(m, 1))[:m, None]  # rows of very different sizes
    x = (torch.randn(m, k, generator=g) * magnitudes).to(torch.bfloat16)
    q, scales = quantize_for_gemm(x, m_pad, k_pad)
    assert q.shape == (m_pad, k_pad) and q.dtype == torch.float8_e4m3fn
    assert scales.shape == (m_pad, k_pad // 128) and scales.dtype == torch.float32
    assert scales.stride(0) == 1 and (scales.stride(1) == m_pad or k_pad == 128)  # one column: any stride
    padded = torch.zeros(m_pad, k_pad)
    padded[:m, :k] = x.float()
    blocks = padded.view(m_pad, k_pad // 128, 128)
    want_s = blocks.abs().amax(-1).clamp(min=1e-12) / E4M3_MAX
    want_q = (blocks / want_s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(m_pad, k_pad)
    assert torch.equal(scales, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert not q[m:].view(torch.uint8).any() and not q[:, k:].view(torch.uint8).any()


def test_the_conversion_keeps_whole_block_weights_in_place_and_frees_every_replaced_layer(monkeypatch):
    """install_scaled_mm over transformers' own FP8Linear layers: each is replaced by a BlockFP8Linear holding the
    very tensor of a whole-block weight (the bytes checked against a copy taken before), a ragged one padded, and
    no replaced layer outlives the conversion (a list of them kept every FP8 weight twice). The GEMM check is
    patched to say yes: the conversion itself runs on any device; only the forward needs the GPU."""
    import gc
    import weakref
    from types import SimpleNamespace

    from torch import nn
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from dflash_prep.target import fp8_weights
    from dflash_prep.target.fp8_weights import BlockFP8Linear, install_scaled_mm

    torch.manual_seed(0)
    model = nn.Sequential(FP8Linear(384, 256, block_size=(128, 128)), FP8Linear(200, 300, block_size=(128, 128)))
    for layer in model:
        layer.weight.data = torch.randn_like(layer.weight, dtype=torch.float32).to(torch.float8_e4m3fn)
        layer.weight_scale_inv.data.uniform_(0.5, 2.0)
    del layer  # the loop's name held the last layer
    before = [(layer.weight.data_ptr(), layer.weight.view(torch.uint8).clone()) for layer in model]
    old = [weakref.ref(layer) for layer in model]
    config = SimpleNamespace(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                  "weight_block_size": [128, 128]})
    alive_at_each_build = []

    class Recording(BlockFP8Linear):  # how many replaced layers are still alive as each new one is built
        def __init__(self, *args):
            gc.collect()
            alive_at_each_build.append(sum(ref() is not None for ref in old))
            super().__init__(*args)

    monkeypatch.setattr(fp8_weights, "fp8_gemm_available", lambda device: True)
    monkeypatch.setattr(fp8_weights, "BlockFP8Linear", Recording)
    said = install_scaled_mm(model, config, "auto", torch.device("cpu"))
    gc.collect()
    assert "2 linear layers run as FP8" in said and all(isinstance(m, BlockFP8Linear) for m in model)
    assert alive_at_each_build == [2, 1] and all(ref() is None for ref in old)
    (ptr0, bytes0), (ptr1, bytes1) = before
    assert model[0].weight.data_ptr() == ptr0 and torch.equal(model[0].weight.view(torch.uint8), bytes0)
    assert model[1].weight.data_ptr() != ptr1 and torch.equal(model[1].weight.view(torch.uint8)[:300, :200], bytes1)

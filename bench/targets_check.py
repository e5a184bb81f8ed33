"""Targets served at engine speed, checked on the GPU (the `targets` scenario; random weights built on the device).

    python3 bench/targets_check.py fp8 --checkpoint DIR --json OUT [--layers 16] [--tiny] [--build-only]
    python3 bench/targets_check.py moe --json OUT [--layers 8] [--batch 8 --length 4096] [--tiny]

`fp8`: a Qwen3.6-27B-shaped slice (`--layers` decoder layers) with random bf16 weights (the product's own random
init) is saved as a block-FP8 checkpoint in DIR: every decoder linear layer whose both dimensions are multiples of
128 quantized per 128x128 block (scale_inv = amax / 448, weight = e4m3(W / scale_inv)), the others and lm_head
listed in `modules_to_not_convert`, config.json with the `quantization_config` of the Qwen3-FP8 / DeepSeek-V3
format. Then the checkpoint is loaded twice through `dflash_prep.target.model.load_model` (fused kernels `auto`):
as FP8 (torch scaled_mm) and dequantized (`model.fp8_weights: dequantize`, bf16 GEMMs), and measured:
- one FP8 linear layer against its emulation (activations rounded to e4m3 per 1x128 block, the dequantized weight,
  an fp32 GEMM) for several token counts (odd ones too): the scale layouts; and against bf16 F.linear, with the
  GEMMs' TFLOP/s at 32,768 tokens;
- the forward of one [batch, length] batch through both models (warm, CUDA events): tok/s and the ratio; the
  states of every layer, FP8 vs the dequantized reference (max |diff| / max |ref|); one more warm forward of each
  under torch.profiler (`forward.profile`: on a GPU its kernels by device time, bench/profiling.py): where the FP8
  forward's time goes against the bf16 one's.
The checkpoint stays in DIR for the scenario's extractions.

`moe`: a Qwen3-30B-A3B-shaped slice (`--layers` layers of 128 experts, top-8, hidden 2048, expert width 768),
random bf16 weights, one [batch, length] batch through the base model with each experts implementation:
transformers' `grouped_mm` (its default; the baseline), `eager` (its loop over experts), `compiled`
(`model.moe_experts: compiled`), `compiled_block` on request (torch.compile of the whole sparse block, router included:
measured only), `liger` (`model.moe_experts: liger`). Per candidate: tok/s (warm), the first call's seconds
(compilation), max |diff| / max |baseline| per layer, and the fraction of tokens routed to the same top-k experts
as the baseline in every sparse layer; the same two against an fp32 copy of the model (eager experts): bf16 paths
round differently (the compiled glue keeps the routing-weight products in fp32), and the first layer's routing is
identical by construction (the router runs eagerly on the same input), later layers' routing follows the states. (`batched_mm` gathers one weight matrix per token and expert: at these
token counts it needs terabytes; not run.)

`--tiny`: CPU-sized configs (the scenario's dry run): the same code, on whatever the device can run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.models import CONFIG_DIR, TOKENIZER_DIR  # noqa: E402
from dflash_prep.target.fp8_weights import BLOCK, FP8_MAX, quantize_1x128  # noqa: E402

TINY_27B = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 128, "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "vocab_size": 1024}
MOE_30B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
           "norm_topk_prob": True, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "tie_word_embeddings": False,
           "mlp_only_layers": [], "decoder_sparse_step": 1}
TINY_MOE = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 1024}


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device, repeats: int) -> float:
    """Seconds per call of `fn`, warm (one call first), wall clock around synchronized calls."""
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / repeats


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


# ------------------------------------------------------------------------------------------------------- fp8
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] (multiples of 128) -> (e4m3 [N, K], fp32 scale_inv [N/128, K/128]), per 128x128 block."""
    N, K = w.shape
    blocks = w.float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, K), scale_inv


def build_fp8_checkpoint(folder: Path, layers: int, tiny: bool, dev: torch.device) -> dict:
    """The random 27B-shaped slice saved in the block-FP8 format (module docstring); -> what was quantized."""
    from safetensors.torch import save_file

    from dflash_prep.recipe.schema import ModelSection
    from dflash_prep.target.model import load_config, load_model

    folder.mkdir(parents=True, exist_ok=True)
    base = json.loads((CONFIG_DIR / "qwen3.6-27b.json").read_text())
    config_json = {**base, **(TINY_27B if tiny else {}), "num_hidden_layers": layers}
    (folder / "random.json").write_text(json.dumps(config_json))
    section = ModelSection(config=str(folder / "random.json"), tokenizer=str(TOKENIZER_DIR), dtype="bfloat16")
    t0 = time.perf_counter()
    model = load_model(section, load_config(section), dev)
    linear = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    state, kept = {}, ["lm_head"]
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in linear and name.endswith(".weight") and module.startswith("model.layers."):
            if tensor.shape[0] % BLOCK == 0 and tensor.shape[1] % BLOCK == 0:
                q, scale_inv = quantize_weight(tensor)
                state[name], state[f"{module}.weight_scale_inv"] = q.cpu(), scale_inv.cpu()
                continue
            kept.append(module)
        state[name] = tensor.contiguous().cpu()
    model.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": kept}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    del model
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    quantized = sum(1 for n in state if n.endswith("_scale_inv"))
    return {"layers": layers, "quantized_linear_layers": quantized, "not_converted": len(kept),
            "bytes": (folder / "model.safetensors").stat().st_size, "build_seconds": round(time.perf_counter() - t0, 1)}


def _load(folder: Path, mode: str, dev: torch.device):
    from dflash_prep.recipe.schema import ModelSection
    from dflash_prep.target.kernels import apply_kernels, select_kernels
    from dflash_prep.target.model import load_config, load_model

    section = ModelSection(name_or_path=str(folder), tokenizer=str(TOKENIZER_DIR), dtype="bfloat16", fp8_weights=mode)
    config = load_config(section)
    model = load_model(section, config, dev)
    kernels = select_kernels("auto", config, dev.type)
    apply_kernels(model, kernels)
    return model, list(kernels.names)


def gemm_check(fp8_model, ref_model, dev: torch.device, tiny: bool) -> dict:
    """One FP8 linear layer (the first MLP up projection) against its emulation and bf16 (module docstring)."""
    from dflash_prep.target.fp8_weights import BlockFP8Linear

    name = next((n for n, m in fp8_model.named_modules() if isinstance(m, BlockFP8Linear) and "up_proj" in n), None)
    if name is None:
        return {"skipped": "no FP8 linear layer (dequantized load: no FP8 GEMM on this device)"}
    fp8, ref = fp8_model.get_submodule(name), ref_model.get_submodule(name)
    W = ref.weight  # the dequantized weight, bf16
    out = {"layer": name, "shape_NK": list(W.shape), "by_tokens": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for M in (1, 17, 300, 4096) if tiny else (1, 17, 300, 4096, 32768):
        x = torch.randn(M, W.shape[1], device=dev, dtype=torch.bfloat16, generator=g)
        q, s = quantize_1x128(x)
        x_hat = (q.float().view(M, -1, BLOCK) * s.unsqueeze(-1)).view(M, -1)
        emulated = x_hat @ W.float().t()
        got = fp8(x)
        out["by_tokens"][M] = {"vs_emulated": _rel(got, emulated), "vs_bf16": _rel(got, x @ W.t())}
    M = 4096 if tiny else 32768
    x = torch.randn(M, W.shape[1], device=dev, dtype=torch.bfloat16, generator=g)
    flop = 2 * M * W.shape[0] * W.shape[1]
    from dflash_prep.target import fp8_weights

    out["quantize"] = quantize_check(dev, tiny)
    out["fp8_tflops"] = flop / _timed(lambda: fp8(x), dev, 10) / 1e12  # the product's quantization (Triton on CUDA)
    out["quantize_compiled"] = not fp8_weights._QUANTIZE["failed"]
    for path in ("compiled", "eager"):  # torch.compile's kernels (before the Triton kernel), and eager
        with _quantize_path(path):
            out[f"fp8_{path}_quantize_tflops"] = flop / _timed(lambda: fp8(x), dev, 10) / 1e12
    out["bf16_tflops"] = flop / _timed(lambda: x @ W.t(), dev, 10) / 1e12
    return out


# how `fp8_weights.quantize_for_gemm` quantizes, as its switches set it: Triton (the product's path on CUDA),
# torch.compile's kernels, eager
_QUANTIZE_PATHS = {"triton": {}, "compiled": {"triton": False}, "eager": {"triton": False, "failed": True}}


@contextlib.contextmanager
def _quantize_path(name: str):
    """`fp8_weights.quantize_for_gemm` on path `name` of _QUANTIZE_PATHS for the block, its switches back after."""
    from dflash_prep.target import fp8_weights

    saved = dict(fp8_weights._QUANTIZE)
    fp8_weights._QUANTIZE.update(_QUANTIZE_PATHS[name])
    try:
        yield
    finally:
        fp8_weights._QUANTIZE.update(saved)


def quantize_check(dev: torch.device, tiny: bool) -> dict:
    """The activations' quantization (`fp8_weights.quantize_for_gemm`) against `quantize_1x128` of the zero-padded
    input, bit for bit (e4m3 bytes and fp32 scales), on odd and aligned shapes with rows from 1e-6 to 1e4 in size,
    one row of zeros, a NaN, an Inf and a -Inf; then the seconds of one call at the 27B's widths as each path runs
    it (Triton, torch.compile, eager), with the bytes it moves (read 2 B and write 1 B an element) as GB/s."""
    from dflash_prep.target import fp8_weights

    triton_fn = fp8_weights._triton_quantizer() if dev.type == "cuda" else False
    out = {"triton": bool(triton_fn), "exact": {}, "seconds": {}}
    g = torch.Generator(device=dev).manual_seed(3)
    for M, K in ((1, 5120), (17, 5120), (300, 6144), (1000, 17408), (4096, 200)):
        x = torch.randn(M, K, device=dev, generator=g) * torch.logspace(-6, 4, M, device=dev)[:, None]
        x = x.to(torch.bfloat16)
        x[M // 2] = 0
        if M > 4:  # non-finite values: a NaN's block scales and rounds to NaN, an Inf's block as IEEE says
            x[1, 3], x[2, -1], x[3, 0] = float("nan"), float("inf"), -float("inf")
        Mp, Kp = -(-M // 16) * 16, -(-K // BLOCK) * BLOCK
        q, s = fp8_weights.quantize_for_gemm(x, Mp, Kp)
        want_q, want_s = quantize_1x128(torch.nn.functional.pad(x, (0, Kp - K, 0, Mp - M)))
        out["exact"][f"{M}x{K}"] = {
            "q_bytes_differing": int(((qb := q.view(torch.uint8)) != (wb := want_q.view(torch.uint8))).logical_and(
                (qb & 0x7F != 0x7F) | (wb & 0x7F != 0x7F)).sum()),  # e4m3fn's NaNs (either sign) are equal
            "scales_differing": int(((s != want_s) & ~(s.isnan() & want_s.isnan())).sum()),
            "scale_strides": list(s.stride())}
    if tiny:
        return out
    for M, K in ((32768, 5120), (32768, 17408)):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
        for name in _QUANTIZE_PATHS:
            with _quantize_path(name):
                seconds = _timed(lambda: fp8_weights.quantize_for_gemm(x, M, K), dev, 20)
            out["seconds"][f"{name} {M}x{K}"] = {"seconds": seconds, "gb_per_s": 3 * M * K / seconds / 1e9}
    return out


def _states(model, ids: torch.Tensor) -> tuple:
    with torch.inference_mode():
        return model.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states


def forward_check(fp8_model, ref_model, dev: torch.device, batch: int, length: int, repeats: int) -> dict:
    """tok/s of one batch through both models, and the per-layer error FP8 vs the dequantized reference."""
    vocab = ref_model.config.get_text_config().vocab_size
    ids = torch.randint(1, vocab, (batch, length), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    errors = [_rel(a, b) for a, b in zip(_states(fp8_model, ids)[1:], _states(ref_model, ids)[1:], strict=True)]
    tokens = batch * length
    out = {"tokens": tokens, "fp8_tok_s": tokens / _timed(lambda: _states(fp8_model, ids), dev, repeats),
           "bf16_tok_s": tokens / _timed(lambda: _states(ref_model, ids), dev, repeats),
           "relative_error_by_layer": [round(e, 5) for e in errors]}
    out["ratio"] = out["fp8_tok_s"] / out["bf16_tok_s"]
    # where each forward's time goes (the FP8 one's GEMMs, quantization, pads, copies against the bf16 one's)
    out["profile"] = {name: _profile(lambda m=m: _states(m, ids), dev) for name, m in (("fp8", fp8_model),
                                                                                        ("bf16", ref_model))}
    return out


def _profile(fn, dev: torch.device) -> dict:
    """One warm call of `fn` under torch.profiler: on a GPU its kernels by device time, else its CPU ops
    (bench/profiling.py)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.profiling import kernel_profile

    cuda = dev.type == "cuda"
    fn()
    _sync(dev)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()
        _sync(dev)
    return kernel_profile(prof, cuda=cuda, top=25)


def run_fp8(args) -> dict:
    dev = _device()
    result = {"device": str(dev), "checkpoint": build_fp8_checkpoint(Path(args.checkpoint), args.layers, args.tiny,
                                                                     dev)}
    print("checkpoint:", result["checkpoint"], flush=True)
    _write(args.json, result)
    if args.build_only:  # the extractions' checkpoint alone (a whole 27B leaves no time for the checks in one call)
        return result
    fp8_model, kernels = _load(Path(args.checkpoint), "auto", dev)
    ref_model, _ = _load(Path(args.checkpoint), "dequantize", dev)
    result["kernels"] = kernels
    try:
        result["gemm"] = gemm_check(fp8_model, ref_model, dev, args.tiny)
    except Exception as e:  # the error is the finding: kept in the JSON, then the step fails
        result["gemm"] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"}
        _write(args.json, result)
        raise
    print("gemm:", json.dumps(result["gemm"]), flush=True)
    differing = {shape: e for shape, e in result["gemm"].get("quantize", {}).get("exact", {}).items()
                 if e["q_bytes_differing"] or e["scales_differing"]}
    print(f"quantize_for_gemm vs quantize_1x128: {'EXACT' if not differing else f'DIFFERS {differing}'}", flush=True)
    _write(args.json, result)
    result["forward"] = forward_check(fp8_model, ref_model, dev, args.batch, args.length, args.repeats)
    f = result["forward"]
    print(f"fp8 forward: {f['fp8_tok_s']:.0f} tok/s, bf16 (dequantized) {f['bf16_tok_s']:.0f} tok/s, ratio "
          f"{f['ratio']:.3f}; worst relative error {max(f['relative_error_by_layer']):.4f} "
          f"(by layer {f['relative_error_by_layer']})", flush=True)
    return result


# ------------------------------------------------------------------------------------------------------- moe
def _moe_model(layers: int, tiny: bool, dev: torch.device):
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_prep.target.norms import randomize_norm_gains

    config = AutoConfig.for_model(**{k: v for k, v in {**MOE_30B, **(TINY_MOE if tiny else {}),
                                                         "num_hidden_layers": layers}.items()
                                     if k not in ("architectures", "model_type")}, model_type="qwen3_moe")
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    randomize_norm_gains(model, 0)
    return model.eval().requires_grad_(False)


def _set_candidate(model, name: str, dev: torch.device) -> str | None:
    """Put the experts on candidate `name`; -> the product's log line (or what was done)."""
    from dflash_prep.target.moe import apply_moe_experts, routed_experts

    for _, m in routed_experts(model):  # back to the class's forward (the transformers dispatch)
        m.__dict__.pop("forward", None)
    for m in model.modules():
        if hasattr(m, "gate") and hasattr(m, "experts"):
            m.__dict__.pop("forward", None)
    impl = name if name in ("eager", "grouped_mm") else "grouped_mm"
    model.set_experts_implementation(impl)
    if name in ("compiled", "liger"):
        return apply_moe_experts(model, name, dev.type, "bfloat16")
    if name == "compiled_block":
        for m in model.modules():
            if hasattr(m, "gate") and hasattr(m, "experts"):
                m.forward = torch.compile(type(m).forward.__get__(m), dynamic=True)
        return "torch.compile of each sparse MoE block (router included)"
    return f"transformers experts_implementation {impl}"


def _routed(model, ids: torch.Tensor):
    chosen = []
    hooks = [m.gate.register_forward_hook(lambda _m, _a, out: chosen.append(torch.sort(out[2], -1).values))
             for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    try:
        states = _states(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return states, chosen


def _fp32_reference(model, ids: torch.Tensor):
    """(states, routes) of an fp32 copy of `model` with transformers' eager experts: how far each bf16 candidate
    is from the exact result (a bf16 path rounds the routing weights' products and the combine differently)."""
    import copy

    ref = copy.deepcopy(model).float()
    ref.set_experts_implementation("eager")
    out = _routed(ref, ids)
    del ref
    if ids.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_moe(args) -> dict:
    dev = _device()
    model = _moe_model(args.layers, args.tiny, dev)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.length), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(1))
    tokens = args.batch * args.length
    result = {"device": str(dev), "layers": args.layers, "tokens": tokens, "candidates": {}}
    ref_states, ref_routes = _fp32_reference(model, ids)
    base_states = base_routes = None
    for name in args.candidates.split(","):
        entry = result["candidates"].setdefault(name, {})
        try:
            entry["applied"] = _set_candidate(model, name, dev)
            t0 = time.perf_counter()
            states, routes = _routed(model, ids)
            _sync(dev)
            entry["first_call_seconds"] = round(time.perf_counter() - t0, 2)
            entry["tok_s"] = tokens / _timed(lambda: _states(model, ids), dev, args.repeats)
            from dflash_prep.target import moe

            if name == "compiled" and moe._COMPILE_FAILED:  # it ran transformers' forward instead: say so
                entry["compile_failed"] = moe._COMPILE_FAILED[0]
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is reported, the others go on
            entry["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
            print(f"{name}: error {entry['error']}", flush=True)
            _write(args.json, result)
            continue
        if base_states is None:
            base_states, base_routes = states, routes
        entry["relative_error_by_layer"] = [round(_rel(a, b), 5) for a, b in zip(states[1:], base_states[1:],
                                                                                  strict=True)]
        entry["same_experts_fraction_by_layer"] = [round(float((a == b).all(-1).float().mean()), 5)
                                                   for a, b in zip(routes, base_routes, strict=True)]
        entry["relative_error_vs_fp32_by_layer"] = [round(_rel(a, b), 5) for a, b in zip(states[1:], ref_states[1:],
                                                                                          strict=True)]
        entry["same_experts_vs_fp32_by_layer"] = [round(float((a == b).all(-1).float().mean()), 5)
                                                  for a, b in zip(routes, ref_routes, strict=True)]
        print(f"{name}: {entry['tok_s']:.0f} tok/s (first call {entry['first_call_seconds']} s), worst relative "
              f"error vs {args.candidates.split(',')[0]} {max(entry['relative_error_by_layer']):.4g}, same experts "
              f"{min(entry['same_experts_fraction_by_layer']):.5f} (worst layer); vs the fp32 reference: worst error {max(entry['relative_error_vs_fp32_by_layer']):.4g}, same "
              f"experts {min(entry['same_experts_vs_fp32_by_layer']):.5f}; {entry['applied']}", flush=True)
        _write(args.json, result)  # a step stopped at its time limit keeps the candidates measured so far
    return result


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("fp8", "moe"))
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="fp8: where the checkpoint is written (kept)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--length", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--candidates", default="grouped_mm,compiled,liger,eager",
                   help="also: compiled_block (torch.compile of the whole sparse block, router included)")
    p.add_argument("--tiny", action="store_true", help="CPU-sized configs")
    p.add_argument("--build-only", action="store_true", help="fp8: build and save the checkpoint, no checks")
    args = p.parse_args(argv)
    defaults = {"fp8": (6, 1, 64) if args.tiny else (16, 4, 4096), "moe": (2, 1, 64) if args.tiny else (8, 8, 4096)}
    layers, batch, length = defaults[args.what]
    args.layers, args.batch, args.length = args.layers or layers, args.batch or batch, args.length or length
    if args.tiny and args.what == "moe":
        args.candidates = ",".join(c for c in args.candidates.split(",") if c != "liger")  # CUDA only
    result = run_fp8(args) if args.what == "fp8" else run_moe(args)
    _write(args.json, result)
    print(f"[bench] targets {args.what}: ok, {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

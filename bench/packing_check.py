"""Exactness check of packed rows (`batching.packing`): one packed row vs each sample alone, on slices of the
benchmark shapes and on every target family's GPU-sized config, with the CUDA paths (torch's varlen_attn, with its
sliding window; fla's Gated DeltaNet kernels).

    python3 bench/packing_check.py [--models qwen3.6-27b,llama3.1-8b] [--families all] [--layers 8]
                                   [--dtypes float32,bfloat16] [--json OUT.json]
    python3 bench/packing_check.py --device cpu --size tiny --models none --dtypes float32     # tiny mode, CPU

Targets: `--models`, the first `--layers` decoder layers of a benchmark config (the Qwen3.6-27B shape: 6 Gated
DeltaNet + 2 full-attention layers; the Llama-3.1-8B shape); `--families`, bench/families.py's configs at `--size`
(`gpu`: each family's real head dims and layer kinds, hidden 1024-2048, 4-6 layers, sliding windows of 128 tokens;
`tiny`: hidden 64, windows of 16, for the CPU): llama, qwen2, qwen3, qwen3_moe, mistral, gemma2 (softcap), gemma3,
phi3, gpt_oss (sinks), qwen3_5, qwen3_5_moe, deepseek_v3 (MLA), mixtral, glm4_moe. Random weights
(`dflash_prep.target.model.load_model`, eager attention for the families: sdpa has no softcap or sinks), the
kernels `model.kernels: auto` chooses here applied, as the extraction does. `--attention-gain G` multiplies the
attention projections (not o_proj) by G and draws the sinks from N(0, 1) so that softcap and sinks bite
(transformers' init, std 0.02, gives near-uniform attention; the CPU tests use 8).

Each of 8 samples of 17-384 tokens (four longer than the GPU-sized window) first runs alone through the model
(plain transformers, `output_hidden_states=True`, before the later layers are dropped); then the same samples as
one right-padded batch (the padded path, for context), then the model is switched to packed rows
(`use_packed_attention`) and the 8 samples run as ONE packed row (with tail padding) through the capture hooks.
Per captured layer: max abs difference / max |value| of the alone states (the relative error `dflash-prep verify`
reports). Recorded per target: what `auto` and `true` resolve to here, which attention path ran how often, and
whether it is the one the capability rule predicts (varlen_attn for every attention module on CUDA in bf16 except
softcap/sinks; per segment otherwise).

- fp32, TF32 off: asserted <= 1e-3 on every layer (the bound of bench/kernels_check.py), or at most 5% above
  the padded batch's own difference from the alone runs where that already exceeds 1e-3 (measured on an H200:
  layer 6 of the 27B slice, 1.029e-3 padded, 1.025e-3 packed). Attention runs per segment here (FlashAttention
  has no fp32), the Gated DeltaNet layers through fla's chunk kernel and causal conv with `cu_seqlens`;
- bf16: torch's varlen FlashAttention where it computes the module's attention; asserted <= 0.1 (verify's bf16
  compute tolerance).

Writes the figures as JSON after every target. Exit code 1 when a bound is exceeded, a target is refused under
`batching.packing: true` or an attention path other than the predicted one ran; 2 without CUDA (`--device cuda`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.families import FAMILIES, family_overrides  # noqa: E402
from bench.kernels_check import relative, slice_section  # noqa: E402
from bench.models import TOKENIZER_DIR  # noqa: E402
from dflash_prep.plan.batches import SampleInfo, collate, collate_packed  # noqa: E402
from dflash_prep.recipe.schema import ModelSection, RecipeError  # noqa: E402
from dflash_prep.target import packing  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import apply_kernels, select_kernels  # noqa: E402
from dflash_prep.target.layers import decoder_layers, find_decoder  # noqa: E402
from dflash_prep.target.model import DTYPES, drop_layers_after, load_config, load_model  # noqa: E402

BOUNDS = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
LENGTHS = [384, 211, 97, 333, 17, 256, 150, 301]  # 1749 tokens, packed into a row of 1792 (a tail segment)


def family_section(family: str, size: str, dtype: str, tmp: Path) -> ModelSection:
    """A ModelSection of the family's config at `size` (random weights, seed 0, eager attention)."""
    from transformers import AutoConfig

    model_type, fields = family_overrides(family, size)
    path = tmp / f"{family}-{size}.json"
    path.write_text(AutoConfig.for_model(model_type, **fields).to_json_string())
    return ModelSection(config=str(path), tokenizer=str(TOKENIZER_DIR), dtype=dtype, attn_implementation="eager")


def check(section: ModelSection, layer_ids: list[int] | None, device: torch.device, gain: float) -> dict:
    """One target in one compute dtype: packed row vs each sample alone, per captured layer."""
    dtype = section.dtype
    config = load_config(section)
    kernels = select_kernels("auto", config, device.type)
    auto = packing.select_packing("auto", config, device.type, kernels.names, compute_dtype=dtype)
    try:  # `true`, as the extraction resolves it (refused where packing is not exact)
        choice = packing.select_packing(True, config, device.type, kernels.names, compute_dtype=dtype)
    except RecipeError as e:
        return {"refused": str(e), "auto": auto.record(), "within_bound": False}
    _, per_segment = packing.packing_verdict(config, device.type, kernels.names, dtype)
    model = load_model(section, config, device)
    _draw_attention(model, gain)
    apply_kernels(model, kernels)
    num_layers = len(decoder_layers(find_decoder(model)))
    layer_ids = layer_ids or list(range(num_layers - 1))  # HF's last hidden state is after the final norm
    g = np.random.default_rng(0)
    vocab = min(config.get_text_config().vocab_size, 32000)
    samples = [SampleInfo(f"{i:010d}", i, None, g.integers(1, vocab, n).astype(np.int32), np.ones(n, np.uint8))
               for i, n in enumerate(LENGTHS)]
    alone = [_alone(model, s, layer_ids, device) for s in samples]  # before the later layers are dropped
    drop_layers_after(model, layer_ids[-1])
    padded = _padded_batch(model, samples, layer_ids, device)
    done = packing.use_packed_attention(model, device.type)
    calls_before = dict(packing.ATTENTION_CALLS)
    batch = collate_packed(samples, -(-sum(LENGTHS) // 64) * 64 + 64, 0)
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32) as cap:
        cap.run(**batch.tensors_on(device))  # first call: Triton compiles and autotunes
        _sync(device)
        t0 = time.perf_counter()
        packed = cap.run(**batch.tensors_on(device)).hidden_states_NK
        _sync(device)
        seconds = time.perf_counter() - t0
    calls = {k: (packing.ATTENTION_CALLS[k] - calls_before[k]) // 2 for k in calls_before}  # per forward
    H = config.get_text_config().hidden_size
    layers, padded_layers = (_versus_alone(packed, alone, samples, layer_ids, H),
                             _versus_alone(padded, alone, samples, layer_ids, H))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    expected = _expected_path(per_segment, done, device, dtype)
    bound = BOUNDS[dtype]
    return {"model_type": config.get_text_config().model_type, "kernels": list(kernels.names),
            "packing": choice.record(), "auto": auto.record(), "per_segment": per_segment, "packed_rows": done,
            "layer_ids": layer_ids, "lengths": LENGTHS, "row_length": int(batch.input_ids.shape[1]),
            "packed_forward_seconds": seconds, "attention_calls": calls, "expected_attention_path": expected,
            "attention_path_as_expected": calls.get(expected, 0) > 0 and sum(calls.values()) == calls[expected],
            "packed_vs_alone": layers, "padded_batch_vs_alone": padded_layers, "worst": max(layers.values()),
            "bound": bound,
            "within_bound": all(v <= max(bound, 1.05 * padded_layers[k]) for k, v in layers.items())}


def _expected_path(per_segment: list[str], done: dict, device, dtype: str) -> str:
    """The attention path the capability rule predicts: varlen_attn where no attention module runs per segment
    (CUDA, fp16/bf16), else SDPA per segment, or the eager computation for softcap and sinks."""
    attention_per_segment = [w for w in per_segment if "GatedDeltaNet" not in w]
    if device.type == "cuda" and dtype in packing.FLASH_DTYPES and not attention_per_segment:
        return "varlen_attn"
    eager = {"softcap", "sinks"} & set(done["attention_features"])
    return "eager_per_segment" if eager else "sdpa_per_segment"


def _draw_attention(model, gain: float) -> None:
    """--attention-gain: attention projections x gain, sinks from N(0, 1) (seeded), so softcap and sinks bite."""
    if gain == 1.0:
        return
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".self_attn." in name and param.ndim == 2 and "o_proj" not in name:
                param.mul_(gain)
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)


def _padded_batch(model, samples: list, layer_ids: list[int], device) -> torch.Tensor:
    """[N, k*H]: the samples as one right-padded batch through the capture hooks (the padded path's own noise
    against the alone runs, for context)."""
    batch = collate(samples, max(LENGTHS), 0)
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32, padding_mask=True) as cap:
        return cap.run(**batch.tensors_on(device)).hidden_states_NK


def _versus_alone(states_NK: torch.Tensor, alone: list, samples: list, layer_ids: list[int], H: int) -> dict:
    """Per captured layer: max over samples of max |states - alone| / max |alone|."""
    layers = {str(layer): 0.0 for layer in layer_ids}
    start = 0
    for s, ref in zip(samples, alone):
        n = len(s.input_ids)
        for slot, layer in enumerate(layer_ids):
            got = states_NK[start:start + n, slot * H:(slot + 1) * H]
            layers[str(layer)] = max(layers[str(layer)], relative(got, ref[slot]))
        start += n
    return layers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _alone(model, sample: SampleInfo, layer_ids: list[int], device) -> list[torch.Tensor]:
    """The sample alone through plain transformers: after-layer id i = hidden_states[i + 1]."""
    with torch.inference_mode():
        hs = find_decoder(model)(input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None].to(device),
                                 use_cache=False, output_hidden_states=True).hidden_states
    return [hs[i + 1][0].float() for i in layer_ids]


# --------------------------------------------------------------------------- the attention function alone
KERNEL_SEGMENTS = [300, 17, 1, 128, 77]  # one row of 523 tokens
KERNEL_CASES = [  # (name, q heads, kv heads, q/k head dim, v head dim, window, softcap, sinks)
    ("gqa", 16, 4, 128, 128, None, None, False), ("gqa-window-1", 16, 4, 128, 128, 1, None, False),
    ("gqa-window-4", 16, 4, 128, 128, 4, None, False), ("gqa-window-16", 16, 4, 128, 128, 16, None, False),
    ("gqa-window-128", 16, 4, 128, 128, 128, None, False), ("mla-192-128", 16, 16, 192, 128, None, None, False),
    ("head-dim-256-window-8", 8, 4, 256, 256, 8, None, False), ("softcap-window-8", 8, 4, 64, 64, 8, 2.0, False),
    ("sinks-window-8", 8, 8, 64, 64, 8, None, True)]
KERNEL_BOUNDS = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def reference_attention(q, k, v, segments: list[int], scale: float, window, softcap, sinks) -> torch.Tensor:
    """[Hq, T, D] x [Hkv, T, D] x [Hkv, T, Dv] -> [T, Hq, Dv] in fp32, written out here (not packing.py's):
    per segment, scores = q k^T x scale, tanh softcap, causal mask within the window (key j seen from query i
    when i - window < j <= i), the sink as one more logit per head, softmax, times v."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    outs, start = [], 0
    for n in segments:
        qs, ks, vs = (t[:, start:start + n].double() for t in (q, k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
        seen = (j <= i) & ((j > i - window) if window is not None else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None, None].expand(-1, n, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :n]
        outs.append((probs @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).float()


def attention_kernel_check(device: torch.device, dtype: str) -> dict:
    """`varlen_attention` on one packed row of random q/k/v vs `reference_attention` (fp32, from the same rounded
    inputs): per case, the path that ran, the relative error, and for windows how far a window one key wider
    would be (the error must be well below it: a window off by one in the CUDA kernel's convention shows)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    T, results = sum(KERNEL_SEGMENTS), {}
    cu = torch.tensor([0] + list(np.cumsum(KERNEL_SEGMENTS)), dtype=torch.int32, device=device)
    module = torch.nn.Module().eval()
    for name, hq, hkv, d, dv, window, softcap, use_sinks in KERNEL_CASES:
        q, k = (torch.randn(h, T, d, generator=g).to(device, DTYPES[dtype]) for h in (hq, hkv))
        v = torch.randn(hkv, T, dv, generator=g).to(device, DTYPES[dtype])
        sinks = torch.randn(hq, generator=g).to(device, DTYPES[dtype]) if use_sinks else None
        before = dict(packing.ATTENTION_CALLS)
        got, _ = packing.varlen_attention(module, q[None], k[None], v[None], None, scaling=d ** -0.5,
                                          sliding_window=window, softcap=softcap, s_aux=sinks, cu_seq_lens_q=cu,
                                          cu_seq_lens_k=cu, max_length_q=max(KERNEL_SEGMENTS),
                                          max_length_k=max(KERNEL_SEGMENTS))
        ref = reference_attention(q.float(), k.float(), v.float(), KERNEL_SEGMENTS, d ** -0.5, window, softcap,
                                  None if sinks is None else sinks.float())
        res = {"path": [p for p in before if packing.ATTENTION_CALLS[p] > before[p]],
               "error": relative(got[0], ref), "bound": KERNEL_BOUNDS[dtype]}
        if window is not None:
            wider = reference_attention(q.float(), k.float(), v.float(), KERNEL_SEGMENTS, d ** -0.5, window + 1,
                                        softcap, None if sinks is None else sinks.float())
            res["window_one_wider_differs_by"] = relative(wider, ref)
        res["ok"] = res["error"] <= res["bound"] and res["error"] < res.get("window_one_wider_differs_by", 1) / 4
        results[name] = res
    return results


def _targets(args, tmp: Path):
    """(name, dtype -> ModelSection, layer ids or None) for every target asked for."""
    for name in [m for m in args.models.split(",") if m and m != "none"]:
        ids = sorted(set(range(1, args.layers - 1, 2)) | {args.layers - 2})  # both layer kinds of the hybrid
        yield name, lambda d, n=name: dataclasses.replace(slice_section(n, args.layers, tmp), dtype=d), ids
    families = FAMILIES if args.families == "all" else [f for f in args.families.split(",") if f and f != "none"]
    for family in families:
        yield f"{family}@{args.size}", lambda d, f=family: family_section(f, args.size, d, tmp), None


def _report(res: dict) -> None:
    if "refused" in res:
        print(f"  REFUSED: {res['refused']}", flush=True)
        return
    print(f"  kernels {res['kernels']}, attention {res['attention_calls']} (expected {res['expected_attention_path']}"
          f"{'' if res['attention_path_as_expected'] else ': NOT AS EXPECTED'}), auto: {res['auto']['reason']}; "
          f"packed forward {res['packed_forward_seconds']:.3f}s; worst {res['worst']:.2e} (bound {res['bound']:.0e})")
    for layer, value in res["packed_vs_alone"].items():
        print(f"  layer {layer:>2}: packed vs alone {value:.2e} (padded batch vs alone "
              f"{res['padded_batch_vs_alone'][layer]:.2e})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3.6-27b,llama3.1-8b", help="benchmark configs to slice, or none")
    p.add_argument("--families", default="all", help=f"bench/families.py names, all, or none ({', '.join(FAMILIES)})")
    p.add_argument("--size", default="gpu", choices=("gpu", "tiny"), help="the families' config size")
    p.add_argument("--layers", type=int, default=8, help="layers of the benchmark-config slices")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--attention-gain", type=float, default=1.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--device", default="cuda", help="cuda; cpu with --size tiny (the tiny mode)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("packing_check needs a CUDA device (or --device cpu --size tiny)", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {"torch": torch.__version__, "size": args.size, "attention_gain": args.attention_gain, "models": {},
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    ok = True
    results["attention_function"] = {}
    for dtype in args.dtypes.split(","):
        kernel = results["attention_function"][dtype] = attention_kernel_check(device, dtype)
        for name, res in kernel.items():
            ok &= res["ok"]
            wider = res.get("window_one_wider_differs_by")
            print(f"[packing_check] attention function {dtype} {name}: {res['path']} error {res['error']:.2e} "
                  f"(bound {res['bound']:.0e}" + (f"; a window one key wider differs by {wider:.2e}" if wider else "")
                  + f"){'' if res['ok'] else ' EXCEEDED'}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, section_for, layer_ids in _targets(args, Path(tmp)):
            for dtype in args.dtypes.split(","):
                print(f"[packing_check] {name} {dtype}: loading", flush=True)
                res = check(section_for(dtype), layer_ids, device, args.attention_gain)
                results["models"][f"{name}/{dtype}"] = res
                ok &= res["within_bound"] and res.get("attention_path_as_expected", False)
                _report(res)
                if args.json:  # after every target: a later failure keeps what was measured
                    Path(args.json).write_text(json.dumps({**results, "ok": ok}, indent=2) + "\n")
    print(f"packing_check: {'OK' if ok else 'EXCEEDED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

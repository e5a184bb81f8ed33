"""GPU exactness check of packed rows (`batching.packing`): one packed row vs each sample alone, on 8-layer slices of
both benchmark shapes with the fused kernels on.

    python3 bench/packing_check.py [--models qwen3.6-27b,llama3.1-8b] [--layers 8] [--json OUT.json]

For each model: the first `--layers` decoder layers of its benchmark config (the Qwen3.6-27B shape: 6 Gated
DeltaNet + 2 full-attention layers; the Llama-3.1-8B shape), random weights (`dflash_prep.target.model.load_model`), the
layers after the deepest captured one dropped and the kernels `model.kernels: auto` chooses on this GPU applied,
as the extraction does. Each of 8 samples of 17-384 tokens first runs alone through that model (plain
transformers, `output_hidden_states=True`, before the later layers are dropped); then the model is switched to
packed rows (`use_packed_attention`) and the 8 samples run as ONE packed row (with tail padding) through the
capture hooks. Per captured layer: max abs
difference / max |value| of the alone states, the relative error `dflash-prep verify` reports; for context the
same samples as one right-padded batch (today's path) against the same alone states.

- fp32, TF32 off: asserted <= 1e-3 on every layer (the bound of bench/kernels_check.py), or at most 5% above
  the padded batch's own difference from the alone runs where that already exceeds 1e-3 (measured on an H200:
  layer 6 of the 27B slice, 1.029e-3 padded, 1.025e-3 packed; the padded path is the extraction's reference). Attention runs per
  segment with SDPA here (FlashAttention has no fp32), the Gated DeltaNet layers through fla's chunk kernel and
  causal conv with `cu_seqlens`;
- bf16: torch's varlen FlashAttention (where this torch has it); reported, and asserted <= 0.1 (verify's bf16
  compute tolerance).

Writes the figures (and which attention path ran, how often) as JSON. Exit code 1 when a bound is exceeded, 2
without CUDA or when `batching.packing: true` would not pack the model here.
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

from bench.kernels_check import relative, slice_section  # noqa: E402
from dflash_prep.plan import batches  # noqa: E402
from dflash_prep.plan.batches import SampleInfo, collate  # noqa: E402
from dflash_prep.target import packing  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import apply_kernels, select_kernels  # noqa: E402
from dflash_prep.target.layers import find_decoder  # noqa: E402
from dflash_prep.target.model import drop_layers_after, load_config, load_model  # noqa: E402

BOUNDS = {"float32": 1e-3, "bfloat16": 0.1}
LENGTHS = [384, 211, 97, 333, 17, 256, 150, 301]  # 1749 tokens, packed into a row of 1792 (a tail segment)


def check(model_name: str, num_layers: int, dtype: str, device: torch.device, tmp: Path) -> dict:
    """One model slice in one compute dtype: packed row vs each sample alone, per captured layer."""
    section = dataclasses.replace(slice_section(model_name, num_layers, tmp), dtype=dtype)
    config = load_config(section)
    kernels = select_kernels("auto", config, device.type)
    # `true`, as the extraction resolves it (refused where packing is not exact)
    choice = packing.select_packing(True, config, device.type, kernels.names)
    if not choice.packed:
        raise SystemExit(f"{model_name}: `batching.packing: true` does not pack here ({choice.reason})")
    layer_ids = sorted(set(range(1, num_layers - 1, 2)) | {num_layers - 2})  # both layer kinds of the hybrid
    model = load_model(section, config, device)
    apply_kernels(model, kernels)
    g = np.random.default_rng(0)
    samples = [SampleInfo(f"{i:010d}", i, None, g.integers(1, config.get_text_config().vocab_size, n)
                          .astype(np.int32), np.ones(n, np.uint8)) for i, n in enumerate(LENGTHS)]
    # alone before the later layers are dropped: HF's last hidden state is after the final norm
    alone = [_alone(model, s, layer_ids, device) for s in samples]
    drop_layers_after(model, layer_ids[-1])
    padded = _padded_batch(model, samples, layer_ids, device)  # the same samples as today's padded batch
    packing.use_packed_attention(model, device.type)
    calls_before = dict(packing.ATTENTION_CALLS)
    batch = batches.collate_packed(samples, -(-sum(LENGTHS) // 64) * 64 + 64, 0)
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32) as cap:
        cap.run(**batch.tensors_on(device))  # first call: Triton compiles and autotunes
        _sync(device)
        t0 = time.perf_counter()
        packed = cap.run(**batch.tensors_on(device)).hidden_states_NK
        _sync(device)
        seconds = time.perf_counter() - t0
    H = config.get_text_config().hidden_size
    layers, padded_layers = _versus_alone(packed, alone, samples, layer_ids, H), \
        _versus_alone(padded, alone, samples, layer_ids, H)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"kernels": list(kernels.names), "packing": choice.record(), "layer_ids": layer_ids, "lengths": LENGTHS,
            "row_length": int(batch.input_ids.shape[1]), "packed_forward_seconds": seconds,
            "attention_calls": {k: packing.ATTENTION_CALLS[k] - calls_before[k] for k in calls_before},
            "packed_vs_alone": layers, "padded_batch_vs_alone": padded_layers, "worst": max(layers.values()),
            "bound": BOUNDS[dtype],
            "within_bound": all(v <= max(BOUNDS[dtype], 1.05 * padded_layers[k]) for k, v in layers.items())}


def _padded_batch(model, samples: list, layer_ids: list[int], device) -> torch.Tensor:
    """[N, k*H]: the samples as one right-padded batch through the capture hooks (the padded path's own noise
    against the alone runs, for context)."""
    batch = collate(samples, max(LENGTHS), 0)
    tensors = batch.tensors_on(device)
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32, padding_mask=True) as cap:
        return cap.run(**tensors).hidden_states_NK


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3.6-27b,llama3.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--device", default="cuda", help="cuda; cpu only as a smoke test of this script (tiny models)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("packing_check needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = {"torch": torch.__version__, "models": {},
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models.split(","):
            for dtype in args.dtypes.split(","):
                print(f"[packing_check] {model_name} {dtype}: loading", flush=True)
                res = check(model_name, args.layers, dtype, device, Path(tmp))
                results["models"][f"{model_name}/{dtype}"] = res
                ok &= res["within_bound"]
                print(f"  kernels {res['kernels']}, attention {res['attention_calls']}, packed forward "
                      f"{res['packed_forward_seconds']:.3f}s; worst {res['worst']:.2e} (bound {res['bound']:.0e})")
                for layer, value in res["packed_vs_alone"].items():
                    print(f"  layer {layer:>2}: packed vs alone {value:.2e} (padded batch vs alone "
                          f"{res['padded_batch_vs_alone'][layer]:.2e})", flush=True)
                if args.json:  # after every model: a later failure keeps what was measured
                    Path(args.json).write_text(json.dumps({**results, "ok": ok}, indent=2) + "\n")
    print(f"packing_check: {'OK' if ok else 'EXCEEDED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Where FP8's error through a random model comes from: block-FP8 (e4m3 weights per 128x128 block, activations per
token and 128-block, the format of bench/targets_check.py's checkpoints) emulated in float32 on the CPU, so the
GPU's kernels are out of the picture.

    python bench/fp8_emulation.py OUT.json [--widths 512,2048] [--layers 8] [--tokens 256]

For a Llama-style stack and a Qwen3.5-style hybrid (3 Gated DeltaNet layers per full-attention layer) of each
hidden width (random weights, transformers' init, seed 0): every decoder linear layer whose dims are multiples of
128 gets its weight rounded to the format (both models below use those rounded weights), then the same tokens run
without and with every such layer's input rounded to e4m3 per 1x128 block (forward pre-hooks). Reported per layer:
max |difference| / max |reference| of the residual stream (the measure of targets_check.py's forward check and of
`verify`) and ||difference|| / ||reference||. Why this exists: the GPU's 27B slice showed 0.13 after one layer and
0.41 after 16 where one FP8 GEMM is 0.026 off bf16 and 0.003 off its emulation; this tells whether that is the
format on random weights (architecture, width, depth) or the GPU path."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: `bench` and `dflash_prep` from this checkout
    sys.path.insert(0, str(REPO))
DEMO_CONFIG = REPO / "dflash_prep" / "demo" / "tiny-demo" / "model_config.json"


def round_weight(w: torch.Tensor) -> torch.Tensor:
    """[N, K] (multiples of 128) -> its e4m3 round trip per 128x128 block (targets_check's checkpoint quantizer)."""
    from bench.targets_check import quantize_weight

    N, K = w.shape
    q, scale_inv = quantize_weight(w)
    return (q.float().reshape(N // 128, 128, K // 128, 128) * scale_inv[:, None, :, None]).reshape(N, K).to(w.dtype)


def round_input(_module, args):
    """Forward pre-hook: the layer's input [..., K] rounded to e4m3 per token and 128 block (the FP8 path's own
    activation quantizer, fp8_weights.quantize_1x128)."""
    from dflash_prep.target.fp8_weights import quantize_1x128

    x = args[0]
    q, scale = quantize_1x128(x.reshape(-1, x.shape[-1]))
    rounded = (q.float().unflatten(-1, (-1, 128)) * scale.unsqueeze(-1)).flatten(-2)
    return (rounded.reshape(x.shape).to(x.dtype),)


def build(kind: str, width: int, layers: int):
    """(model in float32 with its format-rounded weights, names of the rounded layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(hidden_size=width, intermediate_size=3 * width, num_attention_heads=width // 128,
                num_key_value_heads=max(1, width // 1024), head_dim=128, vocab_size=1024, num_hidden_layers=layers)
    if kind == "llama":
        config = AutoConfig.for_model("llama", **dims)
    else:
        base = json.loads(DEMO_CONFIG.read_text())
        base.pop("transformers_version", None)
        base.update(dims, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=max(2, width // 512),
                    linear_num_value_heads=max(4, width // 256),
                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4))
        config = AutoConfig.for_model(**base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rounded = []
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                if module.weight.shape[0] % 128 == 0 and module.weight.shape[1] % 128 == 0:
                    module.weight.copy_(round_weight(module.weight))
                    rounded.append(name)
    return model, rounded


def layer_errors(model, rounded: list[str], tokens: int) -> dict:
    ids = torch.randint(1, 1024, (2, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.model(input_ids=ids, output_hidden_states=True).hidden_states[1:]
        hooks = [model.get_submodule(n).register_forward_pre_hook(round_input) for n in rounded]
        try:
            got = model.model(input_ids=ids, output_hidden_states=True).hidden_states[1:]
        finally:
            for h in hooks:
                h.remove()
    return {"max_relative": [round(float((g - w).abs().max() / w.abs().max()), 4) for g, w in zip(got, want)],
            "norm_relative": [round(float((g - w).norm() / w.norm()), 4) for g, w in zip(got, want)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--widths", default="512,2048")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = []
    for width in (int(w) for w in args.widths.split(",")):
        for kind in ("llama", "hybrid"):
            model, rounded = build(kind, width, args.layers)
            run = {"kind": kind, "hidden_size": width, "layers": args.layers, "tokens": args.tokens,
                   "rounded_linear_layers": len(rounded), **layer_errors(model, rounded, args.tokens)}
            print(json.dumps(run), flush=True)
            runs.append(run)
    args.out.write_text(json.dumps({"device": "cpu", "dtype": "float32", "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

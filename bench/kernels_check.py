"""GPU exactness check of `model.kernels: auto`: fused vs eager on a slice of each benchmark model, in fp32.

    python3 bench/kernels_check.py [--models qwen3.6-27b,llama3.1-8b] [--layers 8] [--json OUT.json]
    python3 bench/kernels_check.py --families qwen2,mistral,phi3,gemma2,gemma3,mixtral --kernels all
        [--speed-tokens 16384] [--json OUT.json]

For each model: the first `--layers` decoder layers of its benchmark config (the Qwen3.6-27B shape: 6 Gated
DeltaNet + 2 full-attention layers; the Llama-3.1-8B shape), random fp32 weights drawn twice with the same seed
(`dflash_prep.target.model.load_model`, as the extraction does), one copy eager and one with the kernels `auto` chooses
on this GPU (`drop_layers_after`, then `apply_kernels`, as the extraction does). One right-padded batch of samples of
different lengths goes through both with the capture hooks and the padding mask (`LayerCapture`, as the
extraction does), and each sample also runs alone through the eager copy. Per captured layer, as max abs
difference / max |value| of the eager states (the relative error `dflash-prep verify` reports):

- `fused_vs_eager`: same batch, fused vs eager: what the kernels change;
- `eager_batched_vs_alone`: eager, batched vs each sample alone: the kernels' own noise (fla's chunk kernels use
  tf32 dots), the level the fused difference is judged against;
- `fused_batched_vs_eager_alone`: the invariant as the extraction sees it with kernels on.

On a MoE target (a sparse block's `gate` router, bench/routing.py) every forward after the eager batch is routed as
the eager batch routed (each token to the same experts with the same weights): the top-k choice is discontinuous, so
float32 noise flips the experts of tokens whose scores nearly tie and moves their states by O(0.1) (the Qwen3.6-35B-A3B
slice without it: eager batched vs alone 0.14-0.21), which measures the routing, not the kernels. `routing` in the
JSON counts the real tokens whose own choice differed: with the fused copy free (its warm-up forward), and with it
pinned (the states compared), and for the samples alone.

`--families` checks bench/families.py's families at their `gpu` size (each family's head dims and layer kinds,
hidden 2048, 6 layers) instead of benchmark models; `--kernels all` lists every kernel the architecture has
(`auto` leaves the families of kernels.AUTO_NOT_MEASURED eager). `--speed-tokens N` adds, per model, the speed
half of the question `auto` asks: the same slice in bfloat16, eager and fused copies, one batch of N tokens in
rows of 2,048 (no padding) through the capture hooks, warmed up twice, then 5 timed forwards each, alternating;
the median seconds, tok/s and fused / eager tok/s (`speed`). A kernel set that is exact but not faster stays out
of `auto`.

Asserted bound: `fused_vs_eager` <= 1e-3 on every layer (verify's fp32 tolerance; an earlier H200 run measured 6.4e-4 for
liger + fla conv on the 27B slice). Exit code 1 when it is exceeded, 2 without CUDA or the kernel libraries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.routing import pin_routing, record_routing  # noqa: E402
from dflash_prep.plan.batches import SampleInfo, collate  # noqa: E402
from dflash_prep.recipe.schema import ModelSection  # noqa: E402
from dflash_prep.target.capture import LayerCapture  # noqa: E402
from dflash_prep.target.kernels import apply_kernels, select_kernels  # noqa: E402
from dflash_prep.target.layers import find_decoder  # noqa: E402
from dflash_prep.target.model import drop_layers_after, load_config, load_model  # noqa: E402

BOUND = 1e-3
LENGTHS = [384, 211, 97, 333, 17, 256, 150, 301]  # one right-padded batch of T = 384


FAMILY_PREFIX = "family:"  # a model name of this form is bench/families.py's family at its `gpu` size


def slice_section(model: str, num_layers: int, tmp: Path, dtype: str = "float32") -> ModelSection:
    """A ModelSection of the benchmark config (or `family:NAME`, the family's `gpu` config) cut to its first
    `num_layers` layers (seed 0). Gemma2 runs eager attention (its logit softcap has no SDPA form), the rest SDPA."""
    attention = "sdpa"
    if model.startswith(FAMILY_PREFIX):
        from bench.families import family_config

        family = model[len(FAMILY_PREFIX):]
        cfg = family_config(family, "gpu").to_dict()
        attention = "eager" if family == "gemma2" else "sdpa"
        if num_layers > cfg["num_hidden_layers"]:
            raise SystemExit(f"{family} has {cfg['num_hidden_layers']} layers at its gpu size: --layers "
                             f"{num_layers} is more")
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:num_layers]
    else:
        cfg = json.loads((REPO / "bench" / "configs" / f"{model}.json").read_text())
        cfg.pop("layer_types", None)  # re-derived from full_attention_interval for the slice
    cfg["num_hidden_layers"] = num_layers
    path = tmp / f"{model.replace(':', '-')}-{num_layers}-{dtype}.json"
    path.write_text(json.dumps(cfg))
    return ModelSection(config=str(path), tokenizer=str(REPO / "dflash_prep" / "demo" / "tiny-demo" / "tokenizer"),
                        dtype=dtype, attn_implementation=attention)


def kernel_choice(kernels: str, config, device: torch.device):
    """`auto`, `all` (every kernel the architecture has, as a list) or a comma-separated list, as select_kernels
    chooses it on `device`."""
    if kernels == "all":
        from dflash_prep.target.kernels import supported_kernels

        return select_kernels(supported_kernels(config)[1], config, device.type)
    return select_kernels(kernels if kernels == "auto" else kernels.split(","), config, device.type)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check_model(model: str, num_layers: int, device: torch.device, tmp: Path, kernels: str = "auto",
                speed_tokens: int = 0) -> dict:
    section = slice_section(model, num_layers, tmp)
    config = load_config(section)
    choice = kernel_choice(kernels, config, device)
    if not choice.names:
        raise SystemExit(f"{model}: `auto` chose no kernels here ({choice.reason}): nothing to check")
    # Both layer kinds of the hybrid (full attention every 4th: 3, 7). Not the last layer: HF's last hidden state,
    # the alone reference, is after the final norm.
    layer_ids = sorted(set(range(1, num_layers - 1, 2)) | {num_layers - 2})
    eager = load_model(section, config, device)
    fused = load_model(section, config, device)
    drop_layers_after(fused, layer_ids[-1])
    apply_kernels(fused, choice)
    g = np.random.default_rng(0)
    samples = [SampleInfo(f"{i:010d}", i, None, g.integers(1, config.vocab_size, n).astype(np.int32),
                          np.ones(n, np.uint8)) for i, n in enumerate(LENGTHS)]
    batch = collate(samples, max(LENGTHS), 0)
    tensors = [t.to(device) for t in (batch.input_ids, batch.attention_mask, batch.position_ids, batch.flat_index)]
    real = tensors[1].flatten().bool()
    runs = {}
    with record_routing(eager) as reference:  # the eager batch's routing: every later forward's (a MoE target)
        runs["eager"], runs["eager_seconds"] = _timed_capture(eager, layer_ids, tensors, device)
    routing = {"routers": len(reference)}  # those the captured layers run (the capture stops at the last)
    with pin_routing(fused, reference, real=real, pin=False) as free, \
            LayerCapture(fused, layer_ids, storage_dtype=torch.float32) as cap:
        cap.run(*tensors)  # first call, free: Triton compiles and autotunes
        _sync(device)
    with pin_routing(fused, reference, real=real) as pinned:
        runs["fused"], runs["fused_seconds"] = _timed_capture(fused, layer_ids, tensors, device, warm=True)
    routing.update(tokens=int(real.sum()), fused_free_rerouted=sum(free.values()),
                   fused_pinned_rerouted=sum(pinned.values()))
    layers = compare(eager, runs, samples, layer_ids, config.hidden_size, device, reference, batch.input_ids.shape[1],
                     routing)
    del eager, fused
    speed = speed_ab(model, num_layers, choice, layer_ids, speed_tokens, device, tmp) if speed_tokens else None
    return {"kernels": list(choice.names), "libraries": choice.libraries, "layer_ids": layer_ids,
            "lengths": LENGTHS, "fp32_forward_seconds": {k: runs[f"{k}_seconds"] for k in ("eager", "fused")},
            "routing": routing, "layers": layers, "speed": speed}


SPEED_ROW_TOKENS = 2048
SPEED_REPEATS = 5


def speed_ab(model: str, num_layers: int, choice, layer_ids: list[int], num_tokens: int, device: torch.device,
             tmp: Path) -> dict:
    """The slice in bfloat16, eager and with `choice`'s kernels, each stopped after the last captured layer: one
    batch of `num_tokens` random tokens in full rows of SPEED_ROW_TOKENS through the capture hooks, two untimed
    forwards each (Triton compiles and autotunes), then SPEED_REPEATS timed forwards each, alternating. Median
    seconds, tok/s, and fused / eager."""
    section = slice_section(model, num_layers, tmp, dtype="bfloat16")
    config = load_config(section)
    copies = {"eager": load_model(section, config, device), "fused": load_model(section, config, device)}
    for m in copies.values():
        drop_layers_after(m, layer_ids[-1])
    apply_kernels(copies["fused"], choice)
    rows = max(1, num_tokens // SPEED_ROW_TOKENS)
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, config.vocab_size, (rows, SPEED_ROW_TOKENS), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    positions = torch.arange(SPEED_ROW_TOKENS, device=device).expand(rows, -1)
    flat = torch.arange(rows * SPEED_ROW_TOKENS, device=device)
    seconds = {k: [] for k in copies}
    with contextlib.ExitStack() as stack:
        caps = {k: stack.enter_context(LayerCapture(m, layer_ids, storage_dtype=torch.bfloat16))
                for k, m in copies.items()}
        for _ in range(2):
            for cap in caps.values():
                cap.run(input_ids, mask, positions, flat)
        for _ in range(SPEED_REPEATS):
            for k, cap in caps.items():
                _sync(device)
                t0 = time.perf_counter()
                cap.run(input_ids, mask, positions, flat)
                _sync(device)
                seconds[k].append(time.perf_counter() - t0)
    tokens = rows * SPEED_ROW_TOKENS
    out = {"tokens": tokens, "rows": rows, "row_tokens": SPEED_ROW_TOKENS, "dtype": "bfloat16"}
    for k, v in seconds.items():
        out[k] = {"median_seconds": float(np.median(v)), "seconds": v, "tokens_per_second": tokens / np.median(v)}
    out["fused_over_eager"] = out["fused"]["tokens_per_second"] / out["eager"]["tokens_per_second"]
    del copies, caps
    return out


def _timed_capture(model, layer_ids, tensors, device, warm: bool = False) -> tuple[torch.Tensor, float]:
    """The captured states [N, k*H] of the batch through `model` and the seconds of that forward (after a first,
    untimed one unless `warm`: Triton compiles and autotunes in it)."""
    with LayerCapture(model, layer_ids, storage_dtype=torch.float32) as cap:
        if not warm:
            cap.run(*tensors)
        _sync(device)
        t0 = time.perf_counter()
        states = cap.run(*tensors).hidden_states_NK
        _sync(device)
    return states, time.perf_counter() - t0


def compare(eager, runs: dict, samples: list, layer_ids: list[int], H: int, device, reference: dict, T: int,
            routing: dict) -> dict:
    """Per layer: the three relative errors of the module docstring (max over samples); each sample alone routed as
    its rows of the eager batch (`reference`, the batch right-padded to T), its own choices counted in `routing`."""
    out = {str(layer): {"fused_vs_eager": 0.0, "eager_batched_vs_alone": 0.0, "fused_batched_vs_eager_alone": 0.0}
           for layer in layer_ids}
    start, routing["alone_pinned_rerouted"] = 0, 0
    for b, s in enumerate(samples):
        n = len(s.input_ids)
        with torch.inference_mode(), pin_routing(eager, reference, rows=slice(b * T, b * T + n)) as rerouted:
            alone = find_decoder(eager)(input_ids=torch.from_numpy(s.input_ids.astype(np.int64))[None].to(device),
                                        use_cache=False, output_hidden_states=True).hidden_states
        routing["alone_pinned_rerouted"] += sum(rerouted.values())
        for slot, layer in enumerate(layer_ids):
            cols = slice(slot * H, (slot + 1) * H)
            e, f = runs["eager"][start:start + n, cols], runs["fused"][start:start + n, cols]
            ref = alone[layer + 1][0]
            row = out[str(layer)]
            row["fused_vs_eager"] = max(row["fused_vs_eager"], relative(f, e))
            row["eager_batched_vs_alone"] = max(row["eager_batched_vs_alone"], relative(e, ref))
            row["fused_batched_vs_eager_alone"] = max(row["fused_batched_vs_eager_alone"], relative(f, ref))
        start += n
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3.6-27b,llama3.1-8b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--kernels", default="auto", help="auto, or a comma-separated list (model.kernels) to check")
    p.add_argument("--device", default="cuda", help="cuda (a CPU has no fused kernels: `auto` is eager there)")
    p.add_argument("--families", default=None,
                   help="bench/families.py families at their gpu size, instead of --models (comma-separated)")
    p.add_argument("--speed-tokens", type=int, default=0,
                   help="also time eager vs fused in bfloat16 on a batch of this many tokens (0: exactness only)")
    args = p.parse_args(argv)
    models = ([FAMILY_PREFIX + f for f in args.families.split(",")] if args.families else args.models.split(","))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("kernels_check needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs in both copies: the kernels are what differs
    results = {"bound": BOUND, "torch": torch.__version__, "models": {},
               "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            res = check_model(model, args.layers, device, Path(tmp), args.kernels, args.speed_tokens)
            results["models"][model] = res
            print(f"{model}: kernels {res['kernels']} {res['libraries']}, fp32 forward eager "
                  f"{res['fp32_forward_seconds']['eager']:.3f}s, fused {res['fp32_forward_seconds']['fused']:.3f}s")
            if res["routing"]["routers"]:
                print("  routing held to the eager batch's; real tokens whose own choice differed (of "
                      f"{res['routing']['tokens']} x {res['routing']['routers']} routers): " +
                      ", ".join(f"{k} {v}" for k, v in res["routing"].items() if k.endswith("rerouted")))
            for layer, row in res["layers"].items():
                print(f"  layer {layer:>2}: " + ", ".join(f"{k} {v:.2e}" for k, v in row.items()))
            if res["speed"]:
                sp = res["speed"]
                print(f"  bf16 speed, {sp['tokens']:,} tokens: eager {sp['eager']['tokens_per_second']:,.0f} tok/s, "
                      f"fused {sp['fused']['tokens_per_second']:,.0f} tok/s: {sp['fused_over_eager']:.3f}x")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    worst = max(row["fused_vs_eager"] for m in results["models"].values() for row in m["layers"].values())
    results["worst_fused_vs_eager"], results["ok"] = worst, worst <= BOUND
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"worst fused vs eager {worst:.2e} (bound {BOUND:.0e}): {'OK' if results['ok'] else 'EXCEEDED'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

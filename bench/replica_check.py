"""Helpers of the `replica` scenario (bench/scenarios.py: targets larger than one GPU, `model.gpus_per_replica`):

    python3 -m bench.replica_check data WORK [--dry-run-cpu]     pre-tokenized data + the configs the steps use
    python3 -m bench.replica_check gemm RESULTS [--dry-run-cpu]  dense bf16 GEMM rate of one GPU (the MFU peak)
    python3 -m bench.replica_check report WORK RESULTS           RESULTS/replica.json + the figures printed

`data` writes WORK/data.parquet (the benchmark's lengths: lognormal mu 5.41, sigma 0.9, clipped to [16, 4096],
seed 0) and WORK/configs/{8b,70b}.json: the Llama-3.1-8B and Llama-3.3-70B shapes of bench/configs, or with
--dry-run-cpu a tiny Llama of 8 layers for both (so every step of the scenario runs on a CPU in seconds).
`report` reads each step's OUT/summary.json and status (WORK/steps.jsonl, the round's) and prints:
the 8B's per-GPU tok/s on 2 GPUs over 1 GPU (data parallel: replicas of 1 GPU), and the 70B replica's tok/s,
MFU over both GPUs (2 x decoder params run x tok/s / (2 x the GEMM rate); attention FLOPs not counted) and
verify's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NUM_SAMPLES = 8000  # ~2.6M tokens: the 8B steps take a prefix (data.max_samples), the 70B a shorter one


def tiny_llama() -> dict:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0).to_dict()


def make_data(work: Path, dry_run_cpu: bool) -> None:
    from bench.samples import make_samples, write_pretokenized

    work.mkdir(parents=True, exist_ok=True)
    configs = work / "configs"
    configs.mkdir(exist_ok=True)
    if dry_run_cpu:
        for name in ("8b", "70b"):
            (configs / f"{name}.json").write_text(json.dumps(tiny_llama()))
        vocab = 1024
    else:
        shutil.copy(REPO / "bench" / "configs" / "llama3.1-8b.json", configs / "8b.json")
        shutil.copy(REPO / "bench" / "configs" / "llama3.3-70b.json", configs / "70b.json")
        vocab = 128256
    samples = make_samples(NUM_SAMPLES, 5.41, 0.9, 16, 4096, vocab, seed=0)
    write_pretokenized(work / "data.parquet", samples, NUM_SAMPLES)
    print(f"data: {NUM_SAMPLES} samples, {samples.params['num_tokens']:,} tokens -> {work / 'data.parquet'}")


def measure_peak(results: Path, dry_run_cpu: bool) -> None:
    import torch

    from bench.timing import measure_gemm

    device = torch.device("cpu" if dry_run_cpu else "cuda")
    gemm = measure_gemm(device, torch.bfloat16, 512 if dry_run_cpu else 8192)
    (results / "gemm.json").write_text(json.dumps(gemm, indent=2))
    print(f"GEMM {gemm['size']}^3 bf16 on {gemm['device']}: {gemm['tflops']:.1f} TFLOP/s (median of "
          f"{gemm['repeats']})")


def decoder_params(config_path: Path) -> int:
    """Parameters of every decoder layer (all run: the final state is captured), counted on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_prep.target.layers import decoder_layers, find_decoder

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_path))
    return sum(p.numel() for layer in decoder_layers(find_decoder(model)) for p in layer.parameters())


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_figures(summary: dict | None) -> dict | None:
    if summary is None:
        return None
    return {"tokens_per_second": summary["tokens_per_second"], "num_tokens": summary["num_tokens_this_run"],
            "loop_seconds": max(r["loop_seconds"] for r in summary["ranks"]),
            "wall_seconds": summary["wall_seconds"], "replicas": summary.get("replicas"),
            "kernels": summary.get("kernels", {}).get("applied"), "disk": summary.get("disk"),
            "num_failed": summary.get("num_failed"), "num_oom": summary.get("num_oom"),
            "peak_gpu_memory_bytes": [r.get("peak_gpu_memory_bytes") for r in summary["ranks"]],
            "triton_cache": summary.get("triton_cache")}


def report(work: Path, results: Path) -> dict:
    steps = {}
    for line in (work / "steps.jsonl").read_text().splitlines() if (work / "steps.jsonl").exists() else []:
        step = json.loads(line)
        steps[step["name"]] = step
    gemm = _read_json(results / "gemm.json")
    out = {"steps": steps, "gemm": gemm, "work_dir": str(work), "disk": _read_json(work / "disk.json")}
    one, two = (_run_figures(_read_json(results / f"8b-{n}gpu.summary.json")) for n in (1, 2))
    out["8b_1gpu"], out["8b_2gpu"] = one, two
    if one and two:
        out["8b_per_gpu_ratio"] = two["tokens_per_second"] / 2 / one["tokens_per_second"]
        print(f"8B shape, data parallel: 1 GPU {one['tokens_per_second']:,.0f} tok/s "
              f"(loop {one['loop_seconds']:.0f} s); "
              f"2 GPUs {two['tokens_per_second']:,.0f} tok/s (loop {two['loop_seconds']:.0f} s); per-GPU ratio "
              f"{out['8b_per_gpu_ratio']:.3f} (target >= 0.95); output on {out['disk']}")
    else:
        print(f"8B shape: no ratio (1 GPU: {steps.get('8b-1gpu', {}).get('status')}, "
              f"2 GPUs: {steps.get('8b-2gpu', {}).get('status')})")
    for name in ("70b-tp", "70b-layer-split"):
        run = _run_figures(_read_json(results / f"{name}.summary.json"))
        if run is None:
            continue
        params = decoder_params(work / "configs" / "70b.json")
        gpus = run["replicas"]["gpus_per_replica"] * run["replicas"]["num_replicas"]
        peak = gemm["flops_per_second"] if gemm else None
        run["decoder_params_run"] = params
        run["mfu_over_all_gpus"] = 2 * params * run["tokens_per_second"] / (gpus * peak) if peak else None
        verify = steps.get(f"verify-{name}", {})
        run["verify"] = verify.get("status")
        one = steps.get(f"verify-{name}-one-process")  # a tensor-parallel output, also checked by one process
        run["verify_one_process"] = one.get("status") if one else None
        out[name] = run
        computing = ("both GPUs compute (tensor parallel)" if run["replicas"]["parallelism"] == "tensor_parallel"
                     else "one GPU computes at a time (layer split)")
        mfu = f"{run['mfu_over_all_gpus']:.3f}" if run["mfu_over_all_gpus"] is not None else "n/a"
        peak_text = f"{gemm['tflops']:.0f}" if gemm else "n/a"
        print(f"70B shape ({name}): {run['replicas']}: {run['tokens_per_second']:,.0f} tok/s over "
              f"{run['num_tokens']:,} tokens (loop {run['loop_seconds']:.0f} s), MFU over {gpus} GPUs {mfu} "
              f"({computing}; "
              f"{params / 1e9:.1f}B decoder params, GEMM peak {peak_text} TFLOP/s per GPU); "
              f"peak memory {[round((b or 0) / 1e9, 1) for b in run['peak_gpu_memory_bytes']]} GB; "
              f"verify: {run['verify']}" + (f" (one process: {run['verify_one_process']})"
                                            if run["verify_one_process"] else ""))
    (results / "replica.json").write_text(json.dumps(out, indent=2, default=str))
    print(f"-> {results / 'replica.json'}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.replica_check")
    p.add_argument("what", choices=("data", "gemm", "report"))
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--dry-run-cpu", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.what == "data":
        make_data(args.paths[0], args.dry_run_cpu)
    elif args.what == "gemm":
        measure_peak(args.paths[0], args.dry_run_cpu)
    else:
        report(args.paths[0], args.paths[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

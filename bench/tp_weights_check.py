"""Do a tensor-parallel replica's random weights and forward equal the documented per-module draw? (GPU check.)

`dflash-prep verify` of the 70B shape extracted as one tensor-parallel replica of 2 GPUs failed on every layer
(relative L2 ~1.0 at layer 1, ~1.41 deeper: about half of layer 1's state agrees, nothing deeper), while the
same code passes on CPU processes (tests/test_replica_tp.py). Cause found on CPU: verify's layer-split reference
carries accelerate hooks on every module with parameters (placed by a device_map over 2 GPUs), and the norm-form
probe of `norms.randomize_norm_gains` failed on them, so every norm kept unit gain there (fixed: the probe runs the
module class's own forward); unit vs drawn gains give relative L2 1.05 at layer 1 of the 70B widths. This check
confirms it on GPUs and localizes any other difference, on the 70B shape cut to a few decoder layers (every width
as in the 70B: about 8 GB of bf16 weights per model), ONE command:

    python3 -m bench.tp_weights_check RESULTS_DIR [--config bench/configs/llama3.3-70b.json] [--layers 2]
    python3 -m bench.tp_weights_check RESULTS_DIR --dry-run-cpu        (2 CPU processes over gloo, tiny model)

Steps (each under a timeout; a failed step does not stop the next; everything logged to RESULTS_DIR/check.log):
1. `rng`: one process; the same seed drawn on cuda:0 and cuda:1 (current device 0), equal or not.
2. `tp`: 2 processes (torch.distributed.run), each builds the replica as the extraction does
   (model.load_replica_model, tensor_parallel) and the documented reference on its own GPU
   (model.build_random_model on one device); per parameter: DTensor or not, local shard vs the reference's slice
   (max abs difference); the whole tensor each process draws for one module seed (checksums compared across
   processes); one forward of fixed tokens through both: relative L2 of every layer's output, per process.
3. `layer_split`: one process holding both GPUs builds verify's reference (load_replica_model, layer_split) and
   compares every parameter with the one-device reference.
4. `extract` + `verify`: the failing pair itself on the 70B widths cut to 8 decoder layers (64 samples, tensor
   parallel over 2 processes, then `dflash-prep verify`): whether the failure shows without the 70B's depth.
Writes RESULTS_DIR/tp_weights.json (every figure) and prints a verdict: which side differs from the rule.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEED = 0


def _config(path: str, layers: int, dry_run_cpu: bool):
    from transformers import AutoConfig, LlamaConfig

    if dry_run_cpu:
        return LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
    config = AutoConfig.from_pretrained(path)
    config.num_hidden_layers = layers
    return config


def _section(dry_run_cpu: bool):
    from dflash_prep.recipe.schema import ModelSection

    return ModelSection(config="check", gpus_per_replica=2, dtype="float32" if dry_run_cpu else "bfloat16",
                        attn_implementation="sdpa")


def _param_report(model, reference, slice_of) -> dict:
    """Per parameter: DTensor or not, max |local - reference slice|; -> {"params": {...}, "mismatched": [...]}."""
    from torch.distributed.tensor import DTensor

    ref = dict(reference.named_parameters())
    params, mismatched = {}, []
    for name, param in model.named_parameters():
        is_dtensor = isinstance(param, DTensor)
        local = param.to_local() if is_dtensor else param
        expected = slice_of(ref[name].to(local.device), param) if is_dtensor else ref[name].to(local.device)
        diff = (local.float() - expected.float()).abs().max().item() if local.shape == expected.shape else None
        params[name] = {"dtensor": is_dtensor, "local_shape": list(local.shape), "max_abs_diff": diff,
                        "placements": str(param.placements) if is_dtensor else None}
        if diff is None or diff > 0:
            mismatched.append(name)
    return {"params": params, "mismatched": mismatched, "num_params": len(params)}


def _forward_report(model, reference, config, device) -> dict:
    """Relative L2 of every layer's output (HF hidden_states) of the replica vs the one-device reference."""
    import torch

    from dflash_prep.target.layers import find_decoder

    tokens = torch.randint(3, min(config.vocab_size, 30000), (1, 96), generator=torch.Generator().manual_seed(1))
    out = {}
    with torch.inference_mode():
        got = find_decoder(model)(input_ids=tokens.to(device), use_cache=False, output_hidden_states=True)
        want = find_decoder(reference)(input_ids=tokens.to(device), use_cache=False, output_hidden_states=True)
    for i, (g, w) in enumerate(zip(got.hidden_states, want.hidden_states)):
        out[str(i)] = float(torch.linalg.vector_norm((g.float() - w.float())) / torch.linalg.vector_norm(w.float()))
    return out


def tp_worker(args) -> None:
    """One process of the replica (under torch.distributed.run)."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from dflash_prep.target.model import _module_seed, build_random_model, load_replica_model
    from dflash_prep.target.replica import TENSOR_PARALLEL, ReplicaLayout

    cpu = args.dry_run_cpu
    dist.init_process_group("gloo" if cpu else "nccl")
    rank = dist.get_rank()
    if not cpu:
        torch.cuda.set_device(rank)
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    report = {"rank": rank, "current_device": None if cpu else torch.cuda.current_device()}
    config, section = _config(args.config, args.layers, cpu), _section(cpu)
    layout = ReplicaLayout(2, TENSOR_PARALLEL, 0, 1, rank, (0, 1))
    t0 = time.perf_counter()
    model = load_replica_model(section, config, layout)
    report["tp_load_seconds"] = time.perf_counter() - t0
    reference = build_random_model(section, config, {"device_map": {"": device}})

    def slice_of(whole, param):
        return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()

    report["weights"] = _param_report(model, reference, slice_of)
    torch.manual_seed(_module_seed(SEED, "model.layers.0.mlp.gate_proj"))  # the same module seed on every process
    draw = torch.empty(4096, 4096, dtype=torch.bfloat16, device=device).normal_()
    digest = hashlib.sha256(draw.float().cpu().numpy().tobytes()).hexdigest()[:16]
    digests = [None, None]
    dist.all_gather_object(digests, digest)
    report["module_seed_draw_digests"] = digests
    report["forward_rel_l2"] = _forward_report(model, reference, config, device)
    Path(args.results, f"tp-rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def rng_check() -> dict:
    import torch

    if torch.cuda.device_count() < 2:
        return {"skipped": "fewer than 2 GPUs"}
    torch.cuda.set_device(0)
    out = {}
    for n in (4096, 1 << 24):
        torch.manual_seed(1234)
        a = torch.empty(n, dtype=torch.bfloat16, device="cuda:0").normal_()
        torch.manual_seed(1234)
        b = torch.empty(n, dtype=torch.bfloat16, device="cuda:1").normal_()
        out[str(n)] = bool(torch.equal(a.cpu(), b.cpu()))
    return {"same_draw_on_cuda0_and_cuda1": out}


def layer_split_check(args) -> dict:
    import torch

    from dflash_prep.target.model import build_random_model, load_replica_model
    from dflash_prep.target.replica import LAYER_SPLIT, ReplicaLayout

    config, section = _config(args.config, args.layers, False), _section(False)
    model = load_replica_model(section, config, ReplicaLayout(2, LAYER_SPLIT, 0, 1, 0, (0, 1)))
    placed = sorted(set(map(str, model.hf_device_map.values())))
    reference = build_random_model(section, config, {"device_map": {"": torch.device("cuda", 0)}})
    report = _param_report(model, reference, None)
    report["devices"] = placed
    return report


def extract_and_verify(args, results: Path, log) -> dict:
    """Steps 4-5: the extraction (tensor parallel, 2 processes) of the cut 70B shape, then verify; their logs."""
    work = results / "work"
    steps = {"data": run_step("data", [sys.executable, "-m", "bench.replica_check", "data", str(work)]
                              + (["--dry-run-cpu"] if args.dry_run_cpu else []), results, 120, log)}
    config = _config(args.config, 8, args.dry_run_cpu)
    (work / "configs").mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(work / "configs" / "cut.json"))
    out = work / "out"
    sets = [f"data.path={work / 'data.parquet'}", "data.max_length=4096", "model.tokenizer=dflash_prep/demo/tiny-demo/tokenizer",
            f"model.dtype={'float32' if args.dry_run_cpu else 'bfloat16'}", "layers.preset=eagle3",
            "batching.max_tokens_per_batch=16384", "batching.num_workers=2", "output.overwrite=true",
            f"model.config={work / 'configs' / 'cut.json'}", "model.gpus_per_replica=2", "data.max_samples=64",
            "layers.capture_final=after_norm", "output.dtype=bfloat16", f"output.dir={out}"]
    procs = (["--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml")] if args.dry_run_cpu
             else ["--multi_gpu", "--num_processes", "2"])
    steps["extract"] = run_step("extract", [sys.executable, "-m", "dflash_prep.commands.cli", "launch", *procs, "extract.py",
                                            *[a for s in sets for a in ("--set", s)]], results, 300, log)
    steps["verify"] = run_step("verify", [sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(out),
                                          "--num-samples", "8", "--skip-hash"], results, 240, log)
    text = (results / "verify.log").read_text() if (results / "verify.log").exists() else ""
    verdict = [line for line in text.splitlines() if line.startswith(("layer ", "verify: OK", "verify: FAILED"))]
    for line in verdict:
        log(f"verify: {line}")
    shutil.rmtree(out, ignore_errors=True)  # ~1 GB of states; the logs stay
    return steps


def run_step(name: str, cmd: list[str], results: Path, timeout_s: int, log) -> str:
    log(f"{name}: start: {' '.join(cmd)}")
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))})
        (results / f"{name}.log").write_text(proc.stdout + proc.stderr)
        status = "ok" if proc.returncode == 0 else f"failed (exit code {proc.returncode})"
    except subprocess.TimeoutExpired as e:
        (results / f"{name}.log").write_text(str(e.stdout or "") + str(e.stderr or ""))
        status = "timeout"
    log(f"{name}: {status} in {time.time() - t0:.0f}s")
    return status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--config", default=str(REPO / "bench" / "configs" / "llama3.3-70b.json"))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dry-run-cpu", action="store_true")
    p.add_argument("--step", choices=["tp", "rng", "layer_split"], help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    if args.step == "tp":
        tp_worker(args)
        return 0
    if args.step in ("rng", "layer_split"):
        out = rng_check() if args.step == "rng" else layer_split_check(args)
        (results / f"{args.step}.json").write_text(json.dumps(out, indent=1))
        return 0
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.dry_run_cpu:
        os.environ["DFLASH_PREP_CPU_REPLICAS"] = "1"  # test-only: CPU processes stand for the GPUs
    log_file = open(results / "check.log", "a")

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    common = ["--config", args.config, "--layers", str(args.layers)] + (["--dry-run-cpu"] if args.dry_run_cpu else [])
    me = [sys.executable, "-m", "bench.tp_weights_check", str(results)]
    steps = {}
    if not args.dry_run_cpu:
        steps["rng"] = run_step("rng", me + ["--step", "rng"], results, 120, log)
    env_cpu = ["--master_port", "29533"]
    steps["tp"] = run_step("tp", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *env_cpu,
                                  "-m", "bench.tp_weights_check", str(results), "--step", "tp", *common],
                           results, 300, log)
    if not args.dry_run_cpu:
        steps["layer_split"] = run_step("layer_split", me + ["--step", "layer_split", *common], results, 240, log)
    steps.update(extract_and_verify(args, results, log))
    summary = {"steps": steps}
    for name in ("rng.json", "tp-rank0.json", "tp-rank1.json", "layer_split.json"):
        if (results / name).exists():
            summary[name[:-5]] = json.loads((results / name).read_text())
    (results / "tp_weights.json").write_text(json.dumps(summary, indent=1))
    for key in ("tp-rank0", "tp-rank1", "layer_split"):
        r = summary.get(key)
        if r is None:
            log(f"{key}: no result")
            continue
        w = r.get("weights", r)
        log(f"{key}: {len(w['mismatched'])} of {w['num_params']} parameters differ from the documented draw "
            f"(first: {w['mismatched'][:4]}); DTensor params: "
            f"{sum(v['dtensor'] for v in w['params'].values())}")
        if "forward_rel_l2" in r:
            log(f"{key}: forward rel L2 per hidden state vs the one-device reference: "
                f"{ {k: round(v, 4) for k, v in r['forward_rel_l2'].items()} }; whole-draw digests "
                f"{r['module_seed_draw_digests']}")
    if "rng" in summary:
        log(f"rng: {summary['rng']}")
    return 0 if all(s == "ok" for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

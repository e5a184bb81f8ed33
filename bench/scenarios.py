"""Device rounds as named scenarios: one command runs a scenario's steps on the GPU machine, each under a time limit,
all within one deadline, every step logged (the round itself: device_round.py).

    python3 -m bench list
    python3 -m bench run SCENARIO [RESULTS_DIR] [--deadline-seconds S] [--set NAME=VALUE ...] [--dry-run-cpu]
                                                [-- ARGS for the `bench` scenario's run_bench.py]

What a round does around its steps (`Round`):
- the environment: on an offline GPU machine the wheels of WHEEL_DIR (default `.whl/`; datasets, webdataset,
  flash-linear-attention, liger-kernel) are installed into a folder of their own, put first on PYTHONPATH with the
  checkout; `alt_wheels` (e.g. another transformers) goes before them for the scenarios that take it;
  RESULTS_DIR/env.txt gets the GPUs and the library versions;
- a step runs a command under `timeout`: the step's own limit or what is left of the round's deadline, whichever
  is less (skipped when 20 s or less are left); its output goes to RESULTS_DIR/logs/NAME.log, its outcome (ok,
  timeout, failed with the exit code, skipped) to RESULTS_DIR/steps.jsonl and the console, with the log's last
  lines that carry figures; a step that ends in a timeout has its process tree stopped (SIGTERM, then SIGKILL
  10 s later); a failed step never stops the next one. The round's exit code is 1 when a step did not end ok;
- `--dry-run-cpu` runs every step a CPU can run with tiny models and tiny data in the same order (GPU-only steps,
  e.g. a CUDA profile, are skipped and said so), so the scenario itself is tested before it costs device time.

Result files are the benchmark's own (bench/results/*.json and .md by run_bench.py, the checks' JSON); bench/RESULTS.md
is written from them by hand. bench/README.md describes each scenario.
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

from bench.device_round import CONFIGS, REPO, SCENARIOS, TOKENIZER, Round, scenario, shm_or_tmp


def _bench(r: Round, model: str, out_dir: Path, *args: str) -> list[str]:
    """bench/run_bench.py on `model` (a tiny one on the CPU in a dry run), results in RESULTS_DIR."""
    if r.dry:
        model = TINY.get(model, model)
        args = (*args, "--device", "cpu", "--num-samples", "24")
    return r.python("bench/run_bench.py", "--results-dir", r.results, "--model", model, "--out-dir", out_dir, *args)


# The CPU stand-ins of a dry run: a tiny model of the same token mixers (the MoE shapes' plumbing is the dense one's)
TINY = {"qwen3.6-27b": "tiny-qwen3.5", "llama3.1-8b": "tiny-llama", "qwen3-8b": "tiny-llama",
        "qwen3-30b-a3b": "tiny-llama", "qwen3.6-35b-a3b": "tiny-qwen3.5"}


def _tiny(model_list: str) -> str:
    return ",".join(TINY.get(m, m) for m in model_list.split(","))


# -------------------------------------------------------------------------------------------------- scenarios
@scenario("smoke", 1, "the demo recipe on the GPU in bf16, its summary")
def smoke(r: Round) -> None:
    out = r.work / "smoke"
    r.step("demo-bf16", 300, r.extract(out, "model.dtype=bfloat16", *(["data.max_samples=60"] if r.dry else [])))
    r.keep(out, "smoke")
    summary = r.results / "smoke.summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        r.say(str({k: s[k] for k in ("num_samples_written", "num_tokens_written", "tokens_per_second",
                                     "padding_efficiency")}))


@scenario("bench", 1, "bench/run_bench.py with the arguments after `--` (default: the 27B, every mode, cold and warm)",
          deadline_seconds=3600)
def bench(r: Round) -> None:
    args = r.extra_args or ["--modes", "per_sample,fixed_batch,dflash_prep,per_sample_warm,fixed_batch_warm,"
                                       "dflash_prep_warm"]
    model = "qwen3.6-27b"
    if "--model" in args:
        i = args.index("--model")
        model, args = args[i + 1], args[:i] + args[i + 2:]
    r.step("run-bench", r.deadline, _bench(r, model, r.work, *args))


@scenario("kernels", 1, "model.kernels on a GPU: fused vs eager in fp32 (kernels_check.py), then a bf16 extraction "
          "of each tiny architecture with the fused kernels and verify against the same kernels and eager",
          check="1:run kernels_check.py first (0: skip it)")
def kernels(r: Round) -> None:
    if r.flag("check"):  # fused kernels exist on CUDA only: nothing to compare on a CPU
        r.step("kernels-check", 200, r.python("bench/kernels_check.py", "--json", r.results / "kernels_check.json"),
               gpu_only=True)
    for arch, sets in _tiny_archs():
        out = r.work / f"kernels-{arch}"
        if r.step(f"extract-{arch}", 200, r.extract(out, "model.dtype=bfloat16", "data.max_samples=" +
                                                     ("60" if r.dry else "300"), *sets)) == 0:
            r.step(f"verify-{arch}", 150, r.verify(out, "--num-samples", "16", "--seed", "0"))
            r.step(f"verify-{arch}-eager", 150, r.verify(out, "--num-samples", "16", "--seed", "0", "--skip-hash",
                                                        "--set", "model.kernels=eager"))
        r.keep(out, f"kernels-{arch}")


def _tiny_archs() -> list[tuple[str, list[str]]]:
    """The demo's Qwen3.5 hybrid (final state before the norm) and a tiny Llama (EAGLE-3, final after the norm)."""
    return [("qwen3.5", ["layers.capture_final=before_norm"]),
            ("llama", [f"model.config={CONFIGS / 'tiny-llama.json'}", "layers.preset=eagle3",
                       "layers.capture_final=after_norm"])]


@scenario("packing", 1, "packed rows on a GPU: one packed row vs each sample alone (packing_check.py, fp32 and bf16 "
          "slices of the 27B and 8B shapes; then every family's GPU-sized config, bench/families.py, with the "
          "attention function checked alone), then a packed bf16 extraction of each tiny architecture and verify",
          check="1:run packing_check.py on the benchmark slices (0: skip it)",
          families="1:run packing_check.py on every family (0: skip it)",
          extract="1:the packed extractions (0: skip them)")
def packing(r: Round) -> None:
    if r.flag("check"):
        device = ["--device", "cpu", "--models", "tiny-qwen3.5,tiny-llama"] if r.dry else []
        r.step("packing-check", 540, r.python("bench/packing_check.py", "--json", r.results / "packing_check.json",
                                               *device))
    if r.flag("families"):
        size = ["--device", "cpu", "--size", "tiny", "--dtypes", "float32"] if r.dry else []
        r.step("packing-check-families", 540, r.python(
            "bench/packing_check.py", "--models", "none", "--families", "all",
            "--json", r.results / "packing_check_families.json", *size))
    if not r.flag("extract"):
        return
    for arch, sets in _tiny_archs():
        out = r.work / f"packing-{arch}"
        dtype = "model.dtype=float32" if r.dry else "model.dtype=bfloat16"  # a CPU packs exactly in fp32
        if r.step(f"extract-{arch}", 300, r.extract(out, dtype, "batching.packing=true", "data.max_samples=" +
                                                     ("60" if r.dry else "300"), *sets)) == 0:
            r.step(f"verify-{arch}", 300, r.verify(out, "--num-samples", "16", "--seed", "0"))
        r.keep(out, f"packing-{arch}")


@scenario("balance", 2, "2 GPUs, the 8B shape on 4,500 samples (EAGLE-3 + final, fp8): the split by predicted time, "
          "the load beside tokenizing, verify, and per rank loop vs predicted seconds (balance_report.py)")
def balance(r: Round) -> None:
    data, out = r.work / "data.parquet", r.work / "out"
    num, vocab = (400, 1024) if r.dry else (4500, 128256)
    r.step("data", 90, r.python("-c", "import sys; from pathlib import Path; from bench.samples import make_samples, "
                                      "write_pretokenized; n, v = int(sys.argv[2]), int(sys.argv[3]); "
                                      "s = make_samples(n, 5.41, 0.9, 16, 4096, v, seed=0); "
                                      "write_pretokenized(Path(sys.argv[1]), s, n); print(s.params)",
                                data, num, vocab))
    config = CONFIGS / ("tiny-llama.json" if r.dry else "llama3.1-8b.json")
    r.step("extract", 330, r.launch(r.two_processes(), out, f"data.path={data}", "data.max_length=4096",
                                    f"model.config={config}", f"model.tokenizer={TOKENIZER}",
                                    "model.dtype=bfloat16", "layers.preset=eagle3", "layers.capture_final=after_norm",
                                    "output.dtype=fp8_e4m3", "batching.max_tokens_per_batch=auto",
                                    "output.overwrite=true"))
    r.step("verify", 240, r.verify(out, "--num-samples", "16", "--seed", "0"))
    r.step("balance", 120, r.python("bench/balance_report.py", out, r.results / "balance.txt"))
    for name in ("summary.json", "plan.json"):
        if (out / name).is_file():
            shutil.copy(out / name, r.results / name)


@scenario("replica", 2, "targets larger than one GPU: the 70B shape as one tensor-parallel replica of 2 GPUs (or a "
          "layer split), verified as the replica and as one process; the 8B on 1 GPU then 2 (per-GPU ratio)",
          run_8b="1:the 8B steps (0: skip them)")
def replica(r: Round) -> None:
    work, dry = r.work, ["--dry-run-cpu"] if r.dry else []
    if r.dry:
        r.env["DFLASH_PREP_CPU_REPLICAS"] = "1"  # test-only: a node's CPU processes stand for its GPUs
    env: dict = {}
    n70, n8, nwarm = (48, 240, 16) if r.dry else (640, 7800, 64)
    (work / "disk.json").write_text(json.dumps(f"{work} ({_filesystem(work)})"))
    r.step("data", 90, r.python("-m", "bench.replica_check", "data", work, *dry))
    r.step("gemm", 60, r.python("-m", "bench.replica_check", "gemm", r.results, *dry))
    common = [f"data.path={work / 'data.parquet'}", "data.max_length=4096", f"model.tokenizer={TOKENIZER}",
              "model.dtype=bfloat16", "layers.preset=eagle3", "batching.max_tokens_per_batch=auto",
              "batching.num_workers=2", f"model.triton_cache_dir={work / 'triton'}", "output.overwrite=true"]
    c70 = [f"model.config={work / 'configs' / '70b.json'}", "model.gpus_per_replica=2", f"data.max_samples={n70}",
           "layers.capture_final=after_norm", "output.dtype=bfloat16"]
    out = work / "out-70b-tp"
    if r.step("70b-tp", 200, r.launch(r.two_processes(), out, *common, *c70), env=env) == 0:
        # the reference computed as the extraction ran (the same tensor-parallel replica), then by one process
        r.step("verify-70b-tp", 200, r.python("-m", "dflash_prep.commands.cli", "launch", *r.two_processes(), "-m",
                                              "dflash_prep.commands.cli", "verify", out, "--num-samples", "8",
                                              "--seed", "0", "--skip-hash"), env=env)
        r.step("verify-70b-tp-one-process", 170, r.verify(out, "--num-samples", "8", "--seed", "0"), env=env)
        r.keep(out, "70b-tp")
    else:
        r.keep(out, "70b-tp")
        out = work / "out-70b-ls"
        if r.step("70b-layer-split", 200, r.launch(["--num_processes", "1"], out, *common, *c70,
                                                   "model.replica_parallelism=layer_split"), env=env) == 0:
            r.step("verify-70b-layer-split", 150, r.verify(out, "--num-samples", "8", "--seed", "0"), env=env)
        r.keep(out, "70b-layer-split")
    if r.flag("run_8b"):
        c8 = [f"model.config={work / 'configs' / '8b.json'}", "layers.capture_final=none", "output.dtype=fp8_e4m3"]
        out = work / "out-8b-warmup"  # fills the shared Triton cache; not measured
        r.step("8b-warmup", 90, r.launch(["--num_processes", "1"], out, *common, *c8, f"data.max_samples={nwarm}"))
        shutil.rmtree(out, ignore_errors=True)
        for name, launch in (("8b-1gpu", ["--num_processes", "1"]), ("8b-2gpu", r.two_processes())):
            out = work / f"out-{name}"
            r.step(name, 170, r.launch(launch, out, *common, *c8, f"data.max_samples={n8}"), env=env)
            r.keep(out, name)
    shutil.copy(r.results / "steps.jsonl", work / "steps.jsonl")
    r.step("report", 60, r.python("-m", "bench.replica_check", "report", work, r.results))


def _filesystem(path: Path) -> str:
    found = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)], capture_output=True, text=True)
    fs = found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else "unknown"
    return f"{fs} filesystem: " + ("memory, not a disk" if fs in ("tmpfs", "ramfs") else "a disk, not /dev/shm")


def _kernels_value(option: str) -> str:
    """`model.kernels` of a variant: `eager` or `auto` as they are, else the comma list as a YAML list."""
    return option if option in ("eager", "auto") else f"[{option}]"


@scenario("shapes", 1, "every target shape `plan` must predict, one after the other in one run, each cold then warm "
          "with the defaults (packed rows, model.kernels auto): the Llama-3.1-8B baseline, Qwen3-8B, the Qwen3-30B-A3B MoE "
          "and the Qwen3.6-35B-A3B hybrid MoE; then plan_check.py on every committed report and these",
          deadline_seconds=570, models="llama3.1-8b,qwen3-8b,qwen3-30b-a3b,qwen3.6-35b-a3b:the benchmark models",
          tokens="400000:real tokens of each run", seconds="125:the limit of each model's run (with a variant: 1.5x)",
          qwen3_kernels="liger_rms_norm,liger_swiglu,liger_rope:Qwen3-8B's variant, A/B against `auto` (which "
                        "applies these three since they were measured faster; empty: no variant)",
          moe_hybrid_kernels="eager:the Qwen3.6-35B-A3B's variant, A/B against `auto` (which applies liger_rms_norm, "
                             "fla_conv and fla_gated_norm since they were measured faster; eager, a list, or empty: "
                             "no variant)",
          moe_kernels="eager:the Qwen3-30B-A3B's variant, A/B against `auto` (which applies liger_rms_norm and "
                      "liger_rope since they were measured faster; eager, a list, or empty: no variant)")
def shapes(r: Round) -> None:
    out = (r.work if r.dry else shm_or_tmp(40)) / "bench-out"
    tokens = ["--dflash-max-tokens", r.opt("tokens")] if not r.dry else []
    variants = {"qwen3-8b": r.opt("qwen3_kernels"), "qwen3.6-35b-a3b": r.opt("moe_hybrid_kernels"),
                "qwen3-30b-a3b": r.opt("moe_kernels")}
    for model in r.opt("models").split(","):
        modes, seconds = ["--modes", "dflash_prep,dflash_prep_warm"], int(r.opt("seconds"))
        if variants.get(model) and not r.dry:  # the fused kernels' speed (CUDA only)
            modes = ["--modes", "dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_variant_warm",
                     "--variant-set", f"model.kernels={_kernels_value(variants[model])}"]
            seconds = int(seconds * 1.5)
        r.step(f"bench-{model}", seconds, _bench(r, model, out, *modes, *tokens))
    # the plan of each job against what it measured (CPU arithmetic: the committed reports are references too)
    r.step("plan-check", 120, r.python("bench/plan_check.py", "--results-dir", "bench/results", "--results-dir",
                                       r.results, "--check-dir", r.results, "--json", r.results / "plan_check.json"))


@scenario("round", 2, "one benchmark round on 2 GPUs at once: the 27B hybrid on GPU 0, the 8B shape on GPU 1, each as "
          "packed rows (cold, warm, the padded A/B, a fresh process); the 8B also profiled and with 65,536-token rows",
          one_gpu="0:both models on GPU 0, one after the other", packed_row_tokens="32768:tokens of a packed row",
          modes_8b=":the 8B's modes (default: dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_fresh,"
                   "dflash_prep_profile)")
def round_(r: Round) -> None:
    out = (r.work if r.dry else shm_or_tmp(60)) / "bench-out"
    row = r.opt("packed_row_tokens")
    packed = ["--dflash-set", "batching.packing=true", "--dflash-set", f"batching.max_tokens_per_batch={row}"]
    one = r.flag("one_gpu")

    def gpu0() -> None:
        r.step("27b-packed", r.deadline, _bench(r, "qwen3.6-27b", out, *packed, "--modes",
                                                 "dflash_prep,dflash_prep_warm,dflash_prep_variant,"
                                                 "dflash_prep_variant_warm,dflash_prep_fresh", "--variant-set",
                                                 "batching.packing=false", "--variant-set",
                                                 "batching.max_tokens_per_batch=65536"), gpus="0")

    def gpu1() -> None:
        modes = r.opt("modes_8b") or ("dflash_prep,dflash_prep_warm,dflash_prep_profile,dflash_prep_variant" if one
                                      else "dflash_prep,dflash_prep_warm,dflash_prep_variant,dflash_prep_fresh,"
                                           "dflash_prep_profile")
        gpu = "0" if one else "1"
        r.step("8b-packed", r.deadline, _bench(r, "llama3.1-8b", out, *packed, "--modes", modes, "--variant-set",
                                                "batching.packing=false", "--variant-set",
                                                "batching.max_tokens_per_batch=131072"), gpus=gpu)
        r.step("8b-packed-65k", r.deadline, _bench(r, "llama3.1-8b", out, "--dflash-set", "batching.packing=true",
                                                    "--dflash-set", "batching.max_tokens_per_batch=65536",
                                                    "--modes", "dflash_prep,dflash_prep_warm"), gpus=gpu)

    if one:
        gpu0()
        gpu1()
    else:
        r.parallel(gpu0, gpu1)


@scenario("levers", 1, "the 27B hybrid's forward levers: padded batches cold and warm, then kernels_check.py on its "
          "slice in fp32", deadline_seconds=540, model="qwen3.6-27b:the benchmark model",
          kc_models="qwen3.6-27b:the models of kernels_check.py")
def levers(r: Round) -> None:
    out = shm_or_tmp(60) / "bench-out" if not r.dry else r.work / "bench-out"
    r.step("27b-padded", 380, _bench(r, r.opt("model"), out, "--dflash-set", "batching.packing=false", "--modes",
                                     "dflash_prep,dflash_prep_warm"))
    r.step("kernels-check", 200, r.python("bench/kernels_check.py", "--models", r.opt("kc_models"), "--json",
                                          r.results / "kernels_check_gated_norm.json"), gpu_only=True)


@scenario("long", 1, "the 27B hybrid on a longer job (800,000 tokens: the once-per-job tail amortized) and the packing "
          "check of the transformers it runs", deadline_seconds=540,
          alt_wheels=":a folder of wheels (e.g. another transformers) first on PYTHONPATH for every step",
          model="qwen3.6-27b:the benchmark model", pc_seconds="300:packing check's limit (0: skip it)",
          pc_models="qwen3.6-27b:models of packing_check.py", long="1:the long run (0: skip it)",
          long_samples="3000:samples of the long run's list", long_tokens="800000:real tokens of the long run",
          short="0:also the standard 250,000-token run", short_modes="dflash_prep,dflash_prep_warm:its modes",
          short_seconds="200:its limit", run_8b="0:also the 8B's standard run", model_8b="llama3.1-8b:that model")
def long(r: Round) -> None:
    out = r.work / "bench-out" if r.dry else shm_or_tmp(60) / "bench-out"
    if int(r.opt("pc_seconds")) > 0:
        device = ["--device", "cpu"] if r.dry else []
        models = _tiny(r.opt("pc_models")) if r.dry else r.opt("pc_models")
        r.step("packing-check", int(r.opt("pc_seconds")), r.python(
            "bench/packing_check.py", "--models", models, "--json", r.results / "packing_check_long.json", *device))
    if r.flag("long"):
        tokens = "20000" if r.dry else r.opt("long_tokens")
        r.step("27b-long", 330, _bench(r, r.opt("model"), out, "--modes", "dflash_prep,dflash_prep_warm",
                                       *([] if r.dry else ["--num-samples", r.opt("long_samples")]),
                                       "--dflash-max-tokens", tokens))
    if r.flag("short"):
        r.step("27b-short", int(r.opt("short_seconds")), _bench(r, r.opt("model"), out, "--modes",
                                                                 r.opt("short_modes")))
    if r.flag("run_8b"):
        r.step("8b", 200, _bench(r, r.opt("model_8b"), out, "--modes", "dflash_prep,dflash_prep_warm"))


@scenario("profile", 1, "one packed forward of a benchmark model, CUDA kernels by device time (forward_profile.py), "
          "with the installed transformers and again with `alt_wheels`; the writer lanes on tmpfs (writer_bench.py)",
          alt_wheels=":a folder of wheels to profile against (a second process with them first on PYTHONPATH)",
          model="qwen3.6-27b:the benchmark model", row_tokens="32768:tokens of the packed row",
          writer_bench="1:also the writer bench (0: skip it)", limit_image="200:the first profile's limit",
          moe_dynamic="tokens:an MoE's compiled experts, dynamic sizes (tokens: the product's; all: the A/B)",
          limit_alt="160:the second profile's limit")
def profile(r: Round) -> None:
    if r.flag("writer_bench"):
        size = ["--gb", "0.05", "--width", "2560"] if r.dry else ["--gb", "3"]
        r.step("writer-bench", 90, r.python("bench/writer_bench.py", "--dir", shm_or_tmp(8), "--threads", "1,4",
                                            *size, "--json", r.results / "writer-bench.json"))
    args = ["--model", r.opt("model"), "--row-tokens", r.opt("row_tokens"), "--moe-dynamic", r.opt("moe_dynamic")]
    alt = r.opt("alt_wheels")
    image_env = {"PYTHONPATH": os.pathsep.join(p for p in r.env["PYTHONPATH"].split(os.pathsep)
                                               if not p.endswith("site-alt"))} if alt else None
    r.step("profile-image", int(r.opt("limit_image")), r.python("bench/forward_profile.py", *args, "--json",
                                                                r.results / "profile-image.json"),
           gpu_only=True, env=image_env)
    if alt:
        r.step("profile-alt", int(r.opt("limit_alt")), r.python("bench/forward_profile.py", *args, "--json",
                                                                r.results / "profile-alt.json"), gpu_only=True)


@scenario("storage", 1, "the shard writer against the disk (disk_vs_writer.py: buffered and O_DIRECT, 4 and 8 lanes), "
          "the Llama-3.1-8B shape with DFlash's 5 layers (40 KB/token, as Qwen3-8B's) into tmpfs, the local disk and "
          "moto's S3 server on loopback, the S3 output read back equal to the disk's (bench/store_bench.py)",
          deadline_seconds=480, gb="4:GB of each disk_vs_writer step", samples="800:samples of the runs' list",
          model="llama3.1-8b:the runs' config, bench/configs/NAME.json (qwen3-8b: the issue's Qwen3-8B shape)",
          s3="1:the S3 run (0: skip it; needs s3fs and, for moto, moto[server], from the wheels of WHEEL_DIR)",
          s3_server="moto:the S3 run's server: moto (moto's, in Python) or rclone (`rclone serve s3`, the binary or "
                    "its .xz at the `rclone` option)",
          rclone=".s3tools/rclone.xz:the rclone binary for s3_server=rclone (a .xz is decompressed first)",
          s3_seconds="260:the S3 step's limit (its probe, the extraction, the download and the comparison)",
          num_layers="5:DFlash's k (5: 40 KB a token on an 8B shape; the recipe's base, the demo's, has 3)",
          writer_threads="4:output.num_writer_threads of the runs (the recipes' and the schema's default; the demo "
                         "base has 2)", disk_vs_writer="1:the disk_vs_writer step (0: skip it)",
          disk_probe="0:1: bench/disk_probe.py on the disk, the writer against raw streams and the staged design "
                     "(`disk_probe_gb` GB in 0.25 GB shards), before the runs",
          disk_probe_gb="8:GB of each disk_probe step",
          switch_interval=":output.switch_interval_seconds of a third run on the disk, after the first (empty: "
                          "none)")
def storage(r: Round) -> None:
    disk = r.work  # the system's temp dir: ext4 on the H200 machine's disk
    tmpfs = r.work / "shm" if r.dry else shm_or_tmp(40) / f"dflash-storage-{os.getpid()}"
    gb = "0.05" if r.dry else r.opt("gb")
    if r.flag("disk_vs_writer"):
        r.step("disk-vs-writer", 150, r.python("bench/disk_vs_writer.py", "--dir", disk, "--gb", gb, "--repeats",
                                               "2" if r.dry else "3", "--label", "disk", "--out",
                                               r.results / "disk_vs_writer-disk.json",
                                               *(["--width", "2048", "--shard-gb", "0.01"] if r.dry else [])))
    if r.flag("disk_probe"):  # is the price of 4 files at once worth a staged writer (bench/disk_probe.py)?
        r.step("disk-probe", 200, r.python(
            "bench/disk_probe.py", "--dir", disk, "--gb", "0.1" if r.dry else r.opt("disk_probe_gb"), "--repeats",
            "1" if r.dry else "2", "--shard-gb", "0.02" if r.dry else "0.25", "--only",
            "raw-1x16M,raw-qd2,raw-4streams,writer-4lanes-16M,staged-4lanes,staged-2lanes",
            "--json", r.results / "disk_probe.json"))
    data = r.work / "data.parquet"
    config = CONFIGS / ("tiny-llama.json" if r.dry else f"{r.opt('model')}.json")
    num, vocab = ("40" if r.dry else r.opt("samples")), str(json.loads(config.read_text())["vocab_size"])
    r.step("data", 60, r.python("-m", "bench.store_bench", "data", data, "--num-samples", num, "--vocab", vocab))
    sets = [f"data.path={data}", "data.max_length=4096", f"model.config={config}", f"model.tokenizer={TOKENIZER}",
            "model.dtype=bfloat16", "layers.preset=dflash", f"layers.num_layers={r.opt('num_layers')}",
            f"output.num_writer_threads={r.opt('writer_threads')}",
            "layers.capture_final=none", "output.dtype=bfloat16", "batching.max_tokens_per_batch=auto",
            f"model.triton_cache_dir={r.work / 'triton'}", "output.overwrite=true"]
    warm = tmpfs / "warmup"  # fills the Triton cache the measured runs share (same kernels: same bytes)
    r.step("8b-warmup", 90, r.extract(warm, *sets, "data.max_samples=" + ("8" if r.dry else "64")))
    shutil.rmtree(warm, ignore_errors=True)
    out = tmpfs / "out"
    r.step("8b-tmpfs", 120, r.extract(out, *sets))
    r.keep(out, "8b-tmpfs")
    out = disk / "out-disk"
    r.step("8b-disk", 120, r.extract(out, *sets))
    if r.flag("s3"):
        # the server's objects (moto: each object over 5 MB in a temporary file; rclone: its folder) on tmpfs, not
        # on the disk measured
        store_tmp = tmpfs / "s3-store"
        store_tmp.mkdir(parents=True, exist_ok=True)
        # the read-back of the 6.4 GB through moto takes as long as the upload (~0.1 GB/s on the H200 machine)
        server = ["--server", r.opt("s3_server")]
        if r.opt("s3_server") == "rclone":
            server += ["--rclone", str(REPO / r.opt("rclone"))]
        r.step("8b-s3", int(r.opt("s3_seconds")),
               r.python("-m", "bench.store_bench", "s3", r.work / "s3", r.results, "--local", out,
                        "--probe-gb", "0.05" if r.dry else "0.5", "--store-tmp", store_tmp, *server, "--",
                        *(a for kv in sets for a in ("--set", kv))))
    r.keep(out, "8b-disk")
    if r.opt("switch_interval"):  # the same disk run with the lanes' GIL switch interval set (an A/B)
        si = disk / "out-disk-si"
        r.step("8b-disk-si", 120, r.extract(si, *sets, f"output.switch_interval_seconds={r.opt('switch_interval')}"))
        r.keep(si, "8b-disk-si")
    shutil.rmtree(tmpfs, ignore_errors=True)
    r.step("report", 30, r.python("-m", "bench.store_bench", "report", r.results))


@scenario("regen", 1, "the in-process regeneration engine: its static-cache / CUDA-graph decoder against its HF "
          "`generate` batches, and a greedy check against `generate` alone, on the 8B and 27B shapes "
          "(regen_bench.py; the arguments after `--` go to it)")
def regen(r: Round) -> None:
    args = ["--dry-run"] if r.dry else r.extra_args
    r.step("regen-bench", r.deadline, r.python("bench/regen_bench.py", r.results, *args))


@scenario("faults", 1, "the failure paths the CPU tests can only inject: a real CUDA out-of-memory error under a "
          "capped allocator, and the device-side NaN check (bf16 and fp8)", fractions="0.0006:the memory caps")
def faults(r: Round) -> None:
    r.step("gpu-faults", 540, r.python("bench/gpu_faults.py", "--out", r.work / "gpu_faults", "--fractions",
                                       r.opt("fractions")), gpu_only=True, grep=r'"stage"|FAILED|"ok"')


@scenario("targets", 1, "FP8 checkpoints and MoE experts (bench/targets_check.py): a random block-FP8 checkpoint of a "
          "Qwen3.6-27B-shaped slice built on the device, its FP8 linear layer vs emulation, its forward as FP8 vs "
          "dequantized (tok/s, per-layer error); extractions of that checkpoint both ways on the same rows (both "
          "warmed up first) and verify of the FP8 one; the Qwen3-30B-A3B-shaped MoE slice with each experts "
          "implementation; the Qwen3 MoE's liger kernels vs eager in fp32, routing pinned (kernels_check.py; the "
          "hybrid MoE's as a part of its own)",
          deadline_seconds=540, layers="16:decoder layers of the 27B slice (64: the whole 27B shape)",
          moe_layers="8:layers of the MoE slice",
          fp8_seconds="230:the fp8-check step's limit (the whole 27B builds and saves a 27 GB checkpoint first)",
          extract_seconds="150:each FP8 extraction step's limit (warm-ups and measured runs)",
          fp8_checks="1:the FP8 layer, forward and profile checks (0: build the checkpoint only, for the extractions)",
          verify="both:verify of the FP8 output (both: against the FP8 model alone and the dequantized twin; fp8: "
                 "the first only; none)",
          warmups="both:warm-up extractions before the measured ones (both; first: the dequantized one only, whose "
                  "Triton cache the FP8 run shares)",
          samples="1000:pre-tokenized rows of each extraction (0: no extractions)",
          fp8_profile="0:1: forward_profile.py of the checkpoint dequantized then as FP8, one packed row of "
                      "`profile_row_tokens` (kernels by GPU time), before the extractions",
          profile_row_tokens="16384:the profiled packed row's tokens (the extraction's auto budget on the 27B)",
          profile_seconds="120:each profile step's limit",
          families="qwen2,mistral,phi3,gemma2,gemma3,mixtral:the families part's families (bench/families.py)",
          family_speed_tokens="16384:the families part's bf16 speed A/B batch (tokens)",
          parts="fp8,moe,kernels:what runs, in this order (fp8: the checkpoint, its extractions and verify; moe: the "
                "experts implementations; hybrid_kernels: the fp32 check of the hybrid MoE's kernels, measured "
                "2026-12-03; kernels: the fp32 check of the Qwen3 MoE's kernels, measured 2026-12-04; families: "
                "every kernel of each family `auto` leaves eager until measured, fp32 check then bf16 speed A/B, "
                "one step a family)")
def targets(r: Round) -> None:
    parts = set(r.opt("parts").split(","))
    tiny = ["--tiny"] if r.dry else []
    if "fp8" in parts:
        ckpt = r.work / "fp8-checkpoint"
        layers = [] if r.dry else ["--layers", r.opt("layers")]
        built = r.step("fp8-check", int(r.opt("fp8_seconds")), r.python(
            "bench/targets_check.py", "fp8", "--checkpoint", ckpt, "--json", r.results / "targets_fp8.json", *tiny,
            *layers, *([] if r.flag("fp8_checks") else ["--build-only"])))
        if built == 0 and r.flag("fp8_profile"):  # where the two forwards' GPU time goes, kernel by kernel
            for mode in ("dequantize", "auto"):
                r.step(f"profile-fp8-{mode}", int(r.opt("profile_seconds")), r.python(
                    "bench/forward_profile.py", "--checkpoint", ckpt, "--fp8-weights", mode, "--row-tokens",
                    r.opt("profile_row_tokens"), "--json", r.results / f"profile-fp8-{mode}.json"), gpu_only=True)
        samples = 40 if r.dry else int(r.opt("samples"))
        if built == 0 and samples:
            _fp8_extractions(r, ckpt, samples)
        shutil.rmtree(ckpt, ignore_errors=True)
    if "moe" in parts:
        moe_layers = [] if r.dry else ["--layers", r.opt("moe_layers")]
        r.step("moe-check", 210, r.python("bench/targets_check.py", "moe", "--json", r.results / "targets_moe.json",
                                          *tiny, *moe_layers))
    if "hybrid_kernels" in parts:
        # the hybrid MoE's Gated DeltaNet kernels (qwen3_5's, on its own modules): 3 Gated DeltaNet + 1 attention
        # layer; fla's kernels autotune for each sample length run alone (~8 s each): the longest step here
        r.step("kernels-qwen3.6-35b-a3b", 300, r.python(
            "bench/kernels_check.py", "--models", "qwen3.6-35b-a3b", "--layers", "4", "--kernels",
            "liger_rms_norm,fla_conv,fla_gated_norm", "--json", r.results / "kernels_check_qwen3_5_moe.json"),
            gpu_only=True)
    if "kernels" in parts:  # the Qwen3 MoE's liger kernels (RMSNorm, RoPE), the routing held to the eager batch's
        r.step("kernels-qwen3-30b-a3b", 150, r.python(
            "bench/kernels_check.py", "--models", "qwen3-30b-a3b", "--layers", "4", "--kernels",
            "liger_rms_norm,liger_rope", "--json", r.results / "kernels_check_qwen3_moe.json"), gpu_only=True)
    if "families" in parts:  # kernels.AUTO_NOT_MEASURED: exact (fp32) and faster (bf16) before `auto` takes them
        for family in r.opt("families").split(","):
            r.step(f"kernels-{family}", 150, r.python(
                "bench/kernels_check.py", "--families", family, "--layers", "6", "--kernels", "all",
                "--speed-tokens", r.opt("family_speed_tokens"), "--json",
                r.results / f"kernels_check_family_{family}.json"), gpu_only=True)


def _fp8_extractions(r: Round, ckpt: Path, samples: int) -> None:
    """The FP8 checkpoint extracted dequantized (bf16 GEMMs) then as FP8, on the same pre-tokenized rows (DFlash
    k=3, fp8 storage, outputs in memory where it fits), each after a warm-up on the same rows (the Triton cache
    filled for every row shape, the FP8 activation quantization compiled), then `verify` of the FP8 output: the
    same FP8 model alone, then the dequantized twin."""
    data = r.work / "fp8-rows.parquet"
    vocab = 1024 if r.dry else 248320
    r.step("fp8-rows", 60, r.python("-c", "import sys; from pathlib import Path; from bench.samples import "
                                          "make_samples, write_pretokenized; n, v = int(sys.argv[2]), int(sys.argv[3]); "
                                          "s = make_samples(n, 5.41, 0.9, 16, 4096, v, seed=0); "
                                          "write_pretokenized(Path(sys.argv[1]), s, n); print(s.params)",
                                    data, samples, vocab))
    where = r.work if r.dry else shm_or_tmp(30)
    common = ["model.config=null", f"model.name_or_path={ckpt}", f"model.tokenizer={TOKENIZER}",
              f"data.path={data}", "data.max_length=4096", "layers.num_layers=3", "output.dtype=fp8_e4m3",
              "model.dtype=" + ("float32" if r.dry else "bfloat16"), f"model.triton_cache_dir={r.work / 'triton'}"]
    for name, mode in (("dequantized", "dequantize"), ("fp8", "auto")):
        # not measured: the same rows once (every row shape's Triton kernels autotuned and cached, the FP8 path's
        # compiled quantization), so that neither measured run pays it
        if mode == "dequantize" or r.opt("warmups") == "both":
            r.step(f"warmup-{name}", int(r.opt("extract_seconds")),
                   r.extract(where / "targets-warmup", *common, f"model.fp8_weights={mode}"))
            shutil.rmtree(where / "targets-warmup", ignore_errors=True)
        out = where / f"targets-extract-{name}"
        rc = r.step(f"extract-{name}", int(r.opt("extract_seconds")),
                    r.extract(out, *common, f"model.fp8_weights={mode}"))
        if rc == 0 and mode == "auto" and r.opt("verify") != "none":
            # the FP8 model alone (the pipeline's invariant), then the dequantized twin (the format's own error)
            r.step("verify-fp8", 120, r.verify(out, "--num-samples", "8", "--seed", "0", "--json"))
            if r.opt("verify") == "both":
                r.step("verify-fp8-dequantized", 120, r.verify(out, "--num-samples", "4", "--seed", "0",
                                                                "--fp8-reference", "dequantized", "--json"))
        r.keep(out, f"extract-{name}")


# ----------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python3 -m bench", description="Benchmark scenarios (bench/scenarios.py).")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the scenarios and their options")
    run = sub.add_parser("run", help="run one scenario")
    run.add_argument("scenario", choices=sorted(SCENARIOS))
    run.add_argument("results", nargs="?", default=None, help="results folder (default bench/results/SCENARIO-TIME)")
    run.add_argument("--deadline-seconds", type=float, default=None, help="all steps within this (scenario default)")
    run.add_argument("--set", dest="options", action="append", default=[], metavar="NAME=VALUE",
                     help="a scenario option (python3 -m bench list shows them)")
    run.add_argument("--dry-run-cpu", action="store_true", help="every step a CPU can run, tiny models and data")
    args = p.parse_args(argv)
    if args.command == "list":
        for sc in SCENARIOS.values():
            print(f"{sc.name:<9} {sc.gpus} GPU(s), deadline {sc.deadline_seconds} s: {sc.summary}")
            for name, o in sc.options.items():
                print(f"          --set {name}={o.default}  {o.help}")
        return 0
    sc = SCENARIOS[args.scenario]
    options = {}
    for kv in args.options:
        name, sep, value = kv.partition("=")
        if not sep or name not in sc.options:
            p.error(f"--set {kv}: {sc.name} takes {', '.join(sc.options) or 'no option'}")
        options[name] = value
    results = Path(args.results or REPO / "bench" / "results" / f"{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    r = Round(sc, results.resolve(), args.deadline_seconds or sc.deadline_seconds, options, args.dry_run_cpu, extra)
    try:
        sc.run(r)
    finally:
        code = r.close()
    return code


if __name__ == "__main__":
    sys.exit(main())


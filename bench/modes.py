"""The benchmark's modes: how each one extracts the states of the sample list and what it reports.

  per_sample / fixed_batch   the baselines (full CausalLM, `output_hidden_states=True`), synchronous timings
  dflash_prep                `dflash_prep.commands.extract.run_extraction` on a recipe built from the benchmark config
                             (`batching.packing: auto`: packed rows on a GPU where exact, padded batches on CPU;
                             `--variant-set batching.packing=false` is the A/B)
  X_warm                     X again on exactly the samples X ran (same shapes: compiled kernels reused)
  dflash_prep_variant        dflash_prep again on its samples with `--variant-set` on top (an A/B in one run)
  dflash_prep_variant_warm   the variant again on the same samples (its own shapes warm: an A/B of warm passes
                             when the variant's shapes differ, e.g. padded batches against packed rows)
  dflash_prep_profile        dflash_prep again on its samples under torch.profiler (where the GPU time goes)
  dflash_prep_fresh          dflash_prep again on its samples in a NEW process that shares the Triton cache the
                             earlier passes filled (model.triton_cache_dir): what the next job on the same machine
                             pays for first-seen shapes (cold process, warm autotune cache)
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.context import Ctx, logits_kwargs
from bench.models import weights_checksum
from bench.outputs import dir_bytes, fixed_batch_path, read_samples, written_ids
from bench.profiling import kernel_profile, synchronizing_calls
from bench.samples import write_pretokenized
from bench.timing import BatchLog, DflashTimings, finish_result, free_memory, peak_memory, sync
from dflash_prep.recipe.schema import recipe_from_dict, set_dotted

ALL_MODES = ("per_sample", "fixed_batch", "dflash_prep", "per_sample_warm", "fixed_batch_warm", "dflash_prep_warm",
             "dflash_prep_variant", "dflash_prep_variant_warm", "dflash_prep_profile", "dflash_prep_fresh")
VARIANT = "dflash_prep_variant"  # dflash_prep again on its samples with --variant-set on top: an A/B in one run
PROFILE = "dflash_prep_profile"  # dflash_prep again on its samples under torch.profiler: where the GPU time goes
FRESH = "dflash_prep_fresh"  # dflash_prep again on its samples in a new process, Triton's disk cache warm
VARIANT_WARM = "dflash_prep_variant_warm"  # the variant again on its samples: its own shapes warm
REPEATS_OF_DFLASH = (VARIANT, PROFILE, FRESH)
DEFAULT_MODES = "per_sample,fixed_batch,dflash_prep"


# ----------------------------------------------------------------------------------------------- per-sample
def run_per_sample(ctx: Ctx, out_dir: Path, repeat_of: dict | None = None) -> dict:
    """One sample at a time, full CausalLM, output_hidden_states=True, one safetensors file per sample."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True)
    model, build_s = ctx.build_model()
    checksum = weights_checksum(model, ctx.layer_ids)
    n_max = min(len(ctx.samples.ids), ctx.args.per_sample_max_samples or len(ctx.samples.ids))
    budget = ctx.args.per_sample_max_seconds
    if repeat_of is not None:  # warm pass: exactly the samples the cold pass ran, no time budget
        n_max, budget = repeat_of["num_samples"], math.inf
    log, stopped_by = BatchLog(), "samples"
    t_loop = time.perf_counter()
    for i in range(n_max):
        if time.perf_counter() - t_loop >= budget:
            stopped_by = "time"
            break
        T = int(ctx.samples.lengths[i])
        if not ctx.disk_ok(out_dir, T * ctx.bytes_per_token):
            stopped_by = "disk"
            break
        t0 = time.perf_counter()
        ids = torch.from_numpy(ctx.samples.tokens[i]).to(ctx.device)[None]
        with torch.inference_mode():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False, **logits_kwargs(ctx))
        sync(ctx.device)
        t1 = time.perf_counter()
        # after-layer id j = hidden_states[j + 1] ([0] is the embeddings); [T, k*H] on the host
        hs = torch.cat([out.hidden_states[j + 1][0] for j in ctx.layer_ids], dim=-1).to(ctx.storage_dtype).cpu()
        del out
        t2 = time.perf_counter()
        path = out_dir / f"{ctx.samples.ids[i]}.safetensors"
        save_file({"input_ids": torch.from_numpy(ctx.samples.tokens[i]), "hidden_states": hs}, str(path))
        t3 = time.perf_counter()
        log.add((1, T), T, T, t1 - t0, t2 - t1, t3 - t2, path.stat().st_size, 1)
    loop_s = time.perf_counter() - t_loop
    result = baseline_result(ctx, log, loop_s, build_s, stopped_by, checksum)
    del model
    return result


# ----------------------------------------------------------------------------------------------- fixed batch
def run_fixed_batch(ctx: Ctx, out_dir: Path, repeat_of: dict | None = None) -> dict:
    """Batches of `--fixed-batch-size` consecutive samples, padded to the batch max, output_hidden_states=True."""
    out_dir.mkdir(parents=True)
    model, build_s = ctx.build_model()
    checksum = weights_checksum(model, ctx.layer_ids)
    bs = ctx.args.fixed_batch_size
    n_max = min(len(ctx.samples.ids), ctx.args.fixed_batch_max_samples or len(ctx.samples.ids))
    budget = ctx.args.fixed_batch_max_seconds
    if repeat_of is not None:  # warm pass: exactly the batches the cold pass ran, no time budget
        n_max, budget = repeat_of["num_samples"], math.inf
    log, stopped_by = BatchLog(), "samples"
    oom = {"splits": 0, "wasted_seconds": 0.0}

    def forward_and_save(idx: list[int]) -> None:
        lengths = [int(ctx.samples.lengths[i]) for i in idx]
        B, T = len(idx), max(lengths)
        t0 = time.perf_counter()
        input_ids = torch.zeros(B, T, dtype=torch.int64)  # pad id 0, right padding
        attention_mask = torch.zeros(B, T, dtype=torch.int64)
        for b, i in enumerate(idx):
            input_ids[b, :lengths[b]] = torch.from_numpy(ctx.samples.tokens[i])
            attention_mask[b, :lengths[b]] = 1
        input_ids, attention_mask = input_ids.to(ctx.device), attention_mask.to(ctx.device)
        failed = False
        try:
            with torch.inference_mode():
                out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                            use_cache=False, **logits_kwargs(ctx))
            sync(ctx.device)
        except torch.OutOfMemoryError:
            if B == 1:
                raise
            failed = True  # leave the except block first, so its traceback frees the partial activations
        if failed:
            out = None
            free_memory(ctx.device)
            oom["splits"] += 1
            oom["wasted_seconds"] += time.perf_counter() - t0
            half = B // 2
            forward_and_save(idx[:half])
            forward_and_save(idx[half:])
            return
        t1 = time.perf_counter()
        hs = torch.cat([out.hidden_states[j + 1] for j in ctx.layer_ids], dim=-1)  # [B, T, k*H]
        del out
        packed = hs[attention_mask.bool()].to(ctx.storage_dtype).cpu()  # unpad on the device: [N, k*H]
        del hs
        t2 = time.perf_counter()
        nbytes, start = 0, 0
        for b, i in enumerate(idx):
            n = lengths[b]
            path = fixed_batch_path(out_dir, i)
            path.parent.mkdir(exist_ok=True)
            ids = torch.from_numpy(ctx.samples.tokens[i])
            # clone: torch.save of a view would store the whole batch's storage
            torch.save({"input_ids": ids, "loss_mask": torch.ones_like(ids),
                        "hidden_states": packed[start:start + n].clone()[None]}, path)
            nbytes += path.stat().st_size
            start += n
        t3 = time.perf_counter()
        log.add((B, T), sum(lengths), B * T, t1 - t0, t2 - t1, t3 - t2, nbytes, B)

    t_loop = time.perf_counter()
    for start in range(0, n_max, bs):
        if time.perf_counter() - t_loop >= budget:
            stopped_by = "time"
            break
        idx = list(range(start, min(start + bs, n_max)))
        if not ctx.disk_ok(out_dir, int(ctx.samples.lengths[idx].sum()) * ctx.bytes_per_token):
            stopped_by = "disk"
            break
        forward_and_save(idx)
    loop_s = time.perf_counter() - t_loop
    result = baseline_result(ctx, log, loop_s, build_s, stopped_by, checksum)
    result.update(batch_size=bs, oom_splits=oom["splits"], oom_wasted_seconds=oom["wasted_seconds"])
    model = None  # free the weights before the next mode (forward_and_save closes over the name)
    return result


def baseline_result(ctx: Ctx, log: BatchLog, loop_s: float, build_s: float, stopped_by: str,
                    checksum: float) -> dict:
    params = ctx.info["decoder_params_active_all_layers"]  # the full CausalLM runs every decoder layer
    steady_s = loop_s - log.first_shape_batch_seconds
    steady_tokens = log.real_tokens - log.first_shape_real_tokens
    return {
        "num_samples": log.num_samples, "num_real_tokens": log.real_tokens, "num_padded_tokens": log.padded_tokens,
        "num_forwards": log.num_batches, "stopped_by": stopped_by,
        "build_seconds": build_s, "loop_seconds": loop_s,
        "num_shapes": len(log.shapes_seen), "first_shape_batches": log.first_shape_batches,
        "first_shape_seconds": log.first_shape_seconds,
        "tokens_per_second_excl_first_shapes": steady_tokens / steady_s if steady_tokens and steady_s > 0 else None,
        "decoder_params_executed": params, "bytes_written": log.bytes_written,
        "breakdown_seconds": {"forward": log.forward_seconds, "copy_to_host": log.copy_seconds,
                              "write": log.write_seconds,
                              "other": loop_s - log.forward_seconds - log.copy_seconds - log.write_seconds},
        "weights_checksum": checksum,
    }


# ----------------------------------------------------------------------------------------------- dflash-prep
def dflash_recipe(ctx: Ctx, data_path: Path, out_dir: Path, extra_overrides: list | None = None) -> object:
    raw = {
        "model": {"config": ctx.section.config, "init_seed": ctx.section.init_seed,
                  "tokenizer": ctx.section.tokenizer, "dtype": ctx.section.dtype,
                  "attn_implementation": ctx.section.attn_implementation},
        "data": {"path": str(data_path), "format": "parquet", "max_length": ctx.spec.max_length
                 if ctx.args.max_length is None else ctx.args.max_length, "overlong": "skip"},
        "layers": {"preset": "explicit", "ids": list(ctx.layer_ids), "capture_final": "none"},
        "batching": {"max_tokens_per_batch": ctx.token_budget},
        "output": {"dir": str(out_dir), "dtype": ctx.args.storage_dtype, "overwrite": True},
        "seed": ctx.args.seed,
    }
    for key, value in list(ctx.args.dflash_overrides) + list(extra_overrides or []):
        set_dotted(raw, key, value)
    return recipe_from_dict(raw)


def run_dflash(ctx: Ctx, out_dir: Path, repeat_of: dict | None = None, extra_overrides: list | None = None) -> dict:
    """`run_extraction` on the longest prefix that fits the token (and disk) budget (a warm pass: the same).
    `extra_overrides` (the variant mode) go on top of `--dflash-set`."""
    from dflash_prep.commands.extract import run_extraction

    out_dir.mkdir(parents=True)
    n = min(len(ctx.samples.ids), ctx.samples.prefix_by_tokens(ctx.args.dflash_max_tokens))
    free = shutil.disk_usage(out_dir).free - ctx.disk_reserve
    capped_by_disk = False
    while n > 1 and int(ctx.samples.lengths[:n].sum()) * ctx.bytes_per_token * 1.02 > free:
        n = int(n * 0.9)
        capped_by_disk = True
    data_path = out_dir.parent / f"{out_dir.name}-data.parquet"
    write_pretokenized(data_path, ctx.samples, n)
    recipe = dflash_recipe(ctx, data_path, out_dir / "extraction", extra_overrides)
    timings = DflashTimings(ctx.device, ctx.layer_ids)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    with timings.installed():
        summary = run_extraction(recipe)
    wall = time.perf_counter() - t0
    data_path.unlink()
    r = summary["ranks"][0]
    t = timings.resolve()
    loop_s = r["loop_seconds"]
    steady_tokens = r["num_real_tokens"] - t["first_shape_real_tokens"]
    steady_s = loop_s - t["first_shape_seconds"]
    b = recipe.batching
    return {
        "num_samples": r["num_samples"], "num_real_tokens": r["num_real_tokens"],
        "num_padded_tokens": r["num_padded_tokens"], "num_forwards": r["num_batches"],
        "stopped_by": "disk" if capped_by_disk else "tokens", "prefix_samples": n,
        "build_seconds": timings.load_seconds, "loop_seconds": loop_s, "run_extraction_seconds": wall,
        "num_shapes": r["num_shapes"], "first_shape_batches": t["first_shape_batches"],
        "first_shape_seconds": t["first_shape_seconds"],
        "tokens_per_second_excl_first_shapes": steady_tokens / steady_s if steady_tokens and steady_s > 0 else None,
        "decoder_params_executed": r["decoder_params_run"], "bytes_written": r["bytes_written"],
        "breakdown_seconds": {
            "setup": wall - loop_s,  # tokenize (datasets), plan, model build, manifest
            "data_wait": r["data_wait_seconds"],  # the loop waiting on the DataLoader
            "forward_gpu": t["forward"],  # GPU span of each forward (CUDA events)
            # from each forward's end to its device-to-host copy's end, on the copy stream (overlaps the next forward)
            "copy_to_host_gpu": t["copy"],
            "idle_gpu": loop_s - t["forward"],  # loop time with no forward on the GPU
            "forward_host": r["forward_seconds"],  # host time inside forward + copy enqueue (summary)
            "writer_wait": r["writer_wait_seconds"],  # loop blocked on a full writer queue
            # after the last forward until the writers had written everything (part of idle_gpu: a run's tail)
            "writer_drain": r.get("writer_drain_seconds"),
            "write": r["write_seconds"],  # writer threads' busy time, summed: encode + tar + fsync (overlaps the GPU)
        },
        "peak_pending_bytes": r.get("peak_pending_bytes"),  # host memory held by batches awaiting the writers
        "recipe_batching": {"max_tokens_per_batch": b.max_tokens_per_batch, "max_batch_size": b.max_batch_size,
                            "packing": b.packing,
                            "length_multiple": b.length_multiple, "length_growth": b.length_growth,
                            "num_workers": b.num_workers, "num_writer_threads": recipe.output.num_writer_threads},
        # extract.py's own CUDA-event sum of the forwards (newer versions): a cross-check of forward_gpu above
        "summary_gpu_forward_seconds": r.get("gpu_forward_seconds"),
        "shapes": [list(s) for s in t["shapes"]],
        "batches": t["batches"],  # per forward, in run order: shape, real tokens, GPU spans, first of its shape
        # with summary["packing"]: batching.packing as the run resolved it (auto: packed rows on a GPU where exact;
        # the A/B is --variant-set batching.packing=false); padding efficiency and num_shapes are the run's own
        "summary": {k: v for k, v in summary.items() if k != "ranks"},
        "weights_checksum": timings.checksum,
    }


def run_dflash_profiled(ctx: Ctx, out_dir: Path, repeat_of: dict) -> dict:
    """`run_dflash` under torch.profiler (CUDA kernels on a GPU, CPU ops on CPU); `profile` in its result."""
    cuda = ctx.device.type == "cuda"
    # On a GPU the host side is recorded too: the CUDA runtime calls that block the host (stream or device
    # synchronizations, pinned allocations, copies from pageable memory) show up by their self CPU time.
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        if cuda:  # and every synchronizing call torch's debug mode reports, by the frames that made it
            res, syncs = synchronizing_calls(lambda: run_dflash(ctx, out_dir, repeat_of))
            res["synchronizing_calls"] = syncs
        else:
            res = run_dflash(ctx, out_dir, repeat_of)
    res["profile"] = kernel_profile(prof, cuda)
    if cuda:
        res["host_profile"] = kernel_profile(prof, False)
    res["profile"]["note"] = "figures of this mode include the profiler's overhead; compare shares only"
    return res


def fresh_process_command(ctx: Ctx, out_dir: Path, results_dir: Path) -> list[str]:
    """The command line of the new process: this run's model, samples and dflash-prep settings (the resolved
    token budget, so both plan the same batches), mode dflash_prep only, its outputs kept under `out_dir`."""
    a = ctx.args
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "run_bench.py"), "--model", a.model,
           "--modes", "dflash_prep", "--num-samples", str(len(ctx.samples.ids)), "--seed", str(a.seed),
           "--length-mu", str(a.length_mu), "--length-sigma", str(a.length_sigma), "--min-length", str(a.min_length),
           "--dflash-max-tokens", str(a.dflash_max_tokens), "--max-tokens-per-batch", str(ctx.token_budget),
           "--storage-dtype", a.storage_dtype, "--device", a.device, "--check-samples", "1",
           "--results-dir", str(results_dir), "--out-dir", str(out_dir), "--keep-outputs"]
    cmd += ["--max-length", str(a.max_length)] if a.max_length else []
    cmd += ["--dtype", a.dtype] if a.dtype else []
    cmd += ["--gemm-size", str(a.gemm_size)] if a.gemm_size else []
    for item in a.dflash_set:
        cmd += ["--dflash-set", item]
    return cmd


def run_dflash_fresh(ctx: Ctx, out_dir: Path, repeat_of: dict) -> dict:
    """dflash_prep on the same samples in a new process (same environment, hence the same Triton cache dir that
    the earlier passes of this run filled): the cold figure of a fresh job on a machine that has run one before.
    Its extraction is moved to `out_dir/extraction`, where run_mode reads the states back."""
    out_dir.mkdir(parents=True)
    results_dir = out_dir / "report"
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run(fresh_process_command(ctx, out_dir, results_dir), env=env, capture_output=True,
                          text=True)
    reports = sorted(results_dir.glob("*.json"))
    if proc.returncode != 0 or not reports:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        raise RuntimeError(f"the fresh process exited {proc.returncode}: {' | '.join(tail)}")
    res = json.loads(reports[-1].read_text())["modes"]["dflash_prep"]
    if res.get("status") != "ok":
        raise RuntimeError(f"the fresh process's dflash_prep failed: {res.get('error')}")
    extraction = next(out_dir.glob("*/dflash_prep/extraction"))
    extraction.rename(out_dir / "extraction")
    res["fresh_process"] = {"triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                            "wall_seconds": res.get("mode_wall_seconds")}
    for key in ("status", "peak_gpu_memory_bytes", "mode_wall_seconds", "sample_ids_are_prefix",
                "output_bytes_on_disk"):
        res.pop(key, None)  # set again by run_mode for this mode
    return res


# ----------------------------------------------------------------------------------------------- driver
RUNNERS = {"per_sample": run_per_sample, "fixed_batch": run_fixed_batch, "dflash_prep": run_dflash}


def run_mode(ctx: Ctx, mode: str, gemm: dict, check_ids: list[str], done: dict) -> tuple[dict, dict]:
    """Run one mode in its own output folder; returns (result, states of the check samples read back).

    `X_warm` runs mode X again on exactly the samples X ran (`done[X]`), in the same process: same shapes, so
    what the first pass compiled and autotuned is reused; the difference of the two is the first-shape cost.
    """
    out_dir = ctx.out_root / mode
    free_memory(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    states: dict = {}
    print(f"[bench] {mode}: start", file=sys.stderr, flush=True)
    try:
        kind = "dflash_prep" if mode in REPEATS_OF_DFLASH + (VARIANT_WARM,) else mode.removesuffix("_warm")
        repeat_of = None
        if mode.endswith("_warm") or mode in REPEATS_OF_DFLASH:
            repeated = VARIANT if mode == VARIANT_WARM else kind
            repeat_of = done.get(repeated)
            if not repeat_of or repeat_of.get("status") != "ok":
                raise RuntimeError(f"{mode} repeats {repeated}, which did not run successfully before it")
        if mode in (VARIANT, VARIANT_WARM):
            res = run_dflash(ctx, out_dir, repeat_of, ctx.args.variant_overrides)
            res["variant_overrides"] = ctx.args.variant_set
        elif mode == PROFILE:
            res = run_dflash_profiled(ctx, out_dir, repeat_of)
        elif mode == FRESH:
            res = run_dflash_fresh(ctx, out_dir, repeat_of)
        else:
            res = RUNNERS[kind](ctx, out_dir, repeat_of)
        res["status"] = "ok"
        if repeat_of is not None:
            res["stopped_by"] = f"same samples as {kind}"
        root = out_dir / "extraction" if kind == "dflash_prep" else out_dir
        ids = written_ids(kind, root)
        res["sample_ids_are_prefix"] = ids == ctx.samples.ids[: len(ids)] and len(ids) == res["num_samples"]
        states = read_samples(kind, root, check_ids)
        res["output_bytes_on_disk"] = dir_bytes(root)
        res = finish_result(ctx, res, gemm)
    except Exception as e:  # noqa: BLE001 - one failed mode must not lose the others' figures
        traceback.print_exc()
        res = {"status": "error", "error": f"{type(e).__name__}: {e}"}
    res["peak_gpu_memory_bytes"] = peak_memory(ctx.device)
    res["mode_wall_seconds"] = time.perf_counter() - t0
    if not ctx.args.keep_outputs:
        shutil.rmtree(out_dir, ignore_errors=True)
    free_memory(ctx.device)
    print(f"[bench] {mode}: {res['status']} in {res['mode_wall_seconds']:.1f}s"
          + (f", {res['tokens_per_second']:,.0f} tok/s" if res.get("tokens_per_second") else ""),
          file=sys.stderr, flush=True)
    return res, states


"""`dflash-prep plan --recipe R`: what a recipe will cost, before any GPU time is spent.

Loads the model config and the tokenizer (never the weights), tokenizes the data exactly as the extraction does
(same `datasets.map` cache, so a second call is fast), and reports: rows kept and skipped by reason, tokens, the
batch plan (batches, distinct shapes, padding efficiency), a length histogram, bytes on disk in every storage
dtype, and the expected wall time for a tokens/s figure and a number of GPUs.

Guarantees (tests/test_plan.py checks them against real extractions):
- the figures come from the functions the extraction itself calls: `recipe.load_recipe`, `model.load_config` /
  `load_tokenizer`, `layers.resolve_layer_ids`, `data.load_rows` / `tokenize_dataset`, `planner.make_plan`,
  `planner.plan_stats` / `split_across_ranks`; so samples, tokens, batches, shapes and padding efficiency are the
  run's own, not estimates;
- bytes on disk are computed member by member from the writer's own encoders (`writer._npy_bytes`,
  `writer.sample_meta` / `meta_json_bytes`), the safetensors header layout (sizes checked against the
  library in the tests), the tar header size measured by writing one probe sample through `writer.ShardWriter`,
  and the writer's shard-roll rule replayed on each rank's batches (per writer lane, end-of-archive
  padding included): they equal the extraction's `num_bytes` for a run with the same number of processes;
- wall time = (real tokens of the busiest rank) / (tokens/s per GPU), + first-seen-shape warm-up when the
  benchmark measured it for this very model. The tokens/s default is the warm dflash-prep figure of the newest
  complete benchmark report in `bench/results/*.json`, as shipped with the package (commands/bench_figures.py;
  the file `bench/RESULTS.md` is written from: `modes.
  dflash_prep_warm.tokens_per_second` of padded batches; 9,130 for the Qwen3.6-27B shape, 41,677 for the
  Llama-3.1-8B shape),
  picked by model (same model_type, hidden size and depth), else the benchmarked model nearest in decoder
  parameters (within 4x), scaled by the ratio of decoder parameters run per token (FLOPs per token = 2 x those
  parameters, for an MoE those a token runs through: routed experts at num_experts_per_tok / num_experts,
  model.decoder_params_run; counted on a meta-device model: no memory, no weights), and for a block-FP8
  checkpoint run as FP8 by the newest measured FP8 / dequantized extraction ratio (`_fp8_scale`, said);
  `--tokens-per-second` overrides it. No default when no benchmark is near: the plan says so;
- the storage bill: the output's bytes in its storage dtype against the time `output.dir`'s disk or object store
  needs at a measured rate (`--storage-bytes-per-second`, or `--storage-bench` with a result file of
  bench/disk_vs_writer.py), beside the GPUs' wall time, and which of the two sets the pace; no rate, no time;
  for every storage dtype: bytes, objects (shards + the ranks' index, done marker and log + the output's small
  files), the time to write or upload them at that rate, and with `--storage-price-per-gb-month` what storing them
  costs a month (decimal GB, the price a store lists);
- the device planned for is the run's, not necessarily this machine's (`plan_device`): GPUs with `--gpu`,
  `--gpu-memory-gb` or a GPU here (batches and `batching.packing` as on CUDA with the gpu extra, the GPU
  benchmark's rates), else the CPU (a CPU run's batches; no default rate: the benchmark's are GPU figures);
- the data verdict is the extraction's own (`data.check_data_verdict`): no kept row, or more than
  `data.max_skipped_fraction` skipped, is the same one-line error and exit code 2; `--show-sample N` first prints
  row N as the extraction tokenizes it, supervised tokens marked (`show_sample`).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import json
import math
import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np

from dflash_prep.commands.regen_rate import BENCH_MAX_PARAM_RATIO  # one bound for both rates
from dflash_prep.commands.bench_figures import DEFAULT as DEFAULT_FIGURES
from dflash_prep.commands.bench_figures import describe, figures
from dflash_prep.recipe.schema import STORAGE_DTYPES, Recipe, RecipeError
from dflash_prep.store.sizes import RecordSizer, shard_sizes
from dflash_prep.units import format_bytes, format_count, format_duration, format_rate


_MetaInfo = namedtuple("_MetaInfo", "sample_id source_row source_id num_tokens")


# ------------------------------------------------------------------------------------------ throughput
def architecture_kind(config) -> str:
    """What sets a model's speed beyond its parameter count: routed experts or dense MLPs, Gated DeltaNet layers
    or attention only ("moe hybrid", "dense attention", ...); "unknown" where the config cannot say. `config`: a
    transformers config, or a model type (its default config)."""
    if isinstance(config, str):
        return _kind_of_model_type(config)
    try:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = max(int(getattr(text, name, 0) or 0)
                      for name in ("num_experts", "num_local_experts", "n_routed_experts"))
        hybrid = "linear_attention" in (getattr(text, "layer_types", None) or ())
    except Exception:  # noqa: BLE001 - a config class of any kind, built or read however it is
        return "unknown"
    return f"{'moe' if experts > 1 else 'dense'} {'hybrid' if hybrid else 'attention'}"


@functools.lru_cache(maxsize=None)
def _kind_of_model_type(model_type: str) -> str:
    from transformers import CONFIG_MAPPING

    try:
        return architecture_kind(CONFIG_MAPPING[model_type]())
    except Exception:  # noqa: BLE001 - unknown model types and config classes that refuse their own defaults
        return "unknown"


def _kind_distance(a: str, b: str) -> int:
    """How far apart two `architecture_kind`s are for carrying a speed: routed experts against dense MLPs (an MoE
    ran at 0.28 MFU of its active parameters where dense models ran at 0.70) weigh more than Gated DeltaNet
    against attention only; "unknown" is farthest."""
    if "unknown" in (a, b):
        return 4
    (moe_a, mix_a), (moe_b, mix_b) = a.split(), b.split()
    return 2 * (moe_a != moe_b) + (mix_a != mix_b)


def choose_reference(refs: list[dict], config, params: int | None, compute_dtype: str,
                     kernels: tuple[str, ...] | None = None) -> tuple[dict | None, str]:
    """(reference, why): the benchmark of this very model if any (the one whose kernels differ least from
    `kernels`, the kernels the planned run applies; the newest on a tie), else the nearest in decoder parameters
    (within BENCH_MAX_PARAM_RATIO) among the benchmarked models of the same `architecture_kind`, else of the
    nearest kind (`_kind_distance`; said: "of another kind"); among other models the kernels break ties of size
    only."""
    from dflash_prep.target.layers import num_decoder_layers
    from dflash_prep.target.model import hidden_size_of

    if not refs:
        return None, "no benchmark report found"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    same = [r for r in refs if r["model_type"] == getattr(text, "model_type", None)
            and r["hidden_size"] == hidden_size_of(config) and r["num_hidden_layers"] == num_decoder_layers(config)]

    def kernel_gap(r: dict) -> int:
        if kernels is None:
            return 0
        return len(set(r["kernels"]) ^ set(kernels)) if r["kernels"] is not None else 1 + len(kernels)

    def size_gap(r: dict) -> float:
        return abs(math.log(r["decoder_params_needed"] / max(params or 1, 1)))

    newest_first = sorted(refs, key=lambda r: r["timestamp"], reverse=True)  # stable: newest wins a tie
    if same:
        pool = [r for r in newest_first if r in same]
        return min(pool, key=lambda r: (r["compute_dtype"] != compute_dtype, kernel_gap(r))), "same model"
    if params is None:
        return None, "the model's decoder parameters could not be counted and no benchmark is of this model"
    near = [r for r in newest_first if size_gap(r) <= math.log(BENCH_MAX_PARAM_RATIO)]
    if not near:
        nearest = min(refs, key=size_gap)
        return None, (f"no benchmark within {BENCH_MAX_PARAM_RATIO:g}x of this model's {format_count(params)} decoder "
                      f"parameters (nearest: {nearest['model']}, {format_count(nearest['decoder_params_needed'])})")
    kind = architecture_kind(config)
    of_kind = [r for r in near if architecture_kind(r["model_type"] or "") == kind]
    ref = min(of_kind or near, key=lambda r: (r["compute_dtype"] != compute_dtype,
                                               _kind_distance(kind, architecture_kind(r["model_type"] or "")),
                                               round(size_gap(r), 2), kernel_gap(r)))
    if of_kind:
        return ref, "nearest benchmarked model"
    return ref, f"nearest benchmarked model of another kind (no {kind} model benchmarked within the size)"


# ------------------------------------------------------------------------------------------ histogram
def length_histogram(lengths: list[int], max_length: int, width: int = 40) -> str:
    """A text histogram of sample lengths in power-of-two bins: samples (bar) and share of tokens."""
    if not lengths:
        return "length histogram: no samples"
    lengths_sorted = sorted(lengths)
    total_tokens = sum(lengths)
    lo = 1 << (lengths_sorted[0].bit_length() - 1)
    edges = [lo]
    while edges[-1] <= lengths_sorted[-1]:
        edges.append(edges[-1] * 2)
    counts = [bisect.bisect_left(lengths_sorted, b) - bisect.bisect_left(lengths_sorted, a)
              for a, b in zip(edges, edges[1:])]
    cum = np.concatenate([[0], np.cumsum(lengths_sorted)])
    tokens = [int(cum[bisect.bisect_left(lengths_sorted, b)] - cum[bisect.bisect_left(lengths_sorted, a)])
              for a, b in zip(edges, edges[1:])]
    peak = max(counts)
    label_w = len(f"{edges[-2]}-{edges[-1] - 1}")
    lines = [f"{'tokens':>{label_w}}  {'samples':<{width}} {'count':>8} {'%samp':>6} {'%tok':>6}"]
    for a, b, n, t in zip(edges, edges[1:], counts, tokens):
        bar = "#" * (math.ceil(n / peak * width) if n else 0)
        lines.append(f"{f'{a}-{b - 1}':>{label_w}}  {bar:<{width}} {n:>8,} {100 * n / len(lengths):>5.1f}% "
                     f"{100 * t / total_tokens:>5.1f}%")

    def pct(p: float) -> int:
        return lengths_sorted[min(len(lengths_sorted) - 1, int(p / 100 * len(lengths_sorted)))]

    top = lengths_sorted[-max(1, len(lengths_sorted) // 100):]
    at_max = len(lengths_sorted) - bisect.bisect_left(lengths_sorted, max_length)
    lines.append(f"p50 {pct(50):,}, p90 {pct(90):,}, p99 {pct(99):,}, max {lengths_sorted[-1]:,} tokens; "
                 f"the longest 1% of samples hold {100 * sum(top) / total_tokens:.1f}% of the tokens"
                 + (f"; {at_max:,} at data.max_length={max_length:,} (truncated, or exactly that long)"
                    if at_max else ""))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- plan
def make_run_plan(recipe: Recipe, num_gpus: int = 1, tokens_per_second: float | None = None,
                  bench_dir=DEFAULT_FIGURES, gpu_memory_bytes: int | None = None,
                  gpu: bool = False, storage_rate: dict | None = None,
                  price_per_gb_month: float | None = None) -> dict:
    """Every figure of `dflash-prep plan` as a dict (see the module docstring). It plans the run of the device the
    recipe will run on (`plan_device`): GPUs with `gpu`, `gpu_memory_bytes` (which also sizes
    `max_tokens_per_batch: auto`) or a GPU on this machine, else the CPU."""
    from dflash_prep.commands.cost import batch_cost_model
    from dflash_prep.data.rows import check_data_verdict, load_rows, tokenize_dataset
    from dflash_prep.plan.planner import make_plan, packed_row_budget, plan_stats, split_across_ranks
    from dflash_prep.target.budget import local_gpu_memory_bytes, resolve_token_budget
    from dflash_prep.target.layers import num_decoder_layers, resolve_layer_ids
    from dflash_prep.target.model import check_context, decoder_params_run, describe_source, hidden_size_of
    from dflash_prep.target.model import load_config, load_tokenizer, vocab_size_of

    _check_arguments(num_gpus, tokens_per_second)
    t0 = time.perf_counter()
    config = load_config(recipe.model)
    check_context(recipe, config)  # the extraction's own refusal of rows past the model's context
    num_layers = num_decoder_layers(config)
    layer_ids = resolve_layer_ids(recipe.layers, num_layers)
    device = plan_device(gpu, gpu_memory_bytes, local_gpu_memory_bytes())
    recipe, budget_how = resolve_token_budget(recipe, config, layer_ids, num_layers,
                                              gpu_memory_bytes if gpu_memory_bytes else local_gpu_memory_bytes())
    hidden_size = hidden_size_of(config)
    tokenizer = load_tokenizer(recipe.model)
    t_tok = time.perf_counter()
    data = tokenize_dataset(load_rows(recipe.data), tokenizer, recipe.data, vocab_size_of(config))
    tokenize_seconds = time.perf_counter() - t_tok
    check_data_verdict(data, recipe.data)  # the extraction's own stop: nothing kept, or too much skipped
    cols = data.kept.select_columns(["sample_id", "source_row", "source_id", "num_tokens"]).to_dict()
    lengths = [int(n) for n in cols["num_tokens"]]
    from dflash_prep.target.replica import TENSOR_PARALLEL

    replicas = _replicas(recipe, config, num_gpus)
    gpu_kernels = planned_kernels(recipe, config, replicas["parallelism"] == TENSOR_PARALLEL)
    packing = plan_packing(recipe, config, device["type"] == "cuda", gpu_kernels)
    plan = make_plan(lengths, recipe, packed=packing.packed)
    stats = plan_stats(plan)

    last_needed = num_layers - 1 if recipe.layers.capture_final != "none" else layer_ids[-1]
    params = decoder_params_run(recipe.model, config, last_needed)
    # the extraction's own split (same cost numbers), so the shards replayed per rank are the run's
    cost_model = batch_cost_model(recipe, config, layer_ids, num_layers, params)
    shares = split_across_ranks(plan, replicas["num_replicas"],  # a rank of the output is a replica
                                functools.partial(cost_model.cost_of, lengths=lengths))
    disk = _disk_figures(recipe, plan, shares, cols, lengths, layer_ids, hidden_size, stats["num_real_tokens"])
    _bill_each_dtype(disk, storage_rate, price_per_gb_month)
    kernels = gpu_kernels if device["type"] == "cuda" else ()
    throughput = _throughput(recipe, config, params, tokens_per_second, bench_dir, packing.packed, kernels) \
        if device["type"] == "cuda" or tokens_per_second else NO_CPU_FIGURE
    if throughput["tokens_per_second"]:
        replicas["tokens_per_second_per_replica"] = throughput["tokens_per_second"] * replicas["computing_gpus"]
    ranks = [plan_stats(share) for share in shares]
    wall = _wall_time(replicas.get("tokens_per_second_per_replica"), throughput.get("seconds_per_new_shape") or 0.0,
                      ranks, num_gpus, disk[recipe.output.dtype]["bytes_per_token"], recipe.model.gpus_per_replica,
                      throughput.get("host_warmup_seconds") or 0.0)

    return {
        "device": device,
        "recipe_fingerprint": recipe.fingerprint(),
        "model": describe_source(recipe.model),
        "model_type": _model_type(config),
        "num_hidden_layers": num_layers, "hidden_size": hidden_size, "layer_ids": layer_ids,
        "capture_final": recipe.layers.capture_final, "layers_run": last_needed + 1,
        "decoder_params_run": params,
        "num_rows": data.num_rows, "num_samples": len(lengths),
        "num_skipped": sum(data.skipped_counts.values()), "skipped": data.skipped_counts,
        "samples": data.samples,
        **_batch_figures(stats),
        "packing": packing.record(), "shapes": _shape_counts(plan),
        "kernels": list(kernels),
        "max_tokens_per_batch": recipe.batching.max_tokens_per_batch, "max_tokens_per_batch_auto": budget_how,
        "max_tokens_per_row": packed_row_budget(recipe.batching) if packing.packed else None,
        "stored_plan": _stored_plan(Path(recipe.output.dir), lengths, recipe),
        "dtype": recipe.output.dtype, "max_shard_bytes": recipe.output.max_shard_bytes, "disk": disk,
        "num_bytes": disk[recipe.output.dtype]["num_bytes"],
        "ranks": [{"rank": i, **{k: r[k] for k in ("num_batches", "num_samples", "num_real_tokens", "num_shapes")}}
                  for i, r in enumerate(ranks)],
        "throughput": throughput, "replicas": replicas, "wall": wall,
        "storage": storage_bill(recipe.output.dir, disk[recipe.output.dtype]["num_bytes"], wall, storage_rate),
        "lengths_histogram": length_histogram(lengths, recipe.data.max_length),
        "tokenize_seconds": tokenize_seconds, "plan_seconds": time.perf_counter() - t0,
    }


def _check_arguments(num_gpus: int, tokens_per_second: float | None) -> None:
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if tokens_per_second is not None and not tokens_per_second > 0:
        raise ValueError(f"tokens_per_second must be > 0, got {tokens_per_second}")


def _model_type(config) -> str | None:
    return getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "model_type", None)


def _batch_figures(stats: dict) -> dict:
    """The plan's batch figures of planner.plan_stats, under the names `plan` reports them with."""
    return {"num_tokens": stats["num_real_tokens"],
            **{k: stats[k] for k in ("num_padded_tokens", "num_batches", "num_shapes", "padding_efficiency",
                                     "batch_size_min", "batch_size_max", "batch_size_mean", "padded_length_min",
                                     "padded_length_max")}}


# The benchmark's figures are of GPUs: a plan of a CPU run has none, unless given.
NO_CPU_FIGURE = {"tokens_per_second": None, "reference": None,
                 "source": "a CPU run: the benchmark's figures are of GPUs; --gpu plans the GPU run"}


def plan_device(gpu: bool, gpu_memory_bytes: int | None, local_gpu_memory_bytes: int | None) -> dict:
    """What the plan is for: {"type": "cuda" or "cpu", "why"}. GPUs when asked (`--gpu`, `--gpu-memory-gb`) or when
    this machine has one; the CPU otherwise: batches, packing and rates then are a CPU run's."""
    if gpu or gpu_memory_bytes:
        return {"type": "cuda", "why": "--gpu" if gpu else "--gpu-memory-gb"}
    if local_gpu_memory_bytes:
        return {"type": "cuda", "why": "this machine's GPU"}
    return {"type": "cpu", "why": "this machine has no GPU; --gpu plans the GPU run"}


def planned_kernels(recipe: Recipe, config, tensor_parallel: bool = False) -> tuple[str, ...]:
    """The kernels the run applies on a GPU: `auto` as the GPU install applies it (kernels.auto_kernels_on_gpu;
    none on a tensor-parallel replica), none for `eager`, else the list (RecipeError, as the run, for a name the
    architecture has no patch for)."""
    from dflash_prep.target.kernels import auto_kernels_on_gpu, check_listed_kernels

    kernels = recipe.model.kernels
    if kernels == "auto":
        return auto_kernels_on_gpu(config, tensor_parallel)
    return () if kernels == "eager" else check_listed_kernels(tuple(kernels), config)


def plan_packing(recipe: Recipe, config, for_gpus: bool, names: tuple[str, ...]):
    """`batching.packing` as the run would resolve it (packing.select_packing): on GPUs (`for_gpus`: this machine
    has one, or --gpu-memory-gb was given) with the kernels `names` the GPU run applies (`planned_kernels`: with
    `model.kernels: auto`, as the GPU install applies it), which a machine without a GPU cannot check; on the CPU
    as the CPU run would."""
    from dflash_prep.target.packing import select_packing

    return select_packing(recipe.batching.packing, config, "cuda" if for_gpus else "cpu", names, assume_fla=for_gpus,
                          several_gpus=recipe.model.gpus_per_replica > 1, compute_dtype=recipe.model.dtype)


def _shape_counts(plan: list) -> dict[str, int]:
    """'BxT' -> batches of that forward shape, largest T first."""
    counts: dict[tuple, int] = {}
    for p in plan:
        counts[p.shape] = counts.get(p.shape, 0) + 1
    return {f"{b}x{t}": n for (b, t), n in sorted(counts.items(), key=lambda kv: (-kv[0][1], -kv[0][0]))}


# ------------------------------------------------------------------------------------------------ report

def _disk_figures(recipe: Recipe, plan: list, shares: list, cols: dict, lengths: list[int], layer_ids: list[int],
                  hidden_size: int, num_real_tokens: int) -> dict:
    """Bytes and shards per storage dtype: each sample's record sized as the writer encodes it, then each rank's
    shards replayed (its writer lanes, the shard size limit)."""
    from dflash_prep.store.writer import meta_json_bytes, sample_meta

    sizer = RecordSizer(layer_ids, hidden_size, recipe.layers.capture_final)
    meta_len: dict[int, int] = {}  # sample index -> meta.json bytes
    for p in plan:
        for i in p.sample_indices:
            info = _MetaInfo(cols["sample_id"][i], int(cols["source_row"][i]), cols["source_id"][i], lengths[i])
            meta_len[i] = len(meta_json_bytes(sample_meta(info, layer_ids, p.batch_id)))
    disk = {}
    for dtype in STORAGE_DTYPES:
        shards = []
        for share in shares:
            shards += shard_sizes([[sizer.record_bytes(lengths[i], meta_len[i], dtype) for i in p.sample_indices]
                                   for p in share], recipe.output.max_shard_bytes, recipe.output.num_writer_threads)
        disk[dtype] = {"num_bytes": sum(shards), "num_shards": len(shards),
                       "num_objects": len(shards) + OBJECTS_PER_RANK * len(shares) + OBJECTS_PER_OUTPUT,
                       "states_bytes_per_token": sizer.states_bytes_per_token(dtype),
                       "bytes_per_token": sum(shards) / max(num_real_tokens, 1)}
    return disk


# The output's files besides its shards, as a local output holds them (an object store's, without lock files,
# holds one fewer per rank and one fewer per output): per rank its index, done marker, log, lock and lease; per
# output manifest.json, plan.json, summary.json, run_state.json, recipe.resolved.yaml, failed.jsonl, skipped.jsonl,
# kernels.jsonl, token_freq.safetensors and the run's lock and lease.
OBJECTS_PER_RANK = 5
OBJECTS_PER_OUTPUT = 11


def _bill_each_dtype(disk: dict, rate: dict | None, price_per_gb_month: float | None) -> None:
    """Adds to each dtype's figures its time at `rate` (storage_rate_from; None without one) and its monthly cost
    at `price_per_gb_month` (per 1e9 bytes; None without one). Raises ValueError on a negative price."""
    if price_per_gb_month is not None and not price_per_gb_month >= 0:
        raise ValueError(f"--storage-price-per-gb-month must be >= 0, got {price_per_gb_month}")
    for d in disk.values():
        d["seconds_at_rate"] = d["num_bytes"] / rate["bytes_per_second"] if rate else None
        d["cost_per_month"] = d["num_bytes"] / 1e9 * price_per_gb_month if price_per_gb_month is not None else None
        d["price_per_gb_month"] = price_per_gb_month


def _throughput(recipe: Recipe, config, params: int | None, tokens_per_second: float | None,
                bench_dir, packed: bool, kernels: tuple[str, ...] = ()) -> dict:
    """tokens/s per GPU: given, or the nearest benchmarked model's (runs of the same layout: `packed` rows or
    padded batches) scaled by decoder parameters run per token. `bench_dir`: where the figures come from
    (commands/bench_figures.py `figures`: the shipped ones, a folder of reports, or None)."""
    figs = figures(bench_dir) if not tokens_per_second else None
    ref, why = (None, "given with --tokens-per-second") if tokens_per_second else (
        choose_reference(figs["extraction"]["packed" if packed else "padded"], config, params, recipe.model.dtype,
                         kernels) if figs is not None else (None, "no benchmark folder"))
    throughput: dict = {"tokens_per_second": tokens_per_second, "source": why, "reference": ref}
    if ref is not None:
        scale = ref["decoder_params_needed"] / params if params else 1.0
        throughput["tokens_per_second"] = ref["tokens_per_second"] * scale
        throughput["scaled_by_decoder_params"] = scale
        same = why == "same model"  # the warm-ups are the model's and its batches' own: not carried to another
        throughput["seconds_per_new_shape"] = ref["seconds_per_new_shape"] if same else None
        throughput["host_warmup_seconds"] = ref.get("host_warmup_seconds") if same else None
        fp8 = _fp8_scale(recipe, config, figs)
        if fp8 is not None:
            throughput["tokens_per_second"] *= fp8["ratio"]
            throughput["fp8_scale"] = fp8
    return throughput


def _fp8_scale(recipe: Recipe, config, figs: dict) -> dict | None:
    """{ratio, folder}: for a block-FP8 checkpoint run as FP8 (target/fp8_weights.py), the benchmark's reference
    being a bf16 model's, the figures' `fp8_extraction_ratio`; None for other checkpoints, with
    `model.fp8_weights: dequantize` (it runs bf16), or where no such pair is committed (then the bf16 figure
    stands, unscaled)."""
    from dflash_prep.target.fp8_weights import block_fp8_format

    if block_fp8_format(config) is None or recipe.model.fp8_weights == "dequantize":
        return None
    return figs.get("fp8_extraction_ratio")


def _replicas(recipe: Recipe, config, num_gpus: int) -> dict:
    """How `num_gpus` GPUs run the recipe: replicas of `model.gpus_per_replica` N (num_gpus / N of them), the
    process model (replica.choose_parallelism: `auto` is a layer split for several replicas) and how many of a replica's GPUs compute at once (N under tensor
    parallelism, taken as N x one GPU's rate: an upper bound; 1 for a layer split or N = 1). ValueError (exit code
    2) when num_gpus is not a multiple of N."""
    from dflash_prep.target.replica import TENSOR_PARALLEL, choose_parallelism

    n = recipe.model.gpus_per_replica
    if num_gpus % n:
        raise ValueError(f"--num-gpus {num_gpus} does not divide into replicas of model.gpus_per_replica = {n} GPUs "
                         f"(use a multiple of {n})")
    # several replicas: one process per replica (tensor parallelism runs one replica per run)
    parallelism = choose_parallelism(config, n, recipe.model.replica_parallelism, num_gpus // n > 1)
    return {"gpus_per_replica": n, "num_replicas": num_gpus // n, "parallelism": parallelism,
            "computing_gpus": n if parallelism == TENSOR_PARALLEL else 1}


def _wall_time(tps: float | None, per_shape: float, ranks: list[dict], num_gpus: int,
               bytes_per_token: float, gpus_per_replica: int = 1, host_warmup: float = 0.0) -> dict | None:
    """The busiest replica's time (its tokens / its tokens/s `tps` + first-seen-shape warm-up + the first pinned
    host buffers' `host_warmup`, once), GPU hours (each replica holds `gpus_per_replica` GPUs), the write rate per
    replica (its one writer)."""
    if not tps:
        return None
    per_rank = [r["num_real_tokens"] / tps + per_shape * r["num_shapes"] + host_warmup for r in ranks]
    return {"num_gpus": num_gpus, "seconds": max(per_rank),
            "compute_seconds": max(r["num_real_tokens"] for r in ranks) / tps,
            "warmup_seconds": max(per_shape * r["num_shapes"] for r in ranks) + host_warmup,
            "gpu_hours": sum(per_rank) * gpus_per_replica / 3600,
            # what each replica's writer threads must sustain so its GPUs never wait on the disk
            "write_bytes_per_second_per_gpu": tps * bytes_per_token / gpus_per_replica,
            "write_bytes_per_second_per_replica": tps * bytes_per_token}

def storage_rate_from(bytes_per_second: str | float | None = None, bench_file: str | Path | None = None) -> dict | None:
    """The rate the output's disk or store takes, all writers of the run together: {"bytes_per_second", "source"}
    from `--storage-bytes-per-second` (a number or '1.4GB'), else from a result file of bench/disk_vs_writer.py (the
    shard writer's measured rate on that filesystem, its raw sequential rate beside it); None without either.
    Raises ValueError on a rate that is not a positive size or a file that is not such a result."""
    from dflash_prep.recipe.schema import RecipeError, _parse_bytes

    if bytes_per_second is not None:
        try:
            rate = _parse_bytes("--storage-bytes-per-second", bytes_per_second)
        except RecipeError as e:
            raise ValueError(str(e)) from None
        if rate <= 0:
            raise ValueError(f"--storage-bytes-per-second must be > 0, got {bytes_per_second!r}")
        return {"bytes_per_second": float(rate), "source": "--storage-bytes-per-second"}
    if bench_file is None:
        return None
    try:
        result = json.loads(Path(bench_file).read_text())
        rate = float(result["writer"]["bytes_per_second"])
        raw = float(result["raw"]["bytes_per_second"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--storage-bench {bench_file}: not a result of bench/disk_vs_writer.py ({e})") from None
    return {"bytes_per_second": rate, "raw_bytes_per_second": raw,
            "source": f"{Path(bench_file).name}: the shard writer on {result.get('filesystem', '?')} "
                      f"({result.get('path', '?')}), raw sequential {format_rate(raw)}"}


def storage_bill(target: str, num_bytes: int, wall: dict | None, rate: dict | None) -> dict:
    """The output's bytes against the time its disk or store needs to take them at `rate` (storage_rate_from), beside
    the GPUs' time (`wall`); `pace`: which of the two is longer, i.e. sets the run's pace ("storage", "gpus", or
    None when a figure is missing)."""
    bill = {"target": str(target), "num_bytes": num_bytes, "bytes_per_second": None, "source": None,
            "seconds": None, "gpu_seconds": wall["seconds"] if wall else None, "pace": None,
            "needed_bytes_per_second": num_bytes / wall["seconds"] if wall and wall["seconds"] else None}
    if rate is not None:
        bill.update(rate)
        bill["seconds"] = num_bytes / rate["bytes_per_second"]
        if bill["gpu_seconds"]:
            bill["pace"] = "storage" if bill["seconds"] > bill["gpu_seconds"] else "gpus"
    return bill


def _storage_line(b: dict, compute: str = "GPUs") -> str:
    head = f"{b['target']}: {format_bytes(b['num_bytes'])}"
    if b["bytes_per_second"] is None:
        return (head + "; its time is unknown: pass --storage-bytes-per-second (what that disk or store takes, all "
                       "writers together) or --storage-bench (a result of bench/disk_vs_writer.py, a script of "
                       "the dflash-prep repository)")
    line = f"{head} at {format_rate(b['bytes_per_second'])} ({b['source']}) = {format_duration(b['seconds'])}"
    if b["pace"] is None:
        return line + f"; no {compute} time to set beside it (pass --tokens-per-second)"
    verdict = "the storage sets the pace" if b["pace"] == "storage" else f"the {compute} set the pace"
    return (line + f", the {compute} {format_duration(b['gpu_seconds'])} (writing "
            f"{format_rate(b['needed_bytes_per_second'])}): " + verdict)


def _stored_plan(out_dir: Path, lengths: list[int], recipe: Recipe | None = None) -> dict | None:
    """What OUT/plan.json holds when the output exists (a resume runs those batches, not a new plan): its number of
    batches and layout, or why a resume would refuse it (job.read_stored_plan, the resume's own check), or that
    the output is finished (its manifest written) by this very job with its inputs untouched (the extraction's own
    pre-flight answer, `finished_summary`: a re-run does nothing) or possibly by another (`finished_other`: the
    extraction's content checks decide at its start); None without one."""
    from dflash_prep.commands.extract.preflight import ChangedJobError, finished_summary
    from dflash_prep.commands.job import PLAN_NAME, OutputMismatchError, read_stored_plan
    from dflash_prep.store.manifest import MANIFEST_NAME, OutputStateError

    path = out_dir / PLAN_NAME
    if not path.is_file():
        return None
    if (out_dir / MANIFEST_NAME).is_file():  # the manifest is written last: nothing is left to run
        try:
            same = recipe is None or finished_summary(recipe) is not None
        except ChangedJobError as e:
            return {"path": str(path), "refused": str(e)}
        return {"path": str(path), "finished": True} if same else {"path": str(path), "finished_other": True}
    try:
        stored = read_stored_plan(path, lengths)
        return {"path": str(path), "num_batches": len(stored["batches"]), "packed": bool(stored.get("packed"))}
    except (OutputStateError, OutputMismatchError) as e:
        return {"path": str(path), "refused": str(e)}


def format_plan(p: dict) -> str:
    stored = p.get("stored_plan")
    resume = [] if not stored else [("resume", f"a resume refuses it: {stored['refused']}" if "refused" in stored
                                     else f"{Path(stored['path']).parent} is finished: running this recipe again "
                                     "changes nothing (the plan below is of a new output)" if stored.get("finished")
                                     else f"{Path(stored['path']).parent} holds a finished output of a recipe or "
                                     "inputs other than these: the extraction refuses it if the job differs (the "
                                     "plan below is of a new output)" if stored.get("finished_other")
                                     else f"{stored['path']} holds {stored['num_batches']:,} "
                                     f"{'packed rows' if stored['packed'] else 'padded batches'}: a resume runs "
                                     f"those, not the plan below")]
    device = p.get("device") or {"type": "cuda", "why": ""}
    lines = resume + [
        ("device", ("GPUs" if device["type"] == "cuda" else "CPU") + f" ({device['why']}): batches, packing and "
                   f"rates as a run there makes them"),
        ("model", f"{p['model']}  [{p['model_type']}, {p['num_hidden_layers']} layers, hidden {p['hidden_size']}]; "
                  f"{p['layers_run']} decoder layers run"
                  + (f" ({format_count(p['decoder_params_run'])} parameters per token)"
                     if p["decoder_params_run"] else "")),
        ("layers", f"{p['layer_ids']} after-layer 0-based; final layer: {p['capture_final']}"),
        ("rows", f"{p['num_rows']:,}: {p['num_samples']:,} kept, {p['num_skipped']:,} skipped"
                 + (" (" + ", ".join(f"{k}: {v:,}" for k, v in p["skipped"].items()) + ")" if p["skipped"] else "")),
        *_samples_lines(p),
        ("tokens", f"{p['num_tokens']:,} (mean {p['num_tokens'] / max(p['num_samples'], 1):.1f} per sample)"),
        _batches_line(p),
        ("padding", f"efficiency {p['padding_efficiency'] or 0:.3f} ({p['num_padded_tokens']:,} padded tokens)"),
        ("budget", f"{p['max_tokens_per_batch']:,} padded tokens per batch"
         + _auto_note(p["max_tokens_per_batch_auto"], device["type"])
         + (f"; packed rows of at most {p['max_tokens_per_row']:,} tokens (batching.max_tokens_per_row)"
            if p.get("max_tokens_per_row") else "")),
    ]
    bf16 = p["disk"]["bfloat16"]["num_bytes"]
    for i, (dtype, d) in enumerate(p["disk"].items()):
        mark = "  <- output.dtype" if dtype == p["dtype"] else ""
        bill = "".join([f", {d['num_objects']:,} objects" if "num_objects" in d else "",
                        f", {format_duration(d['seconds_at_rate'])} at "
                        f"{format_rate(d['num_bytes'] / d['seconds_at_rate'])}" if d.get("seconds_at_rate") else "",
                        f", {d['cost_per_month']:,.2f}/month at {d['price_per_gb_month']:g}/GB"
                        if d.get("cost_per_month") is not None else ""])
        lines.append(("disk" if i == 0 else "", f"{dtype:<9} {format_bytes(d['num_bytes']):>10} in {d['num_shards']:,} "
                      f"shard(s), {d['bytes_per_token']:,.0f} B/token ({d['states_bytes_per_token']:,.0f} of states), "
                      f"{d['num_bytes'] / max(bf16, 1):.2f}x bf16{bill}{mark}"))
    t = p["throughput"]
    if t["tokens_per_second"]:
        ref = t.get("reference")
        kernels = ", ".join(ref.get("kernels") or ()) or "eager" if ref else None
        src = (f"{Path(ref['file']).name} ({ref['mode']}, {ref['tokens_per_second']:,.0f} tok/s on {ref['gpu']}, "
               f"{ref['compute_dtype']}, kernels {kernels}; {t['source']}"
               + (f", scaled x{t['scaled_by_decoder_params']:.3f} by decoder FLOPs/token" if
                  abs(t['scaled_by_decoder_params'] - 1) > 1e-9 else "")
               + (f", x{t['fp8_scale']['ratio']:.2f} for FP8 weights (FP8 / dequantized extraction of the same rows, "
                  f"bench/results/{t['fp8_scale']['folder']})" if t.get("fp8_scale") else "") + ")") \
            if ref else t["source"]
        unit, units, hours = (("GPU", "GPU(s)", "GPU-hours") if device["type"] == "cuda" else
                              ("CPU process", "CPU process(es)", "process-hours"))
        lines.append(("throughput", f"{t['tokens_per_second']:,.0f} real tok/s per {unit}: {src}"))
        w = p["wall"]
        warm = (f" + {format_duration(w['warmup_seconds'])} warm-up: first-seen shapes, first pinned host buffers"
                if w["warmup_seconds"] else "")
        lines.append(("wall time", f"{format_duration(w['seconds'])} on {w['num_gpus']} {units}"
                                   f"{_replicas_note(p['replicas'])} ({format_duration(w['compute_seconds'])} compute{warm}; "
                                   f"{w['gpu_hours']:.2f} {hours})"))
        per = (f"per {unit}" if p["replicas"]["gpus_per_replica"] == 1 else
               f"per replica ({format_rate(w['write_bytes_per_second_per_gpu'])} per GPU)")
        lines.append(("writes", f"{format_rate(w['write_bytes_per_second_per_replica'])} {per} at that rate "
                                f"(bench/writer_bench.py measures what a disk and output.num_writer_threads give)"))
    else:
        lines.append(("throughput", f"unknown ({t['source']}): pass --tokens-per-second"))
    if p.get("storage") is not None:
        lines.append(("storage", _storage_line(p["storage"], "GPUs" if device["type"] == "cuda" else "CPU processes")))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines) + "\n\nlength histogram (kept samples)\n" + \
        p["lengths_histogram"]


def _batches_line(p: dict) -> tuple[str, str]:
    """The plan's batches: padded batches, or packed rows with their shapes (rows x tokens: count)."""
    if not p["packing"]["packed"]:
        return ("batches", f"{p['num_batches']:,}, {p['num_shapes']} distinct shapes, batch size "
                           f"{p['batch_size_min']}-{p['batch_size_max']} (mean {p['batch_size_mean'] or 0:.1f}), "
                           f"padded length {p['padded_length_min']}-{p['padded_length_max']} "
                           f"({p['packing']['reason']})")
    shapes = ", ".join(f"{shape}: {n:,}" for shape, n in p["shapes"].items())
    return ("batches", f"{p['num_batches']:,} packed rows ({p['packing']['reason']}), {p['num_shapes']} distinct "
                       f"shapes ({shapes}), {p['batch_size_min']}-{p['batch_size_max']} samples per row "
                       f"(mean {p['batch_size_mean'] or 0:.1f})")


def _replicas_note(replicas: dict) -> str:
    """` as 2 replica(s) of 4 GPUs (tensor_parallel: 4 x one GPU's rate, an upper bound)` for N > 1, else ''."""
    n = replicas["gpus_per_replica"]
    if n == 1:
        return ""
    how = (f"{n} x one GPU's rate, an upper bound" if replicas["computing_gpus"] > 1 else
           "one GPU computes at a time: one GPU's rate")
    return f" as {replicas['num_replicas']} replica(s) of {n} GPUs ({replicas['parallelism']}: {how})"


def _auto_note(how: str | None, device_type: str = "cpu") -> str:
    if not how:
        return ""
    if how.startswith("no GPU") and device_type == "cuda":  # --gpu without a memory: the CPU figure, said so
        how = f"no GPU memory given, the CPU figure {how.split(':')[-1].strip()}"
    hint = "; pass --gpu-memory-gb to size it for the run's GPUs" if how.startswith("no GPU") else ""
    return f" (max_tokens_per_batch: auto, {how}{hint})"


def build_parser(prog: str = "dflash-prep plan") -> argparse.ArgumentParser:
    from dflash_prep.recipe.schema import add_recipe_args

    p = argparse.ArgumentParser(prog=prog, description="What a recipe will cost (samples, tokens, batches, padding, "
                                                       "bytes, wall time), without loading model weights.")
    add_recipe_args(p)
    p.add_argument("--num-gpus", type=int, default=1,
                   help="GPUs of the run (default 1); with model.gpus_per_replica N, the run has num-gpus / N replicas")
    p.add_argument("--tokens-per-second", type=float, default=None,
                   help="real tokens/s per GPU (default: the benchmark's figure, as shipped with the package)")
    p.add_argument("--bench-results", default=None,
                   help="a folder of benchmark reports to take the figures from (default: the figures shipped with "
                        "the package, from the project's bench/results)")
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory of one GPU of the run, for max_tokens_per_batch: auto (default: this machine's); "
                        "plans for GPUs")
    p.add_argument("--gpu", action="store_true",
                   help="plan the run on GPUs (batches, packing, benchmark rates) from a machine without one")
    p.add_argument("--storage-bytes-per-second", default=None, metavar="RATE",
                   help="what output.dir's disk or object store takes, all writers of the run together (e.g. 1.4GB; "
                        "measure it: bench/disk_vs_writer.py in a checkout), to time the writes beside the GPUs")
    p.add_argument("--storage-bench", default=None, metavar="FILE",
                   help="a result file of bench/disk_vs_writer.py: its shard-writer rate as the storage rate")
    p.add_argument("--storage-price-per-gb-month", type=float, default=None, metavar="PRICE",
                   help="what the store charges per GB (1e9 bytes) a month, e.g. 0.023: each storage dtype's "
                        "monthly cost (in the price's currency)")
    p.add_argument("--json", action="store_true", help="print every figure as JSON")
    p.add_argument("--show-sample", type=int, default=None, metavar="N",
                   help="first print input row N (0-based) as the extraction tokenizes it, supervised tokens marked")
    p.add_argument("--generated-tokens-per-second", type=float, default=None, metavar="X",
                   help="a recipe with a `regenerate:` section: generated tokens/s of the servers (or processes) "
                        "together, measured on yours, to time the regeneration (default: engine transformers, the "
                        "in-process engine's benchmark report in --bench-results; engine openai, none)")
    return p


def _samples_lines(p: dict) -> list[tuple[str, str]]:
    """The `samples` line (data.samples, docs/ON_POLICY.md), when the data has conversation rows."""
    from dflash_prep.data.samples import samples_line

    disk = (p.get("disk") or {}).get(p.get("dtype") or "", {})
    line = samples_line(p.get("samples") or {}, disk.get("bytes_per_token"))
    return [("samples", line)] if line else []


def show_sample(recipe: Recipe, row_index: int) -> str:
    """Row `row_index` of the data as the extraction tokenizes it: its text with the supervised (loss_mask 1) runs
    between `[[` and `]]`, then one line per token (position, id, text, `*` when supervised); or its skip
    reason. Loads the tokenizer and the rows only."""
    from dflash_prep.data.rows import Tokenizer, load_rows, read_chat_template
    from dflash_prep.target.model import load_config, load_tokenizer, vocab_size_of

    rows = load_rows(recipe.data)
    if not 0 <= row_index < len(rows):
        raise ValueError(f"--show-sample {row_index}: the data has rows 0..{len(rows) - 1}")
    tokenizer = load_tokenizer(recipe.model)
    fn = Tokenizer(tokenizer=tokenizer, max_length=recipe.data.max_length, overlong=recipe.data.overlong,
                   vocab_size=vocab_size_of(load_config(recipe.model)), id_column=recipe.data.id_column,
                   chat_template_kwargs=dict(recipe.data.chat_template_kwargs),
                   chat_template=read_chat_template(recipe.data), samples=recipe.data.samples)
    out = fn(rows[row_index: row_index + 1], [row_index])
    return "\n\n".join(_show_one(tokenizer, out, k, row_index) for k in range(len(out["sample_id"])))


def _show_one(tokenizer, out: dict, k: int, row_index: int) -> str:
    """`show_sample`'s text of sample k of a row (a `per_turn` row has one per supervised turn)."""
    head = f"row {row_index} (sample {out['sample_id'][k]}, id {out['source_id'][k]!r})"
    if out["skip_reason"][k]:
        return f"{head}: skipped, {out['skip_reason'][k]}" + (f" ({out['skip_detail'][k]})" if out["skip_detail"][k]
                                                              else "")
    ids, mask = out["input_ids"][k], out["loss_mask"][k]
    pieces, start = [], 0  # text runs decoded whole (a token may hold part of a character)
    for t in range(1, len(ids) + 1):
        if t == len(ids) or mask[t] != mask[start]:
            text = tokenizer.decode(ids[start:t])
            pieces.append(f"[[{text}]]" if mask[start] else text)
            start = t
    table = [f"{t:>6} {token_id:>8} {'*' if m else ' '} {tokenizer.decode([token_id])!r}"
             for t, (token_id, m) in enumerate(zip(ids, mask))]
    return (f"{head}: {len(ids)} tokens, {sum(mask)} supervised (between [[ and ]], * below)\n"
            + "".join(pieces) + "\n\n   pos       id   token\n" + "\n".join(table))


def main(argv: list[str] | None = None) -> int:
    """`dflash-prep plan --recipe R [--set k=v] [--num-gpus N] [--tokens-per-second X] [--json] [--show-sample N]`.

    Exit code 2 when the recipe is invalid or the data would give an empty or mostly skipped run (the message the
    extraction stops with, before any model loads)."""
    from dflash_prep.recipe.schema import load_recipe

    args = build_parser().parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()  # no kernel-fallback notices on the console
    try:
        import datasets

        datasets.disable_progress_bars()
        if args.gpu_memory_gb is not None and not (math.isfinite(args.gpu_memory_gb) and args.gpu_memory_gb > 0):
            raise ValueError(f"--gpu-memory-gb must be a finite number > 0, got {args.gpu_memory_gb:g}")
        recipe = load_recipe(args.recipe, args.overrides)
        if args.show_sample is not None:
            print(show_sample(recipe, args.show_sample) + "\n", flush=True)
        plan = make_run_plan(recipe, num_gpus=args.num_gpus, tokens_per_second=args.tokens_per_second,
                             bench_dir=Path(args.bench_results) if args.bench_results else DEFAULT_FIGURES,
                             gpu_memory_bytes=int(args.gpu_memory_gb * 1e9) if args.gpu_memory_gb else None,
                             gpu=args.gpu,
                             storage_rate=storage_rate_from(args.storage_bytes_per_second, args.storage_bench),
                             price_per_gb_month=args.storage_price_per_gb_month)
        if recipe.regenerate is not None:  # on-policy data: the regeneration first (plan_regeneration, below)
            plan["regenerate"] = plan_regeneration(
                recipe, args.generated_tokens_per_second, num_gpus=args.num_gpus,
                bench_dir=Path(args.bench_results) if args.bench_results else DEFAULT_FIGURES)
    except (RecipeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        if "regenerate" in plan:
            print(format_regeneration(plan["regenerate"]) + "\n")
        print(format_plan(plan))
        print(f"\n(planned in {plan['plan_seconds']:.1f}s, tokenization {plan['tokenize_seconds']:.1f}s)")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The regeneration of a recipe with a `regenerate:` section (commands/regenerate.py): requests, prompt tokens
# counted with the tokenizer, generated tokens at most (max_tokens a request), and time only on a measured rate.
REGEN_PLAN_MAX_ROWS = 20_000  # rows rendered to count prompt tokens; more rows: a seeded sample, scaled


def plan_regeneration(recipe: Recipe, generated_tokens_per_second: float | None = None, num_gpus: int = 1,
                      bench_dir=DEFAULT_FIGURES) -> dict:
    """The regeneration's figures: rows, rows skipped by reason, requests (one per generated turn; with `turns: all`
    an upper bound, since a tool call other than the data's ends a conversation early), prompt tokens (each
    request's prompt rendered by the tokenizer's chat template with the data's earlier turns standing in for the
    target's, `chat_template_kwargs` applied), generated tokens at most (requests x max_tokens). Prompt tokens are
    counted on every row up to REGEN_PLAN_MAX_ROWS, else on a seeded sample of that many rows and scaled. Time:
    from `generated_tokens_per_second` (measured on the user's servers or GPUs), else for the in-process engine
    from its benchmark's committed report (`bench_dir`: commands/bench_figures.py) for `num_gpus` GPUs (commands/regen_rate.py); the
    openai engine's rate is the servers': no default."""
    import random

    from dflash_prep.data.rows import load_rows
    from dflash_prep.regen.conversation import Conversation, RegenSettings
    from dflash_prep.data.chat import ChatRenderer
    from dflash_prep.data.conversation import prompt_conversation
    from dflash_prep.data.rows import read_chat_template
    from dflash_prep.regen.loop import row_at
    from dflash_prep.target.model import load_tokenizer

    section = recipe.regenerate
    kwargs = dict(section.chat_template_kwargs if section.chat_template_kwargs is not None
                  else recipe.data.chat_template_kwargs)
    settings = RegenSettings(turns=section.turns, sampling={}, max_tokens=section.max_tokens,
                             chat_template_kwargs=kwargs, on_length=section.on_length, seed=section.seed)
    rows = load_rows(recipe.data)
    tokenizer = load_tokenizer(recipe.model)
    renderer = ChatRenderer(tokenizer, read_chat_template(recipe.data), kwargs)
    positions = list(range(len(rows)))
    sampled = len(positions) > REGEN_PLAN_MAX_ROWS
    if sampled:
        positions = sorted(random.Random(0).sample(positions, REGEN_PLAN_MAX_ROWS))
    skipped, requests, prompt_tokens = {}, 0, 0
    for position in positions:
        batch = rows[position: position + 1]
        row, reason = row_at(batch, list(batch), 0)  # a line read as raw JSON text is parsed as the run parses it
        conv = reason or Conversation.of_row(row, position, settings, recipe.data.id_column)
        if isinstance(conv, str):
            skipped[str(conv)] = skipped.get(str(conv), 0) + 1
            continue
        for index in conv.targets:
            requests += 1
            try:  # rendered as the in-process engine and the extraction render it (data.chat_template)
                prompt = prompt_conversation(conv.data[:index], conv.tools)
                prompt_tokens += len(renderer.served_prompt_ids(renderer.template_messages(prompt), prompt.tools))
            except Exception:  # noqa: BLE001 - a prompt the template refuses: the engine rejects it too
                skipped["chat_template_error"] = skipped.get("chat_template_error", 0) + 1
    scale = len(rows) / len(positions) if positions else 0.0
    out = {"engine": section.engine, "turns": section.turns, "max_tokens": section.max_tokens,
           "num_rows": len(rows), "counted_rows": len(positions), "sampled": sampled,
           "skipped": {k: round(v * scale) for k, v in sorted(skipped.items())},
           "num_requests": round(requests * scale), "prompt_tokens": round(prompt_tokens * scale),
           "generated_tokens_at_most": round(requests * scale) * section.max_tokens,
           **_regen_rate(recipe, generated_tokens_per_second, num_gpus, bench_dir)}
    rate = out["generated_tokens_per_second"]
    out["seconds_at_most"] = out["generated_tokens_at_most"] / rate if rate else None
    return out


def _regen_rate(recipe: Recipe, given: float | None, num_gpus: int, bench_dir) -> dict:
    """{generated_tokens_per_second, rate_source, rate_reference} (commands/regen_rate.py)."""
    from dflash_prep.commands.regen_rate import regen_rate

    model_type = params = None
    if recipe.regenerate.engine == "transformers" and not given:
        from dflash_prep.target.layers import num_decoder_layers
        from dflash_prep.target.model import decoder_params_run, load_config

        config = load_config(recipe.model)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        model_type = getattr(text, "model_type", None)
        params = decoder_params_run(recipe.model, config, num_decoder_layers(config) - 1)
    rate = regen_rate(recipe.regenerate.engine, given, model_type, params, num_gpus, figures(bench_dir),
                      describe(bench_dir))
    return {"generated_tokens_per_second": rate["generated_tokens_per_second"], "rate_source": rate["source"],
            "rate_reference": rate["reference"]}


def format_regeneration(r: dict) -> str:
    where = (f" (counted on {r['counted_rows']:,} sampled rows, scaled)" if r["sampled"] else "")
    time_line = (f"at most {format_duration(r['seconds_at_most'])} at {r['generated_tokens_per_second']:,.0f} "
                 f"generated tok/s: {r['rate_source']}" if r["seconds_at_most"] is not None else r["rate_source"])
    lines = [
        ("regenerate", f"engine {r['engine']}, turns {r['turns']}, max_tokens {r['max_tokens']:,}"),
        ("rows", f"{r['num_rows']:,}" + (": skipped " + ", ".join(f"{k}: {v:,}" for k, v in r["skipped"].items())
                                         if r["skipped"] else "")),
        ("requests", f"{r['num_requests']:,}" + (" at most (a tool call other than the data's ends a row early)"
                                                 if r["turns"] == "all" else "")),
        ("prompt tokens", f"{r['prompt_tokens']:,}{where}"),
        ("generated", f"{r['generated_tokens_at_most']:,} tokens at most (requests x max_tokens)"),
        ("time", time_line),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines) + \
        "\n(the extraction plan below counts the data's own answers: the regenerated ones are not known yet)"


if __name__ == "__main__":
    sys.exit(main())

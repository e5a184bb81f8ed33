#!/usr/bin/env python
"""Extraction benchmark: per-sample vs fixed-batch vs dflash-prep, same process, same samples.

    python bench/run_bench.py --model qwen3.6-27b|llama3.1-8b|tiny-qwen3.5|tiny-llama
        [--num-samples N] [--per-sample-max-seconds S] [--modes per_sample,fixed_batch,dflash_prep]
        [--results-dir DIR] [--max-tokens-per-batch N|auto] [--out-dir DIR] ...   (see --help)

Modes (all read the same list of pre-drawn samples; a time-bounded mode runs a prefix of it):

  per_sample   one sample at a time through the full CausalLM with `output_hidden_states=True`; the
               captured layers are concatenated to [T, k*H] and saved as one safetensors file per sample
               (what users start with).
  fixed_batch  consecutive batches of 32 (the list is i.i.d. draws, so these are random batches, as with a
               shuffled dataset), right-padded to the batch maximum, `output_hidden_states=True` on the
               CausalLM (no hooks), unpadded and saved per sample with torch.save in SpecForge's layout
               (`rows_{g}-{g+2000}/data_{idx}.ckpt`). A batch that runs out of GPU memory is split in two
               and retried (counted in `oom_splits`; the wasted time stays in the wall time).
  dflash_prep  the real path end to end: the benchmark writes the samples as a parquet of pre-tokenized
               rows (`id`, `input_ids`, `loss_mask` all ones) and calls `dflash_prep.extract.run_extraction`
               on a recipe whose `model.config` is the benchmark config (hooks, planner, loader, async shard
               writer, manifest: all included).
  X_warm       (optional: per_sample_warm, fixed_batch_warm, dflash_prep_warm, each after its X) mode X again,
               in the same process, on exactly the samples X ran: the same shapes, so what X compiled and
               autotuned (Triton/fla kernels of the Gated DeltaNet layers, cuBLAS heuristics) is reused. Cold
               pass = what a short or fresh run pays; warm pass = the steady state of a long run; their
               difference = the first-shape cost (`warm_vs_cold` in the report).

Every mode builds the model the same way (`dflash_prep.model.load_model`: random weights drawn on the device
with the same seed, `from_config(..., dtype=...)` under `torch.device(...)`), so all modes see identical
weights (a checksum per mode proves it) and their states can be compared (`consistency` in the report).

Random weights, pre-drawn random token ids: the numbers measure the extraction machinery, not a checkpoint.
"""

from __future__ import annotations

import os

# Same allocator setting as dflash-prep's extract.py, set for every mode before torch touches CUDA (fair, and
# fewer fragmentation OOMs for the batches of changing shapes of the baselines). A user setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/run_bench.py` from a checkout, package not installed
    sys.path.insert(0, str(REPO_ROOT))

from dflash_prep.model import DTYPES, load_model  # noqa: E402
from dflash_prep.recipe import ModelSection, recipe_from_dict  # noqa: E402

CONFIG_DIR = BENCH_DIR / "configs"
# Any tokenizer works for pre-tokenized rows (ids are checked against the model config's vocab, not the
# tokenizer's); dflash-prep only reads its pad id (0) and fingerprints it. The demo tokenizer ships offline.
TOKENIZER_DIR = REPO_ROOT / "recipes" / "tiny-demo" / "tokenizer"

ALL_MODES = ("per_sample", "fixed_batch", "dflash_prep", "per_sample_warm", "fixed_batch_warm", "dflash_prep_warm",
             "dflash_prep_variant", "dflash_prep_profile")
VARIANT = "dflash_prep_variant"  # dflash_prep again on its samples with --variant-set on top: an A/B in one run
PROFILE = "dflash_prep_profile"  # dflash_prep again on its samples under torch.profiler: where the GPU time goes
DEFAULT_MODES = "per_sample,fixed_batch,dflash_prep"
GB = 1e9


# ------------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: a config JSON in bench/configs/ and the defaults sized for one H200."""

    config: str
    layer_ids: tuple[int, ...]  # after-layer, 0-based (id i = HF hidden_states[i + 1])
    layer_rule: str
    dtype: str  # compute dtype
    num_samples: int  # size of the sample list (the dflash-prep prefix is cut from it by tokens)
    per_sample_max_seconds: float
    fixed_batch_max_seconds: float
    dflash_max_tokens: int  # real tokens given to dflash-prep (bounds its disk use)
    max_length: int = 4096  # length clip (and data.max_length of the recipe)


MODELS = {
    # 27B hybrid: 51.2 KB per token stored (5 x 5120 x bf16): 250k tokens = 12.8 GB on disk.
    "qwen3.6-27b": ModelSpec("qwen3.6-27b.json", (1, 16, 31, 46, 61), "DFlash k=5 for L=64", "bfloat16",
                             num_samples=900, per_sample_max_seconds=60, fixed_batch_max_seconds=60,
                             dflash_max_tokens=250_000),
    # 8B: 24.6 KB per token (3 x 4096 x bf16): 800k tokens = 19.7 GB.
    "llama3.1-8b": ModelSpec("llama3.1-8b.json", (1, 15, 28), "EAGLE-3 for L=32", "bfloat16",
                             num_samples=3000, per_sample_max_seconds=45, fixed_batch_max_seconds=60,
                             dflash_max_tokens=800_000),
    # CPU-sized (seconds): used by tests/test_bench.py. 8 layers each.
    "tiny-qwen3.5": ModelSpec("tiny-qwen3.5.json", (1, 2, 3, 4, 5), "DFlash k=5 for L=8", "float32",
                              num_samples=24, per_sample_max_seconds=120, fixed_batch_max_seconds=120,
                              dflash_max_tokens=10**9, max_length=1024),
    "tiny-llama": ModelSpec("tiny-llama.json", (1, 3, 4), "EAGLE-3 for L=8", "float32",
                            num_samples=24, per_sample_max_seconds=120, fixed_batch_max_seconds=120,
                            dflash_max_tokens=10**9, max_length=1024),
}


# ----------------------------------------------------------------------------------------------- samples
@dataclass
class Samples:
    """The one sample list every mode reads (a mode that stops early ran a prefix of it)."""

    ids: list[str]  # "{i:010d}": dflash-prep's sample_id of row i of the data file the benchmark writes
    tokens: list[np.ndarray]  # int64 [T]
    lengths: np.ndarray  # int64 [n]
    params: dict

    def prefix_by_tokens(self, max_tokens: int) -> int:
        """Largest n such that the first n samples hold <= max_tokens real tokens (at least 1)."""
        return max(1, int(np.searchsorted(np.cumsum(self.lengths), max_tokens, side="right")))


def make_samples(n: int, mu: float, sigma: float, min_len: int, max_len: int, vocab: int, seed: int) -> Samples:
    """Lengths ~ round(lognormal(mu, sigma)) clipped to [min_len, max_len]; token ids uniform in [1, vocab)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), min_len, max_len).astype(np.int64)
    tokens = [rng.integers(1, vocab, size=int(L), dtype=np.int64) for L in lengths]
    params = {"distribution": "lognormal", "mu": mu, "sigma": sigma, "clip": [min_len, max_len], "seed": seed,
              "token_ids": f"uniform in [1, {vocab})", "num_samples": n,
              "num_tokens": int(lengths.sum()), "mean": float(lengths.mean()),
              "median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
              "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()), "min": int(lengths.min()),
              "expected_mean_unclipped": math.exp(mu + sigma**2 / 2)}
    return Samples([f"{i:010d}" for i in range(n)], tokens, lengths, params)


# ----------------------------------------------------------------------------------------------- helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def peak_memory(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def measure_gemm(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 10) -> dict:
    """Dense GEMM rate on this device: n x n x n matmul, warmed, median of `repeats` timed calls."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b)
    sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            torch.matmul(a, b)
            times.append(time.perf_counter() - t0)
    del a, b
    free_memory(device)
    median = float(np.median(times))
    return {"size": n, "dtype": str(dtype).replace("torch.", ""), "device": str(device), "repeats": repeats,
            "median_seconds": median, "flops_per_second": 2 * n**3 / median,
            "tflops": 2 * n**3 / median / 1e12, "all_tflops": [2 * n**3 / t / 1e12 for t in times]}


def model_info(config, layer_ids: list[int]) -> dict:
    """Parameter counts from a meta-device build (no memory, no time)."""
    from transformers import AutoModelForCausalLM

    from dflash_prep.layers import decoder_layers, find_decoder

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = decoder_layers(find_decoder(model))
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    info = {"model_type": text.model_type, "architecture": type(model).__name__,
            "num_hidden_layers": len(layers), "hidden_size": int(text.hidden_size),
            "vocab_size": int(text.vocab_size), "params_total": sum(p.numel() for p in model.parameters()),
            "decoder_params_all_layers": sum(per_layer),
            "decoder_params_needed": sum(per_layer[: max(layer_ids) + 1]),
            "layers_needed": max(layer_ids) + 1, "per_layer_params": per_layer}
    del model
    return info


def weights_checksum(model, layer_ids: list[int]) -> float:
    """float64 sum of the embedding and of decoder layers 0 and max(layer_ids): the same in every mode iff the
    modes built the same random weights (later layers may be dropped by dflash-prep, so they are not summed)."""
    from dflash_prep.layers import decoder_layers, find_decoder

    decoder = find_decoder(model)
    layers = decoder_layers(decoder)
    tensors = list(decoder.get_input_embeddings().parameters())
    for i in sorted({0, max(layer_ids)}):
        tensors += list(layers[i].parameters())
    with torch.no_grad():
        return float(sum(torch.sum(t, dtype=torch.float64).item() for t in tensors))


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fs_info(path: Path) -> dict:
    """Filesystem type (from /proc/mounts) and free space of `path`."""
    path = path.resolve()
    fstype, mount = None, None
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
        mount = best or None
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    return {"path": str(path), "mount": mount, "fstype": fstype, "free_bytes": usage.free,
            "total_bytes": usage.total}


def environment(device: torch.device) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "host": socket.gethostname(),
           "cpu_count": os.cpu_count(), "device": str(device),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING")}
    for mod in ("fla", "causal_conv1d", "liger_kernel", "triton", "datasets", "webdataset", "accelerate",
                "safetensors"):
        spec = importlib.util.find_spec(mod)
        if spec is None:
            env[mod] = None
            continue
        try:
            from importlib.metadata import version

            name = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d",
                    "liger_kernel": "liger-kernel"}.get(mod, mod)
            env[mod] = version(name)
        except Exception:  # noqa: BLE001 - installed without metadata
            env[mod] = "installed"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   sm_count=props.multi_processor_count)
    return env


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def auto_token_budget(device: torch.device, config, info: dict, dtype_name: str, storage_dtype_name: str,
                      k: int) -> tuple[int, str]:
    """`--max-tokens-per-batch auto`: the product's own rule (`batching.max_tokens_per_batch: auto`,
    dflash_prep/budget.py), with the weights of the whole model (the baselines hold all of it)."""
    from dflash_prep import budget

    if device.type != "cuda":
        return budget.auto_token_budget(None, 0, 1)
    per_token = budget.bytes_per_padded_token(config, dtype_name, storage_dtype_name, k)
    weights = info["params_total"] * DTYPES[dtype_name].itemsize
    return budget.auto_token_budget(torch.cuda.get_device_properties(device).total_memory, weights, per_token)


# --------------------------------------------------------------------------------------- per-batch records
@dataclass
class BatchLog:
    """Per-forward timings of a mode (baselines: synchronous wall times)."""

    shapes_seen: set = field(default_factory=set)
    num_batches: int = 0
    num_samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    forward_seconds: float = 0.0
    copy_seconds: float = 0.0
    write_seconds: float = 0.0
    bytes_written: int = 0
    first_shape_batches: int = 0
    first_shape_seconds: float = 0.0  # forward time of batches whose shape was new
    first_shape_batch_seconds: float = 0.0  # whole time (forward, copy, save) of those batches
    first_shape_real_tokens: int = 0

    def add(self, shape: tuple, real: int, padded: int, t_forward: float, t_copy: float, t_write: float,
            nbytes: int, num_samples: int) -> None:
        new = shape not in self.shapes_seen
        self.shapes_seen.add(shape)
        self.num_batches += 1
        self.num_samples += num_samples
        self.real_tokens += real
        self.padded_tokens += padded
        self.forward_seconds += t_forward
        self.copy_seconds += t_copy
        self.write_seconds += t_write
        self.bytes_written += nbytes
        if new:
            self.first_shape_batches += 1
            self.first_shape_seconds += t_forward
            self.first_shape_batch_seconds += t_forward + t_copy + t_write
            self.first_shape_real_tokens += real


# ----------------------------------------------------------------------------------------------- readers
# What each mode wrote, read back from disk: {sample_id: (input_ids int64 [T], hidden_states [T, k*H])}.
def fixed_batch_path(root: Path, index: int) -> Path:
    g = index // 2000 * 2000
    return root / f"rows_{g}-{g + 2000}" / f"data_{index}.ckpt"


def written_ids(mode: str, root: Path) -> list[str]:
    """Sample ids a mode's output holds, sorted."""
    if mode == "per_sample":
        return sorted(p.stem for p in root.glob("*.safetensors"))
    if mode == "fixed_batch":
        return sorted(f"{int(p.stem.split('_')[1]):010d}" for p in root.glob("rows_*/data_*.ckpt"))
    return sorted(key for path in dflash_shards(root) for key in tar_keys(path))


def dflash_shards(root: Path) -> list[Path]:
    """The committed shards of a dflash-prep output, as its manifest lists them."""
    with open(root / "manifest.json") as f:
        return [root / shard["path"] for shard in json.load(f)["shards"]]


def tar_keys(path: Path) -> set[str]:
    """webdataset sample keys in a tar: member names up to the first dot."""
    with tarfile.open(path) as tar:
        return {name.partition(".")[0] for name in tar.getnames()}


def read_samples(mode: str, root: Path, sample_ids: list[str]) -> dict:
    """Read `sample_ids` (those present) back from a mode's output."""
    from safetensors.torch import load as st_load
    from safetensors.torch import load_file

    out = {}
    if mode == "per_sample":
        for sid in sample_ids:
            p = root / f"{sid}.safetensors"
            if p.exists():
                t = load_file(str(p))
                out[sid] = (t["input_ids"].numpy().astype(np.int64), t["hidden_states"])
        return out
    if mode == "fixed_batch":
        for sid in sample_ids:
            p = fixed_batch_path(root, int(sid))
            if p.exists():
                d = torch.load(p, weights_only=True)
                out[sid] = (d["input_ids"].numpy().astype(np.int64), d["hidden_states"][0])
        return out
    # dflash-prep: webdataset tar shards (read with the standard library: members `{key}.{suffix}`).
    wanted = set(sample_ids)
    for path in dflash_shards(root):
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, suffix = member.name.partition(".")
                if key not in wanted or suffix not in ("input_ids.npy", "hidden_states.safetensors"):
                    continue
                data = tar.extractfile(member).read()
                ids, hs = out.get(key, (None, None))
                if suffix == "input_ids.npy":
                    ids = np.load(io.BytesIO(data), allow_pickle=False).astype(np.int64)
                else:
                    hs = st_load(data)["hidden_states"]
                out[key] = (ids, hs)
    return out


def compare(a: dict, b: dict, k: int) -> dict:
    """States of two modes on their common samples: max |a-b|, relative L2 error (worst sample and layer)."""
    common = sorted(set(a) & set(b))
    res = {"samples_compared": len(common), "input_ids_equal": True, "shapes_equal": True,
           "max_abs_diff": 0.0, "max_rel_l2": 0.0, "max_abs_ref": 0.0, "max_rel_l2_per_layer": [0.0] * k}
    for sid in common:
        (ia, ha), (ib, hb) = a[sid], b[sid]
        res["input_ids_equal"] &= bool(np.array_equal(ia, ib))
        if ha.shape != hb.shape:
            res["shapes_equal"] = False
            continue
        ha, hb = ha.float(), hb.float()
        res["max_abs_diff"] = max(res["max_abs_diff"], float((ha - hb).abs().max()))
        res["max_abs_ref"] = max(res["max_abs_ref"], float(ha.abs().max()))
        for slot, (la, lb) in enumerate(zip(ha.chunk(k, dim=-1), hb.chunk(k, dim=-1))):  # per captured layer
            rel = float((la - lb).norm() / la.norm().clamp_min(1e-30))
            res["max_rel_l2"] = max(res["max_rel_l2"], rel)
            res["max_rel_l2_per_layer"][slot] = max(res["max_rel_l2_per_layer"][slot], rel)
    return res


# ----------------------------------------------------------------------------------------------- context
@dataclass
class Ctx:
    args: argparse.Namespace
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    storage_dtype: torch.dtype
    section: ModelSection  # the model section every mode builds from
    config: object
    layer_ids: list[int]
    info: dict
    samples: Samples
    out_root: Path
    token_budget: int
    token_budget_how: str
    disk_reserve: int = 2 * 1024**3

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.info["hidden_size"] * self.storage_dtype.itemsize

    def build_model(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        model = load_model(self.section, self.config, self.device)
        sync(self.device)
        return model, time.perf_counter() - t0

    def disk_ok(self, path: Path, next_bytes: int) -> bool:
        return shutil.disk_usage(path).free > self.disk_reserve + next_bytes


def logits_kwargs(ctx: Ctx) -> dict:
    return {"logits_to_keep": 1} if ctx.args.logits == "last" else {}


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
    params = ctx.info["decoder_params_all_layers"]  # the full CausalLM runs every decoder layer
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
class DflashTimings:
    """Per-batch timings of run_extraction, gathered by wrapping two of extract.py's module globals.

    `LayerCapture.run` (the forward) and `_to_host` (the device-to-host copy) are bracketed by CUDA events on
    the current stream: no synchronization is added, the pipeline runs as it does without the benchmark; the
    events are read after the run. On CPU, wall-clock times (CPU ops are synchronous).
    """

    def __init__(self, device: torch.device, layer_ids: list[int]):
        self.cuda = device.type == "cuda"
        self.layer_ids = layer_ids
        self.batches: list[dict] = []
        self.checksum: float | None = None
        self.load_seconds: float | None = None

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def span(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    @contextlib.contextmanager
    def installed(self):
        import dflash_prep.extract as ex

        timings = self
        orig_capture, orig_to_host, orig_load = ex.LayerCapture, ex._to_host, ex.load_model

        class TimedCapture(orig_capture):
            def run(self, input_ids, attention_mask, position_ids, flat_index):
                rec = {"shape": tuple(input_ids.shape), "real": int(flat_index.shape[0]),
                       "start": timings.mark(), "host_start": time.perf_counter()}
                timings.batches.append(rec)
                out = super().run(input_ids, attention_mask, position_ids, flat_index)
                rec["forward_end"] = timings.mark()
                rec["host_forward"] = time.perf_counter() - rec["host_start"]
                return out

        def timed_to_host(captured, device):
            out = orig_to_host(captured, device)
            if timings.batches:
                timings.batches[-1]["copy_end"] = timings.mark()
            return out

        def timed_load(section, config, device):
            t0 = time.perf_counter()
            model = orig_load(section, config, device)
            sync(device)
            timings.load_seconds = time.perf_counter() - t0
            timings.checksum = weights_checksum(model, timings.layer_ids)
            return model

        ex.LayerCapture, ex._to_host, ex.load_model = TimedCapture, timed_to_host, timed_load
        try:
            yield self
        finally:
            ex.LayerCapture, ex._to_host, ex.load_model = orig_capture, orig_to_host, orig_load

    def resolve(self) -> dict:
        """Sum the per-batch spans (after the run, once every event has completed)."""
        if self.cuda:
            torch.cuda.synchronize()
        seen, fwd, copy, first_s, first_n, first_real, host_fwd = set(), 0.0, 0.0, 0.0, 0, 0, 0.0
        per_batch = []
        for rec in self.batches:
            f = self.span(rec["start"], rec["forward_end"])
            c = self.span(rec["forward_end"], rec["copy_end"]) if "copy_end" in rec else 0.0
            fwd, copy, host_fwd = fwd + f, copy + c, host_fwd + rec["host_forward"]
            first = rec["shape"] not in seen
            if first:
                seen.add(rec["shape"])
                first_s, first_n, first_real = first_s + f, first_n + 1, first_real + rec["real"]
            per_batch.append({"B": rec["shape"][0], "T": rec["shape"][1], "real_tokens": rec["real"],
                              "forward_seconds": f, "copy_seconds": c, "host_forward_seconds": rec["host_forward"],
                              "first_of_shape": first})
        return {"forward": fwd, "copy": copy, "first_shape_seconds": first_s, "first_shape_batches": first_n,
                "first_shape_real_tokens": first_real, "num_shapes": len(seen), "host_forward": host_fwd,
                "shapes": sorted(seen, key=lambda s: (-s[1], -s[0])), "batches": per_batch}


def write_pretokenized(path: Path, samples: Samples, n: int) -> None:
    """Rows `id`, `input_ids`, `loss_mask` (all ones) as parquet: dflash-prep's pre-tokenized input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [t.astype(np.int32) for t in samples.tokens[:n]]
    table = pa.table({
        "id": pa.array(samples.ids[:n], pa.string()),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array([np.ones(len(t), np.int8) for t in ids], pa.list_(pa.int8())),
    })
    pq.write_table(table, path)


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
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return recipe_from_dict(raw)


def run_dflash(ctx: Ctx, out_dir: Path, repeat_of: dict | None = None, extra_overrides: list | None = None) -> dict:
    """`run_extraction` on the longest prefix that fits the token (and disk) budget (a warm pass: the same).
    `extra_overrides` (the variant mode) go on top of `--dflash-set`."""
    from dflash_prep.extract import run_extraction

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
            "copy_to_host_gpu": t["copy"],  # GPU span of the device-to-host copy
            "idle_gpu": loop_s - t["forward"] - t["copy"],  # loop time with neither on the GPU
            "forward_host": r["forward_seconds"],  # host time inside forward + copy enqueue (summary)
            "writer_wait": r["writer_wait_seconds"],  # loop blocked on a full writer queue
            "write": r["write_seconds"],  # writer threads' busy time, summed: encode + tar + fsync (overlaps the GPU)
        },
        "peak_pending_bytes": r.get("peak_pending_bytes"),  # host memory held by batches awaiting the writers
        "recipe_batching": {"max_tokens_per_batch": b.max_tokens_per_batch, "max_batch_size": b.max_batch_size,
                            "length_multiple": b.length_multiple, "length_growth": b.length_growth,
                            "num_workers": b.num_workers, "num_writer_threads": recipe.output.num_writer_threads},
        # extract.py's own CUDA-event sum of the forwards (newer versions): a cross-check of forward_gpu above
        "summary_gpu_forward_seconds": r.get("gpu_forward_seconds"),
        "shapes": [list(s) for s in t["shapes"]],
        "batches": t["batches"],  # per forward, in run order: shape, real tokens, GPU spans, first of its shape
        "summary": {k: v for k, v in summary.items() if k != "ranks"},
        "weights_checksum": timings.checksum,
    }


# ---------------------------------------------------------------------------------------------- profile
# Kernel name patterns, first match wins: where a forward's GPU time goes.
KERNEL_CATEGORIES = (  # attention first: flash / mem-efficient kernels carry "cutlass" in their template names
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|addmm|bmm|\bmm\b|linear|cublas", re.I)),
    # flash-linear-attention's Gated DeltaNet kernels (chunk_gated_delta_rule_fwd_kernel_h_blockdim64, solve_tril,
    # merge_16x16_to_64x64_inverse, recompute_w_u_fwd, chunk_scaled_dot_kkt_fwd, chunk_local_cumsum, l2norm_fwd,
    # gdn_gate_fwd, chunk_fwd_kernel_o, ...)
    ("gated_deltanet", re.compile(r"chunk|delta|fla_|l2norm|solve_tril|recompute_w_u|cumsum|recurrent|kkt|"
                                  r"gdn|beta_sigmoid|merge_\d+x\d+|inverse", re.I)),
    ("conv", re.compile(r"conv", re.I)),
    ("memory", re.compile(r"memcpy|memset|copy|cat|index|gather|scatter|fill", re.I)),
    ("norm", re.compile(r"norm|rsqrt", re.I)),
)


def kernel_profile(prof, cuda: bool, top: int = 40) -> dict:
    """Seconds and share per kernel category and the `top` kernels (GPU: kernels by self device time; CPU: ops
    by self CPU time), from a finished torch.profiler session."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            t = getattr(evt, "self_device_time_total", None)
            t = getattr(evt, "self_cuda_time_total", 0) if t is None else t
        else:
            t = evt.self_cpu_time_total
        if t and t > 0:
            rows.append((evt.key, t / 1e6, evt.count))
    total = sum(t for _, t, _ in rows) or 1.0
    categories: dict[str, float] = {}
    for name, t, _ in rows:
        cat = next((c for c, pattern in KERNEL_CATEGORIES if pattern.search(name)), "other")
        categories[cat] = categories.get(cat, 0.0) + t
    rows.sort(key=lambda r: -r[1])
    return {"device": "cuda" if cuda else "cpu", "total_seconds": total,
            "categories": {c: {"seconds": t, "share": t / total}
                           for c, t in sorted(categories.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "seconds": t, "share": t / total, "calls": c} for n, t, c in rows[:top]]}


# ----------------------------------------------------------------------------------------------- driver
RUNNERS = {"per_sample": run_per_sample, "fixed_batch": run_fixed_batch, "dflash_prep": run_dflash}


def finish_result(ctx: Ctx, res: dict, gemm: dict) -> dict:
    """Derived figures, the same formulas for every mode."""
    loop = res["loop_seconds"]
    real, padded = res["num_real_tokens"], res["num_padded_tokens"]
    tps = real / loop if loop > 0 else None
    res["tokens_per_second"] = tps
    res["samples_per_second"] = res["num_samples"] / loop if loop > 0 else None
    res["padding_efficiency"] = real / padded if padded else None
    flops = gemm["flops_per_second"]
    # MFU = 2 x params of the executed decoder layers x real tok/s / measured GEMM rate (lm_head not counted)
    res["mfu"] = 2 * res["decoder_params_executed"] * tps / flops if tps else None
    # ... and over the layers the capture needs (same numerator in every mode: comparable useful work)
    res["mfu_needed_layers"] = 2 * ctx.info["decoder_params_needed"] * tps / flops if tps else None
    steady = res.get("tokens_per_second_excl_first_shapes")
    res["mfu_excl_first_shapes"] = 2 * res["decoder_params_executed"] * steady / flops if steady else None
    res["write_gb_per_second"] = res["bytes_written"] / loop / GB if loop > 0 else None
    return res


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
        kind = "dflash_prep" if mode in (VARIANT, PROFILE) else mode.removesuffix("_warm")
        repeat_of = None
        if mode.endswith("_warm") or mode in (VARIANT, PROFILE):
            repeat_of = done.get(kind)
            if not repeat_of or repeat_of.get("status") != "ok":
                raise RuntimeError(f"{mode} repeats {kind}, which did not run successfully before it")
        if mode == VARIANT:
            res = run_dflash(ctx, out_dir, repeat_of, ctx.args.variant_overrides)
            res["variant_overrides"] = ctx.args.variant_set
        elif mode == PROFILE:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if ctx.device.type == "cuda"
                                                    else torch.profiler.ProfilerActivity.CPU]) as prof:
                res = run_dflash(ctx, out_dir, repeat_of)
            res["profile"] = kernel_profile(prof, ctx.device.type == "cuda")
            res["profile"]["note"] = "figures of this mode include the profiler's overhead; compare shares only"
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


def parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    import yaml

    out = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--dflash-set {item!r}: expected KEY=VALUE, e.g. batching.length_growth=1.25")
        key, text = item.split("=", 1)
        out.append((key.strip(), yaml.safe_load(text)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list, run in this order, of {', '.join(ALL_MODES)} (default {DEFAULT_MODES})")
    p.add_argument("--num-samples", type=int, default=None, help="size of the sample list (model default)")
    p.add_argument("--per-sample-max-seconds", type=float, default=None, help="time budget (model default)")
    p.add_argument("--per-sample-max-samples", type=int, default=None, help="sample cap (default: the list)")
    p.add_argument("--fixed-batch-max-seconds", type=float, default=None, help="time budget (model default)")
    p.add_argument("--fixed-batch-max-samples", type=int, default=None, help="sample cap (default: the list)")
    p.add_argument("--fixed-batch-size", type=int, default=32, help="default 32 (SpecForge-like)")
    p.add_argument("--dflash-max-tokens", type=int, default=None,
                   help="real tokens given to dflash-prep: the longest prefix of the list under it (model default)")
    p.add_argument("--max-tokens-per-batch", default="auto", help="dflash-prep padded-token budget: N or auto (default: from GPU memory)")
    p.add_argument("--dflash-set", dest="dflash_set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra dflash-prep recipe override, e.g. batching.length_growth=1.25 (repeatable)")
    p.add_argument("--variant-set", dest="variant_set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"recipe overrides of the {VARIANT} mode, on top of --dflash-set (e.g. "
                        f"model.padding_mask=false): dflash_prep again, same samples, same process")
    p.add_argument("--results-dir", default=str(BENCH_DIR / "results"), help="default bench/results/")
    p.add_argument("--out-dir", default=None,
                   help="where modes write (a fresh subfolder, deleted after each mode); default: the system "
                        "temp dir (/tmp), i.e. the real disk; /dev/shm measures without the disk")
    p.add_argument("--keep-outputs", action="store_true", help="keep every mode's output (tests)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (model default)")
    p.add_argument("--storage-dtype", default="bfloat16", choices=list(DTYPES), help="dtype of stored states (default bfloat16)")
    p.add_argument("--logits", default="all", choices=["all", "last"],
                   help="baselines: full-vocab logits for every position (plain CausalLM call, the default) or "
                        "logits_to_keep=1")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, token ids and weights (default 0)")
    p.add_argument("--length-mu", type=float, default=5.41, help="lognormal mu of sample lengths (default 5.41)")
    p.add_argument("--length-sigma", type=float, default=0.9, help="lognormal sigma of sample lengths (default 0.9)")
    p.add_argument("--min-length", type=int, default=16, help="length clip (default 16)")
    p.add_argument("--max-length", type=int, default=None, help="length clip (model default, 4096 for real models)")
    p.add_argument("--gemm-size", type=int, default=None, help="GEMM n for the MFU rate (8192 on GPU, 1024 on CPU)")
    p.add_argument("--check-samples", type=int, default=4,
                   help="first N samples read back from every mode and compared (0: every sample; default 4)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    spec = MODELS[args.model]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ALL_MODES]
    if bad or not modes or len(set(modes)) != len(modes):
        raise SystemExit(f"--modes {args.modes!r}: expected distinct names among {ALL_MODES}")
    for i, m in enumerate(modes):
        if m.endswith("_warm") and m.removesuffix("_warm") not in modes[:i]:
            raise SystemExit(f"--modes: {m} repeats {m.removesuffix('_warm')}, which must come before it")
        if m in (VARIANT, PROFILE) and "dflash_prep" not in modes[:i]:
            raise SystemExit(f"--modes: {m} repeats dflash_prep, which must come before it")
    if (VARIANT in modes) != bool(args.variant_set):
        raise SystemExit(f"--variant-set goes with the {VARIANT} mode, and the mode needs at least one")
    args.variant_overrides = parse_overrides(args.variant_set)
    args.per_sample_max_seconds = args.per_sample_max_seconds or spec.per_sample_max_seconds
    args.fixed_batch_max_seconds = args.fixed_batch_max_seconds or spec.fixed_batch_max_seconds
    args.dflash_max_tokens = args.dflash_max_tokens or spec.dflash_max_tokens
    args.dflash_overrides = parse_overrides(args.dflash_set)
    max_length = args.max_length or spec.max_length
    t_start = time.perf_counter()
    timestamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")

    device = resolve_device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")  # run_extraction's PartialState device
    dtype_name = args.dtype or spec.dtype
    dtype, storage_dtype = DTYPES[dtype_name], DTYPES[args.storage_dtype]

    out_base = Path(args.out_dir) if args.out_dir else Path(tempfile.gettempdir())
    out_base.mkdir(parents=True, exist_ok=True)
    out_root = Path(tempfile.mkdtemp(prefix=f"dflash-bench-{args.model}-", dir=out_base))
    # datasets' cache of the parquet load and tokenization: inside the run folder, removed with it (only
    # effective if `datasets` was not imported yet by this process).
    os.environ.setdefault("HF_DATASETS_CACHE", str(out_root / "hf-datasets-cache"))

    from transformers import AutoConfig

    section = ModelSection(config=str(CONFIG_DIR / spec.config), init_seed=args.seed,
                           tokenizer=str(TOKENIZER_DIR), dtype=dtype_name, attn_implementation="sdpa")
    config = AutoConfig.from_pretrained(section.config)
    layer_ids = list(spec.layer_ids)
    info = model_info(config, layer_ids)
    n = args.num_samples or spec.num_samples
    samples = make_samples(n, args.length_mu, args.length_sigma, args.min_length, max_length,
                           info["vocab_size"], args.seed)
    if args.max_tokens_per_batch == "auto":
        budget, how = auto_token_budget(device, config, info, dtype_name, args.storage_dtype, len(layer_ids))
    else:
        budget, how = int(args.max_tokens_per_batch), "command line"
    ctx = Ctx(args, spec, device, dtype, storage_dtype, section, config, layer_ids, info, samples, out_root,
              budget, how)
    print(f"[bench] {args.model} on {device} ({dtype_name}), {n} samples / {samples.params['num_tokens']:,} "
          f"tokens, modes {modes}, outputs under {out_root}", file=sys.stderr, flush=True)

    gemm = measure_gemm(device, dtype, args.gemm_size or (8192 if device.type == "cuda" else 1024))
    print(f"[bench] GEMM {gemm['size']}^3 {gemm['dtype']}: {gemm['tflops']:.1f} TFLOP/s", file=sys.stderr)

    check_ids = samples.ids if args.check_samples == 0 else samples.ids[: args.check_samples]
    report = {
        "benchmark": "dflash-prep extraction: per-sample vs fixed-batch vs dflash-prep",
        "report_version": 1, "timestamp": timestamp,
        "command": [sys.argv[0]] + list(sys.argv[1:] if argv is None else argv),
        "model": args.model, "config": str((CONFIG_DIR / spec.config).relative_to(REPO_ROOT)), "layer_ids": layer_ids,
        "layer_rule": spec.layer_rule, "model_info": {k: v for k, v in info.items() if k != "per_layer_params"},
        "environment": environment(device),
        "settings": {"modes": modes, "device": str(device), "dtype": dtype_name,
                     "storage_dtype": args.storage_dtype, "weights": f"random, seed {args.seed}",
                     "baseline_logits": args.logits, "per_sample_max_seconds": args.per_sample_max_seconds,
                     "per_sample_max_samples": args.per_sample_max_samples,
                     "fixed_batch_max_seconds": args.fixed_batch_max_seconds,
                     "fixed_batch_max_samples": args.fixed_batch_max_samples,
                     "fixed_batch_size": args.fixed_batch_size, "dflash_max_tokens": args.dflash_max_tokens,
                     "max_tokens_per_batch": budget, "max_tokens_per_batch_how": how,
                     "dflash_overrides": args.dflash_set, "variant_overrides": args.variant_set,
                     "out_dir": {**fs_info(out_root), "deleted_after_each_mode": not args.keep_outputs},
                     "samples": samples.params},
        "gemm": gemm,
        "modes": {},
        "consistency": {},
        "complete": False,
    }
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.model}-{timestamp}"
    report["json_path"] = str(results_dir / f"{stem}.json")
    report["markdown_path"] = str(results_dir / f"{stem}.md")

    states = {}
    try:
        for mode in modes:
            report["modes"][mode], states[mode] = run_mode(ctx, mode, gemm, check_ids, report["modes"])
            # Written after every mode, so a run cut short still leaves the figures of the finished modes.
            report["consistency"] = consistency_of(report["modes"], states, check_ids, len(layer_ids))
            report["warm_vs_cold"] = warm_overheads(report["modes"])
            report["wall_seconds"] = time.perf_counter() - t_start
            write_report(report)
    finally:
        if not args.keep_outputs:
            shutil.rmtree(out_root, ignore_errors=True)
    report["complete"] = True
    write_report(report)
    print(render_markdown(report))
    print(f"[bench] wrote {report['json_path']} and {report['markdown_path']}", file=sys.stderr)
    return report


def warm_overheads(results: dict) -> dict:
    """For each mode run cold then warm on the same samples: the extra seconds of the cold pass's forwards
    (compilation, autotuning of first-seen shapes), in all and per distinct shape."""
    out = {}
    for mode, cold in results.items():
        warm = results.get(f"{mode}_warm")
        if mode.endswith("_warm") or not warm or cold.get("status") != "ok" or warm.get("status") != "ok":
            continue
        key = "forward_gpu" if mode == "dflash_prep" else "forward"
        extra = cold["breakdown_seconds"][key] - warm["breakdown_seconds"][key]
        out[mode] = {"cold_forward_seconds": cold["breakdown_seconds"][key],
                     "warm_forward_seconds": warm["breakdown_seconds"][key],
                     "first_shape_overhead_seconds": extra, "num_shapes": cold["num_shapes"],
                     "overhead_per_shape_seconds": extra / cold["num_shapes"] if cold["num_shapes"] else None,
                     "cold_tokens_per_second": cold["tokens_per_second"],
                     "warm_tokens_per_second": warm["tokens_per_second"]}
    return out


def consistency_of(results: dict, states: dict, check_ids: list[str], k: int) -> dict:
    """Cross-mode check on the first samples: every pair of finished modes, and the weights checksums."""
    ok = [m for m in results if results[m].get("status") == "ok"]
    # Every mode against the first (per_sample when it ran), each warm pass against its cold pass, and the two
    # batched modes against each other.
    wanted = [(ok[0], m) for m in ok[1:]] if ok else []
    wanted += [(m.removesuffix("_warm"), m) for m in ok if m.endswith("_warm") and m.removesuffix("_warm") in ok]
    if VARIANT in ok and "dflash_prep" in ok:
        wanted.append(("dflash_prep", VARIANT))
    if "fixed_batch" in ok and "dflash_prep" in ok:
        wanted.append(("fixed_batch", "dflash_prep"))
    pairs = {f"{a}~{b}": compare(states[a], states[b], k) for a, b in dict.fromkeys(wanted)}
    checksums = {m: results[m].get("weights_checksum") for m in ok}
    return {"samples_checked": len(check_ids), "pairs": pairs, "same_weights": len(set(checksums.values())) <= 1,
            "weights_checksums": checksums}


def write_report(report: dict) -> None:
    with open(report["json_path"], "w") as f:
        json.dump(report, f, indent=2, default=_json_default)
    Path(report["markdown_path"]).write_text(render_markdown(report))


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


# ----------------------------------------------------------------------------------------------- markdown
def _fmt(v, spec: str = ",.0f", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


BREAKDOWN_NOTES = {
    (False, "forward"): "CausalLM forward, synchronized",
    (False, "copy_to_host"): "cat layers, unpad, .cpu()",
    (False, "write"): "serialize + write the files (no fsync)",
    (False, "other"): "batch building, loop overhead",
    (True, "setup"): "outside the loop: tokenize, plan, model build, manifest",
    (True, "data_wait"): "loop waiting on the DataLoader",
    (True, "forward_gpu"): "GPU span of the forwards (CUDA events)",
    (True, "copy_to_host_gpu"): "GPU span of the device-to-host copies",
    (True, "idle_gpu"): "loop time with neither on the GPU",
    (True, "forward_host"): "host time in forward + copy enqueue (overlaps the GPU)",
    (True, "writer_wait"): "loop blocked on a full writer queue",
    (True, "write"): "writer threads, busy time summed: encode, tar, fsync (overlaps the GPU)",
}


def render_markdown(r: dict) -> str:
    res = r["modes"]
    modes = [m for m in r["settings"]["modes"] if m in res]
    s = r["settings"]["samples"]
    info = r["model_info"]
    env = r["environment"]
    lines = [f"# Extraction benchmark: {r['model']} ({r['timestamp']})", "",
             f"- model: `{info['architecture']}` ({info['model_type']}), random {r['settings']['dtype']} weights, "
             f"{info['params_total'] / 1e9:.2f}B params, {info['decoder_params_all_layers'] / 1e9:.2f}B in "
             f"{info['num_hidden_layers']} decoder layers; captured after-layer ids {r['layer_ids']} "
             f"({r['layer_rule']}), stored as {r['settings']['storage_dtype']}",
             f"- device: {env.get('gpu', r['settings']['device'])}; torch {env['torch']}, transformers "
             f"{env['transformers']}, fla {env.get('fla')}, causal-conv1d {env.get('causal_conv1d')}, liger-kernel "
             f"{env.get('liger_kernel')}",
             f"- samples: lognormal(mu={s['mu']}, sigma={s['sigma']}) clipped to {s['clip']}, seed {s['seed']}: "
             f"{s['num_samples']} samples, mean {s['mean']:.0f}, median {s['median']:.0f}, p99 {s['p99']:.0f}, "
             f"max {s['max']} tokens; each mode runs a prefix of this list",
             f"- GEMM {r['gemm']['size']}^3 {r['gemm']['dtype']}: {r['gemm']['tflops']:.1f} TFLOP/s (median of "
             f"{r['gemm']['repeats']}): the MFU denominator",
             f"- outputs: {r['settings']['out_dir']['path']} ({r['settings']['out_dir']['fstype']}), deleted after "
             f"each mode: {r['settings']['out_dir']['deleted_after_each_mode']}; baselines' logits: "
             f"{r['settings']['baseline_logits']}; dflash-prep max_tokens_per_batch "
             f"{r['settings']['max_tokens_per_batch']} ({r['settings']['max_tokens_per_batch_how']})",
             f"- total wall time {r.get('wall_seconds', 0):.0f} s"
             + ("" if r.get("complete") else " (INCOMPLETE: the run stopped before its last mode)"), ""]
    ref = res.get("per_sample", {}).get("tokens_per_second")
    ref_warm = res.get("per_sample_warm", {}).get("tokens_per_second")
    rows = [
        ("status", lambda m: m.get("status") if m.get("status") == "ok" else f"{m.get('status')}: {m.get('error')}"),
        ("samples", lambda m: _fmt(m.get("num_samples"))),
        ("real tokens", lambda m: _fmt(m.get("num_real_tokens"))),
        ("stopped by", lambda m: m.get("stopped_by", "-")),
        ("kernels (`model.kernels`)", lambda m: ", ".join(m["summary"]["kernels"]["applied"]) or "eager"
         if m.get("summary", {}).get("kernels") else "eager (baseline)"),
        ("loop seconds", lambda m: _fmt(m.get("loop_seconds"), ".1f")),
        ("**tokens/s** (real)", lambda m: _fmt(m.get("tokens_per_second"))),
        ("speed-up vs per-sample", lambda m: _fmt(m["tokens_per_second"] / ref, ".1f") + "x"
         if ref and m.get("tokens_per_second") else "-"),
        ("speed-up vs per-sample warm", lambda m: _fmt(m["tokens_per_second"] / ref_warm, ".1f") + "x"
         if ref_warm and m.get("tokens_per_second") else "-"),
        ("tokens/s excl. first-shape batches", lambda m: _fmt(m.get("tokens_per_second_excl_first_shapes"))),
        ("samples/s", lambda m: _fmt(m.get("samples_per_second"), ".2f")),
        ("MFU (executed layers)", lambda m: _fmt(m.get("mfu"), ".3f")),
        ("MFU (needed layers)", lambda m: _fmt(m.get("mfu_needed_layers"), ".3f")),
        ("decoder params executed (B)", lambda m: _fmt((m.get("decoder_params_executed") or 0) / 1e9, ".2f")),
        ("padding efficiency", lambda m: _fmt(m.get("padding_efficiency"), ".3f")),
        ("forwards", lambda m: _fmt(m.get("num_forwards"))),
        ("distinct shapes", lambda m: _fmt(m.get("num_shapes"))),
        ("seconds in first-shape forwards", lambda m: _fmt(m.get("first_shape_seconds"), ".1f")),
        ("peak GPU memory (GB)", lambda m: _fmt((m["peak_gpu_memory_bytes"] / GB)
                                                if m.get("peak_gpu_memory_bytes") else None, ".1f")),
        ("written (GB)", lambda m: _fmt((m["bytes_written"] / GB) if m.get("bytes_written") is not None else None,
                                        ".2f")),
        ("write rate (GB/s of loop time)", lambda m: _fmt(m.get("write_gb_per_second"), ".3f")),
        ("model build (s)", lambda m: _fmt(m.get("build_seconds"), ".1f")),
        ("OOM splits", lambda m: _fmt(m.get("oom_splits"))),
        ("written ids = list prefix", lambda m: _fmt(m.get("sample_ids_are_prefix"))),
    ]
    lines += ["| metric | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for name, fn in rows:
        cells = []
        for mode in modes:
            try:
                cells.append(fn(res[mode]))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # Time breakdowns: one table for the baselines, one for dflash-prep (their parts differ).
    for is_dflash, title in ((False, "Baselines"), (True, "dflash-prep")):
        group = [m for m in modes if m.startswith("dflash") == is_dflash and res[m].get("breakdown_seconds")]
        if not group:
            continue
        loops = ", ".join(f"{m} {res[m]['loop_seconds']:.1f} s" for m in group)
        lines += ["", f"{title}: time breakdown, seconds (share of the loop: {loops})", "",
                  "| part | " + " | ".join(group) + " | what |", "|---|" + "---|" * (len(group) + 1)]
        for part in res[group[0]]["breakdown_seconds"]:
            cells = []
            for m in group:
                v, loop = res[m]["breakdown_seconds"][part], res[m]["loop_seconds"]
                cells.append(f"{v:.2f}" + (f" ({v / loop:.0%})" if loop and part != "setup" else ""))
            lines.append(f"| {part} | " + " | ".join(cells) + f" | {BREAKDOWN_NOTES.get((is_dflash, part), '')} |")
    if r.get("warm_vs_cold"):
        lines += ["", "First-shape cost (cold pass minus warm pass over the same samples, same process):", "",
                  "| mode | cold forward s | warm forward s | extra s | shapes | extra s per shape | cold tok/s | "
                  "warm tok/s |", "|---|---|---|---|---|---|---|---|"]
        for mode, w in r["warm_vs_cold"].items():
            lines.append(f"| {mode} | {w['cold_forward_seconds']:.1f} | {w['warm_forward_seconds']:.1f} | "
                         f"{w['first_shape_overhead_seconds']:.1f} | {w['num_shapes']} | "
                         f"{_fmt(w['overhead_per_shape_seconds'], '.2f')} | {_fmt(w['cold_tokens_per_second'])} | "
                         f"{_fmt(w['warm_tokens_per_second'])} |")
    for mode, m in res.items():
        prof = m.get("profile") if isinstance(m, dict) else None
        if not prof:
            continue
        unit = "GPU kernel time" if prof["device"] == "cuda" else "CPU op time"
        lines += ["", f"Where the time goes ({mode}, torch.profiler, {unit} {prof['total_seconds']:.1f} s; "
                      f"{prof['note']}):", "", "| category | seconds | share |", "|---|---|---|"]
        lines += [f"| {c} | {v['seconds']:.2f} | {v['share']:.1%} |" for c, v in prof["categories"].items()]
        lines += ["", "| top kernels | calls | seconds | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls']} | {k['seconds']:.2f} | {k['share']:.1%} |"
                  for k in prof["top"][:15]]
    c = r["consistency"]
    lines += ["", f"Consistency (states read back from disk, first samples; same weights in every mode: "
              f"{_fmt(c['same_weights'])}):", "",
              "| pair | samples | input_ids equal | max abs diff | max rel L2 (per captured layer) |", "|---|---|---|---|---|"]
    for pair, v in c["pairs"].items():
        per_layer = ", ".join(f"{x:.2g}" for x in v["max_rel_l2_per_layer"])
        lines.append(f"| {pair} | {v['samples_compared']} | {_fmt(v['input_ids_equal'])} | "
                     f"{v['max_abs_diff']:.3g} (ref max {v['max_abs_ref']:.3g}) | {v['max_rel_l2']:.3g} "
                     f"({per_layer}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

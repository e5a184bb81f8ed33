"""Recipes: YAML files mapped onto frozen dataclasses.

Guarantees:
- every key of a recipe maps to a field below; an unknown key or a bad value raises `RecipeError` naming the
  key (dotted path) and the value, before any model or dataset is loaded;
- `--set a.b=value` overrides any key (the value is parsed as YAML, so `--set batching.max_batch_size=64`
  gives an int and `--set layers.ids=[1,2]` a list);
- relative input paths in a recipe (model, tokenizer, data) resolve against the recipe file's folder, so a
  recipe runs from any cwd; `output.dir` resolves against the cwd;
- `fingerprint()` hashes everything that decides the content of the records (not where they go, how they are
  batched, or how many processes run), so a resume can refuse to mix outputs of different jobs.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from dflash_prep.recipe.location import PACKAGE_PREFIX, is_remote, local_path, package_path, portable_path

DEFAULT_RECIPE = Path(__file__).resolve().parent.parent / "demo" / "tiny-demo.yaml"

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# Named fused kernels of `model.kernels` (dflash_prep/target/kernels.py says what each replaces, and for which models).
KERNEL_NAMES = ("liger_rms_norm", "liger_swiglu", "liger_geglu", "liger_rope", "fla_conv", "fla_gated_norm")
REPLICA_PARALLELISMS = ("auto", "tensor_parallel", "layer_split")  # model.replica_parallelism (replica.py)
MOE_EXPERTS = ("auto", "transformers", "compiled", "liger")  # model.moe_experts (dflash_prep/target/moe.py)
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "fp8_e4m3")


class RecipeError(ValueError):
    """A recipe key has a bad value; the message names the key, the value and the fix."""


def _fail(key: str, value: Any, why: str) -> None:
    raise RecipeError(f"recipe key `{key}` = {value!r}: {why}")


def _parse_bytes(key: str, value: Any) -> int:
    """Accept an int or a string like '2GB', '512MiB', '1.5e9'."""
    if isinstance(value, bool):
        _fail(key, value, "expected a size in bytes, e.g. 2000000000 or '2GB'")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", value)
        if m:
            units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
            try:
                return int(float(m.group(1)) * units[m.group(2) or "B"])
            except ValueError:
                pass
    _fail(key, value, "expected a size in bytes, e.g. 2000000000 or '2GB'")
    raise AssertionError  # unreachable


@dataclass(frozen=True)
class ModelSection:
    """The frozen target model."""

    name_or_path: str | None = None
    """Hub id or local folder of a pretrained model (config, weights, tokenizer)."""
    config: str | None = None
    """Instead of weights: a config.json (or folder holding one) to build a model with random weights
    (demo, tests, benchmarks). Exactly one of `name_or_path` and `config` is set."""
    init_seed: int = 0
    """Seed of the random weights when `config` is used."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to `name_or_path`. Required with `config`."""
    dtype: str = "bfloat16"
    """Compute dtype: float32, bfloat16 or float16."""
    padding_mask: bool = False
    """Pass the padding mask to the model. false (default): no mask and no position ids, transformers counts
    positions 0..T-1 on every row. The states of real tokens are the same (right padding, causal decoders: padding
    only follows real tokens; tests/test_capture.py checks it on Llama and the Gated DeltaNet hybrid), attention
    takes its mask-free causal kernels, and the forward reads no tensor on the host: transformers' mask checks
    (`padding_mask.all()`) are device-to-host syncs that keep the host from queueing the next forward while the GPU
    runs this one (measured on an H200, Llama-3.1-8B shape: GPU idle 13% of the loop with the mask,
    5% in a pass without it, bench/results/llama3.1-8b-20261130-144123.json).
    true: pass it (e.g. for a remote-code model whose padding tokens could reach real ones)."""
    attn_implementation: str = "sdpa"
    """transformers attention backend: sdpa, eager, flash_attention_2, ..."""
    trust_remote_code: bool = False
    kernels: str | list[str] = "auto"
    """Fused kernels from liger-kernel and flash-linear-attention (dflash_prep/target/kernels.py): `auto` applies, on CUDA,
    those measured exact and faster for the architecture (Llama: liger RMSNorm, SwiGLU, RoPE; Qwen3.5 hybrid: liger
    RMSNorm, SwiGLU and fla's causal conv), eager elsewhere; `eager` applies none; a list (e.g. `[liger_rms_norm,
    fla_conv]`) applies exactly those, for A/B runs. States differ from eager by rounding only; not part of the
    job's identity (a resume may use another set: each run's set is recorded in the manifest)."""
    gpus_per_replica: int = 1
    """GPUs of one node holding one copy of the target (dflash_prep/target/replica.py): 1 = one model copy per GPU; N > 1
    for a target larger than one GPU: tensor parallelism where transformers has a plan for the architecture (one
    process per GPU), else a layer split (one process per replica). Data parallelism runs over GPUs / N replicas.
    Not part of the job's identity (a resume may change it and the number of replicas)."""
    replica_parallelism: str = "auto"
    """How a replica of `gpus_per_replica` > 1 GPUs runs the target: `auto` (tensor parallel where transformers has
    a plan for the architecture and the launch runs one process per GPU, else a layer split), `tensor_parallel`
    (one replica per run; refused for an architecture without a plan) or `layer_split` (one process per replica,
    one GPU computing at a time). Not part of the job's identity:
    both hold the same weights (random weights too: drawn per module, model.draw_random_weights)."""
    fp8_weights: str = "auto"
    """A block-scaled FP8 checkpoint (`quantization_config` quant_method fp8, weight_block_size [128, 128]:
    dflash_prep/target/fp8_weights.py): `auto` runs its linear layers as FP8 on a GPU of compute capability 9.0
    (torch scaled_mm, activations quantized per token and 128 block: the states are the FP8 model's) and
    dequantized elsewhere (said in the log); `dequantize` loads it dequantized to `dtype` everywhere (the reference
    `verify` compares an FP8 run with, or the bf16 side of an A/B). No effect on an unquantized checkpoint; any
    other quantization format is refused."""
    moe_experts: str = "auto"
    """How the routed experts of a mixture-of-experts target run (dflash_prep/target/moe.py): `auto` (on CUDA in
    bfloat16: `compiled`; else `transformers`), `transformers` (transformers' own experts forward, grouped_mm by
    default) or `compiled` (the experts' forward, routing excluded, through torch.compile: the gathers, gating and
    combine around the grouped GEMMs fused) or `liger` (liger-kernel's fused MoE, CUDA). The router always runs
    eagerly. Not part of the job's identity."""
    triton_cache_dir: str | None = "~/.cache/dflash-prep/triton"
    """Where Triton keeps its compiled kernels and autotuning results (TRITON_CACHE_DIR, with
    TRITON_CACHE_AUTOTUNING=1), shared by the ranks of a node and by later runs, so each new (batch, length) shape is
    tuned once per machine, not once per process (measured on an H200: 12 s instead of 33 s of first-shape
    forwards in a second process of the same 27B job). Set before Triton is imported; a user's own TRITON_CACHE_DIR /
    TRITON_CACHE_AUTOTUNING always win; null leaves Triton's defaults. Not part of the job's identity."""

    def validate(self, p: str) -> None:
        if (self.name_or_path is None) == (self.config is None):
            _fail(f"{p}.name_or_path", self.name_or_path,
                  f"set exactly one of `{p}.name_or_path` (pretrained weights) and `{p}.config` (random weights)")
        if self.config is not None and self.tokenizer is None:
            _fail(f"{p}.tokenizer", None, f"`{p}.config` builds random weights and has no tokenizer: set `{p}.tokenizer`")
        if self.dtype not in COMPUTE_DTYPES:
            _fail(f"{p}.dtype", self.dtype, f"expected one of {COMPUTE_DTYPES}")
        kernels = self.kernels
        if isinstance(kernels, list):
            bad = [k for k in kernels if k not in KERNEL_NAMES]
            if not kernels or bad or len(set(kernels)) != len(kernels):
                _fail(f"{p}.kernels", kernels, f"a list of distinct names from {list(KERNEL_NAMES)} (or `auto`, `eager`)")
        elif kernels not in ("auto", "eager"):
            _fail(f"{p}.kernels", kernels, f"expected `auto`, `eager` or a list of names from {list(KERNEL_NAMES)}")
        if self.gpus_per_replica < 1:
            _fail(f"{p}.gpus_per_replica", self.gpus_per_replica, "expected a whole number of GPUs, at least 1")
        if self.fp8_weights not in ("auto", "dequantize"):
            _fail(f"{p}.fp8_weights", self.fp8_weights, "expected `auto` or `dequantize`")
        if self.moe_experts not in MOE_EXPERTS:
            _fail(f"{p}.moe_experts", self.moe_experts, f"expected one of {MOE_EXPERTS}")
        if self.replica_parallelism not in REPLICA_PARALLELISMS:
            _fail(f"{p}.replica_parallelism", self.replica_parallelism, f"expected one of {REPLICA_PARALLELISMS}")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.name_or_path  # type: ignore[return-value]


@dataclass(frozen=True)
class DataSection:
    """Where the rows come from and how they become token ids."""

    path: str | list[str] = ""
    """A file (jsonl/json/parquet/arrow), a glob, a `save_to_disk` folder, or a hub dataset id; or a list of files,
    folders of files or globs (read in order, all of one format)."""
    format: Literal["auto", "json", "parquet", "arrow", "disk", "hub"] = "auto"
    """How to load `path`; `auto` decides from the file suffix / folder content."""
    split: str = "train"
    max_samples: int | None = None
    """Keep only the first N rows (for a quick trial run)."""
    max_length: int = 4096
    """Longest sample in tokens; longer rows follow `overlong`."""
    overlong: Literal["truncate", "skip"] = "truncate"
    id_column: str | None = None
    """Column holding a row's own id (kept in meta.json as `source_id`); default: `id` when present."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own: a file path (relative to the recipe) or the template
    itself (a string holding `{%` or `{{`). Any template works; `{% generation %}` blocks are optional (docs/FORMAT.md,
    loss mask)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of `apply_chat_template`, e.g. {enable_thinking: false}."""
    samples: Literal["auto", "conversation", "per_turn"] = "auto"
    """What a conversation row becomes (docs/ON_POLICY.md): `conversation`, one sample (the whole rendering);
    `per_turn`, one sample per supervised assistant turn (its served prompt, then the turn; only it supervised);
    `auto`, `per_turn` for a row whose whole rendering does not show each supervised turn in the context the target
    had (a template that drops earlier turns' reasoning, such as Qwen3's), else `conversation`."""
    max_skipped_fraction: float = 0.5
    """Stop before any model loads (exit code 2) when more than this fraction of the rows is skipped (1.0: never;
    no kept row always stops)."""
    num_proc: int | None = None
    """Processes of `datasets.map` for tokenization (None: one)."""
    strict: bool = False
    """Stop (exit code 2, before any model loads) when a whole kind of row is lost: every row with tool calls, or
    every row with reasoning, skipped or rendered without them (false: a warning with the counts). Not part of the
    records' content."""
    allow_beyond_context: bool = False
    """A `max_length` longer than the model's context (`max_position_embeddings`, RoPE scaling counted) is refused at
    start-up (exit code 2): rows past the context would be extracted at positions the target was never trained on.
    true: extract them anyway (a warning, and the summary counts them: `num_samples_beyond_context`). Not part of
    the records' content."""

    def validate(self, p: str) -> None:
        if not self.path or (isinstance(self.path, list) and not all(isinstance(x, str) and x for x in self.path)):
            _fail(f"{p}.path", self.path, "set the dataset: a file, a folder, a glob or a hub id, or a list of "
                                          "files, folders or globs")
        if self.max_samples is not None and self.max_samples < 1:
            _fail(f"{p}.max_samples", self.max_samples, "must be >= 1 (or null for all rows)")
        if self.max_length < 2:
            _fail(f"{p}.max_length", self.max_length, "must be >= 2 tokens")
        if self.num_proc is not None and self.num_proc < 1:
            _fail(f"{p}.num_proc", self.num_proc, "must be >= 1 (or null)")
        if not 0.0 <= self.max_skipped_fraction <= 1.0:
            _fail(f"{p}.max_skipped_fraction", self.max_skipped_fraction, "must be between 0 and 1")
        if self.chat_template is not None and not ("{%" in self.chat_template or "{{" in self.chat_template):
            if not Path(self.chat_template).is_file():
                _fail(f"{p}.chat_template", self.chat_template,
                      "no such file (a template given inline must hold `{%` or `{{`)")


@dataclass(frozen=True)
class LayersSection:
    """Which decoder layers to capture, as after-layer, 0-based ids (id i = HF `hidden_states[i+1]`)."""

    preset: Literal["dflash", "eagle3", "explicit"] = "dflash"
    num_layers: int = 5
    """k, for the `dflash` preset."""
    ids: list[int] | None = None
    """The explicit list (preset `explicit`), ascending, each in 0..L-2 (the last layer, L-1, is `capture_final`)."""
    capture_final: Literal["none", "before_norm", "after_norm"] = "none"
    """Also store the final decoder output: `before_norm` (output of the last decoder layer, what
    speculators/vLLM call the final layer) or `after_norm` (after the final norm, what EAGLE-3 in SpecForge
    uses)."""

    def validate(self, p: str) -> None:
        if self.preset == "explicit":
            if not self.ids:
                _fail(f"{p}.ids", self.ids, f"preset `explicit` needs a non-empty `{p}.ids` list")
            if list(self.ids) != sorted(set(self.ids)) or min(self.ids) < 0:
                _fail(f"{p}.ids", self.ids, "must be distinct, ascending, >= 0 (after-layer, 0-based ids)")
        elif self.ids is not None:
            _fail(f"{p}.ids", self.ids, f"only used with `{p}.preset: explicit`")
        if self.preset == "dflash" and self.num_layers < 1:
            _fail(f"{p}.num_layers", self.num_layers, "must be >= 1")


@dataclass(frozen=True)
class BatchingSection:
    """How samples are grouped into GPU batches."""

    max_tokens_per_batch: int | str = 65536
    """Budget of padded tokens per forward (batch size x padded length; a packed row's length), or `auto`: sized
    from the GPU's memory and the model config when the plan is made (dflash_prep/target/budget.py; 16,384 without a GPU)."""
    max_batch_size: int = 256
    """Samples per padded batch at most; packed rows (`packing`) have no such limit."""
    length_multiple: int = 64
    """Padded lengths are multiples of this ..."""
    length_growth: float = 1.125
    """... growing geometrically by this factor, so few distinct shapes are ever compiled/autotuned."""
    num_workers: int = 2
    """DataLoader worker processes that collate batches ahead of the GPU (0: in the main process)."""
    packing: str | bool = "auto"
    """Packed batches (dflash_prep/target/packing.py): each forward is ONE row holding several whole samples back to back
    (position ids restart at 0 per sample, attention and the Gated DeltaNet layers kept inside each sample), padded
    only to one of a few row lengths. `auto`: packed on CUDA where that is exact for the architecture (Llama;
    the Qwen3.5 hybrid with flash-linear-attention's chunk kernel and `fla_conv`), padded batches otherwise (CPU);
    `true`: packed (also on CPU), refused (exit 2) where not exact; `false`: padded batches. Recorded in the
    summary and the manifest; not part of the job's identity (a resume replays the stored plan's layout)."""
    max_tokens_per_row: int | str = "auto"
    """Packed rows only: tokens per row (one forward) at most, never above `max_tokens_per_batch`. `auto`: 32,768
    (planner.PACKED_ROW_TOKENS_AUTO; on an H200 rows of 32,768 tokens ran faster than padded batches and rows of
    131,072 slower, bench/RESULTS.md)."""

    def validate(self, p: str) -> None:
        if self.packing != "auto" and not isinstance(self.packing, bool):  # 0/1 compare equal to False/True
            _fail(f"{p}.packing", self.packing, "expected `auto`, true or false")
        for name in ("max_tokens_per_batch", "max_batch_size", "length_multiple", "max_tokens_per_row"):
            if name.startswith("max_tokens_per_") and getattr(self, name) == "auto":
                continue
            if getattr(self, name) < 1:
                _fail(f"{p}.{name}", getattr(self, name), "must be >= 1")
        if not self.length_growth > 1.0:
            _fail(f"{p}.length_growth", self.length_growth, "must be > 1.0")
        if self.num_workers < 0:
            _fail(f"{p}.num_workers", self.num_workers, "must be >= 0")


@dataclass(frozen=True)
class OutputSection:
    """Where and how records are written."""

    dir: str = "out"
    """Output folder: shards, manifest, logs, summary. A local path, or an object-store URL (`s3://bucket/prefix`,
    `gs://...`, `az://...`, through fsspec; docs/STORAGE.md, "Where the output goes"): shards are then staged locally
    (`staging_dir`) and uploaded as they close. A URL whose protocol is unknown or not installed is refused."""
    storage_options: dict = field(default_factory=dict)
    """Non-secret fsspec options of an object-store `dir` (e.g. {endpoint_url: ..., region_name: ...}); credentials
    come from the store's own configuration (environment, profile), and keys naming a secret are refused."""
    staging_dir: str | None = None
    """Object-store `dir` only: the local folder where each node stages the shards being written and uploaded, and
    its copy of the output's small files; null: a folder under the system's temporary directory. Holds at most
    (num_writer_threads + max_uploads_in_flight) x max_shard_bytes of shards per rank."""
    max_uploads_in_flight: int = 4
    """Object-store `dir` only: closed shards per rank being uploaded at once (each multipart, by the filesystem);
    a lane that closes a shard beyond it waits. Not part of the job's identity."""
    require_conditional_writes: bool = True
    """Object-store `dir` only (S3): the store must honour conditional writes (`If-None-Match: *` and `If-Match`),
    on which the output's leases and fenced commits rest; a probe object under `locks/` checks it once at the start.
    A store that ignores them (`rclone serve s3`, some gateways) is refused (exit code 2), unless this is false: the
    run then goes on, said in the log, and nothing keeps two runs into the output apart (run one at a time). Not
    part of the job's identity."""
    dtype: str = "bfloat16"
    """Storage dtype of hidden states: bfloat16, float16, float32, or fp8_e4m3 (float8 e4m3 with one fp32 scale
    per token and layer, about half the bytes of bf16; see dflash_prep/target/fp8.py and docs/FORMAT.md)."""
    max_shard_bytes: int = 2_000_000_000
    """A shard is closed at the first batch boundary after it reaches this size (bytes or '2GB')."""
    overwrite: bool = False
    """Delete an existing output folder's content first. Refused on a folder that is not a dflash-prep output
    (no run_state.json, plan.json or manifest.json): the user's own files are never deleted."""
    nan_policy: Literal["fail_sample", "fatal"] = "fail_sample"
    """A sample whose captured states hold a NaN or an Inf: `fail_sample` records it as failed (not written,
    listed in failed.jsonl, counted in the manifest) and goes on; `fatal` stops the run (committed shards stay)."""
    num_writer_threads: int = 4
    """Shard writer threads per rank ("lanes"), each with its own open shard; batch i goes to lane i mod this
    (the layout does not depend on timing). More lanes, more write bandwidth when cores are spare (hashing,
    writing and fsync release the GIL): an 8B target with 3 bf16 layers at ~34k tokens/s per GPU
    produces ~0.85 GB/s. Each lane holds up to 2 batches of states in (pinned) host memory. Not part of the job's
    identity: a resume may use another value."""
    write_mode: Literal["auto", "direct", "buffered"] = "auto"
    """How the lanes write shards to the disk: `direct` with O_DIRECT (no page cache; where the filesystem
    refuses it, tmpfs or some network filesystems, buffered instead, said once in the log), `buffered` through the
    page cache, `auto`: `direct` for a local output, `buffered` for an object store's staging folder (the upload
    reads the shard back from the page cache). Same bytes and commits either way (docs/STORAGE.md, "Writers and
    object stores"). Not part of the job's identity."""
    switch_interval_seconds: float | None = None
    """The process's GIL switch interval (`sys.setswitchinterval`) while the writer lanes run; null keeps
    Python's (5 ms). A main thread busy in Python (the forward loop launching kernels) holds the GIL for up to that
    interval each time a lane waits for it between its copies and writes: with a pure-Python busy thread beside
    them, 4 lanes wrote 0.86-0.94 GB/s at 5 ms, 1.17-1.23 at 1 ms and 1.18-1.49 at 0.2 ms, 1.36-1.64 alone
    (bench/gil_switch_probe.py, bench/results/gil-switch-cpu-20261204/, a 2-core machine). On a GPU run 1 ms was
    slower: the Qwen3-8B shape onto a disk 27,482 tok/s against 31,955 at Python's interval
    (bench/results/storage-20261204-qwen3-8b-si/): an opt-in. Not part of the job's identity."""
    max_pending_bytes: int = 16_000_000_000
    """Host memory (bytes or '16GB') the states of batches captured but not yet written may hold, per rank
    (pinned on a GPU machine): the loop waits for the writer threads beyond it. A single larger batch still goes
    through. Not part of the job's identity."""
    max_failed_samples: int | None = 0
    """The run exits with code 3 when more samples than this failed (out of memory alone, non-finite states);
    the output is complete either way. null: never fail the exit code for failed samples."""
    lease_seconds: float = 300.0
    """How long a run's claim on the output folder outlives its last heartbeat (renewed every lease / 10 s, at most
    10 s apart, while the run lives): another run, from any host, is refused while the lease is fresh and takes a
    lapsed one over (store/locks.py). A run of a host that is gone blocks the folder this long. Not part of the
    job's identity."""
    peer_timeout_seconds: float = 600.0
    """Several processes: how long a process waits where every process meets (the output claimed, the rows
    tokenized, the plan made, the end of the run) for a peer that shows no sign of life (commands/extract/peers.py)
    before it stops the run (exit code 1, resumable) naming it. Not part of the job's identity."""

    def validate(self, p: str) -> None:
        if not self.dir:
            _fail(f"{p}.dir", self.dir, "set an output folder")
        from dflash_prep.recipe.location import LocationError, check_location, check_storage_options, is_remote

        try:
            check_location(self.dir, writable=True, key=f"{p}.dir")
            check_storage_options(self.storage_options, f"{p}.storage_options")
        except LocationError as e:
            raise RecipeError(str(e)) from None
        if self.storage_options and not is_remote(self.dir):
            _fail(f"{p}.storage_options", self.storage_options, "applies to an object-store output.dir only")
        if self.max_uploads_in_flight < 1:
            _fail(f"{p}.max_uploads_in_flight", self.max_uploads_in_flight, "must be >= 1")
        if self.dtype not in STORAGE_DTYPES:
            _fail(f"{p}.dtype", self.dtype, f"expected one of {STORAGE_DTYPES}")
        if self.max_shard_bytes < 1:
            _fail(f"{p}.max_shard_bytes", self.max_shard_bytes, "must be >= 1 byte")
        if self.max_pending_bytes < 1:
            _fail(f"{p}.max_pending_bytes", self.max_pending_bytes, "must be >= 1 byte")
        if self.num_writer_threads < 1:
            _fail(f"{p}.num_writer_threads", self.num_writer_threads, "must be >= 1")
        if self.switch_interval_seconds is not None and not 1e-5 <= self.switch_interval_seconds <= 1:
            _fail(f"{p}.switch_interval_seconds", self.switch_interval_seconds,
                  "must be between 0.00001 and 1 second (or null: Python's own)")
        if self.max_failed_samples is not None and self.max_failed_samples < 0:
            _fail(f"{p}.max_failed_samples", self.max_failed_samples, "must be >= 0 (or null for no limit)")
        if not 1 <= self.lease_seconds <= 7 * 86400:  # NaN and inf too: a lease is renewed, never held for good
            _fail(f"{p}.lease_seconds", self.lease_seconds, "must be between 1 second and 7 days (604800)")
        if not self.peer_timeout_seconds >= 15:
            _fail(f"{p}.peer_timeout_seconds", self.peer_timeout_seconds,
                  "must be >= 15 seconds (a peer's heartbeat comes every 10 s at most)")


REGEN_ENGINES = ("openai", "transformers")
# Sampling parameters a recipe may set (`regenerate.sampling`) or take from generation_config.json, by their OpenAI /
# vLLM names; the OpenAI API itself has only temperature, top_p and the two penalties (regen/sampling.py).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


SERVER_PRESETS = ("vllm", "sglang", "transformers")
SERVER_PLACEHOLDERS = ("model", "host", "port", "served_model_name", "gpus_per_server", "gpus", "chat_template",
                       "python", "transformers", "device")


@dataclass(frozen=True)
class ServersSection:
    """`regenerate.servers`: the run starts the serving engine itself, one server per `gpus_per_server` GPUs of
    each node, waits for them, restarts one that dies and stops them all when it ends (regen/servers.py;
    docs/SERVERS.md). Not part of the identity."""

    preset: Literal["vllm", "sglang", "transformers"] | None = None
    """The engine: `vllm` (`vllm serve`), `sglang` (`python -m sglang.launch_server`), `transformers`
    (`transformers serve`, needs `pip install 'transformers[serving]'`); or null with `command`."""
    command: str | list[str] | None = None
    """A command template instead of a preset, with {model}, {host}, {port}, {served_model_name},
    {gpus_per_server}, {gpus}, {chat_template}, {python}, {transformers}, {device} filled in."""
    gpus_per_server: int = 1
    """GPUs of one server (its tensor parallelism: `--tensor-parallel-size`, `--tp-size`)."""
    num_servers: int | None = None
    """Servers per node; default: the node's GPUs // gpus_per_server (without GPUs: one per process)."""
    extra_args: list[str] = field(default_factory=list)
    """Appended to the command, e.g. [--max-model-len, "8192", --gpu-memory-utilization, "0.9"]."""
    env: dict = field(default_factory=dict)
    """Environment variables of the servers (beyond the run's own; CUDA_VISIBLE_DEVICES is set per server)."""
    host: str = "127.0.0.1"
    """The address the servers listen on (the run's processes reach their own node's servers)."""
    startup_timeout_seconds: float = 1800.0
    """How long a server may take to answer `GET /models` after its start (weights loading, compilation)."""
    max_restarts: int = 3
    """Restarts of one server (its process exited, or every request failing) before it counts as down."""
    stop_timeout_seconds: float = 30.0
    """After SIGTERM, how long a server may take to exit before SIGKILL."""

    def validate(self, p: str) -> None:
        if (self.preset is None) == (self.command is None):
            _fail(f"{p}.preset", self.preset, f"set exactly one of `{p}.preset` {list(SERVER_PRESETS)} and "
                                              f"`{p}.command` (a command template)")
        if self.command is not None:
            import string

            parts = [self.command] if isinstance(self.command, str) else self.command
            for part in parts:
                try:
                    names = {name for _, name, _, _ in string.Formatter().parse(part) if name is not None}
                except ValueError as e:
                    _fail(f"{p}.command", self.command, f"not a template: {e} (write a literal brace as {{{{ }}}})")
                unknown = names - set(SERVER_PLACEHOLDERS)
                if unknown:
                    _fail(f"{p}.command", self.command, f"unknown placeholder(s) {sorted(unknown)}; known: "
                                                        f"{list(SERVER_PLACEHOLDERS)}")
            if "{port}" not in "".join(parts):
                _fail(f"{p}.command", self.command, "the template must pass {port} (the run picks a free port)")
        if self.gpus_per_server < 1:
            _fail(f"{p}.gpus_per_server", self.gpus_per_server, "must be >= 1")
        if self.num_servers is not None and self.num_servers < 1:
            _fail(f"{p}.num_servers", self.num_servers, "must be >= 1 (or null)")
        if self.max_restarts < 0:
            _fail(f"{p}.max_restarts", self.max_restarts, "must be >= 0")
        for name in ("startup_timeout_seconds", "stop_timeout_seconds"):
            if not getattr(self, name) > 0:
                _fail(f"{p}.{name}", getattr(self, name), "must be > 0 seconds")


@dataclass(frozen=True)
class RegenerateSection:
    """On-policy data (dflash_prep/regen/): the target answers the rows' prompts itself before extraction.

    `dflash-prep regenerate` runs this section alone; with the section present, `dflash-prep launch extract.py`
    first completes the regeneration (resuming it) and then extracts from its output. Every row of `data.*` is read
    as the extraction reads it; every non-assistant turn is kept and the assistant turns are asked of the target
    (regen/conversation.py states the rules). The keys marked "identity" decide the generated text: an output made
    with other values is refused (exit code 2) unless `overwrite` is set."""

    engine: Literal["openai", "transformers"] = "transformers"
    """Who generates (identity): `openai`, any OpenAI-compatible chat server (vLLM, SGLang, TGI, `transformers
    serve`) at `base_urls`, the fast path at scale; `transformers`, HF `generate` on each process's own copy of
    `model` (in process, the same `dflash-prep launch` and accelerate configs as extraction; no server needed)."""
    base_urls: list[str] = field(default_factory=list)
    """engine `openai`: the servers' OpenAI base URLs, e.g. [http://10.0.0.5:8000/v1, http://10.0.0.6:8000/v1];
    requests go to whichever server has a free slot. Not part of the identity (servers may move)."""
    servers: ServersSection | None = None
    """engine `openai`: servers the run starts and stops itself, instead of `base_urls` (ServersSection)."""
    served_model_name: str | None = None
    """engine `openai`: the model name the servers serve (identity); default `model.name_or_path` (what
    `vllm serve PATH` and `transformers serve PATH` call it)."""
    api_key_env: str = "OPENAI_API_KEY"
    """engine `openai`: the environment variable holding the servers' API key (unset: the placeholder `EMPTY`,
    which local servers accept). A key is never written into a recipe or an output."""
    max_concurrency: int = 32
    """engine `openai`: requests in flight per server at most (threads of this process: each process of a launch
    sends its own)."""
    timeout_seconds: float = 1800.0
    """engine `openai`: one request's time limit (a long generation must fit); past it the request is retried."""
    max_retries: int = 5
    """engine `openai`: retries of a request after a transient error (connection refused or reset, timeout, HTTP
    408, 429, 500, 502, 503, 504) before the server counts as down (the run stops, exit code 1, resumable)."""
    retry_backoff_seconds: float = 1.0
    """engine `openai`: the wait before the first retry, doubling at each further one (at most 60 s a wait)."""
    extra_sampling: Literal["extra_body", "generation_config"] = "extra_body"
    """engine `openai`: how the sampling parameters the OpenAI API lacks (top_k, min_p, repetition_penalty) reach
    the server: `extra_body`, as top-level request fields (vLLM, SGLang); `generation_config`, as one
    `generation_config` JSON field with `do_sample` (`transformers serve`, which refuses unknown fields with HTTP
    422 and samples only when `do_sample` is set)."""
    turns: Literal["last", "all"] = "all"
    """Which assistant turns the target writes (identity): `all` (the default), every one, turn k generated from the
    regenerated turns before it (multi-turn on-policy: a DFlash-family drafter for Qwen3-8B reached 0.405 full-block
    accuracy on such data against 0.374 on regenerated last turns, docs/ON_POLICY.md); `last`, the final one
    (earlier ones kept from the data; a conversation ending in a user or tool turn gets its answer appended)."""
    sampling: dict = field(default_factory=dict)
    """Sampling parameters overriding the model's own generation_config.json (identity), by OpenAI / vLLM names:
    temperature (0: greedy), top_p, top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty."""
    generation_config: str | None = None
    """Where the default sampling parameters come from: a generation_config.json or a folder holding one; default
    `model.name_or_path`'s. Neither found (a served model with no local folder, random weights): greedy unless
    `sampling` says otherwise."""
    max_tokens: int = 2048
    """New tokens per generated turn at most (identity); a turn cut there has finish reason `length`."""
    chat_template_kwargs: dict | None = None
    """Keyword arguments of the chat template when the prompt is rendered (identity), e.g. {enable_thinking:
    false}; passed to the server as `chat_template_kwargs`. Default: `data.chat_template_kwargs`, so the
    extraction renders the answers as they were asked for."""
    on_length: Literal["keep", "drop"] = "keep"
    """A generated turn cut by `max_tokens` (identity): `keep` the row as generated (the conversation goes on),
    or `drop` the row (counted as skipped, `finish_reason_length`)."""
    seed: int = 0
    """Seed of the per-request seeds (identity): request seed = hash(seed, row position, turn), the same on every
    re-run, so an engine that honours seeds regenerates the same text."""
    output_dir: str | None = None
    """Where the regenerated rows go (a `datasets.load_from_disk` folder; `data.path` of an extraction can point
    at it); default `<output.dir>-regenerated`. Resolved against the current directory."""
    overwrite: bool = False
    """Start the regeneration afresh instead of resuming (refused on a folder that is not a regeneration output).
    Independent of `output.overwrite`: the regenerated rows are the costly part."""
    rows_per_shard: int = 1000
    """Rows per chunk (an output shard): a chunk is committed when all its rows are answered, or in parts (see
    `commit_seconds`). Frozen by the first run (a resume keeps its chunks)."""
    commit_seconds: float = 60.0
    """Every this many seconds, each chunk still open commits the rows answered since its last commit as a part of
    its own (a shard `shard-CCCCCC-PPP.arrow`): a kill loses at most this span of answers, at any request rate; a
    resume asks exactly the rows no part lists."""
    max_rows_in_flight: int | None = None
    """Rows being answered at once per process; default: 4 x the servers' total `max_concurrency` (openai), 1024
    (transformers). More keeps servers busier at the ends of multi-turn rows; each holds its conversation in memory."""
    max_tokens_per_batch: int = 65536
    """engine `transformers`: prompt + new tokens x batch size per `generate` batch at most (the token budget)."""
    max_batch_size: int = 256
    """engine `transformers`: requests per `generate` batch at most."""

    def validate(self, p: str) -> None:
        if self.engine == "openai" and not self.base_urls and self.servers is None:
            _fail(f"{p}.base_urls", self.base_urls, "engine `openai` needs the servers' base URLs, e.g. "
                                                    f"[http://127.0.0.1:8000/v1], or `{p}.servers` to start them")
        if self.engine != "openai" and (self.base_urls or self.servers is not None):
            key = "base_urls" if self.base_urls else "servers"
            _fail(f"{p}.engine", self.engine, f"`{p}.{key}` is set: use `engine: openai` to send the requests "
                                              f"to those servers")
        if self.base_urls and self.servers is not None:
            _fail(f"{p}.servers", "(set)", f"`{p}.base_urls` is set too: either the run starts its servers "
                                           f"(`servers`) or it uses those you run (`base_urls`), not both")
        if self.servers is not None:
            self.servers.validate(f"{p}.servers")
        for i, url in enumerate(self.base_urls):
            if not re.match(r"^https?://[^/\s]+", url):
                _fail(f"{p}.base_urls[{i}]", url, "expected an http(s) URL such as http://127.0.0.1:8000/v1")
        for name in ("max_concurrency", "max_tokens", "rows_per_shard", "max_tokens_per_batch", "max_batch_size"):
            if getattr(self, name) < 1:
                _fail(f"{p}.{name}", getattr(self, name), "must be >= 1")
        if self.max_rows_in_flight is not None and self.max_rows_in_flight < 1:
            _fail(f"{p}.max_rows_in_flight", self.max_rows_in_flight, "must be >= 1 (or null)")
        if self.max_retries < 0:
            _fail(f"{p}.max_retries", self.max_retries, "must be >= 0")
        if not self.commit_seconds > 0:
            _fail(f"{p}.commit_seconds", self.commit_seconds, "must be > 0 seconds")
        if not self.timeout_seconds > 0:
            _fail(f"{p}.timeout_seconds", self.timeout_seconds, "must be > 0")
        if self.retry_backoff_seconds < 0:
            _fail(f"{p}.retry_backoff_seconds", self.retry_backoff_seconds, "must be >= 0")
        for key, value in self.sampling.items():
            if key not in SAMPLING_KEYS:
                _fail(f"{p}.sampling.{key}", value, f"unknown sampling parameter; known: {list(SAMPLING_KEYS)}")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail(f"{p}.sampling.{key}", value, "expected a number")
        if self.generation_config is not None and not Path(self.generation_config).exists():
            _fail(f"{p}.generation_config", self.generation_config,
                  "no such file or folder (a generation_config.json, or a model folder holding one)")


@dataclass(frozen=True)
class Recipe:
    model: ModelSection
    data: DataSection
    layers: LayersSection = field(default_factory=LayersSection)
    batching: BatchingSection = field(default_factory=BatchingSection)
    output: OutputSection = field(default_factory=OutputSection)
    seed: int = 0
    regenerate: RegenerateSection | None = None
    """On-policy data: the target's own answers first (RegenerateSection); absent: the data's answers are used."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def portable_dict(self) -> dict:
        """`to_dict` with the paths inside the installed package written package-relative (`dflash_prep:demo/...`,
        recipe/location.py), so the same recipe reads the same from any install of the package."""
        d = self.to_dict()
        for section, key in _PATH_KEYS:
            if isinstance(d.get(section), dict) and key in d[section]:
                value = d[section][key]
                d[section][key] = [portable_path(v) for v in value] if isinstance(value, list) else portable_path(value)
        return d

    def to_yaml(self) -> str:
        """The resolved recipe (`OUT/recipe.resolved.yaml`): absolute paths, the package's own assets
        package-relative (`portable_dict`)."""
        return yaml.safe_dump(self.portable_dict(), sort_keys=False)

    def fingerprint(self, template_content: bool = True) -> str:
        """sha256 of what decides record content (model, data, layers, storage dtype); `model.kernels` is left out
        (fused kernels change the rounding only), as are `model.gpus_per_replica` and `model.replica_parallelism`
        (where the model runs), `model.triton_cache_dir` (where compiled kernels are cached), `model.moe_experts`
        (the same experts, fused glue) and `model.fp8_weights` at its default (a dequantized run is another job). A
        chat template file counts by its content; `template_content=False`, by its name only (the inputs stamp,
        whose files part covers the file itself)."""
        d = self.portable_dict()
        data = {k: v for k, v in d["data"].items()
                if k not in ("num_proc", "max_skipped_fraction", "strict", "allow_beyond_context")
                and not (k == "chat_template" and v is None)}
        template = self.data.chat_template
        if template_content and template is not None and "{%" not in template and "{{" not in template \
                and Path(template).is_file():
            data["chat_template"] = hashlib.sha256(Path(template).read_bytes()).hexdigest()  # the file's content
        content = {"model": {k: v for k, v in d["model"].items()
                             if k not in ("kernels", "gpus_per_replica", "replica_parallelism",
                                          "triton_cache_dir", "moe_experts")
                             and not (k == "fp8_weights" and v == "auto")},
                   "data": data,
                   "layers": d["layers"], "dtype": d["output"]["dtype"]}
        if self.regenerate is not None:  # the answers are the target's own: what decides their text
            content["regenerate"] = {k: v for k, v in d["regenerate"].items() if k in REGEN_IDENTITY_KEYS}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


# The `regenerate` keys that decide the generated text (the others say where it runs and how fast).
REGEN_IDENTITY_KEYS = ("engine", "served_model_name", "turns", "sampling", "generation_config", "max_tokens",
                       "chat_template_kwargs", "on_length", "seed")


# Inputs named in a recipe resolve against the recipe's folder; `output.dir` resolves against the cwd.
_PATH_KEYS = {("model", "name_or_path"), ("model", "config"), ("model", "tokenizer"), ("data", "path"),
              ("data", "chat_template"),  # chat_template only when it is not an inline template
              ("regenerate", "generation_config")}


def _coerce(key: str, hint: Any, value: Any) -> Any:
    """Check `value` against a field's type hint; return it (ints accepted for floats)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        if value not in args:
            _fail(key, value, f"expected one of {list(args)}")
        return value
    if origin is not None and type(None) in args:  # X | None
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        return _coerce(key, rest[0] if len(rest) == 1 else Union[tuple(rest)], value)
    if origin is not None and str in args and any(get_origin(a) is list for a in args):  # str | list[str]
        return _coerce(key, str if isinstance(value, str) else next(a for a in args if get_origin(a) is list), value)
    if hint is bool:
        if not isinstance(value, bool):
            _fail(key, value, "expected true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, value, "expected an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, value, "expected a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            _fail(key, value, "expected a string")
        return value
    if origin is list or hint is list:
        if not isinstance(value, list):
            _fail(key, value, "expected a list")
        if args:
            return [_coerce(f"{key}[{i}]", args[0], v) for i, v in enumerate(value)]
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            _fail(key, value, "expected a mapping")
        return value
    raise AssertionError(f"unhandled type hint {hint} for {key}")


def _build(cls: type, raw: Any, prefix: str, base_dir: Path | None) -> Any:
    if not isinstance(raw, dict):
        _fail(prefix or "<recipe>", raw, "expected a mapping of keys")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        _fail(key, raw[unknown[0]], f"unknown key; known keys here: {sorted(names)}")
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, key, base_dir)
            continue
        optional = [a for a in get_args(hint) if a is not type(None)]
        if len(optional) == 1 and dataclasses.is_dataclass(optional[0]):  # a section that may be absent
            kwargs[name] = None if value is None else _build(optional[0], value, key, base_dir)
            continue
        if key in ("output.max_shard_bytes", "output.max_pending_bytes"):
            value = _parse_bytes(key, value)
        if key == "model.kernels":  # `auto`, `eager` or a list of names: checked by ModelSection.validate
            kwargs[name] = list(value) if isinstance(value, (list, tuple)) else value
            continue
        if key == "batching.packing":  # `auto`, true or false: checked by BatchingSection.validate
            kwargs[name] = value
            continue
        if key in ("batching.max_tokens_per_batch", "batching.max_tokens_per_row"):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int)):
                _fail(key, value, "expected an integer or `auto`")
            kwargs[name] = value
            continue
        value = _coerce(key, hint, value)
        if (prefix, name) in _PATH_KEYS and isinstance(value, str) and value.startswith(PACKAGE_PREFIX):
            value = package_path(value)
        elif ((prefix, name) in _PATH_KEYS and isinstance(value, str) and base_dir is not None
                and not ("{%" in value or "{{" in value)):
            value = _resolve_path(value, base_dir)
        elif (prefix, name) in _PATH_KEYS and isinstance(value, list) and base_dir is not None:  # data.path list
            value = [_resolve_path(v, base_dir) for v in value]
        kwargs[name] = value
    missing = [f.name for f in dataclasses.fields(cls)
               if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        key = f"{prefix}.{missing[0]}" if prefix else missing[0]
        _fail(key, None, "required key is missing")
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(prefix)
    return obj


def _resolve_path(value: str, base_dir: Path) -> str:
    """Make a recipe-relative path absolute; leave absolute paths and hub ids (`org/name` not on disk) alone. A
    package-relative name (`dflash_prep:demo/...`, what a resolved recipe holds for the shipped assets) becomes the
    path under this install."""
    if package_path(value) != value:  # `dflash_prep:demo/...`, or another install's demo that is gone
        return package_path(value)
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    candidate = base_dir / p
    # Hub ids look like relative paths (`org/name`): only resolve what exists or is clearly a path.
    if value.startswith(("./", "../")) or candidate.exists() or glob.glob(str(candidate)):
        return str(candidate.resolve())
    return value


def _override_path(value: str) -> str:
    """A path given with --set, absolute against the cwd (where it was typed) when it exists or is written as a
    path (`./`, `../`, `~`): a missing `./data.jsonl` is then refused under the name the user means, not under the
    recipe's folder. Anything else (a hub id, `org/name`) is left for the recipe's rules."""
    p = Path(value).expanduser()
    if p.exists() or value.startswith(("./", "../", "~")):
        return str(p.resolve())
    return value


def set_dotted(raw: dict, key: str, value: Any) -> None:
    """`raw["a"]["b"] = value` for key "a.b" (sections made as needed); RecipeError when a part is not a section."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            _fail(key, value, f"`{part}` is not a section")
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """`["a.b=1", "c=[1, 2]"]` -> [("a.b", 1), ("c", [1, 2])]; values are parsed as YAML.

    A value that is not valid YAML is taken as the plain string it is (an inline Jinja template such as
    `data.chat_template={% for m in messages %}...` or `{{ ... }}`, which YAML would read as a broken flow
    mapping); the key's own validation then says if a string is not what it takes."""
    parsed = []
    for item in overrides or []:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. --set output.dir=/data/out")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        parsed.append((key.strip(), value))
    return parsed


def load_recipe(path: str | Path | None = None, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe. `path=None` loads the embedded default."""
    path = Path(path) if path is not None else DEFAULT_RECIPE
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        what = getattr(e, "problem", None) or type(e).__name__
        raise RecipeError(f"recipe {path}: not valid YAML{at} ({what})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level")
    base_dir = path.resolve().parent
    # Overrides are relative to the cwd (where the user typed them), recipe paths to the recipe's folder.
    for key, value in parse_overrides(overrides):
        if tuple(key.split(".")) in _PATH_KEYS and isinstance(value, str) and "{" not in value:
            value = _override_path(value)
        elif tuple(key.split(".")) in _PATH_KEYS and isinstance(value, list):  # data.path as a list
            value = [_override_path(v) if isinstance(v, str) else v for v in value]
        set_dotted(raw, key, value)
    if isinstance(raw.get("output"), dict) and isinstance(raw["output"].get("dir"), str) \
            and not is_remote(raw["output"]["dir"]):  # a URL is never a local path (recipe/location.py)
        raw["output"]["dir"] = str(local_path(raw["output"]["dir"]).expanduser().resolve())
    if isinstance(raw.get("regenerate"), dict) and isinstance(raw["regenerate"].get("output_dir"), str):
        raw["regenerate"]["output_dir"] = str(Path(raw["regenerate"]["output_dir"]).expanduser().resolve())
    return _build(Recipe, raw, "", base_dir)


def recipe_from_dict(raw: dict, base_dir: Path | None = None) -> Recipe:
    """Build and validate a recipe from a mapping (tests, programmatic use)."""
    return _build(Recipe, raw, "", base_dir)


def add_recipe_args(parser) -> None:
    """`--recipe PATH` and `--set KEY=VALUE` (repeatable), as `extract`, `plan` and `launch` take them."""
    parser.add_argument("--recipe", default=None,
                        help="recipe YAML (default: dflash_prep/demo/tiny-demo.yaml, the embedded CPU demo)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set output.dir=/data/out (repeatable)")

"""`dflash-prep export OUT --to specforge|speculators|modelopt --dest DIR`: rewrite shards in a trainer's layout.

Layouts (as each trainer's data loader reads them; T tokens, k captured layers, H hidden size; every hidden state bf16):

- `specforge` (`--strategy dflash`, default): `DIR/rows_{g}-{g+2000}/data_{i}.ckpt`, g = i rounded down to 2000,
  one `torch.save` dict per sample: `input_ids` int64 [T], `loss_mask` int64 [T], `hidden_states` [1, T, k*H]
  (layers in ascending after-layer id order, SpecForge's `dflash_config.target_layer_ids` order).
- `specforge --strategy eagle3`: same files with `input_ids`, `loss_mask`, `aux_hidden_state` [1, T, 3H] and
  `hidden_state` [1, T, H] = the final layer AFTER the final norm. Needs k == 3 and
  `layers.capture_final: after_norm`, or `before_norm` (then the after-norm states are derived at export time
  from the stored final norm, `OUT/final_norm.safetensors`: norms.py; one extraction serves every trainer).
- `speculators` (DFlash and EAGLE-3 alike): an Arrow dataset in DIR (`datasets.save_to_disk` after
  `set_format(type="torch")`; row i = `input_ids` int64 [T], `loss_mask` int64 [T], `seq_len` int64) and
  `DIR/hidden_states/hs_{i}.safetensors` = `hidden_states` [T, k+1, H] (the k layers, then the final layer
  BEFORE the final norm) and `token_ids` int64 [T]. Needs `layers.capture_final: before_norm`. Also
  `DIR/token_freq.pt`, speculators' supervised-token frequency file (a {token id: count} dict) for its
  d2t/t2d builder, from `OUT/token_freq.safetensors`.
  From an fp8 output (`output.dtype: fp8_e4m3`) it writes speculators' fp8 layout instead: `hidden_states`
  float8_e4m3fn [T, k+1, H] + `hidden_states_scales` float32 [T, 1, 1], ONE scale per token for all k+1 layers
  (dequantize: `hidden_states.float() * hidden_states_scales`). The output stores one scale per token and layer,
  so each token is re-quantized from its dequantized values with S = max of its layer scales: the layer(s) with
  the largest scale are copied exactly, the others rounded a second time (per element
  |x'' - x| <= (2^-3 + 2^-8)|x| + (2 + 2^-4) 2^-10 S against the original x; fp8.requantize_error_bound).
  speculators' default reader (`--hidden-states-backend file`) loads those files as they are and hands the
  trainer the raw e4m3 codes without their scales (values up to 448), with no warning; only its `fp8` backend
  (`--hidden-states-backend fp8`: `hs_connectors.transfer.FP8Backend` / `FP8Transfer`) dequantizes. So the fp8
  layout is written only when the export is given `--hidden-states-backend fp8`, which then goes into the
  trainer config of `dflash_prep_export.json`; without it the export is refused.
  `--cast-to-bfloat16` writes the bf16 layout from the dequantized values instead (any backend reads it).
- `modelopt` (NVIDIA Model-Optimizer): `DIR/{sample_id}.pt`, one `torch.save` dict per sample: `input_ids`
  int64 [T], `hidden_states` [T, H] (final layer AFTER the final norm, what its HF dumper stores:
  `outputs.hidden_states[-1]`), `aux_hidden_states` [T, k*H], `loss_mask` int64 [T], and `conversation_id`
  (str, = sample_id) as its dumper writes. Needs `layers.capture_final: after_norm`, or `before_norm` (the
  after-norm states derived at export time, as for EAGLE-3 above).

Guarantees:
- a requirement the output does not meet (final layer missing or of the wrong kind, k != 3 for EAGLE-3, a
  storage dtype other than bf16 without `--cast-to-bfloat16`, except fp8 to speculators) fails before anything
  is written, naming the recipe key and value to re-extract with;
- export index i = the sample's rank in sample_id order, i.e. source-row order: independent of how many ranks
  extracted it or how batches were planned (so speculators' first-rows/last-rows train/validation split is
  not a split by length); `DIR/dflash_prep_export.json` records the trainer, layer ids in both conventions,
  and `sample_ids` in export order;
- streaming: one sample in memory at a time (plus, for speculators, the Arrow rows in a temporary datasets
  cache on disk); tensors equal the shard's bit for bit (the only conversion is int32/uint8 -> int64 ids and
  masks, the explicit bf16 cast when asked, and the fp8 dequantization / speculators re-quantization above);
- integrity: the manifest's shard list must name each path once and add up to `num_samples`, and every shard's
  sha256 is verified as it is streamed (`--skip-hash` to skip): a corrupted shard stops the export (exit 1)
  before DIR exists;
- one export per DIR at a time: `DIR.lock` (beside DIR, flock'ed, released by the kernel when the process dies;
  removed when the export ends)
  is held from before DIR is looked at until the rename; a second export into DIR is refused (exit 2);
- the export is written to `DIR.partial` and renamed to DIR at the end: DIR never holds a partial export.
  After the rename the files in DIR are counted: the report's `num_files` is that count, and a per-sample file
  count different from the samples exported fails (exit 1). An existing non-empty DIR is refused unless
  `--overwrite`, which replaces only an earlier export (a DIR holding `dflash_prep_export.json`), never other
  files; a DIR that is the output, holds it or lies inside it is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file as safetensors_save_file

from dflash_prep import __version__
from dflash_prep.consume.shard_format import (
    OutputLayout,
    ShardFormatError,
    ShardInfo,
    manifest_shard_problems,
    shards_of,
)
from dflash_prep.consume.shard_read import iter_shard, iter_tar_samples
from dflash_prep.consume.vocab import TOKEN_FREQ_NAME, read_token_freq, token_freq_dict
from dflash_prep.recipe.location import as_location, is_remote_path, one_line_store_errors
from dflash_prep.store.locks import FileLock
from dflash_prep.store.manifest import OutputStateError, read_committed, read_manifest
from dflash_prep.target.fp8 import dequantize as fp8_dequantize
from dflash_prep.target.fp8 import quantize_rows as fp8_quantize_rows
from dflash_prep.target.norms import can_derive_after_norm, read_final_norm, with_after_norm_final
from dflash_prep.units import format_bytes

TARGETS = ("specforge", "speculators", "modelopt")
STRATEGIES = ("dflash", "eagle3")
HIDDEN_STATES_BACKENDS = ("file", "fp8")  # speculators' `--hidden-states-backend` values that read these files
EXPORT_INFO_NAME = "dflash_prep_export.json"
SPECFORGE_GROUP_SIZE = 2000


class ExportError(RuntimeError):
    """The output cannot be exported to the requested layout; the message says what to change."""


class ExportBusyError(ExportError):
    """Another export holds the lock of the destination."""


class ExportIncompleteError(RuntimeError):
    """After the final rename the destination does not hold one file per exported sample."""


@dataclass
class ExportReport:
    target: str
    strategy: str
    dest: str
    num_samples: int
    num_tokens: int
    num_files: int
    num_bytes: int
    seconds: float


# ----------------------------------------------------------------------------------------- requirements
def _reextract_hint(key_value: str) -> str:
    return (f"re-extract with `--set {key_value}` (recipe key `{key_value.replace('=', ': ')}`), into a new "
            f"output.dir or with --set output.overwrite=true")


def check_exportable(manifest: dict, target: str, strategy: str = "dflash", cast_to_bfloat16: bool = False,
                     source: str = "the output", hidden_states_backend: str = "file") -> None:
    """Raise `ExportError` when `manifest` lacks what `target` (+ `strategy`) needs; say which recipe key to set.

    `hidden_states_backend` is the speculators `--hidden-states-backend` the export will be trained with; an
    fp8 output goes to speculators (without `cast_to_bfloat16`) only with `fp8`, the backend that dequantizes."""
    if hidden_states_backend not in HIDDEN_STATES_BACKENDS:
        raise ExportError(f"unknown --hidden-states-backend {hidden_states_backend!r}; choose one of "
                          f"{HIDDEN_STATES_BACKENDS}")
    if hidden_states_backend != "file" and target != "speculators":
        raise ExportError("--hidden-states-backend applies to --to speculators only")
    if target not in TARGETS:
        raise ExportError(f"unknown export target {target!r}; choose one of {TARGETS}")
    if strategy not in STRATEGIES:
        raise ExportError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if strategy != "dflash" and target != "specforge":
        raise ExportError(f"--strategy applies to --to specforge only ({target} has one layout for DFlash and "
                          f"EAGLE-3)")
    final = manifest.get("capture_final", "none")
    k = len(manifest["layer_ids"])
    fp8_native = manifest["dtype"] == "fp8_e4m3" and target == "speculators"  # speculators has an fp8 layout
    if manifest["dtype"] != "bfloat16" and not cast_to_bfloat16 and not fp8_native:
        how = ("dequantizes: e4m3 value x scale, rounded to bf16; the fp8 rounding error stays"
               if manifest["dtype"] == "fp8_e4m3" else "rounds")
        raise ExportError(f"{target} reads bf16 hidden states but {source} stores {manifest['dtype']}: "
                          f"{_reextract_hint('output.dtype=bfloat16')}, or pass --cast-to-bfloat16 ({how})")
    if fp8_native and not cast_to_bfloat16 and hidden_states_backend != "fp8":
        raise ExportError(f"{source} stores fp8_e4m3: speculators' default reader (--hidden-states-backend file) "
                          f"would hand the trainer the raw e4m3 codes without their scales (values up to 448); "
                          f"pass --hidden-states-backend fp8 and train with speculators' --hidden-states-backend "
                          f"fp8 (its reader dequantizes), or pass --cast-to-bfloat16 (bf16 files, any backend)")
    needs = None
    if target == "speculators":
        needs = ("before_norm", "speculators stores the final layer as the last of its K = k+1 layers and wants "
                                "it BEFORE the final norm (vLLM's final-layer id; its trainer applies the norm)")
    elif target == "modelopt":
        needs = ("after_norm", "Model-Optimizer's `hidden_states` is the final layer AFTER the final norm "
                               "(its HF dumper stores transformers' `outputs.hidden_states[-1]`)")
    elif strategy == "eagle3":
        needs = ("after_norm", "SpecForge EAGLE-3's `hidden_state` is the final layer AFTER the final norm")
        if k != 3:
            raise ExportError(f"SpecForge EAGLE-3 needs exactly 3 auxiliary layers (`aux_hidden_state` "
                              f"[1, T, 3H]) but {source} captured {k}: {manifest['layer_ids']}; "
                              f"{_reextract_hint('layers.preset=eagle3')}")
    if needs is not None and needs[0] == "after_norm" and can_derive_after_norm(manifest):
        return  # derived at export time from the before-norm states and the stored final norm (norms.py)
    if needs is not None and final != needs[0]:
        got = "did not capture the final layer" if final == "none" else f"captured it {final.replace('_', ' ')}"
        hint = _reextract_hint("layers.capture_final=" + needs[0])
        if needs[0] == "after_norm" and final == "none":  # one re-extraction that serves every trainer
            hint = (f"{_reextract_hint('layers.capture_final=before_norm')} (serves every exporter where the "
                    f"target's final norm is an RMSNorm, x * w or x * (1 + w): the after-norm states are derived "
                    f"at export from the stored norm), or with layers.capture_final=after_norm (any norm)")
        raise ExportError(f"{needs[1]}, but {source} {got} (layers.capture_final={final}); {hint}")


def _derives_after_norm(manifest: dict, target: str, strategy: str) -> bool:
    """The layout wants the final layer after the norm (Model-Optimizer, SpecForge EAGLE-3) and the output stores
    it before: the export applies the stored final norm (norms.py)."""
    return (target == "modelopt" or strategy == "eagle3") and manifest.get("capture_final") == "before_norm"


# ----------------------------------------------------------------------------------------- export order
def sample_ids_by_shard(out_dir: Path, shards: list[ShardInfo]) -> dict[str, list[str]]:
    """Each shard's sample ids (tar order): from the rank indexes when they agree with the manifest (path,
    sha256, count), else from the tar (read through, no tensor decoded)."""
    records = {r.path: r for r in read_committed(out_dir)}
    out: dict[str, list[str]] = {}
    for s in shards:
        r = records.get(s.rel_path)
        if r is not None and r.sha256 == s.sha256 and len(r.sample_ids) == s.num_samples:
            out[s.rel_path] = list(r.sample_ids)
        else:
            out[s.rel_path] = [key for _, key, _ in iter_tar_samples(s.path, wanted=lambda j: False)]
    return out


def export_order(out_dir: Path, shards: list[ShardInfo]) -> list[str]:
    """All sample ids in export order (sorted: source-row order); raises on a duplicate id."""
    ids = [i for lst in sample_ids_by_shard(out_dir, shards).values() for i in lst]
    ordered = sorted(ids)
    dupes = sorted({a for a, b in zip(ordered, ordered[1:]) if a == b})
    if dupes:
        raise ExportError(f"{out_dir}: sample ids in more than one place: {dupes[:5]}")
    return ordered


# ---------------------------------------------------------------------------------------------- writers
def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` as a contiguous tensor that owns exactly its bytes (torch.save writes a view's whole storage)."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset() != 0:
        t = t.clone()
    return t


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)


def specforge_path(dest: Path, index: int) -> Path:
    g = index // SPECFORGE_GROUP_SIZE * SPECFORGE_GROUP_SIZE
    return dest / f"rows_{g}-{g + SPECFORGE_GROUP_SIZE}" / f"data_{index}.ckpt"


def speculators_path(dest: Path, index: int) -> Path:
    return dest / "hidden_states" / f"hs_{index}.safetensors"


def modelopt_path(dest: Path, sample_id: str) -> Path:
    return dest / f"{sample_id}.pt"


def specforge_record(sample: dict[str, Any], strategy: str) -> dict[str, torch.Tensor]:
    """The dict SpecForge's offline reader loads for one sample."""
    record = {"input_ids": _owned(sample["input_ids"]), "loss_mask": _owned(sample["loss_mask"])}
    if strategy == "dflash":
        record["hidden_states"] = _owned(_bf16(sample["hidden_states"]).unsqueeze(0))
    else:
        record["aux_hidden_state"] = _owned(_bf16(sample["hidden_states"]).unsqueeze(0))
        record["hidden_state"] = _owned(_bf16(sample["final_hidden_states"]).unsqueeze(0))
    return record


def speculators_record(sample: dict[str, Any], hidden_size: int) -> dict[str, torch.Tensor]:
    """The tensors of one `hs_{i}.safetensors`: `hidden_states` [T, k+1, H] (final last), `token_ids` [T]."""
    hidden_states_TK = _bf16(sample["hidden_states"])
    T = hidden_states_TK.shape[0]
    layers_TkH = hidden_states_TK.reshape(T, -1, hidden_size)
    final_T1H = _bf16(sample["final_hidden_states"]).reshape(T, 1, hidden_size)
    return {"hidden_states": torch.cat([layers_TkH, final_T1H], dim=1).contiguous(),
            "token_ids": sample["input_ids"].contiguous()}


def speculators_fp8_record(sample: dict[str, Any], hidden_size: int) -> dict[str, torch.Tensor]:
    """speculators' fp8 file from a raw fp8 sample (`fp8="raw"`): `hidden_states` float8_e4m3fn [T, k+1, H],
    `hidden_states_scales` float32 [T, 1, 1] (one scale per token over all k+1 layers), `token_ids` int64 [T]."""
    layers_TW = fp8_dequantize(sample["hidden_states"], sample["hidden_states_scales"])
    final_TH = fp8_dequantize(sample["final_hidden_states"], sample["final_hidden_states_scales"])
    T = layers_TW.shape[0]
    x_TKH = torch.cat([layers_TW.view(T, -1, hidden_size), final_TH.view(T, 1, hidden_size)], dim=1)
    K = x_TKH.shape[1]
    q, scale_T = fp8_quantize_rows(x_TKH.view(T, K * hidden_size))
    return {"hidden_states": q.view(T, K, hidden_size).contiguous(), "hidden_states_scales": scale_T.view(T, 1, 1),
            "token_ids": sample["input_ids"].contiguous()}


def modelopt_record(sample: dict[str, Any]) -> dict[str, Any]:
    """The dict Model-Optimizer's `OfflineSupervisedDataset` loads (torch.load(weights_only=True))."""
    return {"input_ids": _owned(sample["input_ids"]),
            "hidden_states": _owned(_bf16(sample["final_hidden_states"])),
            "aux_hidden_states": _owned(_bf16(sample["hidden_states"])),
            "loss_mask": _owned(sample["loss_mask"]),
            "conversation_id": sample["sample_id"]}


def _save_torch(obj: dict, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
    return path.stat().st_size


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors_save_file(tensors, str(path))
    return path.stat().st_size


# ------------------------------------------------------------------------------------------------ export
def _refuse_overlap(out_dir: Path, dest: Path) -> None:
    """DEST (replaced whole by the export, and by `--overwrite` before it) must not be OUT, hold it, or lie
    inside it: each would delete or alter the output being read. Raises ExportError."""
    if is_remote_path(out_dir):
        return  # an output in an object store: DEST is a local folder
    source, target = out_dir.resolve(), dest.resolve()
    if target == source or source.is_relative_to(target) or target.is_relative_to(source):
        raise ExportError(f"--dest {dest} overlaps the output {out_dir} (the same folder, a folder holding it, or "
                          f"one inside it): the export would delete or alter what it reads; choose a --dest "
                          f"outside the output")


def lock_dest(dest: Path) -> FileLock:
    """Hold `DEST.lock` (beside DEST) for this export; raises `ExportBusyError` when another export holds it."""
    dest = dest.resolve()
    lock = FileLock(dest.with_name(dest.name + ".lock"))
    if not lock.try_acquire():
        raise ExportBusyError(f"another export into {dest} is running ({lock.holder()}): wait for it to end, or "
                              f"choose another --dest")
    return lock


def export(out_dir: str | Path, target: str, dest: str | Path, *, strategy: str = "dflash",
           overwrite: bool = False, cast_to_bfloat16: bool = False, verify_sha256: bool = True,
           hidden_states_backend: str = "file", progress: bool = True) -> ExportReport:
    """Export the output at `out_dir` to `dest` in `target`'s layout (see the module docstring).

    Raises `ExportError` (a refused export; `ExportBusyError` when another export holds `dest`),
    `ShardFormatError` (the output is inconsistent or a shard corrupted) or `ExportIncompleteError`."""
    out_dir, dest = as_location(out_dir), Path(dest)  # OUT: a local folder or an object-store URL
    _refuse_overlap(out_dir, dest)
    manifest = read_manifest(out_dir)
    check_exportable(manifest, target, strategy, cast_to_bfloat16, source=str(out_dir),
                     hidden_states_backend=hidden_states_backend)
    problems = manifest_shard_problems(manifest)
    if problems:
        raise ShardFormatError(f"{out_dir / 'manifest.json'}: {'; '.join(problems[:5])}")
    lock = lock_dest(dest)
    try:
        return _export_locked(out_dir, manifest, target, dest, strategy, overwrite, cast_to_bfloat16, verify_sha256,
                              hidden_states_backend, progress)
    finally:
        lock.release(remove=True)  # no DEST.lock left beside DEST


def _export_locked(out_dir: Path, manifest: dict, target: str, dest: Path, strategy: str, overwrite: bool,
                   cast_to_bfloat16: bool, verify_sha256: bool, hidden_states_backend: str,
                   progress: bool) -> ExportReport:
    t0 = time.perf_counter()
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        if not overwrite:
            raise ExportError(f"{dest} exists and is not empty; choose another --dest or pass --overwrite")
        if not (dest / EXPORT_INFO_NAME).is_file():
            raise ExportError(f"{dest} is not an earlier export (no {EXPORT_INFO_NAME}): --overwrite replaces only "
                              f"an export, never other files; choose another --dest")
    layout = OutputLayout.from_manifest(manifest)
    shards = shards_of(out_dir, manifest)
    missing = [s.rel_path for s in shards if not s.path.is_file()]
    if missing:
        raise ExportError(f"{out_dir}: shard(s) listed in the manifest are missing: {missing[:5]}")
    order = export_order(out_dir, shards)
    if len(order) != int(manifest["num_samples"]):
        raise ExportError(f"{out_dir}: the shards hold {len(order)} samples, the manifest says "
                          f"{manifest['num_samples']}")
    index_of = {sid: i for i, sid in enumerate(order)}

    partial = dest.with_name(dest.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)  # left by an interrupted export of this dest
    partial.mkdir(parents=True)
    report = ExportReport(target, strategy, str(dest), 0, 0, 0, 0, 0.0)
    bar = _progress(progress, len(order), f"export -> {target}")
    rows_cache = partial / ".rows-cache"
    try:
        if target == "speculators":
            _export_speculators(shards, layout, partial, rows_cache, index_of, report, bar, verify_sha256,
                                fp8_layout=layout.is_fp8 and not cast_to_bfloat16)
            if (out_dir / TOKEN_FREQ_NAME).is_file():  # speculators' frequency file, for its d2t/t2d builder
                torch.save(token_freq_dict(read_token_freq(out_dir)), partial / "token_freq.pt")
        else:
            write: Callable[[dict], int]
            if target == "specforge":
                def write(sample):
                    return _save_torch(specforge_record(sample, strategy),
                                       specforge_path(partial, index_of[sample["sample_id"]]))
            else:
                def write(sample):
                    return _save_torch(modelopt_record(sample), modelopt_path(partial, sample["sample_id"]))
            final_norm = read_final_norm(out_dir) if _derives_after_norm(manifest, target, strategy) else None
            for sample in _samples(shards, layout, verify_sha256, final_norm=final_norm):
                report.num_bytes += write(sample)
                _count(report, sample, bar)
        if report.num_samples != len(order):
            raise ExportError(f"exported {report.num_samples} samples, expected {len(order)}")
        info = _export_info(manifest, out_dir, target, strategy, order, cast_to_bfloat16, hidden_states_backend)
        (partial / EXPORT_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        if dest.exists():
            shutil.rmtree(dest) if dest.is_dir() else dest.unlink()
        os.replace(partial, dest)
    except BaseException:
        if bar is not None:
            bar.close()
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if bar is not None:
        bar.close()
    _count_files(dest, target, report)
    report.seconds = time.perf_counter() - t0
    return report


PER_SAMPLE_FILES = {"specforge": "rows_*/data_*.ckpt", "speculators": "hidden_states/hs_*.safetensors",
                    "modelopt": "*.pt"}


def _count_files(dest: Path, target: str, report: ExportReport) -> None:
    """Count what DEST holds after the rename: `num_files` = every file; one per-sample file per sample."""
    report.num_files = sum(1 for p in dest.rglob("*") if p.is_file())
    per_sample = sum(1 for p in dest.glob(PER_SAMPLE_FILES[target]) if p.is_file())
    if per_sample != report.num_samples:
        raise ExportIncompleteError(f"{dest} holds {per_sample} per-sample files after the rename, "
                                    f"{report.num_samples} were exported: something else wrote into or removed "
                                    f"from it; export again with --overwrite")


def _samples(shards: list[ShardInfo], layout: OutputLayout, verify_sha256: bool, fp8: str = "bfloat16",
             final_norm: dict | None = None):
    """Every sample in shard order; with `final_norm`, its final states after that norm (norms.py)."""
    for shard in shards:
        for sample in iter_shard(shard, layout, fp8=fp8, verify_sha256=verify_sha256):
            yield sample if final_norm is None else with_after_norm_final(sample, final_norm)


def _count(report: ExportReport, sample: dict, bar) -> None:
    report.num_samples += 1
    report.num_tokens += int(sample["input_ids"].shape[0])
    if bar is not None:
        bar.update(1)


def _export_speculators(shards, layout: OutputLayout, partial: Path, rows_cache: Path, index_of: dict[str, int],
                        report: ExportReport, bar, verify: bool, fp8_layout: bool = False) -> None:
    """hs_{i}.safetensors while streaming; the Arrow rows through a datasets cache, sorted by i at the end."""
    import datasets

    features = datasets.Features({"_index": datasets.Value("int64"),
                                  "input_ids": datasets.List(datasets.Value("int64")),
                                  "loss_mask": datasets.List(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})

    def rows():
        for sample in _samples(shards, layout, verify, fp8="raw" if fp8_layout else "bfloat16"):
            i = index_of[sample["sample_id"]]
            record = (speculators_fp8_record if fp8_layout else speculators_record)(sample, layout.hidden_size)
            report.num_bytes += _save_safetensors(record, speculators_path(partial, i))
            _count(report, sample, bar)
            yield {"_index": i, "input_ids": sample["input_ids"].numpy(), "loss_mask": sample["loss_mask"].numpy(),
                   "seq_len": int(sample["input_ids"].shape[0])}

    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        # A fresh cache folder and a random fingerprint: from_generator never returns a stale cached dataset
        # (and never tries to hash the generator's closure).
        ds = datasets.Dataset.from_generator(rows, features=features, cache_dir=str(rows_cache),
                                             fingerprint=uuid.uuid4().hex)
        position_of_index = np.argsort(ds.with_format("numpy")["_index"][:], kind="stable")
        ds = ds.select(position_of_index, new_fingerprint=uuid.uuid4().hex).remove_columns("_index")
        ds.set_format(type="torch")
        ds.save_to_disk(str(partial))
        # The Arrow files count towards the export's size.
        report.num_bytes += sum(p.stat().st_size for p in partial.glob("*.arrow"))
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    shutil.rmtree(rows_cache, ignore_errors=True)


def _export_info(manifest: dict, out_dir: Path, target: str, strategy: str, order: list[str], cast: bool,
                 hidden_states_backend: str = "file") -> dict:
    after = [int(i) for i in manifest["layer_ids"]]
    info = {
        "exported_by": f"dflash-prep {__version__}",
        "source": str(out_dir) if is_remote_path(out_dir) else str(out_dir.resolve()),
        "source_recipe_fingerprint": manifest.get("recipe_fingerprint"),
        "source_model": manifest.get("model"),
        "target": target,
        "strategy": strategy if target == "specforge" else "dflash or eagle3",
        "num_hidden_layers": manifest.get("num_hidden_layers"),
        "hidden_size": manifest["hidden_size"],
        "layer_ids_after_layer": after,
        "layer_ids_before_layer": [i + 1 for i in after],
        "capture_final": manifest.get("capture_final", "none"),
        "final_norm_applied_at_export": _derives_after_norm(manifest, target, strategy),
        "source_dtype": manifest["dtype"],
        "cast_to_bfloat16": bool(cast and manifest["dtype"] != "bfloat16"),
        "hidden_states_dtype": ("float8_e4m3fn + hidden_states_scales [T, 1, 1] (one scale per token, re-quantized)"
                                if target == "speculators" and manifest["dtype"] == "fp8_e4m3" and not cast
                                else "bfloat16"),
        "num_samples": len(order),
        "num_tokens": manifest["num_tokens"],
        "index_order": "export index i = position of the sample id in `sample_ids` (sorted = source-row order)",
    }
    if target == "specforge":
        info["trainer_config"] = {"dflash_config.target_layer_ids": after} if strategy == "dflash" else {}
    elif target == "speculators":
        info["trainer_config"] = {"--target-layer-ids": [i + 1 for i in after],
                                  "--hidden-states-backend": hidden_states_backend,
                                  "note": "before-layer ids; the final layer is the extra last slot of hidden_states"}
        if hidden_states_backend == "fp8":
            info["trainer_config"]["note"] += ("; --hidden-states-backend fp8: speculators' reader dequantizes the "
                                               "fp8 files (its default `file` reader would not)")
    else:
        info["trainer_config"] = {"aux layer ids (after-layer, HF hidden_states[i+1])": after}
    info["sample_ids"] = order
    return info


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True, file=sys.stderr, mininterval=1.0)


# ------------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "dflash-prep export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Rewrite an extraction output in a drafter trainer's "
                                                       "layout (SpecForge, speculators, Model-Optimizer).")
    p.add_argument("out", help="extraction output folder (holds manifest.json), or its object-store URL")
    p.add_argument("--to", dest="target", required=True, choices=TARGETS, help="trainer layout to write")
    p.add_argument("--dest", required=True, help="folder to create (written as DEST.partial, renamed at the end)")
    p.add_argument("--strategy", default="dflash", choices=STRATEGIES,
                   help="SpecForge only: dflash (hidden_states) or eagle3 (aux_hidden_state + hidden_state)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty DEST")
    p.add_argument("--cast-to-bfloat16", action="store_true",
                   help="accept an output stored as float16/float32 and round its states to bf16")
    p.add_argument("--hidden-states-backend", default="file", choices=HIDDEN_STATES_BACKENDS,
                   help="speculators only: the --hidden-states-backend you will train with; an fp8 output needs "
                        "`fp8` (speculators' reader that dequantizes), written into the trainer config")
    p.add_argument("--skip-hash", action="store_true",
                   help="do not verify each shard's sha256 while streaming it (verified by default)")
    p.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


@one_line_store_errors
def main(argv: list[str] | None = None) -> int:
    """`dflash-prep export OUT --to TARGET --dest DIR`; 0 on success, 2 on a refused export (or DIR busy), 1 on
    bad data (a corrupt or inconsistent output, or DIR changed under the export)."""
    args = build_parser().parse_args(argv)
    try:
        report = export(args.out, args.target, args.dest, strategy=args.strategy, overwrite=args.overwrite,
                        cast_to_bfloat16=args.cast_to_bfloat16, verify_sha256=not args.skip_hash,
                        hidden_states_backend=args.hidden_states_backend, progress=not args.no_progress)
    except (ShardFormatError, ExportIncompleteError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ExportError, FileNotFoundError, ValueError, OutputStateError) as e:  # a damaged manifest or index
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {report.num_samples} samples ({report.num_tokens} tokens) to {report.dest} as "
          f"{report.target}{' ' + report.strategy if report.target == 'specforge' else ''}: {report.num_files} "
          f"files, {format_bytes(report.num_bytes)} in {report.seconds:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dflash-prep inspect OUT [--check] [--json]`: what an extraction output holds, and whether it is intact.

Without `--check` only `OUT/manifest.json` (and `summary.json` when present) is read: model, layers, dtype,
final-layer capture, samples, tokens, shards, size, skipped and failed counts.

`--check` then verifies every shard the manifest lists and exits non-zero on any mismatch, naming the shard:
- the file exists, its size equals the manifest's `num_bytes` and its sha256 the manifest's `sha256`;
- its tar parses; every sample has `input_ids.npy` (int32 [T]), `loss_mask.npy` (uint8 [T]) and
  `hidden_states.safetensors` whose header lists exactly `hidden_states` [T, k*H] (+ `final_hidden_states`
  [T, H] when captured) in the manifest's dtype (fp8_e4m3: F8_E4M3 plus the F32 `*_scales` [T, k] / [T, 1]),
  with data sizes that add up; no sample id appears twice (in a shard or across shards);
- every sample also has its `meta.json`, whose `layer_ids` equal the manifest's, `sample_id` the member key and
  `num_tokens` the sample's T; the width of its `hidden_states` equals len(meta `layer_ids`) x the manifest's
  `hidden_size` (so an edited `layer_ids` or `hidden_size` in the manifest is caught even when k x H is unchanged);
- its sample and token counts equal the manifest's, the manifest's totals equal the sums over shards, and
  `num_samples == num_sample_candidates - num_skipped - num_failed` (`num_rows` in manifests without that key).
Only headers and the small id/mask members are parsed (plus one sequential read per shard for the hash).

An output without a manifest (a run in progress, or interrupted) gets its progress instead: batches and
samples committed against the plan, per rank, the time since the last commit, and whether a process holds the
output's locks now (running) or not (interrupted: resume it); exit code 0 (it is how a live run is watched), 2
with `--check` (there is nothing to verify yet).

Exit codes: 0 = fine (or an unfinished output's progress), 1 = a mismatch (each printed as `FAIL <shard>: <what>`),
2 = nothing readable: no run in the folder, a damaged manifest or plan.json, `--check` of an unfinished output.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import struct
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_prep.consume.shard_format import (
    MEMBER_INPUT_IDS,
    MEMBER_LOSS_MASK,
    MEMBER_META,
    MEMBER_STATES,
    REQUIRED_MEMBERS,
    OutputLayout,
    ShardInfo,
    shards_of,
)
from dflash_prep.consume.shard_read import open_for_reading, sample_key
from dflash_prep.data.samples import samples_line
from dflash_prep.recipe.location import as_location, is_remote_path, one_line_store_errors
from dflash_prep.store.manifest import OutputStateError, read_manifest, read_state_json
from dflash_prep.store.records import SHARDS_DIR
from dflash_prep.store.writer import ST_CODE, ST_ITEMSIZE, ST_TORCH_CODE
from dflash_prep.units import format_bytes

MAX_PROBLEMS_PER_SHARD = 20


# ---------------------------------------------------------------------------------------------- describe
def describe(out_dir: str | Path) -> dict:
    """Facts about an output from its manifest (and summary.json when present); reads no shard."""
    out_dir = as_location(out_dir)  # a folder, or an object-store URL (recipe/location.py)
    m = read_manifest(out_dir)
    layer_ids = [int(i) for i in m["layer_ids"]]
    H = int(m["hidden_size"])
    bytes_per_value = ST_ITEMSIZE.get(ST_CODE.get(m["dtype"]), 0)  # fp8: plus one F32 scale per token and layer
    capture_final = m.get("capture_final", "none")
    num_blocks = len(layer_ids) + (1 if capture_final != "none" else 0)
    values_per_token = num_blocks * H
    scale_bytes = 4 * num_blocks if m["dtype"] == "fp8_e4m3" else 0  # one fp32 scale per token and layer
    facts = {
        "output_dir": str(out_dir),
        "format_version": m.get("format_version"),
        "dflash_prep_version": m.get("dflash_prep_version"),
        "model": m.get("model"),
        "model_type": m.get("model_type"),
        "num_hidden_layers": m.get("num_hidden_layers"),
        "hidden_size": H,
        "layer_ids": layer_ids,
        "layer_ids_before_layer": [i + 1 for i in layer_ids],
        "capture_final": capture_final,
        "dtype": m["dtype"],
        "bytes_per_token": values_per_token * bytes_per_value + scale_bytes,
        "num_rows": m.get("num_rows"),
        "num_samples": int(m["num_samples"]),
        "num_tokens": int(m["num_tokens"]),
        "num_skipped": m.get("num_skipped", 0),
        "skipped": m.get("skipped", {}),
        "samples": m.get("samples", {}),
        "num_failed": m.get("num_failed", 0),
        "failed": m.get("failed", {}),
        "num_shards": len(m["shards"]),
        "num_bytes": int(m.get("num_bytes", sum(int(s["num_bytes"]) for s in m["shards"]))),
    }
    summary_path = out_dir / "summary.json"
    if summary_path.is_file():
        try:
            s = json.loads(summary_path.read_text())
            facts["extraction"] = {k: s.get(k) for k in ("num_ranks", "wall_seconds", "loop_seconds",
                                                          "tokens_per_second", "num_tokens_this_run",
                                                          "padding_efficiency", "num_batches",
                                                          "num_tokens_committed_before")}
        except (OSError, json.JSONDecodeError):
            facts["extraction"] = None
    return facts


def _live_leases(out_dir) -> dict[str, str]:
    """{lease name: holder} of the live leases of an output in an object store (store/lease.py)."""
    from dflash_prep.store.lease import Lease

    held = {}
    folder = out_dir / "locks"
    for path in folder.glob("*.lease"):
        lease = Lease(path.fs, path.path)
        content, _ = lease.read()
        if content is not None and not lease.stale(content):
            held[path.name[:-len(".lease")]] = content.get("holder", "unknown")
    return held


def format_description(f: dict) -> str:
    """The human-readable report of `describe()`."""
    mean = f["num_tokens"] / f["num_samples"] if f["num_samples"] else 0.0
    lines = [
        ("output", f["output_dir"]),
        ("model", f"{f['model']}  [{f['model_type']}, {f['num_hidden_layers']} layers, hidden {f['hidden_size']}]"),
        ("layers", f"{f['layer_ids']} after-layer 0-based (= HF hidden_states[i+1]; before-layer/vLLM ids "
                   f"{f['layer_ids_before_layer']})"),
        ("final layer", {"none": "not captured", "before_norm": "captured, before the final norm",
                         "after_norm": "captured, after the final norm"}.get(f["capture_final"], f["capture_final"])),
        ("dtype", f"{f['dtype']} ({f['bytes_per_token']:,} bytes of states per token)"),
        ("samples", f"{f['num_samples']:,}" + (f" of {f['num_rows']:,} rows" if f.get("num_rows") is not None else "")
         + f" ({f['num_skipped']:,} skipped, {f['num_failed']:,} failed)"),
        ("tokens", f"{f['num_tokens']:,} (mean {mean:.1f} per sample)"),
        ("shards", f"{f['num_shards']:,}, {format_bytes(f['num_bytes'])}"),
    ]
    if f["skipped"]:
        lines.append(("skipped", ", ".join(f"{k}: {v:,}" for k, v in sorted(f["skipped"].items()))))
    if (line := samples_line(f.get("samples") or {}, f["bytes_per_token"])) is not None:
        lines.append(("from rows", line))
    if f["failed"]:
        lines.append(("failed", ", ".join(f"{k}: {v:,}" for k, v in sorted(f["failed"].items()))))
    x = f.get("extraction")
    if x:
        parts = []
        if x.get("num_ranks") is not None:
            parts.append(f"{x['num_ranks']} rank(s)")
        # two rates, each named by its basis: the run's tokens over its wall time (start-up included), and the
        # forward loop's (summary.json `tokens_per_second`: tokens over the slowest rank's loop)
        if x.get("wall_seconds") is not None:
            wall = f"{x['wall_seconds']:.1f} s wall"
            if x.get("num_tokens_this_run") and x["wall_seconds"] > 0:
                wall += f" ({x['num_tokens_this_run'] / x['wall_seconds']:,.0f} tok/s over the wall time)"
            parts.append(wall)
        if x.get("tokens_per_second") is not None:
            loop = f" {x['loop_seconds']:.1f} s" if x.get("loop_seconds") is not None else ""
            parts.append(f"its loop{loop} at {x['tokens_per_second']:,.0f} tok/s")
        if x.get("padding_efficiency") is not None:
            parts.append(f"padding efficiency {x['padding_efficiency']:.3f}")
        before = x.get("num_tokens_committed_before")
        # the figures are the last run's: on a resume, after what earlier runs committed
        prefix = f"the last run, a resume ({before:,} tokens were committed by earlier runs): " if before else ""
        if parts:
            lines.append(("extraction", prefix + ", ".join(parts)))
    lines.append(("format", f"version {f['format_version']}, written by dflash-prep {f['dflash_prep_version']}"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


# ---------------------------------------------------------------------------------------------- progress
RATE_WINDOW_SECONDS = 900


def _last_run_started_at(out_dir) -> float | None:
    """When the latest run into `out_dir` claimed it (run_state.json's `runs`, unix seconds), or None."""
    try:
        runs = read_state_json(out_dir / "run_state.json").get("runs") or []
        started = runs[-1].get("started_at")
    except (OSError, ValueError, OutputStateError, AttributeError, IndexError):
        return None
    return float(started) if isinstance(started, (int, float)) else None


def _commit_time(record) -> float | None:
    """A record's `committed_at` as unix seconds, None where absent or not a number (an index edited by hand or
    written by another tool: progress figures leave it out rather than fail on it)."""
    t = record.committed_at
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def describe_progress(out_dir: str | Path) -> dict | None:
    """How far the run of an output without a manifest got, and whether a process runs into it now.

    Reads `plan.json` (planned batches and samples), the rank index files (what is committed: exactly what a
    resume keeps) and probes the locks (locks.py); reads no shard. None when the folder holds no run at all."""

    from dflash_prep.store.locks import running_holders
    from dflash_prep.store.manifest import read_committed

    out_dir = as_location(out_dir)
    plan_path, index_dir = out_dir / "plan.json", out_dir / "index"
    if not plan_path.is_file() and not index_dir.is_dir():
        return None
    planned = read_state_json(plan_path) if plan_path.is_file() else None  # damaged: OutputStateError, one line
    committed = read_committed(out_dir)
    by_rank: dict[str, dict] = {}
    for r in committed:
        rank = Path(r.path).parent.name
        entry = by_rank.setdefault(rank, {"shards": 0, "samples": 0, "tokens": 0})
        entry["shards"] += 1
        entry["samples"] += r.num_samples
        entry["tokens"] += r.num_tokens
    timed = [(t, r) for r in committed if (t := _commit_time(r)) is not None]  # (unix seconds, record)
    if is_remote_path(out_dir):  # an object store: the last commit's own time; the live leases (store/lease.py)
        last = max((t for t, _ in timed if t), default=None)
        running = _live_leases(out_dir)
    else:
        indexes = list(index_dir.glob("rank-*.jsonl")) if index_dir.is_dir() else []
        last = max((p.stat().st_mtime for p in indexes), default=None)
        running = running_holders(out_dir)
    # Rate over the commits of the last RATE_WINDOW_SECONDS (all ranks), and the ETA of a running job. The window
    # ends now for a running job, at the last commit for an interrupted one (its rate must not decay while idle).
    now = time.time()
    end = now if running or not timed else max(t for t, _ in timed)
    rate = eta = None
    started = _last_run_started_at(out_dir)
    if started is not None and end > started:
        # From the latest run's start (or the window's, the later): commits bunch (every lane commits at a stop),
        # so a span from the first commit in the window can be a fraction of a second and the rate thousands of
        # samples per second; the work of those commits was done since the run started.
        start = max(started, end - RATE_WINDOW_SECONDS)
        done = sum(r.num_samples + len(r.failed) for t, r in timed if t > start)
        rate = done / (end - start) if done else None
    else:  # an output whose run_state.json does not say when its run started: between the window's commits
        recent = [(t, r) for t, r in timed if t >= end - RATE_WINDOW_SECONDS]
        if len(recent) >= 2:
            first = min(t for t, _ in recent)
            done = sum(r.num_samples + len(r.failed) for t, r in recent if t > first)
            rate = done / (end - first) if end > first else None
    if rate and running and planned:
        left = planned["num_samples"] - sum(r.num_samples + len(r.failed) for r in committed)
        eta = max(left, 0) / rate
    return {
        "output_dir": str(out_dir), "finished": False,
        "planned_batches": len(planned["batches"]) if planned else None,
        "planned_samples": planned["num_samples"] if planned else None,
        "committed_batches": len({b for r in committed for b in r.batch_ids}),
        "num_samples": sum(r.num_samples for r in committed),
        "num_failed": sum(len(r.failed) for r in committed),
        "num_tokens": sum(r.num_tokens for r in committed),
        "num_shards": len(committed), "num_bytes": sum(r.num_bytes for r in committed),
        "by_rank": dict(sorted(by_rank.items())),
        "running": running,
        "seconds_since_last_commit": None if last is None else max(now - last, 0.0),
        "samples_per_second_recent": rate, "eta_seconds": eta,
    }


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def format_progress(p: dict) -> str:
    """The human-readable report of `describe_progress()`."""
    running = p["running"]
    if running:
        ranks = sorted(k for k in running if k.startswith("rank-"))
        status = ("unfinished, running now (" + (f"main process {running['run']}" if "run" in running else
                                                 "no main process") + f"; {len(ranks)} rank(s) writing)")
    else:
        status = "unfinished, not running (interrupted: re-run the same command to resume)"
    lines = [("output", p["output_dir"]), ("status", status)]
    if p["planned_batches"]:
        done = p["committed_batches"] / p["planned_batches"]
        lines.append(("progress", f"{p['committed_batches']:,} of {p['planned_batches']:,} batches committed "
                                  f"({100 * done:.1f}%)"))
    lines.append(("samples", f"{p['num_samples']:,} written" + (f" of {p['planned_samples']:,} planned"
                                                                if p["planned_samples"] is not None else "")
                  + f", {p['num_failed']:,} failed"))
    lines.append(("tokens", f"{p['num_tokens']:,}"))
    since = p["seconds_since_last_commit"]
    lines.append(("shards", f"{p['num_shards']:,}, {format_bytes(p['num_bytes'])}"
                            + (f"; last commit {since:,.0f} s ago" if since is not None else "")))
    if p["samples_per_second_recent"]:
        lines.append(("rate", f"{p['samples_per_second_recent']:,.1f} samples/s over the last "
                              f"{RATE_WINDOW_SECONDS // 60} min of commits"
                              + (f"; ETA {_hms(p['eta_seconds'])}" if p["eta_seconds"] is not None else "")))
    for rank, r in p["by_rank"].items():
        lines.append(("", f"{rank}: {r['shards']:,} shards, {r['samples']:,} samples, {r['tokens']:,} tokens"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in lines)


# ------------------------------------------------------------------------------------------------- check
@dataclass
class ShardCheck:
    """What `check_shard` found in one shard."""

    shard: str
    num_samples: int = 0
    num_tokens: int = 0
    sample_ids: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def sha256_file(path: Path, chunk_bytes: int = 8 << 20) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read sequentially."""
    h, n = hashlib.sha256(), 0
    with open_for_reading(path, chunk_bytes) as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _safetensors_header(f, member_size: int) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > member_size - 8 or n > 100_000_000:
        raise ValueError(f"header length {n} exceeds the member ({member_size} bytes)")
    return json.loads(f.read(n)), 8 + n


def _check_states(header: dict, data_start: int, member_size: int, T: int, layout: OutputLayout) -> str | None:
    """None when a parsed safetensors header matches the layout for a T-token sample, else what is wrong."""
    header = {k: v for k, v in header.items() if k != "__metadata__"}
    expected = {name: (ST_TORCH_CODE[dtype], list(shape))
                for name, (dtype, shape) in layout.expected_tensors(T).items()}
    if set(header) != set(expected):
        return f"{MEMBER_STATES} holds {sorted(header)}, expected {sorted(expected)}"
    end = 0
    for name, (code, shape) in expected.items():
        item = ST_ITEMSIZE[code]
        h = header[name]
        if h.get("dtype") != code or h.get("shape") != shape:
            return f"{name} is {h.get('dtype')} {h.get('shape')}, expected {code} {shape}"
        a, b = h["data_offsets"]
        if b - a != shape[0] * shape[1] * item:
            return f"{name} holds {b - a} bytes, expected {shape[0] * shape[1] * item}"
        end = max(end, b)
    if data_start + end != member_size:
        return f"{MEMBER_STATES} is {member_size} bytes, its header accounts for {data_start + end}"
    return None


def _read_meta(f):
    try:
        return json.loads(f.read())
    except ValueError:
        return "not JSON"


def _check_meta(meta, key: str, T: int, header: dict, layout: OutputLayout) -> list[str]:
    """What disagrees between one sample's meta.json, its states' width and the manifest (empty: nothing)."""
    if not isinstance(meta, dict):
        return [f"{MEMBER_META} is {meta if isinstance(meta, str) else 'not a JSON object'}"]
    problems = []
    meta_ids = meta.get("layer_ids")
    if meta_ids != list(layout.layer_ids):
        problems.append(f"{MEMBER_META} layer_ids {meta_ids} differ from the manifest's {list(layout.layer_ids)}")
    if meta.get("sample_id") != key:
        problems.append(f"{MEMBER_META} sample_id {meta.get('sample_id')!r} differs from the member key")
    if meta.get("num_tokens") != T:
        problems.append(f"{MEMBER_META} num_tokens {meta.get('num_tokens')} differs from the {T} tokens stored")
    shape = header.get("hidden_states", {}).get("shape")
    if isinstance(meta_ids, list) and meta_ids and isinstance(shape, list) and len(shape) == 2:
        if shape[1] != len(meta_ids) * layout.hidden_size:
            problems.append(f"hidden_states is {shape[1]} wide = {len(meta_ids)} layers (meta.json) x "
                            f"{shape[1] / len(meta_ids):g}, but the manifest's hidden_size is {layout.hidden_size}")
    return problems


def _load_npy(f) -> np.ndarray:
    return np.load(io.BytesIO(f.read()), allow_pickle=False)


class _SampleCheck:
    """The members of one sample as a shard's tar lists them, checked when the next sample starts (`close`)."""

    def __init__(self, key: str, layout: OutputLayout, result: "ShardCheck"):
        self.key, self.layout, self.result = key, layout, result
        self.lengths: dict[str, int] = {}  # member suffix -> T of this sample's npy members
        self.states = None  # (header, data_start, member_size) of this sample's safetensors member
        self.has_meta, self.meta = False, None  # whether it has a meta.json, and its parsed content

    def member(self, tar: tarfile.TarFile, info: tarfile.TarInfo, suffix: str) -> None:
        problems = self.result.problems
        if suffix in (MEMBER_INPUT_IDS, MEMBER_LOSS_MASK):
            array = _load_npy(tar.extractfile(info))
            want = np.dtype(np.int32 if suffix == MEMBER_INPUT_IDS else np.uint8)
            if array.dtype != want or array.ndim != 1:
                problems.append(f"sample {self.key!r}: {suffix} is {array.dtype} {list(array.shape)}, "
                                f"expected {want} [T]")
            self.lengths[suffix] = int(array.shape[0]) if array.ndim else -1
        elif suffix == MEMBER_STATES:
            self.states = (*_safetensors_header(tar.extractfile(info), info.size), info.size)
        elif suffix == MEMBER_META:
            self.has_meta, self.meta = True, _read_meta(tar.extractfile(info))

    def close(self) -> None:
        problems, key = self.result.problems, self.key
        missing = [m for m in REQUIRED_MEMBERS if m not in self.lengths and m != MEMBER_STATES]
        if self.states is None:
            missing.append(MEMBER_STATES)
        if not self.has_meta:
            missing.append(MEMBER_META)
        if missing:
            problems.append(f"sample {key!r} lacks {sorted(missing)}")
            return
        if len(set(self.lengths.values())) != 1:
            problems.append(f"sample {key!r}: token counts differ between members {self.lengths}")
            return
        T = self.lengths[MEMBER_INPUT_IDS]
        self.result.num_tokens += T
        why = _check_states(*self.states, T, self.layout)
        if why:
            problems.append(f"sample {key!r}: {why}")
        problems.extend(f"sample {key!r}: {p}" for p in _check_meta(self.meta, key, T, self.states[0], self.layout))


def _check_members(tar: tarfile.TarFile, layout: OutputLayout, result: "ShardCheck") -> None:
    """Each sample's members, in tar order: a sample id seen twice, and each sample's own checks."""
    seen: set[str] = set()
    sample: _SampleCheck | None = None
    while (info := tar.next()) is not None:
        tar.members.clear()
        if not info.isfile():
            continue
        key, suffix = sample_key(info.name)
        if sample is None or key != sample.key:
            if sample is not None:
                sample.close()
            if key in seen:
                result.problems.append(f"sample id {key!r} appears twice")
            seen.add(key)
            result.sample_ids.append(key)
            sample = _SampleCheck(key, layout, result)
            result.num_samples += 1
        sample.member(tar, info, suffix)
    if sample is not None:
        sample.close()


def check_shard(shard: ShardInfo, layout: OutputLayout, hash_bytes: bool = True) -> ShardCheck:
    """Verify one shard against its manifest entry and the format (see the module docstring)."""
    result = ShardCheck(shard.rel_path)
    problems = result.problems
    if not shard.path.is_file():
        problems.append("file is missing")
        return result
    if hash_bytes:
        digest, size = sha256_file(shard.path)
        if size != shard.num_bytes:
            problems.append(f"size {size} bytes, the manifest says {shard.num_bytes}")
        if digest != shard.sha256:
            problems.append(f"sha256 {digest[:16]}... differs from the manifest's {shard.sha256[:16]}...")
    try:
        with tarfile.open(fileobj=open_for_reading(shard.path, 1 << 20), mode="r:") if is_remote_path(shard.path) \
                else tarfile.open(shard.path, mode="r:") as tar:
            _check_members(tar, layout, result)
    except (tarfile.TarError, ValueError, OSError, struct.error) as e:
        problems.append(f"unreadable ({type(e).__name__}: {e})")
        return result
    if result.num_samples != shard.num_samples:
        problems.append(f"holds {result.num_samples} samples, the manifest says {shard.num_samples}")
    if result.num_tokens != shard.num_tokens:
        problems.append(f"holds {result.num_tokens} tokens, the manifest says {shard.num_tokens}")
    if len(problems) > MAX_PROBLEMS_PER_SHARD:
        result.problems = problems[:MAX_PROBLEMS_PER_SHARD] + [
            f"... and {len(problems) - MAX_PROBLEMS_PER_SHARD} more problem(s) in this shard"]
    return result


def check_output(out_dir: str | Path, progress: bool = False) -> list[str]:
    """Every problem of the output, one line each, naming the shard (empty list: the output is intact)."""
    out_dir = as_location(out_dir)
    manifest = read_manifest(out_dir)
    layout = OutputLayout.from_manifest(manifest)
    shards = shards_of(out_dir, manifest)
    problems: list[str] = []
    owner: dict[str, str] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(s.num_bytes for s in shards), desc="check", unit="B", unit_scale=True,
                   file=sys.stderr, dynamic_ncols=True, mininterval=1.0)
    for shard in shards:
        result = check_shard(shard, layout)
        problems += [f"{shard.rel_path}: {p}" for p in result.problems]
        for sid in result.sample_ids:
            if sid in owner and owner[sid] != shard.rel_path:
                problems.append(f"{shard.rel_path}: sample id {sid!r} is also in {owner[sid]}")
            owner.setdefault(sid, shard.rel_path)
        if bar is not None:
            bar.update(shard.num_bytes)
    if bar is not None:
        bar.close()
    paths = [s.rel_path for s in shards]
    for p in sorted({p for p in paths if paths.count(p) > 1}):
        problems.append(f"{p}: listed more than once in the manifest")
    for name, total in (("num_samples", sum(s.num_samples for s in shards)),
                        ("num_tokens", sum(s.num_tokens for s in shards)),
                        ("num_bytes", sum(s.num_bytes for s in shards))):
        if name in manifest and int(manifest[name]) != total:
            problems.append(f"manifest.json: {name} is {manifest[name]}, its shards add up to {total}")
    offered = "num_sample_candidates" if "num_sample_candidates" in manifest else "num_rows"  # older: one a row
    if all(k in manifest for k in (offered, "num_skipped", "num_failed")):
        kept = int(manifest[offered]) - int(manifest["num_skipped"]) - int(manifest["num_failed"])
        if kept != int(manifest["num_samples"]):
            problems.append(f"manifest.json: num_samples is {manifest['num_samples']} but {offered} - num_skipped - "
                            f"num_failed is {kept}")
    return problems


def unlisted_shard_files(out_dir: str | Path) -> list[str]:
    """Files under OUT/shards/ that the manifest does not list (an unfinished or crashed run leaves them)."""
    out_dir = as_location(out_dir)
    listed = {s["path"] for s in read_manifest(out_dir)["shards"]}
    found = [str(p)[len(str(out_dir)):].lstrip("/") for p in (out_dir / "shards").glob("*/*") if p.is_file()]
    return sorted(rel for rel in found if rel not in listed)


# --------------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "dflash-prep inspect") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Show what an extraction output holds; --check verifies "
                                                       "every shard against the manifest.")
    p.add_argument("out", help="extraction output folder (holds manifest.json)")
    p.add_argument("--check", action="store_true", help="re-hash every shard and check counts; exit 1 on a mismatch")
    p.add_argument("--json", action="store_true", help="print the facts (and problems) as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar during --check")
    return p


@one_line_store_errors
def main(argv: list[str] | None = None) -> int:
    """`dflash-prep inspect OUT [--check]`: 0 fine (or an unfinished output's progress), 1 mismatch (shards named),
    2 nothing readable (see the module docstring)."""
    args = build_parser().parse_args(argv)
    try:
        out = as_location(args.out)
    except ValueError as e:  # a URL of an unknown or uninstalled protocol
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not out.is_dir():
        print(f"error: {args.out}: no such folder", file=sys.stderr)
        return 2
    try:
        facts = describe(args.out)
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError) as e:
        try:
            progress = describe_progress(args.out) if not (out / "manifest.json").exists() else None
        except OutputStateError as state_error:
            print(f"error: {state_error}", file=sys.stderr)
            return 2
        if progress is None:
            print(f"error: {e}", file=sys.stderr)
            return 2
        # A run that has not finished (or was interrupted): how far it got, and whether it runs now.
        print(json.dumps(progress, indent=2) if args.json else format_progress(progress))
        if args.check:
            print("error: no manifest yet: --check verifies a finished output", file=sys.stderr)
            return 2
        return 0
    extra = unlisted_shard_files(args.out)
    problems = check_output(args.out, progress=not args.no_progress and not args.json) if args.check else None
    if args.json:
        facts["unlisted_shard_files"] = extra
        if problems is not None:
            facts["check"] = {"ok": not problems, "problems": problems}
        print(json.dumps(facts, indent=2))
    else:
        print(format_description(facts))
        if extra:
            print(f"note: {len(extra)} file(s) under shards/ are not in the manifest (left by an unfinished or "
                  f"interrupted run; readers ignore them): {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        if problems is not None:
            for p in problems:
                print(f"FAIL {p}")
            print(f"check: {'OK' if not problems else 'FAILED'}: {facts['num_shards']} shard(s), "
                  f"{facts['num_samples']:,} samples, {facts['num_tokens']:,} tokens"
                  + (f"; {len(problems)} problem(s)" if problems else " match the manifest"))
            if any(p.startswith(SHARDS_DIR + "/") for p in problems):
                print("to repair: delete the shard files named above and run the extraction's command again (the "
                      "same recipe and --set): it redoes their batches and writes the manifest again (docs/FAULTS.md)")
    if problems:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

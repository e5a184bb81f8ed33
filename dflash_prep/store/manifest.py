"""The output's state on disk: committed shards (from the rank indexes), clean-up, and the final manifest.

`OUT/manifest.json` is written last, atomically, by the main process once every rank has finished. It lists
only committed shards (those with an index line), so a reader that trusts it never sees a partial shard.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from dflash_prep.recipe.location import as_location
from dflash_prep.store.record_store import (  # noqa: F401 - OutputStateError, damaged_state: their home was here
    OutputStateError,
    RecordKind,
    RecordStore,
    damaged_state,
    write_manifest as _write_manifest,
)
from dflash_prep.store.records import SHARDS_DIR, ShardRecord

FORMAT_VERSION = 1
REGENERATED_ROWS_FORMAT = "dflash-prep regenerated rows"  # regen/output.py's FORMAT: another kind of output
MANIFEST_NAME = "manifest.json"
STATE_NAME = "run_state.json"
FINISHED_INPUTS = "finished_inputs"  # run_state.json's key: the inputs as the run that finished the output found them


SHARD_KIND = RecordKind(record_type=ShardRecord, key=lambda r: r.path, files_glob=f"{SHARDS_DIR}/rank-*/*",
                        noun="shard", items=lambda r: r.sample_ids, to_json=ShardRecord.to_json)


def shard_store(out_dir) -> RecordStore:
    """The record store (store/record_store.py) of an extraction output's shards."""
    return RecordStore(out_dir, SHARD_KIND)


def read_committed(out_dir: str | Path) -> list[ShardRecord]:
    """Every committed shard of every rank index, in (index file, line) order (`RecordStore.read_committed`:
    a torn tail ignored, a line copied counted once; OutputStateError when two records claim one shard file or one
    sample). `out_dir`: a local folder or an object-store location (read-only)."""
    return shard_store(as_location(out_dir)).read_committed()


def repair_indexes(out_dir: str | Path) -> list[tuple[str, int]]:
    """`RecordStore.repair_indexes` of the shard indexes (main process, before any rank writes)."""
    return shard_store(Path(out_dir)).repair_indexes()


def read_state_json(path: Path) -> dict:
    """A JSON state file of the output; raises OutputStateError (one line: the file and the way out) when it is
    not valid JSON (truncated by a copy, a full disk, an edit)."""
    try:
        with path.open("rb") as f:  # a Path, or a UPath of an output in an object store
            return json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise damaged_state(path, f"{type(e).__name__}: {e}") from None


def damaged_shards(out_dir: str | Path, committed: list[ShardRecord]) -> dict[str, str]:
    """Committed shards whose file is not what its index record says -> why: missing, another size than the
    record's `num_bytes` (`RecordStore.size_mismatches`), or a first member that is not the record's first sample
    (a file swapped in). Costs one stat and one 512-byte read per shard (no hashing: `inspect --check` re-hashes)."""
    out_dir = Path(out_dir)
    bad = shard_store(out_dir).size_mismatches(committed)
    for record in committed:
        if record.path in bad or not record.sample_ids:
            continue
        try:
            with tarfile.open(out_dir / record.path, "r:") as tar:
                first = tar.next()
            name = first.name if first is not None else ""
        except (tarfile.TarError, OSError):
            name = ""
        if name.split(".", 1)[0] != record.sample_ids[0]:
            bad[record.path] = f"starts with {name!r}, not with sample {record.sample_ids[0]}"
    return bad


def drop_records(out_dir: str | Path, paths: set[str]) -> None:
    """Remove the index lines of the shards `paths` (and those files): their batches are then redone."""
    shard_store(Path(out_dir)).drop(paths)


def uncommitted_files(out_dir: str | Path, committed: list[ShardRecord]) -> list[Path]:
    """`.tmp` files and shard files no index lists (left by a crash)."""
    return shard_store(Path(out_dir)).uncommitted_files(committed)


def remove_uncommitted(out_dir: str | Path, committed: list[ShardRecord]) -> list[Path]:
    """Delete `uncommitted_files`. Returns what was removed."""
    return shard_store(Path(out_dir)).remove_uncommitted(committed)


def next_shard_number(committed: list[ShardRecord], rank_dir_name: str) -> int:
    """The first shard number a rank may use without overwriting committed shards of that rank folder."""
    numbers = [int(Path(r.path).stem.split("-")[1]) for r in committed if Path(r.path).parent.name == rank_dir_name]
    return max(numbers) + 1 if numbers else 0


def build_manifest(records: list[ShardRecord], info: dict) -> dict:
    """The manifest: run facts (`info`) + totals + the shard list (sorted by path)."""
    shards = sorted(records, key=lambda r: r.path)
    sample_ids = [s for r in shards for s in r.sample_ids]
    if len(sample_ids) != len(set(sample_ids)):
        dupes = sorted({s for s in sample_ids if sample_ids.count(s) > 1})[:5]
        raise AssertionError(f"sample ids committed twice: {dupes}")
    failed_ids = [f["sample_id"] for r in shards for f in r.failed]
    if len(failed_ids) != len(set(failed_ids)) or not set(failed_ids).isdisjoint(sample_ids):
        raise AssertionError("a sample is recorded as failed twice, or as both failed and written")
    return {
        "format_version": FORMAT_VERSION,
        **info,
        "num_samples": sum(r.num_samples for r in shards),
        "num_tokens": sum(r.num_tokens for r in shards),
        "num_bytes": sum(r.num_bytes for r in shards),
        "shards": [{"path": r.path, "num_samples": r.num_samples, "num_tokens": r.num_tokens,
                    "num_bytes": r.num_bytes, "sha256": r.sha256} for r in shards],
    }


def write_manifest(out_dir: str | Path, manifest: dict, fence=None) -> Path:
    """OUT/manifest.json, atomically, only while `fence` (locks.OutputFence) says this run holds the output."""
    return _write_manifest(Path(out_dir), MANIFEST_NAME, manifest, fence)


def read_manifest(out_dir: str | Path) -> dict:
    """OUT/manifest.json of a local folder or an object-store URL (recipe/location.py); FileNotFoundError while the
    extraction has not finished, ValueError when it is damaged or of another format version."""
    folder = as_location(out_dir)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        if not (folder / STATE_NAME).is_file():  # a refused start leaves its locks and logs, no run
            raise FileNotFoundError(f"{path} not found: no extraction has begun in {out_dir}")
        raise FileNotFoundError(f"{path} not found: the extraction has not finished (the manifest is written last)")
    try:
        with path.open("rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); re-run the extraction's command: it "
                         f"rewrites the manifest from the committed shards without recomputing them") from None
    if isinstance(manifest, dict) and manifest.get("format") == REGENERATED_ROWS_FORMAT:
        raise ValueError(f"{folder} holds regenerated rows (`dflash-prep regenerate`'s output), not "
                         f"hidden states: extract them first (`dflash-prep extract --set data.path={out_dir}`), "
                         "then read that output")
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(f"{path}: format_version {version} is not supported "
                         f"(this version reads {FORMAT_VERSION})")
    why = manifest_field_error(manifest)
    if why is not None:
        raise ValueError(f"{path} is damaged ({why}); re-run the extraction's command: it rewrites the manifest "
                         f"from the committed shards without recomputing them")
    return manifest


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _shard_entry_error(entry) -> str | None:
    """What is wrong with one entry of a manifest's `shards` (None: nothing): the fields `build_manifest` writes,
    of their types, its path a relative one under shards/."""
    if not isinstance(entry, dict):
        return f"a shard entry is {type(entry).__name__}, not an object"
    rel = entry.get("path")
    if not isinstance(rel, str) or not rel.startswith(f"{SHARDS_DIR}/") or ".." in rel.split("/") or "\\" in rel:
        return f"shard path {rel!r} is not a relative path under {SHARDS_DIR}/"
    bad = [k for k in ("num_samples", "num_tokens", "num_bytes") if not _count(entry.get(k))]
    if bad:
        return f"shard {rel}: {', '.join(bad)} not a count"
    digest = entry.get("sha256")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return f"shard {rel}: sha256 {digest!r} is not a hex digest"
    return None


def manifest_field_error(manifest: dict) -> str | None:
    """What is wrong with the types of the fields readers use in a manifest of this format version (None: nothing):
    the shard list, the totals, the storage dtype, the layer ids and the hidden size. A manifest edited into valid
    JSON of other types is damaged, as one that is not JSON. (Whether the shards add up to the totals is the
    consumers' check, `consume.shard_format.manifest_shard_problems`.)"""
    from dflash_prep.recipe.schema import STORAGE_DTYPES

    shards = manifest.get("shards")
    if not isinstance(shards, list):
        return f"shards is {type(shards).__name__}, not a list"
    for entry in shards:
        why = _shard_entry_error(entry)
        if why is not None:
            return why
    for key in ("num_samples", "num_tokens", "num_bytes"):
        if not _count(manifest.get(key)):
            return f"{key} is {manifest.get(key)!r}, not a count"
    if manifest.get("dtype") not in STORAGE_DTYPES:
        return f"dtype {manifest.get('dtype')!r} is not one of {', '.join(STORAGE_DTYPES)}"
    layer_ids = manifest.get("layer_ids")
    if not isinstance(layer_ids, list) or not all(_count(i) for i in layer_ids):
        return f"layer_ids {layer_ids!r} is not a list of layer ids"
    if not _count(manifest.get("hidden_size")) or not manifest["hidden_size"]:
        return f"hidden_size {manifest.get('hidden_size')!r} is not a positive count"
    return None

"""The output's state on disk: committed shards (from the rank indexes), clean-up, and the final manifest.

`OUT/manifest.json` is written last, atomically, by the main process once every rank has finished. It lists
only committed shards (those with an index line), so a reader that trusts it never sees a partial shard.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

from dflash_prep.io import atomic_write_json, atomic_write_lines
from dflash_prep.recipe.location import as_location, read_whole
from dflash_prep.store.records import INDEX_DIR, SHARDS_DIR, SUPERSEDED_NAME, ShardRecord

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
STATE_NAME = "run_state.json"
FINISHED_INPUTS = "finished_inputs"  # run_state.json's key: the inputs as the run that finished the output found them


def read_committed(out_dir: str | Path) -> list[ShardRecord]:
    """Every committed shard of every rank index, in (index file, line) order.

    A torn last line (a crash while appending) is ignored: its shard is then not committed and is redone. The
    same record listed twice (a line copied) counts once. Raises OutputStateError when two records claim the same
    shard file or the same sample (an index edited or merged by hand): a resume would write those samples twice.
    """
    records: dict[str, ShardRecord] = {}
    index_dir = as_location(out_dir) / INDEX_DIR  # a local folder, or an output in an object store (read-only)
    for index in sorted(index_dir.glob("rank-*.jsonl"), key=str):
        for line in read_whole(index).decode().splitlines():  # an object being rewritten: one version of it
            line = line.strip()
            if not line:
                continue
            try:
                record = ShardRecord(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                break  # torn tail
            if records.setdefault(record.path, record) != record:
                raise _damaged_index(out_dir, f"{record.path} is listed twice, differently")
    sample_ids = [s for r in records.values() for s in r.sample_ids]
    if len(sample_ids) != len(set(sample_ids)):
        twice = sorted({s for s in sample_ids if sample_ids.count(s) > 1})[:5]
        raise _damaged_index(out_dir, f"samples {twice} are listed in two shards")
    return list(records.values())


def _damaged_index(out_dir, why: str) -> "OutputStateError":
    return damaged_state(Path(out_dir) / INDEX_DIR, why)


def damaged_state(path: Path, why: str) -> "OutputStateError":
    """The one-line error (exit code 2) for a state file or folder of the output that cannot be resumed from."""
    return OutputStateError(f"{path} is damaged ({why}); the output cannot be resumed from it: start afresh with "
                            f"--set output.overwrite=true, or use another output.dir")


def repair_indexes(out_dir: str | Path) -> list[tuple[str, int]]:
    """Cut each rank index back to its last complete line before the first unreadable one (a crash or a full disk
    can leave a torn tail; an edit can leave a bad line anywhere).

    Without this a resumed run would append after the torn bytes, and every line it commits would be unreadable
    (read_committed stops at the first bad line). Main process only, before any rank writes. Returns (file, number
    of readable records cut after the bad line: their shards are redone; 0 for a torn tail) per file repaired.
    """
    repaired = []
    for index in sorted((Path(out_dir) / INDEX_DIR).glob("rank-*.jsonl")):
        data = index.read_bytes()
        lines = data.splitlines(keepends=True)
        good, cut_at = 0, len(lines)
        for i, line in enumerate(lines):
            if not line.endswith(b"\n") or (line.strip() and not _is_record(line)):
                cut_at = i
                break
            good += len(line)
        if good != len(data):
            with open(index, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
            repaired.append((str(index), sum(1 for line in lines[cut_at + 1:] if _is_record(line))))
    return repaired


def _is_record(line: bytes) -> bool:
    try:
        ShardRecord(**json.loads(line))
        return True
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        return False


class OutputStateError(RuntimeError):
    """A state file of the output (plan.json, run_state.json) cannot be read: damaged or truncated."""


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
    record's `num_bytes`, or a first member that is not the record's first sample (a file swapped in). Costs one
    stat and one 512-byte read per shard (no hashing: `inspect --check` re-hashes)."""
    out_dir = Path(out_dir)
    bad = {}
    for record in committed:
        path = out_dir / record.path
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            bad[record.path] = "missing"
            continue
        if size != record.num_bytes:
            bad[record.path] = f"{size} bytes, its index record says {record.num_bytes}"
            continue
        if record.sample_ids:
            try:
                with tarfile.open(path, "r:") as tar:
                    first = tar.next()
                name = first.name if first is not None else ""
            except (tarfile.TarError, OSError):
                name = ""
            if name.split(".", 1)[0] != record.sample_ids[0]:
                bad[record.path] = f"starts with {name!r}, not with sample {record.sample_ids[0]}"
    return bad


def drop_records(out_dir: str | Path, paths: set[str]) -> None:
    """Remove the index lines of the shards `paths` (and those files): their batches are then not committed and
    a run redoes them. Each rank index is rewritten atomically. The dropped lines are appended to
    `index/superseded.jsonl` first (a follower's record of where their samples went). Main process only, no rank
    writing."""
    out_dir = Path(out_dir)
    indexes = {index: index.read_bytes().splitlines(keepends=True)
               for index in sorted((out_dir / INDEX_DIR).glob("rank-*.jsonl"))}
    dropped = [line for lines in indexes.values() for line in lines
               if line.strip() and json.loads(line).get("path") in paths]
    if dropped:  # first, so a follower never sees the redone shard without the record it replaces
        superseded = out_dir / INDEX_DIR / SUPERSEDED_NAME
        before = superseded.read_bytes().splitlines(keepends=True) if superseded.exists() else []
        atomic_write_lines(superseded, before + [line if line.endswith(b"\n") else line + b"\n" for line in dropped])
    for index, lines in indexes.items():
        kept = [line for line in lines if not line.strip() or json.loads(line).get("path") not in paths]
        if len(kept) != len(lines):
            atomic_write_lines(index, kept)
    for rel in paths:
        (out_dir / rel).unlink(missing_ok=True)


def uncommitted_files(out_dir: str | Path, committed: list[ShardRecord]) -> list[Path]:
    """`.tmp` files and shard files no index lists (left by a crash)."""
    out_dir = Path(out_dir)
    keep = {out_dir / r.path for r in committed}
    return [path for path in sorted((out_dir / SHARDS_DIR).glob("rank-*/*")) if path not in keep]


def remove_uncommitted(out_dir: str | Path, committed: list[ShardRecord]) -> list[Path]:
    """Delete `uncommitted_files`. Returns what was removed."""
    removed = uncommitted_files(out_dir, committed)
    for path in removed:
        path.unlink()
    return removed


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


def write_manifest(out_dir: str | Path, manifest: dict) -> Path:
    path = Path(out_dir) / MANIFEST_NAME
    atomic_write_json(path, manifest)
    return path


def read_manifest(out_dir: str | Path) -> dict:
    """OUT/manifest.json of a local folder or an object-store URL (recipe/location.py); FileNotFoundError while the
    extraction has not finished, ValueError when it is damaged or of another format version."""
    path = as_location(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the extraction has not finished (the manifest is written last)")
    try:
        with path.open("rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is damaged ({type(e).__name__}: {e}); re-run the extraction's command: it "
                         f"rewrites the manifest from the committed shards without recomputing them") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise ValueError(f"{path}: format_version {version} is not supported "
                         f"(this version reads {FORMAT_VERSION})")
    return manifest

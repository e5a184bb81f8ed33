"""The regeneration's output folder: atomic shards, the rank indexes that commit them, resume, job identity, and the
files that make the folder a dataset (written last).

Layout (`regenerate.output_dir`):

    data/shard-000000.arrow   the rows of chunk 0 (source rows 0..rows_per_shard-1) that were answered, in source
                              order; Arrow IPC stream files, as `datasets.save_to_disk` writes them
    data/shard-000000-001.arrow  part 1 of chunk 0: a chunk still open after `commit_seconds` is committed in parts
                              (part 0 keeps the plain name), each holding the rows answered since the part before
    index/rank-00000.jsonl    one line per committed part (its shard, its rows, its skipped rows, its counts)
    run_state.json            the job's identity and its runs; skipped.jsonl, summary.json, recipe.resolved.yaml
    manifest.json             the shards, counts and provenance (written at the end)
    dataset_info.json, state.json   the `datasets.load_from_disk` files, written last

Why Arrow and the `save_to_disk` layout, not JSON Lines or parquet: a folder given as `data.path` is read by
data/rows.py whole, every .json/.jsonl file in it (manifest, index, summary) as rows, and parquet beside JSON is
refused as mixed formats; a `save_to_disk` folder is read through `datasets.load_from_disk`, which reads exactly the
shards its `state.json` lists. So the finished folder is both `data.path` of an extraction and
`datasets.load_from_disk(folder)` for anyone else (`.to_json("rows.jsonl")` gives JSON Lines); an unfinished one has
no `state.json` and is refused as data.

Guarantees:
- a shard is committed by the record store every stage shares (store/record_store.py): written to `NAME.tmp`,
  fsynced, renamed, and only then committed by its index line (appended, fsynced); a shard no index line lists, a
  `.tmp` and a torn last index line are what a kill leaves, and the next run removes them (`prepare`), so each
  chunk is committed once or redone whole; what is regeneration's own here is the Arrow bytes, their features and
  the files that make the folder a dataset;
- the chunks are fixed by the data and `rows_per_shard` (frozen by the first run), not by the number of processes:
  a resume on any number of processes runs exactly the chunks whose rows the index lines do not all list, and of
  those only the rows no line lists (a part lists its rows and its skipped rows by source position; the next part of
  a chunk is numbered after its last committed one). A chunk is done when its parts list every row of it once;
- rows skipped for a server error by a version that did not confirm such rejections (`rejections_confirmed` false,
  a detail starting "HTTP 5") make their part uncommitted again at `prepare`: a resume asks those rows again;
- an output made with another identity (model, served model name, sampling parameters, template keyword arguments,
  turns, ...) is refused with what changed (RegenMismatchError), unless `regenerate.overwrite`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dflash_prep import __version__
from dflash_prep.io import atomic_write_json, atomic_write_jsonl, fsync_file
from dflash_prep.recipe.fingerprints import describe_files_change, describe_weights_change, portable_location
from dflash_prep.store.locks import LOCKS_DIR, LeaseLostError
from dflash_prep.store.manifest import REGENERATED_ROWS_FORMAT, read_state_json
from dflash_prep.store.record_store import (
    INDEX_DIR,  # noqa: F401 - the regeneration command names the index folder through this module
    TMP_SUFFIX,
    OutputStateError,
    RecordKind,
    RecordStore,
    write_manifest,
)

log = logging.getLogger("dflash_prep")

FORMAT = REGENERATED_ROWS_FORMAT
FORMAT_VERSION = 2  # 2: messages keep their `weight`, generated turns their token ids
DATA_DIR = "data"
STATE_NAME, MANIFEST_NAME, SUMMARY_NAME, SKIPPED_NAME = "run_state.json", "manifest.json", "summary.json", \
    "skipped.jsonl"
RECIPE_NAME = "recipe.resolved.yaml"
DATASET_FILES = ("dataset_info.json", "state.json")  # datasets' save_to_disk files: the folder is a dataset
_MARKERS = (STATE_NAME, MANIFEST_NAME)


class RegenMismatchError(RuntimeError):
    """The output folder holds a regeneration of another job (exit code 2)."""


def features():
    """The rows' `datasets.Features`: messages with every OpenAI key (null where a message has none), `tools` as a
    JSON string, the row's own id and position, and `regen` (provenance)."""
    from datasets import Features, List, Value

    call = {"id": Value("string"), "type": Value("string"),
            "function": {"name": Value("string"), "arguments": Value("string")}}
    message = {"role": Value("string"), "content": Value("string"), "reasoning_content": Value("string"),
               "tool_calls": List(call), "tool_call_id": Value("string"), "name": Value("string"),
               "weight": Value("int64")}
    turn = {"message_index": Value("int64"), "finish_reason": Value("string"), "prompt_tokens": Value("int64"),
            "completion_tokens": Value("int64"), "seed": Value("int64"),
            "prompt_token_ids": List(Value("int64")), "completion_token_ids": List(Value("int64"))}
    regen = {"engine": Value("string"), "model": Value("string"), "sampling": Value("string"),
             "max_tokens": Value("int64"), "turns": List(turn), "ended_early": Value("string")}
    return Features({"id": Value("string"), "source_row": Value("int64"), "messages": List(message),
                     "tools": Value("string"), "regen": regen})


def shard_path(chunk: int, part: int = 0) -> str:
    return f"{DATA_DIR}/shard-{chunk:06d}.arrow" if part == 0 else f"{DATA_DIR}/shard-{chunk:06d}-{part:03d}.arrow"


def chunk_rows(chunk: int, rows_per_shard: int, num_rows: int) -> range:
    """The source row positions of `chunk`."""
    return range(chunk * rows_per_shard, min((chunk + 1) * rows_per_shard, num_rows))


@dataclass
class ChunkRecord:
    """One committed part of a chunk (an index line): its shard (written even when none of its rows was answered),
    the source positions it accounts for (`rows` + `skipped`) and its counts (of those rows' requests)."""

    chunk: int
    path: str
    num_rows: int  # rows written
    rows: list[int]  # their source positions
    skipped: list[dict]  # {source_row, source_id, reason, detail}
    num_bytes: int = 0
    sha256: str = ""
    num_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: dict = field(default_factory=dict)
    tool_calls: dict = field(default_factory=dict)
    ended_early: dict = field(default_factory=dict)
    rank: int = 0
    part: int = 0  # 0 for a chunk committed whole (lines written before parts existed have none)
    rejections_confirmed: bool = False  # its HTTP 5xx rejections were confirmed by the server's other answers
    fence: int | None = None  # the committing run's fencing token (store/locks.py; None: older versions)


def positions_of(record: ChunkRecord) -> set[int]:
    """The source positions a part accounts for: its written rows and its skipped rows."""
    return set(record.rows) | {s["source_row"] for s in record.skipped}


def parts_by_chunk(records: dict) -> dict[int, list[ChunkRecord]]:
    """(chunk, part) -> record  =>  chunk -> its parts in part order."""
    out: dict[int, list[ChunkRecord]] = {}
    for key in sorted(records):
        out.setdefault(key[0], []).append(records[key])
    return out


def done_chunks(records: dict, rows_per_shard: int, num_rows: int) -> set[int]:
    """The chunks whose parts account for every one of their rows."""
    return {c for c, parts in parts_by_chunk(records).items()
            if set().union(*map(positions_of, parts)) >= set(chunk_rows(c, rows_per_shard, num_rows))}


def _unconfirmed_server_error(record: ChunkRecord) -> bool:
    """A part written before server-error rejections were confirmed, with a row skipped for one (its server may
    have been failing every request then: the row is asked again)."""
    return not record.rejections_confirmed and any(
        str(s.get("detail") or "").startswith("HTTP 5") for s in record.skipped)


# ------------------------------------------------------------------------------------------------ identity, claim
def _differences(previous: dict, current: dict, path: tuple = ()) -> list[tuple]:
    """The key paths (tuples: a key may hold dots, e.g. a file name) whose values differ; keys one side has not
    computed (None) are not compared; `data_rows`, `sampling`, `weights` and `input_files` are compared whole."""
    diffs = []
    for key in sorted(set(previous) | set(current)):
        a, b = previous.get(key), current.get(key)
        if a is None or b is None:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key not in ("data_rows", "sampling", "weights",
                                                                       "input_files"):
            diffs += _differences(a, b, (*path, key))
        elif a != b and not (key == "weights" and describe_weights_change(a, b) is None):
            diffs.append((*path, key))
    return diffs


def identity_diffs(previous: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ; keys one side has not computed (None) are not compared."""
    return [prefix + ".".join(p) for p in _differences(previous, current)]


def portable_identity(identity: dict) -> dict:
    """`identity` with its paths as they read from any install and any place (recipe/fingerprints.py
    `portable_location`: the package's own assets package-relative, a local path by its last component; the
    content is in `weights`, `input_files` and `data_rows`); applied to a stored identity too."""
    out = dict(identity)
    for section in ("model", "data"):
        if isinstance(out.get(section), dict):
            out[section] = {k: portable_location(v) if k in ("name_or_path", "config", "tokenizer", "path") else v
                            for k, v in out[section].items()}
    return out


def _describe(key: tuple, a, b) -> str:
    name = ".".join(key)
    if key[-1] == "weights":
        return f"{name}: model weights differ ({describe_weights_change(a, b)})"
    if key[-1] == "input_files":
        return f"{name}: {describe_files_change(a, b)}"
    return f"{name}: output has {a!r}, this run has {b!r}"


def check_identity(out_dir: Path, identity: dict) -> None:
    """RegenMismatchError (one line, naming what changed and its values) when `out_dir` holds another job's rows."""
    path = Path(out_dir) / STATE_NAME
    if not path.exists():
        return
    previous = portable_identity(read_state_json(path).get("identity") or {})
    identity = portable_identity(identity)
    diffs = _differences(previous, identity)
    if diffs:
        def value(d, key):
            for part in key:
                d = d.get(part) if isinstance(d, dict) else None
            return d
        details = "; ".join(_describe(k, value(previous, k), value(identity, k)) for k in diffs)
        raise RegenMismatchError(f"{out_dir} holds a regeneration of a different job ({details}). Use another "
                                 f"regenerate.output_dir, or --set regenerate.overwrite=true to start afresh.")


def open_output(out_dir: Path, identity: dict, overwrite: bool) -> None:
    """Main process, holding the run lock: start afresh (`overwrite`; refused on a folder that is not a
    regeneration output) or check that the output is this job's."""
    out_dir = Path(out_dir)
    if overwrite and out_dir.is_dir():
        names = {p.name for p in out_dir.iterdir()} - {"logs", LOCKS_DIR}
        if names and not names & set(_MARKERS):
            raise RegenMismatchError(f"regenerate.overwrite: {out_dir} is not a regeneration output (it holds "
                                     f"{', '.join(sorted(names)[:5])}): refusing to delete its files; set "
                                     f"regenerate.output_dir to a new or empty folder")
        for child in out_dir.iterdir():
            if child.name not in ("logs", LOCKS_DIR):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    check_identity(out_dir, identity)


def stored_rows_per_shard(out_dir: Path, wanted: int) -> int:
    """The chunk size the output was started with (a resume keeps its chunks), else `wanted`."""
    path = Path(out_dir) / STATE_NAME
    if path.exists():
        stored = read_state_json(path).get("rows_per_shard")
        if isinstance(stored, int) and stored >= 1:
            if stored != wanted:
                log.warning("regenerate.rows_per_shard: the output was started with %d; resuming with it", stored)
            return stored
    return wanted


def record_run(out_dir: Path, identity: dict, rows_per_shard: int, recipe_yaml: str) -> None:
    """Save the identity, the chunk size, this run's start and the resolved recipe (main process)."""
    path = Path(out_dir) / STATE_NAME
    runs = read_state_json(path).get("runs", []) if path.exists() else []
    runs.append({"started_at": time.time(), "dflash_prep_version": __version__})
    (Path(out_dir) / RECIPE_NAME).write_text(recipe_yaml)
    atomic_write_json(path, {"format": FORMAT, "identity": identity, "rows_per_shard": rows_per_shard, "runs": runs})


# ------------------------------------------------------------------------------------------------ index, repair
CHUNK_KIND = RecordKind(record_type=ChunkRecord, key=lambda r: (r.chunk, r.part), files_glob=f"{DATA_DIR}/*",
                        noun="chunk part", items=lambda r: sorted(positions_of(r)),  # a row in one part only
                        to_json=lambda r: {k: v for k, v in asdict(r).items() if k != "fence" or v is not None})


def chunk_store(out_dir: Path) -> RecordStore:
    """The record store (store/record_store.py: the commit, the index, the repair) of the regenerated chunks."""
    return RecordStore(Path(out_dir), CHUNK_KIND)


def read_committed(out_dir: Path) -> dict[tuple[int, int], ChunkRecord]:
    """(chunk, part) -> its record, over every rank's index (`RecordStore.read_committed`: a torn last line
    ignored, its part redone; the same line twice counted once; two different records of one part:
    OutputStateError)."""
    return {(r.chunk, r.part): r for r in chunk_store(out_dir).read_committed()}


UNCONFIRMED = "holds rows skipped for a server error (HTTP 5xx) that no healthy answer confirmed"


def prepare(out_dir: Path) -> dict[tuple[int, int], ChunkRecord]:
    """Main process, no rank writing (`RecordStore.prepare`): cut torn index tails, drop committed parts whose
    shard is missing, has another size or another sha256 (`digest_mismatches`) and parts holding unconfirmed
    server-error skips (their rows are redone), remove shards and `.tmp` files no index lists. -> the committed
    parts, (chunk, part) -> record."""
    store = chunk_store(out_dir)

    def check(committed: list) -> dict[str, str]:
        bad = {**{r.path: UNCONFIRMED for r in committed if _unconfirmed_server_error(r)},
               **store.size_mismatches(committed)}
        return {**bad, **digest_mismatches(out_dir, [r for r in committed if r.path not in bad])}

    found = store.prepare(check=check)
    for index, _ in found.repaired:
        log.warning("regenerate: %s ended in a torn or unreadable line: cut back to its last complete one", index)
    damaged = {p: why for p, why in found.damaged.items() if why != UNCONFIRMED}
    if damaged:
        log.warning("regenerate: %d committed shard(s) missing, of another size or altered (e.g. %s: %s): redone",
                    len(damaged), min(damaged), damaged[min(damaged)])
    if len(damaged) < len(found.damaged):
        log.warning("regenerate: %d committed part(s) %s: their rows are asked again",
                    len(found.damaged) - len(damaged), UNCONFIRMED)
    if found.superseded:
        log.warning("regenerate: %d chunk part(s) committed by a run that had lost the output (frozen past its "
                    "lease) were also committed by the run that took over: its records kept", len(found.superseded))
    if found.removed:
        log.info("regenerate: removed %d uncommitted file(s) left by an interrupted run", len(found.removed))
    return {(r.chunk, r.part): r for r in found.committed}


def digest_mismatches(out_dir: Path, committed: list) -> dict[str, str]:
    """Committed parts whose shard's sha256 is not their record's -> why (a part of an older version without one
    is not read). Every committed byte is read: answered text, a few GB for a million rows, seconds against the
    hours that asked for it, so a shard altered in place at the same size is redone, never built into the dataset."""
    bad = {}
    for record in committed:
        if not record.sha256:
            continue
        digest = hashlib.sha256()
        with open(Path(out_dir) / record.path, "rb") as f:
            for block in iter(lambda: f.read(8 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != record.sha256:
            bad[record.path] = f"sha256 {digest.hexdigest()[:12]}..., its index record says {record.sha256[:12]}..."
    return bad


class ChunkCommitter:
    """One rank's writer: `commit(chunk, rows, skipped, counts, part)` writes the part's Arrow shard to `.tmp` and
    fsyncs it; the record store renames it (never over a file another run put there) and appends its index line
    (fsynced), while `fence` (locks.OutputFence) says this run holds the output: the part is committed there."""

    def __init__(self, out_dir: Path, rank: int, faults=None, fence=None):
        self.out_dir, self.rank, self.faults, self.fence = Path(out_dir), rank, faults, fence
        (self.out_dir / DATA_DIR).mkdir(parents=True, exist_ok=True)
        self.appender = chunk_store(self.out_dir).appender(rank)
        self.index = self.appender.index_path
        self.schema = features().arrow_schema
        self.num_committed = 0

    def commit(self, chunk: int, rows: list[dict], skipped: list[dict], counts: dict, part: int = 0) -> ChunkRecord:
        """rows: output rows (conversation.Conversation.result), any order; skipped: {source_row, source_id,
        reason, detail}; counts: num_requests, prompt_tokens, completion_tokens, finish_reasons, tool_calls,
        ended_early; part: 0, 1, ... for the parts of a chunk committed by time."""
        rows = sorted(rows, key=lambda r: r["source_row"])
        path = shard_path(chunk, part)  # written even without rows: datasets loads a folder of empty shards
        final = self.out_dir / path
        tmp = final.with_name(f"{final.name}.{os.getpid()}{TMP_SUFFIX}")  # two runs never share a .tmp
        size, digest = self._write_shard(tmp, rows)
        record = ChunkRecord(chunk=chunk, path=path, num_rows=len(rows), rows=[r["source_row"] for r in rows],
                             skipped=sorted(skipped, key=lambda s: s["source_row"]), num_bytes=size, sha256=digest,
                             rank=self.rank, part=part, rejections_confirmed=True, **counts)
        try:
            self.appender.commit(tmp, final, record, self.fence, replace=False)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise LeaseLostError(f"{final}: another run committed chunk {chunk} part {part} while this one was "
                                 f"writing it (this run lost the output); it commits nothing more") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.num_committed += 1
        return record

    def _write_shard(self, tmp: Path, rows: list[dict]) -> tuple[int, str]:
        """The rows as an Arrow IPC stream file at `tmp`, fsynced. -> (its size in bytes, its sha256)."""
        import pyarrow as pa

        table = pa.Table.from_pylist(rows, schema=self.schema)
        with pa.OSFile(str(tmp), "wb") as sink:
            with pa.ipc.new_stream(sink, self.schema) as writer:
                writer.write_table(table)
        digest = hashlib.sha256()
        with open(tmp, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        fsync_file(tmp)
        return tmp.stat().st_size, digest.hexdigest()


# ------------------------------------------------------------------------------------------------ the end
def is_finished(out_dir: Path) -> bool:
    """Whether the folder is a finished regeneration (its last file, state.json, reads back)."""
    try:
        read_state_json(Path(out_dir) / DATASET_FILES[1])
        return (Path(out_dir) / MANIFEST_NAME).is_file()
    except (OSError, OutputStateError):
        return False


def write_dataset_files(out_dir: Path, records: list[ChunkRecord], manifest: dict, skipped: list[dict],
                        summary: dict, fence=None) -> None:
    """skipped.jsonl, summary.json, manifest.json, then datasets' dataset_info.json and, last, state.json (listing
    the shards in chunk and part order: the rows in source order, except that the parts of a chunk committed by
    time each hold the rows answered in their span). Main process, every chunk committed; only while `fence` says
    this run holds the output (checked before the manifest and before state.json)."""
    import datasets

    out_dir = Path(out_dir)
    atomic_write_jsonl(out_dir / SKIPPED_NAME, skipped)
    atomic_write_json(out_dir / SUMMARY_NAME, summary)
    write_manifest(out_dir, MANIFEST_NAME, manifest, fence)
    info = asdict(datasets.DatasetInfo(description="dflash-prep regenerated rows", features=features()))
    atomic_write_json(out_dir / DATASET_FILES[0], {k: info[k] for k in sorted(info)})
    shards = [r.path for r in sorted(records, key=lambda r: (r.chunk, r.part))]
    fingerprint = hashlib.sha256(json.dumps([r.sha256 for r in records]).encode()).hexdigest()[:16]
    if fence is not None:
        fence.check()
    atomic_write_json(out_dir / DATASET_FILES[1], {
        "_data_files": [{"filename": s} for s in shards], "_fingerprint": fingerprint, "_format_columns": None,
        "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": "train"})


def remove_dataset_files(out_dir: Path) -> None:
    """A run with work to do: the folder stops being a finished dataset until its end writes them again."""
    for name in reversed(DATASET_FILES):
        (Path(out_dir) / name).unlink(missing_ok=True)

"""One record store for every stage's output: how a file is committed, indexed, repaired and read back, whatever a
record holds (an extraction's webdataset shard, a regeneration's Arrow chunk).

Layout (relative to the output folder):

    <files>                       the committed files (e.g. shards/rank-00000/shard-000003-R.tar, data/shard-000003.arrow)
    index/rank-RRRRR.jsonl        one JSON line per committed file: its record, appended after the file's rename

The commit, for every kind of record:
- the file is written to `NAME.tmp`, flushed and fsynced by its writer, then `IndexAppender.commit` renames it to
  `NAME`, fsyncs the folder, and appends the record's line to the rank index (one write, fsynced; the folder
  fsynced when the index is new). A file is committed when, and only when, its line is in an index;
- the appends of one rank index are serialized (a lock shared by its writers): each line is whole;
- an append that fails takes back what it wrote (the line's bytes and the renamed file, best effort).

What a kill can leave, and what the next run's `RecordStore.prepare` (main process, no rank writing) does with it:
a torn last index line (cut back to the last complete line; an unreadable line anywhere cuts the index there),
a committed record whose file is missing or of another size (its line dropped, its work redone), and files no
index lists or `.tmp` files (removed). `read_committed` reads the committed set: a torn tail is ignored, the same
line twice counts once.

Why our own code and not a library's: the index is the format readers (`inspect`, the follow-mode reader, trainers)
already read, a webdataset/Arrow file is committed by one rename, and no library offers an append-only index
repaired this way; the code is one screen per step.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_prep.io import atomic_write_json, atomic_write_lines, fsync_dir

INDEX_DIR = "index"
INDEX_GLOB = "rank-*.jsonl"
TMP_SUFFIX = ".tmp"


def index_name(rank: int) -> str:
    """A rank index's file name: `rank-00003.jsonl`."""
    return f"rank-{rank:05d}.jsonl"


class OutputStateError(RuntimeError):
    """A state file or folder of the output (an index, plan.json, run_state.json) cannot be resumed from (exit
    code 2)."""


def damaged_state(path: Path, why: str) -> OutputStateError:
    """The one-line error (exit code 2) for a state file or folder of the output that cannot be resumed from."""
    return OutputStateError(f"{path} is damaged ({why}); the output cannot be resumed from it: start afresh with "
                            f"--set output.overwrite=true, or use another output.dir")


@dataclass(frozen=True)
class RecordKind:
    """What the records of one kind of output hold.

    `record_type`: a dataclass built from an index line's JSON object (`record_type(**obj)`), with at least `path`
    (the file, relative to the output) and `num_bytes` (its size). `key`: what a record commits (a shard's path, a
    chunk's number): two different records of one key are a damaged index. `items`: what a record holds that no
    other record may hold (sample ids), or None. `files_glob`: where the committed files and their leftovers lie,
    relative to the output. `noun`: the record's name in messages."""

    record_type: type
    key: Callable[[Any], Hashable]
    files_glob: str
    noun: str
    items: Callable[[Any], list] | None = None
    to_json: Callable[[Any], dict] = field(default=asdict)

    def parse(self, line: bytes):
        """The record of one index line, or None when it does not read as one (torn, damaged, edited)."""
        try:
            obj = json.loads(line)
            return self.record_type(**obj) if isinstance(obj, dict) else None
        except (ValueError, TypeError, UnicodeDecodeError):  # json.JSONDecodeError is a ValueError
            return None

    def line(self, record) -> bytes:
        return (json.dumps(self.to_json(record)) + "\n").encode()


def _read_bytes(path) -> bytes:
    """A file's bytes; an object of a store in one GET (recipe/location.py: one version of an object rewritten)."""
    from dflash_prep.recipe.location import read_whole

    return read_whole(path)


class RecordStore:
    """The committed records of one output folder (`out_dir`: a local folder; `read_committed` also takes an
    object-store location from recipe/location.py's `as_location`, read-only)."""

    def __init__(self, out_dir, kind: RecordKind):
        from dflash_prep.recipe.location import as_location

        self.out_dir = as_location(out_dir) if isinstance(out_dir, str) else out_dir
        self.kind = kind

    @property
    def index_dir(self):
        return self.out_dir / INDEX_DIR

    def index_paths(self) -> list:
        return sorted(self.index_dir.glob(INDEX_GLOB), key=str)

    # -- reading -----------------------------------------------------------------------------------------------
    def read_committed(self) -> list:
        """Every committed record of every rank index, in (index file, line) order. A torn or unreadable line ends
        its file (what follows is not committed); the same record twice counts once. OutputStateError when two
        different records name one key, or two records hold one item (an index edited or merged by hand)."""
        records: dict[Hashable, Any] = {}
        for index in self.index_paths():
            for line in _read_bytes(index).splitlines():
                if not line.strip():
                    continue
                record = self.kind.parse(line)
                if record is None:
                    break  # torn tail
                key = self.kind.key(record)
                if records.setdefault(key, record) != record:
                    raise damaged_state(self.index_dir, f"{self.kind.noun} {key} is listed twice, differently")
        if self.kind.items is not None:
            items = [s for r in records.values() for s in self.kind.items(r)]
            if len(items) != len(set(items)):
                twice = sorted({s for s in items if items.count(s) > 1})[:5]
                raise damaged_state(self.index_dir, f"samples {twice} are listed in two {self.kind.noun}s")
        return list(records.values())

    # -- repair ------------------------------------------------------------------------------------------------
    def repair_indexes(self) -> list[tuple[str, int]]:
        """Cut each rank index back to its last complete line before the first unreadable one (a crash or a full
        disk leaves a torn tail; an edit can leave a bad line anywhere). Without this a resumed run would append
        after the torn bytes and every line it commits would be unreadable. Returns (file, number of readable
        records cut after the bad line: redone; 0 for a torn tail) per file repaired."""
        repaired = []
        for index in self.index_paths():
            data = index.read_bytes()
            lines = data.splitlines(keepends=True)
            good, cut_at = 0, len(lines)
            for i, line in enumerate(lines):
                if not line.endswith(b"\n") or (line.strip() and self.kind.parse(line) is None):
                    cut_at = i
                    break
                good += len(line)
            if good != len(data):
                with open(index, "r+b") as f:
                    f.truncate(good)
                    f.flush()
                    os.fsync(f.fileno())
                cut = sum(1 for line in lines[cut_at + 1:] if self.kind.parse(line) is not None)
                repaired.append((str(index), cut))
        return repaired

    def size_mismatches(self, committed: list) -> dict[str, str]:
        """Committed records whose file is missing or of another size than the record's `num_bytes` -> why."""
        bad = {}
        for record in committed:
            try:
                size = (self.out_dir / record.path).stat().st_size
            except FileNotFoundError:
                bad[record.path] = "missing"
                continue
            if size != record.num_bytes:
                bad[record.path] = f"{size} bytes, its index record says {record.num_bytes}"
        return bad

    def drop(self, paths: set[str]) -> None:
        """Remove the index lines of the records of the files `paths`, and those files: their work is then not
        committed and a run redoes it. Each rank index is rewritten atomically. Main process, no rank writing."""
        for index in self.index_paths():
            lines = index.read_bytes().splitlines(keepends=True)
            kept = [line for line in lines
                    if line.strip() and getattr(self.kind.parse(line), "path", None) not in paths]
            if len(kept) != len(lines):
                atomic_write_lines(index, kept)
        for rel in paths:
            (self.out_dir / rel).unlink(missing_ok=True)

    def uncommitted_files(self, committed: list) -> list[Path]:
        """`.tmp` files and files no index lists (left by a crash)."""
        keep = {self.out_dir / r.path for r in committed}
        return [p for p in sorted(self.out_dir.glob(self.kind.files_glob)) if p.is_file() and p not in keep]

    def remove_uncommitted(self, committed: list) -> list[Path]:
        """Delete `uncommitted_files`. Returns what was removed."""
        removed = self.uncommitted_files(committed)
        for path in removed:
            path.unlink()
        return removed

    def prepare(self, check: Callable[[list], dict[str, str]] | None = None) -> "Prepared":
        """Main process, no rank writing: repair the indexes, drop committed records whose file is damaged
        (`size_mismatches`, or `check(committed)` -> {path: why} when given), remove uncommitted files. -> what it
        found and did, and the committed records left."""
        repaired = self.repair_indexes()
        committed = self.read_committed()
        damaged = check(committed) if check is not None else self.size_mismatches(committed)
        if damaged:
            self.drop(set(damaged))
            committed = self.read_committed()
        removed = self.remove_uncommitted(committed)
        return Prepared(committed=committed, repaired=repaired, damaged=damaged, removed=removed)

    # -- writing -----------------------------------------------------------------------------------------------
    def appender(self, rank: int, lock: threading.Lock | None = None) -> "IndexAppender":
        """The committer of rank `rank`'s files into `index/rank-RRRRR.jsonl` (writers of one rank share `lock`)."""
        return IndexAppender(self.index_dir / index_name(rank), self.kind, lock)


@dataclass
class Prepared:
    """What `RecordStore.prepare` found: the committed records left, the indexes cut ((file, records cut)), the
    records dropped ({path: why}) and the files removed."""

    committed: list
    repaired: list[tuple[str, int]]
    damaged: dict[str, str]
    removed: list[Path]


class IndexAppender:
    """Commits one rank's files: `commit(tmp, final, record)` renames the fsynced `tmp` to `final` and appends the
    record's line to the rank index (module docstring)."""

    def __init__(self, index_path: Path, kind: RecordKind, lock: threading.Lock | None = None):
        self.index_path, self.kind = Path(index_path), kind
        self.lock = lock if lock is not None else threading.Lock()
        self.index_path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def place(tmp: Path, final: Path) -> None:
        """Rename the written and fsynced `tmp` to `final` and make the rename durable."""
        os.replace(tmp, final)
        fsync_dir(final.parent)

    def commit(self, tmp: Path, final: Path, record) -> None:
        """`place` the file, then append its record's line (fsynced): the commit. On an error nothing is committed:
        the line's bytes and the renamed file are taken back (best effort; a resume would remove the unlisted file
        and cut a torn line anyway)."""
        with self.lock:
            self.place(tmp, final)
            self.append(record, undo=final)

    def append(self, record, undo: Path | None = None) -> None:
        """Append the record's line, fsynced (and the folder, for a new index). Callers hold `lock`."""
        created = not self.index_path.exists()
        size = 0 if created else self.index_path.stat().st_size
        try:
            with open(self.index_path, "ab") as f:
                f.write(self.kind.line(record))
                f.flush()
                os.fsync(f.fileno())
            if created:
                fsync_dir(self.index_path.parent)
        except BaseException:
            try:
                os.truncate(self.index_path, size)
                if undo is not None:
                    undo.unlink(missing_ok=True)
            except OSError:
                pass
            raise


def fsync_file(path: Path) -> None:
    """fsync a file written by a library that does not (pyarrow's writers): before its commit renames it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(out_dir: Path, name: str, manifest: dict) -> Path:
    """The output's manifest, written atomically (written last: a reader that trusts it sees committed files only)."""
    path = Path(out_dir) / name
    atomic_write_json(path, manifest)
    return path

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

Fencing: a commit happens only while the committing run holds the output. The appender checks the run's fence
(`fence.check()`: the output's run lease is still at the generation this run took, store/locks.py) under the
index's own lock, before the rename and again before the line; a run that lost the output (frozen past its lease,
another run took over) raises LeaseLostError there and commits nothing. Each record carries its run's fencing token
(`fence`, the lease generation: a take-over always gets a higher one). A process frozen between its last check and
its append can still land one line; a resume that then finds one item (sample) in records of two runs keeps one
record, the one of the higher token (the run that took over), and drops the other: nothing else is redone.

What a kill can leave, and what the next run's `RecordStore.prepare` (main process, no rank writing) does with it:
a torn last index line (cut back to the last complete line; an unreadable line anywhere cuts the index there),
a committed record whose file is missing or of another size (its line dropped, its work redone), and files no
index lists or `.tmp` files (removed), a record of a fenced run that another run's record supersedes (dropped).
`read_committed` reads the committed set: a torn tail is ignored, the same line twice counts once, and of two runs'
records of one item the higher token's.

Why our own code and not a library's: the index is the format readers (`inspect`, the follow-mode reader, trainers)
already read, a webdataset/Arrow file is committed by one rename, and no library offers an append-only index
repaired this way; the code is one screen per step.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_prep.io import atomic_write_lines, fsync_dir

INDEX_DIR = "index"
INDEX_GLOB = "rank-*.jsonl"
# index/superseded.jsonl: the index lines `drop` removed (records whose file was found damaged, then redone), kept
# so that a follower that met them sends their redone items to the consumer that had them (consume/follow.py)
SUPERSEDED_NAME = "superseded.jsonl"
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
    def read_lines(self) -> list:
        """Every readable record of every rank index, in (index file, line) order, the same record once; a torn
        or unreadable line ends its file (what follows is not committed)."""
        records, seen = [], set()
        for index in self.index_paths():
            for line in _read_bytes(index).splitlines():
                if not line.strip():
                    continue
                record = self.kind.parse(line)
                if record is None:
                    break  # torn tail
                if line not in seen:
                    seen.add(line)
                    records.append(record)
        return records

    def read_committed(self) -> list:
        """The committed records (`read_lines`, then `resolve`), in (index file, line) order."""
        return self.resolve(self.read_lines())[0]

    def resolve(self, records: list) -> tuple[list, list]:
        """One record per key and per item: -> (kept, superseded). Of two records of two runs (fencing tokens
        that differ) sharing a key or an item, the one of the higher token is kept (the run that took over); of
        two of one run, or of unknown runs, the first. OutputStateError when two records of one run differ for
        one key, or share an item (an index edited or merged by hand: nothing says which one is right)."""
        kept: dict[int, Any] = {}  # position -> record
        by_key: dict[Hashable, int] = {}
        by_item: dict[Hashable, int] = {}
        superseded = []
        for position, record in enumerate(records):
            rivals = {by_key[k] for k in [self.kind.key(record)] if k in by_key}
            rivals |= {by_item[i] for i in self._items(record) if i in by_item}
            if any(kept[rival] == record for rival in rivals):
                continue  # the same record again (a line copied): once
            for rival in sorted(rivals):
                self._refuse_same_run(kept[rival], record)
            if any(not _supersedes(record, kept[rival]) for rival in rivals):
                superseded.append(record)
                continue
            for rival in rivals:
                loser = kept.pop(rival)
                superseded.append(loser)
                by_key.pop(self.kind.key(loser), None)
                for item in self._items(loser):
                    by_item.pop(item, None)
            kept[position] = record
            by_key[self.kind.key(record)] = position
            for item in self._items(record):
                by_item[item] = position
        return list(kept.values()), superseded

    def _items(self, record) -> list:
        return self.kind.items(record) if self.kind.items is not None else []

    def _refuse_same_run(self, first, second) -> None:
        if _fence_of(first) is not None and _fence_of(first) != _fence_of(second):
            return
        if self.kind.key(first) == self.kind.key(second):
            raise damaged_state(self.index_dir, f"{self.kind.noun} {self.kind.key(first)} is listed twice, "
                                                f"differently")
        twice = sorted(set(self._items(first)) & set(self._items(second)))[:5]
        raise damaged_state(self.index_dir, f"samples {twice} are listed in two {self.kind.noun}s")

    def max_fence(self) -> int:
        """The highest fencing token any readable line of the indexes carries (-1: none): a new run's token is
        above it (its records then win over every earlier run's)."""
        tokens = [-1]
        for index in self.index_paths():
            for line in _read_bytes(index).splitlines():
                record = self.kind.parse(line)
                if record is not None and isinstance(_fence_of(record), int):
                    tokens.append(_fence_of(record))
        return max(tokens)

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
        committed and a run redoes it. Each rank index is rewritten atomically. The removed lines are appended to
        `index/superseded.jsonl` first, so a follower never meets a redone record without the one it replaces.
        Main process, no rank writing."""
        indexes = {index: index.read_bytes().splitlines(keepends=True) for index in self.index_paths()}
        dropped = [line.rstrip(b"\n") + b"\n" for lines in indexes.values() for line in lines
                   if line.strip() and getattr(self.kind.parse(line), "path", None) in paths]
        if dropped:
            superseded = self.index_dir / SUPERSEDED_NAME
            before = superseded.read_bytes().splitlines(keepends=True) if superseded.exists() else []
            atomic_write_lines(superseded, before + dropped)
        for index, lines in indexes.items():
            kept = [line for line in lines
                    if line.strip() and getattr(self.kind.parse(line), "path", None) not in paths]
            if len(kept) != len(lines):
                atomic_write_lines(index, kept)
        for rel in paths:
            (self.out_dir / rel).unlink(missing_ok=True)

    def drop_records(self, records: list, keep: list) -> None:
        """Remove the index lines of exactly these records (superseded ones), and their files unless a record of
        `keep` names the same file. Main process, no rank writing."""
        lines_of = {self.kind.line(r) for r in records}
        for index in self.index_paths():
            lines = index.read_bytes().splitlines(keepends=True)
            kept = [line for line in lines if line.strip() and self._canonical(line) not in lines_of]
            if len(kept) != len(lines):
                atomic_write_lines(index, kept)
        kept_paths = {r.path for r in keep}
        for record in records:
            if record.path not in kept_paths:
                (self.out_dir / record.path).unlink(missing_ok=True)

    def _canonical(self, line: bytes) -> bytes | None:
        record = self.kind.parse(line)
        return self.kind.line(record) if record is not None else None

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
        """Main process, no rank writing: repair the indexes, drop records whose file is damaged
        (`size_mismatches`, or `check(records)` -> {path: why} when given), then the records another run's record
        supersedes (`resolve`: of intact records only, so the one kept is intact), remove uncommitted files. -> what
        it found and did, and the committed records left."""
        repaired = self.repair_indexes()
        records = self.read_lines()
        self.resolve(records)  # a hand-merged index is refused before anything is dropped
        damaged = check(records) if check is not None else self.size_mismatches(records)
        if damaged:
            self.drop(set(damaged))
            records = [r for r in records if r.path not in damaged]
        committed, superseded = self.resolve(records)
        if superseded:
            self.drop_records(superseded, keep=committed)
        removed = self.remove_uncommitted(committed)
        return Prepared(committed=committed, repaired=repaired, damaged=damaged, removed=removed,
                        superseded=superseded)

    # -- writing -----------------------------------------------------------------------------------------------
    def appender(self, rank: int, lock: threading.Lock | None = None) -> "IndexAppender":
        """The committer of rank `rank`'s files into `index/rank-RRRRR.jsonl` (writers of one rank share `lock`)."""
        return IndexAppender(self.index_dir / index_name(rank), self.kind, lock)


@dataclass
class Prepared:
    """What `RecordStore.prepare` found: the committed records left, the indexes cut ((file, records cut)), the
    records dropped ({path: why}), the files removed, and the records of a fenced run another run's superseded."""

    committed: list
    repaired: list[tuple[str, int]]
    damaged: dict[str, str]
    removed: list[Path]
    superseded: list = field(default_factory=list)


class IndexAppender:
    """Commits one rank's files: `commit(tmp, final, record, fence)` renames the fsynced `tmp` to `final` and appends
    the record's line to the rank index, while `fence` says this run holds the output (module docstring)."""

    def __init__(self, index_path: Path, kind: RecordKind, lock: threading.Lock | None = None):
        self.index_path, self.kind = Path(index_path), kind
        self.lock = lock if lock is not None else threading.Lock()
        self.index_path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def place(tmp: Path, final: Path, replace: bool = True) -> None:
        """Rename the written and fsynced `tmp` to `final` and make the rename durable. `replace=False`: never over
        an existing file (a link, then the tmp removed: FileExistsError when `final` exists; a filesystem without
        links renames)."""
        if replace:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)
            except OSError as e:
                if e.errno == errno.EEXIST:
                    raise
                os.replace(tmp, final)
            else:
                os.unlink(tmp)
        fsync_dir(final.parent)

    def commit(self, tmp: Path, final: Path, record, fence=None, replace: bool = True,
               at: Callable[[str], None] | None = None) -> None:
        """Check the fence, `place` the file, check again, append its record's line (fsynced): the commit. Under
        the rank's lock and the index file's own flock. On an error nothing is committed: the renamed file and the
        line's bytes are taken back (best effort; a resume would remove an unlisted file and cut a torn line
        anyway). `at(point)`: a test hook at "checked", "renamed" and "appending" (after the last check; faults.py)."""
        if fence is not None:
            record.fence = fence.token
        with self.lock, _index_flock(self.index_path) as flock:
            if fence is not None:
                fence.check()
            if at is not None:
                at("checked")
            try:
                self.place(tmp, final, replace)
            except OSError:
                if fence is not None:
                    fence.check()  # the file went because another run took over: say that
                raise
            try:
                if at is not None:
                    at("renamed")
                if fence is not None:
                    fence.check()
                if at is not None:
                    at("appending")
            except BaseException:
                final.unlink(missing_ok=True)
                raise
            self.append(record, undo=final, created=flock.created)

    def append(self, record, undo: Path | None = None, created: bool | None = None) -> None:
        """Append the record's line, fsynced (and the folder, for a new index). Callers hold `lock`."""
        if created is None:
            created = not self.index_path.exists()
        size = self.index_path.stat().st_size if self.index_path.exists() else 0
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


class _index_flock:
    """The index file's own flock for the time of one commit (processes of one host); a filesystem without flock
    is left to the fence alone. `created`: the index did not exist before (its folder is fsynced after the line)."""

    def __init__(self, index_path: Path):
        self.path = Path(index_path)
        self.fd: int | None = None
        self.created = False

    def __enter__(self):
        self.created = not self.path.exists()
        if self.created:
            return self  # a new index: the rank's lock alone (another run's process of this host holds no rank)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock here: the fence alone
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock


def _fence_of(record) -> int | None:
    fence = getattr(record, "fence", None)
    return fence if isinstance(fence, int) and not isinstance(fence, bool) else None


def _supersedes(record, other) -> bool:
    """Whether `record` wins over `other`, an earlier record of the same key or item: only a record of a later run
    (a higher fencing token) does."""
    mine, theirs = _fence_of(record), _fence_of(other)
    return mine is not None and theirs is not None and mine > theirs




def write_manifest(out_dir: Path, name: str, manifest: dict, fence=None) -> Path:
    """The output's manifest, written atomically (written last: a reader that trusts it sees committed files only),
    only while `fence` says this run holds the output (checked before the rename)."""
    path = Path(out_dir) / name
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        if fence is not None:
            fence.check()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path

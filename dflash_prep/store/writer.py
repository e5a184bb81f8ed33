"""Atomic, size-rolled webdataset shards, written per rank by background writer threads ("lanes").

Layout (per rank r, run id R: 8 hex digits, locks.new_run_id):
    OUT/shards/rank-{r:05d}/shard-{n:06d}-{R}.tar      committed shards (plain, uncompressed tar)
    OUT/shards/rank-{r:05d}/shard-{n:06d}-{R}.tar.tmp  a shard being written (never read, removed on resume)
    OUT/index/rank-{r:05d}.jsonl                       one line per committed shard, appended after its rename
Outputs of earlier versions hold `shard-{n:06d}.tar` (no run id); both read and resume alike (the number is the
name's second dash-separated field either way). The run id makes a name no other run can write: two runs into one
folder (a lock that failed) never overwrite each other's shards.

A rank with L lanes hands its i-th batch to lane i mod L; lane j numbers its shards first + j, first + j + L, ...
(`first` = one past the rank's highest committed shard). So the layout depends only on the rank's batch order and
L, not on thread timing, and shard numbers never collide; they may have gaps (a lane that got no batch).

Guarantees:
- a shard becomes visible under its final name only when complete: it is written to `.tmp`, flushed, fsync'ed
  and renamed; then its index line is appended and fsync'ed. A shard without an index line is not committed;
- shards roll at batch boundaries only (a batch never spans two shards), once they reach `max_shard_bytes`;
- the lanes of a rank share its index file; appends are serialized by a lock, each line whole;
- each sample is one webdataset sample keyed by its `sample_id` with members `input_ids.npy` (int32),
  `loss_mask.npy` (uint8), `hidden_states.safetensors` (`hidden_states` [T, k*H], plus `final_hidden_states`
  [T, H] when captured) and `meta.json`; no pickle anywhere;
- `AsyncShardWriter` never loses an error: a failure in a lane is raised by the next `submit` or `close`; the
  shards being written (one per lane) are then dropped (their `.tmp` removed), committed shards and the index
  stay untouched;
- the host memory of batches captured but not yet written is bounded (`max_pending_bytes`);
- write modes (`write_mode`): `direct` writes each shard with O_DIRECT from a page-aligned buffer of its own
  (`_DirectFile`), where the filesystem takes it; a filesystem that refuses it (tmpfs, some network filesystems)
  gets buffered writes instead, said once in the log. `buffered` goes through the page cache. The bytes, the
  `.tmp` + fsync + rename + index line commit and the hash are the same in both;
- failed samples (out of memory alone, non-finite states) are listed, with their reason, in the index line of the
  shard that commits their batch (`failed`), so they are exactly as durable as the batch's written samples; a
  batch whose every sample failed still commits (a shard may then hold zero samples).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import logging
import math
import mmap
import os
import queue
import struct
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_prep.plan.batches import SampleInfo
from dflash_prep.store.manifest import shard_store
from dflash_prep.store.records import INDEX_DIR, SHARDS_DIR, ShardRecord, rank_name
from dflash_prep.target.backoff import FAIL_NON_FINITE
from dflash_prep.target.fp8 import unpack_rows as unpack_fp8_rows

log = logging.getLogger("dflash_prep")

WRITE_MODES = ("auto", "direct", "buffered")


class _HashingFile:
    """Write-only file wrapper that hashes (sha256) and counts what passes through, in one pass over the bytes.

    The hashing runs on a thread of its own, in write order, while this thread writes the same bytes to the file:
    a lane then runs at the slower of the two instead of their sum (both release the GIL on large buffers). One
    lane into tmpfs, bench/writer_bench.py on a 2-core VM: 1.15 -> 1.89 GB/s; the 27B benchmark's lanes on an H200
    machine: 0.73 -> 1.2-1.4 GB/s (bench/RESULTS.md, fifth round). Pieces under
    `_HASH_BATCH_BYTES` (tar headers, paddings, small members) are handed over together with the next large one.
    `wait()` returns once every byte written so far is hashed: the caller's buffers may then be reused.
    """

    _HASH_BATCH_BYTES = 1 << 16

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0
        self.discarded = False
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-sha256")  # one: in order
        self._small: list = []
        self._small_bytes = 0
        self._last = None
        self._error: BaseException | None = None  # the first hashing error: the digest is void from then on

    def _hash(self, pieces: list) -> None:
        # Only the last hand-over's future is waited for; an earlier one's error would be lost (and the later
        # pieces hashed without the failed ones: a wrong digest committed), so it is kept here for `wait`.
        if self._error is not None:
            return
        try:
            for piece in pieces:
                self.sha256.update(piece)
        except BaseException as e:
            self._error = e
            raise

    def _hand_over(self) -> None:
        if self._small:
            self._last = self._hasher.submit(self._hash, self._small)
            self._small, self._small_bytes = [], 0

    def write(self, data) -> int:
        # Bytes, not len(): a member buffer may be an array of wider items or of several dimensions (`Parts`),
        # whose len() counts elements or rows while the tar header and the file hold its bytes.
        nbytes = memoryview(data).nbytes
        if self.discarded:  # an aborted shard: late writes go nowhere
            return nbytes
        self._small.append(data)
        self._small_bytes += nbytes
        if self._small_bytes >= self._HASH_BATCH_BYTES:
            self._hand_over()
        self.num_bytes += nbytes
        return self.f.write(data)

    def wait(self) -> None:
        """Block until every byte written so far is hashed (re-raises an error of the hashing thread)."""
        self._hand_over()
        if self._last is not None:
            self._last.result()
        if self._error is not None:  # raised on every later wait too: no digest of this shard is ever valid
            raise self._error

    def hexdigest(self) -> str:
        """The sha256 of everything written (hashes what is still pending first)."""
        self.wait()
        return self.sha256.hexdigest()

    def flush(self) -> None:
        if not self.discarded:
            self.f.flush()

    def close(self) -> None:
        """Stop the hashing thread (after the hashing in flight)."""
        self._hasher.shutdown(wait=True)


# O_DIRECT needs the buffer's address, the file offset and the length aligned to the device's logical block (512 B
# or 4 KiB): 4 KiB covers both; an anonymous mmap is page aligned.
_DIRECT_ALIGN = 4096
_DIRECT_BUFFER_BYTES = 16 << 20
_direct_refusals_said: set[str] = set()  # filesystems whose O_DIRECT refusal was logged (once per process)


class _DirectFile:
    """A write-only shard file written with O_DIRECT: bytes are copied into a page-aligned buffer of
    `buffer_bytes` and each full buffer goes to the disk in one aligned write at its offset, bypassing the page
    cache. On the H200 machine's ext4 disk, buffered writes + fsync reached 1.27-1.41 GB/s, O_DIRECT 2.03-2.16
    (bench/disk_vs_writer.py): the page cache's copy and writeback, not the disk, capped buffered writers there.

    `flush()` writes what the buffer holds, its last partial block zero-padded, then truncates the file to the bytes
    written (the padding never stays); the buffer keeps its bytes, so later writes continue in place. A write the
    filesystem refuses with EINVAL (O_DIRECT accepted at open but not for writes) clears O_DIRECT on the descriptor
    and goes on buffered. Construction raises OSError where `open` refuses O_DIRECT (tmpfs: EINVAL).
    Not thread-safe: one lane writes one shard."""

    def __init__(self, path: Path, buffer_bytes: int = _DIRECT_BUFFER_BYTES):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            self._buf = mmap.mmap(-1, buffer_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = np.frombuffer(self._buf, np.uint8)
        self._fill = 0  # bytes in the buffer
        self._base = 0  # file offset of the buffer's first byte (a multiple of the buffer size)
        self.closed = False

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> int:
        src = np.frombuffer(data, np.uint8)  # a view of the caller's bytes, whatever their item type
        n, pos, cap = src.size, 0, self._view.size
        while pos < n:
            k = min(n - pos, cap - self._fill)
            np.copyto(self._view[self._fill:self._fill + k], src[pos:pos + k])  # numpy copies without the GIL
            self._fill += k
            pos += k
            if self._fill == cap:
                self._pwrite(cap)
                self._base += cap
                self._fill = 0
        return n

    def _pwrite(self, nbytes: int) -> None:
        """The buffer's first `nbytes` (a multiple of the alignment) at its file offset."""
        view, done = memoryview(self._buf)[:nbytes], 0
        try:
            while done < nbytes:
                try:
                    done += os.pwrite(self.fd, view[done:], self._base + done)
                except OSError as e:
                    if e.errno != errno.EINVAL or not fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT:
                        raise
                    _say_refused(self.path, f"a write: {e.strerror}")
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        finally:
            view.release()

    def flush(self) -> None:
        if self._fill:
            padded = -(-self._fill // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._view[self._fill:padded] = 0
            self._pwrite(padded)
        os.ftruncate(self.fd, self._base + self._fill)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            del self._view
            self._buf.close()


def _say_refused(path: Path, why: str) -> None:
    """Log, once per filesystem type and process, that O_DIRECT was refused and shards are written buffered."""
    fs = filesystem_type(path.parent)
    if fs not in _direct_refusals_said:
        _direct_refusals_said.add(fs)
        log.warning("output.write_mode: the %s filesystem of %s refuses O_DIRECT (%s): shards are written through "
                    "the page cache there", fs, path.parent, why)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts: the longest mount point above it), or "unknown"."""
    best, kind, target = "", "unknown", str(Path(path).resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def open_shard_file(path: Path, write_mode: str):
    """A new shard file at `path` for `write_mode` (WRITE_MODES): a `_DirectFile` for `direct`/`auto` where the
    filesystem takes O_DIRECT, else a buffered binary file (a 1 MiB buffer gathers the tar headers and paddings;
    member data, larger, goes straight to the file)."""
    if write_mode not in WRITE_MODES:
        raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {write_mode!r}")
    if write_mode != "buffered" and hasattr(os, "O_DIRECT"):
        try:
            return _DirectFile(path, _DIRECT_BUFFER_BYTES)  # read at each call: bench/disk_probe.py varies it
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            path.unlink(missing_ok=True)
            _say_refused(path, f"open: {e.strerror}")
    return open(path, "wb", buffering=1 << 20)


# Tar layout constants, as `tarfile` writes them (POSIX: 512-byte blocks, the archive padded to 20-block records).
_TAR_BLOCK = tarfile.BLOCKSIZE
_TAR_RECORD = tarfile.RECORDSIZE


class _TarStream:
    """Writes webdataset samples as tar members: for each member one header (encoded by `tarfile.TarInfo`) and
    one write of the data, straight from the encoded buffer.

    The bytes are those `webdataset.TarWriter(f, encoder=False, mtime=0)` writes (members of a sample in sorted
    order, owner bigdata, mode 0444; a test checks the equality), but `tarfile`'s stream mode, under that writer,
    copies every member through Python in 10 KiB pieces, which capped one writer near 0.3-0.5 GB/s; one write per
    member runs at the speed of the copy into the page cache and holds the GIL for microseconds, not seconds.
    """

    def __init__(self, f):
        self.f = f
        self.offset = 0

    def _put(self, data) -> None:
        self.f.write(data)
        self.offset += memoryview(data).nbytes

    def write_sample(self, sample: dict) -> None:
        key = sample["__key__"]
        for member in sorted(k for k in sample if not k.startswith("_")):
            data = sample[member]
            if isinstance(data, str):
                data = data.encode("utf-8")
            parts = data if isinstance(data, Parts) else (data,)
            size = data.num_bytes if isinstance(data, Parts) else memoryview(data).nbytes  # bytes, not items
            info = tarfile.TarInfo(f"{key}.{member}")
            info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "bigdata", "bigdata"
            self._put(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            for part in parts:
                self._put(part)
            if size % _TAR_BLOCK:
                self._put(bytes(_TAR_BLOCK - size % _TAR_BLOCK))

    def close(self) -> None:
        """End-of-archive: two zero blocks, then zeros up to a whole record."""
        end = self.offset + 2 * _TAR_BLOCK
        self._put(bytes(2 * _TAR_BLOCK + (-end) % _TAR_RECORD))


# safetensors, laid out as the library lays it out (tests/test_writer.py checks the bytes against
# `safetensors.torch.save`): an 8-byte little-endian header length, a compact JSON header padded with spaces to a
# multiple of 8, then the tensors' bytes, ordered by dtype (descending in the library's Dtype enum order), then name.
ST_CODE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8_e4m3": "F8_E4M3"}
ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}
_ST_ORDER = {"F8_E4M3": 7, "F16": 11, "BF16": 12, "F32": 15}
ST_TORCH_CODE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[str]]:
    """(header bytes, tensor names in data order) of a safetensors file of tensors given as (name, dtype code,
    shape); the file is the header followed by each tensor's bytes in that order."""
    ordered = sorted(entries, key=lambda t: (-_ST_ORDER[t[1]], t[0]))
    offset, fields = 0, []
    for name, code, shape in ordered:
        n = math.prod(shape) * ST_ITEMSIZE[code]
        fields.append(f'"{name}":{{"dtype":"{code}","shape":[{",".join(str(d) for d in shape)}],'
                      f'"data_offsets":[{offset},{offset + n}]}}')
        offset += n
    text = "{" + ",".join(fields) + "}"
    text += " " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text.encode(), [name for name, _, _ in ordered]


class Parts(list):
    """A tar member's bytes as several buffers written one after the other (no joining copy)."""

    @property
    def num_bytes(self) -> int:
        return sum(memoryview(p).nbytes for p in self)


def safetensors_parts(tensors: dict[str, torch.Tensor]) -> Parts:
    """The bytes of `safetensors.torch.save(tensors)`, as [header, each tensor's memory]: the states reach the
    file straight from the host buffer, without the copy into one `bytes` object that `save` makes."""
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    header, order = safetensors_header([(name, ST_TORCH_CODE[t.dtype], tuple(t.shape))
                                        for name, t in tensors.items()])
    return Parts([header] + [tensors[name].view(torch.uint8).reshape(-1).numpy() for name in order])


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def sample_meta(info: SampleInfo, layer_ids: list[int], batch_id: int) -> dict:
    """The content of a sample's `meta.json` (also used by `dflash-prep plan` to size the records exactly; `info`
    needs only `sample_id`, `source_row`, `source_id` and `num_tokens`)."""
    return {"sample_id": info.sample_id, "source_row": info.source_row, "source_id": info.source_id,
            "num_tokens": info.num_tokens, "layer_ids": layer_ids, "batch_id": batch_id}


def meta_json_bytes(meta: dict) -> bytes:
    """The bytes of the `meta.json` member."""
    return json.dumps(meta, sort_keys=True).encode()


def encode_sample(info: SampleInfo, hidden_states_TK: torch.Tensor, final_TH: torch.Tensor | None,
                  meta: dict) -> dict[str, bytes | Parts | str]:  # __key__ is the only str
    """One sample's tar members (webdataset naming: `{key}.{member}`).

    fp8 storage: `hidden_states_TK` / `final_TH` are packed uint8 rows (dflash_prep/target/fp8.py); they are written as
    `hidden_states` (float8_e4m3fn [T, k*H]) + `hidden_states_scales` (float32 [T, k]) and `final_hidden_states`
    (float8_e4m3fn [T, H]) + `final_hidden_states_scales` (float32 [T, 1])."""
    if hidden_states_TK.dtype == torch.uint8:
        q, scales = unpack_fp8_rows(hidden_states_TK, len(meta["layer_ids"]))
        tensors = {"hidden_states": q, "hidden_states_scales": scales}
        if final_TH is not None:
            tensors["final_hidden_states"], tensors["final_hidden_states_scales"] = unpack_fp8_rows(final_TH, 1)
    else:
        tensors = {"hidden_states": hidden_states_TK.contiguous()}
        if final_TH is not None:
            tensors["final_hidden_states"] = final_TH.contiguous()
    return {
        "__key__": info.sample_id,
        "input_ids.npy": _npy_bytes(info.input_ids.astype(np.int32, copy=False)),
        "loss_mask.npy": _npy_bytes(info.loss_mask.astype(np.uint8, copy=False)),
        "hidden_states.safetensors": safetensors_parts(tensors),
        "meta.json": meta_json_bytes(meta),
    }


class ShardWriter:
    """Synchronous per-rank writer; `write_batch` appends whole batches, `close` commits the last shard."""

    publisher = None  # an object-store output's ShardUploader (remote.py): it commits each shard after its upload

    def __init__(self, out_dir: str | Path, rank: int, max_shard_bytes: int, first_shard_number: int = 0,
                 faults=None, shard_number_step: int = 1, index_lock: threading.Lock | None = None,
                 run_id: str | None = None, write_mode: str = "auto", fence=None):
        """`shard_number_step` and a shared `index_lock` let several writers (lanes) of one rank interleave their
        shard numbers and share the rank's index file (see `lanes`); `run_id` goes into every shard's name;
        `write_mode` (WRITE_MODES): `auto` and `direct` write with O_DIRECT where the filesystem takes it; `fence`
        (locks.OutputFence): checked at every commit, its token in every record (store/record_store.py)."""
        if write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {write_mode!r}")
        self.write_mode = write_mode
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.shard_dir = self.out_dir / SHARDS_DIR / rank_name(rank)
        self.index_path = self.out_dir / INDEX_DIR / f"{rank_name(rank)}.jsonl"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.appender = shard_store(self.out_dir).appender(rank, index_lock)  # the commit (store/record_store.py)
        self.fence = fence
        self.next_number = first_shard_number
        self.shard_number_step = shard_number_step
        self.committed: list[ShardRecord] = []
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._open = None  # (final_path, file, hashing, tarwriter, record)
        self.faults = faults  # test-only fault injection (faults.py); None in real runs
        self.name_suffix = f"-{run_id}.tar" if run_id else ".tar"

    def _start_shard(self) -> None:
        final = self.shard_dir / f"shard-{self.next_number:06d}{self.name_suffix}"
        self.next_number += self.shard_number_step
        f = open_shard_file(final.with_name(final.name + ".tmp"), self.write_mode)
        hashing = _HashingFile(f)
        # mtime fixed (0): the same records give the same bytes (and hash) on every run.
        tar = _TarStream(hashing)
        rel = str(final.relative_to(self.out_dir))
        self._open = (final, f, hashing, tar, ShardRecord(rel, 0, 0, 0, ""))

    def write_batch(self, batch_id: int, encoded: list[tuple[dict, int]], failed: list[dict] | None = None) -> None:
        """Append one batch of encoded samples [(members, num_tokens)] and the failure records of its failed
        samples; roll the shard after it if full."""
        t0 = time.perf_counter()
        if self.faults is not None:
            self.faults.before_batch_write()
        if self._open is None:
            self._start_shard()
        final, _, hashing, tar, record = self._open
        before = hashing.num_bytes
        for members, num_tokens in encoded:
            tar.write_sample(members)
            if self.faults is not None:
                self.faults.on_shard_write(self.rank, _shard_number(final), final.with_name(final.name + ".tmp"))
            record.num_samples += 1
            record.num_tokens += num_tokens
            record.sample_ids.append(members["__key__"])
        record.batch_ids.append(batch_id)
        record.failed.extend(failed or [])
        hashing.wait()  # the batch's host buffers are released after this returns
        self.bytes_written += hashing.num_bytes - before
        if hashing.num_bytes >= self.max_shard_bytes:
            self._commit()
        self.write_seconds += time.perf_counter() - t0

    def _commit(self) -> None:
        final, f, hashing, tar, record = self._open
        # `_open` stays set until the rename: if anything before it fails (ENOSPC on the last blocks or the
        # fsync), `abort` still finds the shard and removes its .tmp.
        before = hashing.num_bytes
        tar.close()  # writes the tar end-of-archive blocks through `hashing`
        self.bytes_written += hashing.num_bytes - before
        f.flush()  # a `_DirectFile` writes its last, partial block here and truncates the padding away
        os.fsync(f.fileno())
        f.close()
        record.num_bytes = hashing.num_bytes
        record.sha256 = hashing.hexdigest()
        hashing.close()
        record.committed_at = time.time()
        tmp = final.with_name(final.name + ".tmp")
        if self.publisher is not None:  # uploaded, then committed by the index in the store; not listed locally
            self.appender.place(tmp, final)
            self._open = None
            self._after_rename(final)
            self.publisher.publish(final, record)
            return
        number = _shard_number(final)
        try:
            self.appender.commit(tmp, final, record, self.fence, at=lambda point: self._at(point, number))
        finally:
            if not tmp.exists():
                self._open = None  # renamed (committed, or taken back): nothing left for `abort`
        self.committed.append(record)

    def _after_rename(self, final: Path) -> None:
        if self.faults is not None:
            self.faults.after_rename(_shard_number(final))

    def _at(self, point: str, number: int) -> None:
        """The commit's test hooks (faults.py): after the fence check, after the rename."""
        if self.faults is not None:
            if hasattr(self.faults, "at_commit"):
                self.faults.at_commit(point, number)
            if point == "renamed":
                self.faults.after_rename(number)

    def close(self) -> None:
        """Commit the open shard (if it holds anything)."""
        t0 = time.perf_counter()
        if self._open is not None:
            if self._open[4].num_samples or self._open[4].batch_ids:  # batches whose samples all failed commit too
                self._commit()
            else:
                final, f, hashing, tar, _ = self._open
                self._open = None
                hashing.close()
                f.close()
                final.with_name(final.name + ".tmp").unlink(missing_ok=True)
        self.write_seconds += time.perf_counter() - t0

    def abort(self) -> None:
        """Drop the open shard without committing it (its batches will be redone on resume)."""
        if self._open is not None:
            final, f, hashing, _, _ = self._open
            self._open = None
            hashing.discarded = True
            try:
                hashing.close()
                f.close()
            finally:
                final.with_name(final.name + ".tmp").unlink(missing_ok=True)


def _shard_number(final: Path) -> int:
    return int(final.stem.split("-")[1])


@dataclass
class PendingBatch:
    """A batch whose states are (being) copied to host memory; `ready` is a CUDA event or None on CPU.

    `samples` are those whose states are in the buffers (batch order); `failed` the batch's samples that failed in
    the forward, with their reason; `nonfinite_B` (host, [len(samples)] bool, valid once `ready`) marks samples
    whose states hold a NaN or an Inf: they are not written but recorded as failed (or stop the run).
    """

    batch_id: int
    samples: list[SampleInfo]
    hidden_states_NK: torch.Tensor
    final_NH: torch.Tensor | None
    ready: object | None
    layer_ids: list[int]
    failed: list[tuple[SampleInfo, str]] = field(default_factory=list)
    nonfinite_B: torch.Tensor | None = None


class NonFiniteStatesError(RuntimeError):
    """Captured states hold a NaN or an Inf and `output.nan_policy` is `fatal`."""


def _nonfinite_flags(pending: PendingBatch) -> list[bool]:
    if pending.nonfinite_B is None:
        return [False] * len(pending.samples)
    return [bool(x) for x in pending.nonfinite_B.tolist()]


def failure_records(pending: PendingBatch) -> list[dict]:
    """The batch's failed samples as index records (forward failures, then non-finite states), batch order."""
    if pending.ready is not None:
        pending.ready.synchronize()
    failed = list(pending.failed) + [(info, FAIL_NON_FINITE) for info, bad in
                                     zip(pending.samples, _nonfinite_flags(pending)) if bad]
    return [{"sample_id": info.sample_id, "source_row": info.source_row, "source_id": info.source_id,
             "batch_id": pending.batch_id, "reason": reason} for info, reason in failed]


def encode_batch(pending: PendingBatch) -> list[tuple[dict, int]]:
    """Split a packed host buffer into per-sample records (views: no copy until serialization); samples with
    non-finite states are left out (see `failure_records`)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    out, start = [], 0
    for info, bad in zip(pending.samples, _nonfinite_flags(pending)):
        n = info.num_tokens
        if bad:
            start += n
            continue
        meta = sample_meta(info, pending.layer_ids, pending.batch_id)
        final = pending.final_NH[start:start + n] if pending.final_NH is not None else None
        out.append((encode_sample(info, pending.hidden_states_NK[start:start + n], final, meta), n))
        start += n
    if start != pending.hidden_states_NK.shape[0]:
        raise AssertionError(f"batch {pending.batch_id}: {start} tokens in samples, "
                             f"{pending.hidden_states_NK.shape[0]} captured")
    return out


def _held_bytes(pending: PendingBatch) -> int:
    """Host bytes of a batch's captured states."""
    final = pending.final_NH.nbytes if pending.final_NH is not None else 0
    return pending.hidden_states_NK.nbytes + final


def lanes(out_dir: str | Path, rank: int, max_shard_bytes: int, first_shard_number: int, num_lanes: int,
          faults=None, publisher=None, run_id: str | None = None, write_mode: str = "auto",
          fence=None) -> list[ShardWriter]:
    """The `num_lanes` writers of one rank: lane j numbers its shards first + j, first + j + num_lanes, ...
    `publisher`: an object-store output's uploader (remote.ShardUploader), shared by the lanes; `run_id`: this run's
    id, in its shards' names; `write_mode` (WRITE_MODES): `auto` is `direct` for a local output and `buffered` for
    an object store's staging folder (the upload then reads the shard back from the page cache, not the disk);
    `fence`: the run's (locks.OutputFence), checked at each local commit."""
    if write_mode == "auto" and publisher is not None:
        write_mode = "buffered"
    if num_lanes < 1:
        raise ValueError(f"num_lanes must be >= 1, got {num_lanes}")
    lock = threading.Lock()
    writers = [ShardWriter(out_dir, rank, max_shard_bytes, first_shard_number + j, faults,
                           shard_number_step=num_lanes, index_lock=lock, run_id=run_id, write_mode=write_mode,
                           fence=fence)
               for j in range(num_lanes)]
    for w in writers:
        w.publisher = publisher
    return writers


class AsyncShardWriter:
    """Runs one or more `ShardWriter`s (lanes), each on its own thread, so the GPU never waits on serialization or
    the disk; the i-th submitted batch goes to lane i mod L (a layout independent of timing).

    Hashing, file writes and fsync release the GIL, so lanes add write bandwidth on a machine with
    spare cores. `submit` blocks when the receiving lane already has `max_pending_batches` batches waiting, or
    when the batches submitted and not yet written hold `max_pending_bytes` of states (host memory, pinned on a
    GPU machine: without that bound 4 lanes could hold 8 batches, e.g. 8 x 3.8 GB for a Llama-3.1-8B shape with
    3 layers + the final one in bf16 and 131,072-token batches, per rank).
    """

    def __init__(self, writers: ShardWriter | list[ShardWriter], max_pending_batches: int = 1,
                 nan_policy: str = "fail_sample", max_pending_bytes: int | None = None):
        self.writers = [writers] if isinstance(writers, ShardWriter) else list(writers)
        self.nan_policy = nan_policy
        self.max_pending_bytes = max_pending_bytes if max_pending_bytes is not None else 1 << 62
        self._pending = threading.Condition()
        self._pending_bytes = 0  # states of the batches submitted and not yet written (host memory held)
        self.peak_pending_bytes = 0
        self.failed: list[dict] = []  # failure records of the batches written by this run
        self._queues = [queue.Queue(maxsize=max_pending_batches) for _ in self.writers]
        self._error: BaseException | None = None
        self._num_submitted = 0
        self.wait_seconds = 0.0  # time the producer spent blocked on a full queue
        self._threads = [threading.Thread(target=self._loop, args=(w, q), daemon=True,
                                          name=f"shard-writer-{w.rank}-{j}")
                         for j, (w, q) in enumerate(zip(self.writers, self._queues))]
        for t in self._threads:
            t.start()

    @property
    def publisher(self):
        """The lanes' uploader of an object-store output (committed shards are the uploaded ones), else None."""
        return self.writers[0].publisher if self.writers else None

    @property
    def committed(self) -> list[ShardRecord]:
        if self.publisher is not None:
            return list(self.publisher.committed)
        return [r for w in self.writers for r in w.committed]

    @property
    def bytes_written(self) -> int:
        return sum(w.bytes_written for w in self.writers)

    @property
    def write_seconds(self) -> float:
        """Busy time summed over the lanes (may exceed wall time when lanes overlap)."""
        return sum(w.write_seconds for w in self.writers)

    def _loop(self, writer: ShardWriter, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            nbytes = _held_bytes(item)
            try:
                self._write(writer, item)
            finally:
                del item  # drop this lane's hold on the host buffers, then let a waiting producer go on
                with self._pending:
                    self._pending_bytes -= nbytes
                    self._pending.notify_all()

    def _write(self, writer: ShardWriter, item: PendingBatch) -> None:
        if self._error is not None:
            return  # drain: after an error (in any lane) nothing more is written
        try:
            failed = failure_records(item)
            nonfinite = [f for f in failed if f["reason"] == FAIL_NON_FINITE]
            if nonfinite and self.nan_policy == "fatal":
                raise NonFiniteStatesError(
                    f"non-finite (NaN/Inf) hidden states in sample(s) {[f['sample_id'] for f in nonfinite]} "
                    f"of batch {item.batch_id} (output.nan_policy: fatal)")
            writer.write_batch(item.batch_id, encode_batch(item), failed)
            self.failed.extend(failed)
        except BaseException as e:  # noqa: BLE001 - handed to the producer thread
            if self._error is None:
                self._error = e

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the writer threads, if any (the first one)."""
        return self._error

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, pending: PendingBatch) -> None:
        """Hand a batch to its lane; blocks while its lane's queue is full or while the batches not yet written
        hold `max_pending_bytes` (a batch larger than that alone still goes when nothing else is pending)."""
        self._raise_if_failed()
        t0 = time.perf_counter()
        nbytes = _held_bytes(pending)
        with self._pending:
            while (self._error is None and self._pending_bytes > 0
                   and self._pending_bytes + nbytes > self.max_pending_bytes):
                self._pending.wait()
            self._raise_if_failed()
            self._pending_bytes += nbytes
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes)
        self._queues[self._num_submitted % len(self._queues)].put(pending)
        self._num_submitted += 1
        self.wait_seconds += time.perf_counter() - t0

    def _join(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()

    def close(self) -> None:
        """Wait for every submitted batch, commit the lanes' last shards, re-raise any error of a thread."""
        self._join()
        if self._error is not None:
            try:
                self._abort_writers()
            finally:  # the uploads stopped and their clients closed even when a lane's abort fails
                if self.publisher is not None:
                    self.publisher.abort()
            raise self._error
        for j, w in enumerate(self.writers):
            try:
                w.close()
            except BaseException as e:
                if isinstance(e, Exception):  # a write error of a last commit is reported like one of a thread;
                    self._error = e  # a Ctrl-C meanwhile is the user's stop, not a failed write
                # The failing lane too: a commit that failed before its rename leaves its shard open (the .tmp,
                # the hashing thread); this close may be the caller's last call.
                for other in self.writers[j:]:
                    other.abort()
                if self.publisher is not None:
                    self.publisher.abort()
                raise
        if self.publisher is not None:  # every upload done and committed, or the first upload error raised
            try:
                self.publisher.close()
            except Exception as e:  # a Ctrl-C while waiting is the user's stop, not a failed write
                self._error = e
                raise

    def _abort_writers(self) -> None:
        errors = []
        for w in self.writers:
            try:
                w.abort()
            except OSError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def abort(self) -> None:
        self._join()
        try:
            self._abort_writers()
        finally:
            if self.publisher is not None:
                self.publisher.abort()


class DiscardingWriter:
    """The writer of a process that is not its replica's writer (tensor parallelism, replica.py): the replica's first
    process writes the same batches, so this one drops each batch it is handed. Same interface as
    AsyncShardWriter; writes nothing, commits nothing."""

    def __init__(self):
        self.error: BaseException | None = None
        self.writers: list = []
        self.committed: list = []
        self.failed: list = []
        self.wait_seconds = self.write_seconds = 0.0
        self.peak_pending_bytes = self.bytes_written = 0

    def submit(self, pending: PendingBatch) -> None:
        if pending.ready is not None:
            pending.ready.synchronize()  # the host copy is done before its buffer is dropped

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass

"""Atomic, size-rolled webdataset shards, one writer per rank, written by a background thread.

Layout (per rank r):
    OUT/shards/rank-{r:05d}/shard-{n:06d}.tar      committed shards (plain, uncompressed tar)
    OUT/shards/rank-{r:05d}/shard-{n:06d}.tar.tmp  the shard being written (never read, removed on resume)
    OUT/index/rank-{r:05d}.jsonl                   one line per committed shard, appended after its rename

Guarantees:
- a shard becomes visible under its final name only when complete: it is written to `.tmp`, flushed, fsync'ed
  and renamed; then its index line is appended and fsync'ed. A shard without an index line is not committed;
- shards roll at batch boundaries only (a batch never spans two shards), once they reach `max_shard_bytes`;
- each sample is one webdataset sample keyed by its `sample_id` with members `input_ids.npy` (int32),
  `loss_mask.npy` (uint8), `hidden_states.safetensors` (`hidden_states` [T, k*H], plus `final_hidden_states`
  [T, H] when captured) and `meta.json`; no pickle anywhere;
- `AsyncShardWriter` never loses an error: a failure in the thread is raised by the next `submit` or `close`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

from .collate import SampleInfo

SHARDS_DIR = "shards"
INDEX_DIR = "index"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingFile:
    """Write-only file wrapper that hashes and counts what passes through (one pass over the bytes)."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def write(self, data) -> int:
        self.sha256.update(data)
        self.num_bytes += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def encode_sample(info: SampleInfo, hidden_states_TK: torch.Tensor, final_TH: torch.Tensor | None,
                  meta: dict) -> dict[str, bytes | str]:  # __key__ is the only str
    """One sample's tar members (webdataset naming: `{key}.{member}`)."""
    tensors = {"hidden_states": hidden_states_TK.contiguous()}
    if final_TH is not None:
        tensors["final_hidden_states"] = final_TH.contiguous()
    return {
        "__key__": info.sample_id,
        "input_ids.npy": _npy_bytes(info.input_ids.astype(np.int32, copy=False)),
        "loss_mask.npy": _npy_bytes(info.loss_mask.astype(np.uint8, copy=False)),
        "hidden_states.safetensors": safetensors_save(tensors),
        "meta.json": json.dumps(meta, sort_keys=True).encode(),
    }


@dataclass
class ShardRecord:
    """One committed shard, as listed in the rank index and the manifest."""

    path: str  # relative to OUT
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str
    batch_ids: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(path=self.path, num_samples=self.num_samples, num_tokens=self.num_tokens,
                    num_bytes=self.num_bytes, sha256=self.sha256, batch_ids=self.batch_ids,
                    sample_ids=self.sample_ids)


class ShardWriter:
    """Synchronous per-rank writer; `write_batch` appends whole batches, `close` commits the last shard."""

    def __init__(self, out_dir: str | Path, rank: int, max_shard_bytes: int, first_shard_number: int = 0):
        import webdataset as wds

        self._wds = wds
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.max_shard_bytes = max_shard_bytes
        self.shard_dir = self.out_dir / SHARDS_DIR / rank_name(rank)
        self.index_path = self.out_dir / INDEX_DIR / f"{rank_name(rank)}.jsonl"
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.index_path.parent.mkdir(parents=True, exist_ok=True)
        self.next_number = first_shard_number
        self.committed: list[ShardRecord] = []
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._open = None  # (final_path, file, hashing, tarwriter, record)

    def _start_shard(self) -> None:
        final = self.shard_dir / f"shard-{self.next_number:06d}.tar"
        self.next_number += 1
        f = open(final.with_name(final.name + ".tmp"), "wb")
        hashing = _HashingFile(f)
        # mtime fixed: the same records give the same bytes (and hash) on every run.
        tar = self._wds.TarWriter(hashing, encoder=False, mtime=0.0)
        rel = str(final.relative_to(self.out_dir))
        self._open = (final, f, hashing, tar, ShardRecord(rel, 0, 0, 0, ""))

    def write_batch(self, batch_id: int, encoded: list[tuple[dict, int]]) -> None:
        """Append one batch of encoded samples [(members, num_tokens)]; roll the shard after it if full."""
        t0 = time.perf_counter()
        if self._open is None:
            self._start_shard()
        _, _, hashing, tar, record = self._open
        before = hashing.num_bytes
        for members, num_tokens in encoded:
            tar.write(members)
            record.num_samples += 1
            record.num_tokens += num_tokens
            record.sample_ids.append(members["__key__"])
        record.batch_ids.append(batch_id)
        self.bytes_written += hashing.num_bytes - before
        if hashing.num_bytes >= self.max_shard_bytes:
            self._commit()
        self.write_seconds += time.perf_counter() - t0

    def _commit(self) -> None:
        final, f, hashing, tar, record = self._open
        self._open = None
        before = hashing.num_bytes
        tar.close()  # writes the tar end-of-archive blocks through `hashing`
        self.bytes_written += hashing.num_bytes - before
        f.flush()
        os.fsync(f.fileno())
        f.close()
        record.num_bytes = hashing.num_bytes
        record.sha256 = hashing.sha256.hexdigest()
        os.replace(final.with_name(final.name + ".tmp"), final)
        fsync_dir(final.parent)
        with open(self.index_path, "a") as idx:
            idx.write(json.dumps(record.to_json()) + "\n")
            idx.flush()
            os.fsync(idx.fileno())
        self.committed.append(record)

    def close(self) -> None:
        """Commit the open shard (if it holds anything)."""
        t0 = time.perf_counter()
        if self._open is not None:
            if self._open[4].num_samples:
                self._commit()
            else:
                final, f, _, tar, _ = self._open
                self._open = None
                f.close()
                final.with_name(final.name + ".tmp").unlink(missing_ok=True)
        self.write_seconds += time.perf_counter() - t0

    def abort(self) -> None:
        """Drop the open shard without committing it (its batches will be redone on resume)."""
        if self._open is not None:
            final, f, _, _, _ = self._open
            self._open = None
            try:
                f.close()
            finally:
                final.with_name(final.name + ".tmp").unlink(missing_ok=True)


@dataclass
class PendingBatch:
    """A batch whose states are (being) copied to host memory; `ready` is a CUDA event or None on CPU."""

    batch_id: int
    samples: list[SampleInfo]
    hidden_states_NK: torch.Tensor
    final_NH: torch.Tensor | None
    ready: object | None
    layer_ids: list[int]


def encode_batch(pending: PendingBatch) -> list[tuple[dict, int]]:
    """Split a packed host buffer into per-sample records (views: no copy until serialization)."""
    if pending.ready is not None:
        pending.ready.synchronize()
    out, start = [], 0
    for info in pending.samples:
        n = info.num_tokens
        meta = {"sample_id": info.sample_id, "source_row": info.source_row, "source_id": info.source_id,
                "num_tokens": n, "layer_ids": pending.layer_ids, "batch_id": pending.batch_id}
        final = pending.final_NH[start:start + n] if pending.final_NH is not None else None
        out.append((encode_sample(info, pending.hidden_states_NK[start:start + n], final, meta), n))
        start += n
    if start != pending.hidden_states_NK.shape[0]:
        raise AssertionError(f"batch {pending.batch_id}: {start} tokens in samples, "
                             f"{pending.hidden_states_NK.shape[0]} captured")
    return out


class AsyncShardWriter:
    """Runs a `ShardWriter` on a background thread so the GPU never waits on serialization or the disk.

    `submit` blocks only when `max_pending_batches` batches are already waiting (bounded host memory).
    """

    def __init__(self, writer: ShardWriter, max_pending_batches: int = 2):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending_batches)
        self._error: BaseException | None = None
        self.wait_seconds = 0.0  # time the producer spent blocked on a full queue
        self._thread = threading.Thread(target=self._loop, name=f"shard-writer-{writer.rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # drain: after an error nothing more is written
            try:
                self.writer.write_batch(item.batch_id, encode_batch(item))
            except BaseException as e:  # noqa: BLE001 - handed to the producer thread
                self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, pending: PendingBatch) -> None:
        self._raise_if_failed()
        t0 = time.perf_counter()
        self._queue.put(pending)
        self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Wait for every submitted batch, commit the last shard, re-raise any error of the thread."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            self.writer.abort()
            raise self._error
        self.writer.close()

    def abort(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.writer.abort()

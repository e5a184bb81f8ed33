"""Where the shard writer's O_DIRECT lanes lose against the raw disk: a diagnostic of `bench/disk_vs_writer.py`'s gap.

Each step writes `--gb` GB into a fresh file (or shards) of `--dir`, `--repeats` rounds, median kept:

  raw-1x{B}M        one stream of O_DIRECT writes of B MiB from one page-aligned buffer, then fsync (B: 8, 16, 64);
  raw-{N}streams    N threads, each its own file, 16 MiB O_DIRECT writes, fsync each: what N lanes ask of the disk
                    with none of the writer's work;
  raw-fallocate     one stream, 16 MiB writes, the file first preallocated with posix_fallocate (no block allocation
                    in the write path);
  raw-qd2           one file, two threads writing alternate 16 MiB blocks (two writes in flight, one stream);
  writer-*          the real writer (`AsyncShardWriter` over `lanes`, O_DIRECT) as disk_vs_writer.py runs it, with
                    LANES lanes, the direct buffer of BUF MiB, and optionally `fallocate` (each shard preallocated
                    to `max_shard_bytes` at open) or `overlap` (two buffers a lane: a full one is written by a
                    helper thread while the lane fills the other).

Every O_DIRECT write of the writer steps is timed (`_DirectFile._pwrite` wrapped): the JSON gives, per step, the
fraction of the wall time with at least one write in flight (`disk_busy_fraction`), the mean number in flight,
each lane's share of the wall time in writes, and the median rate of one write. A writer whose disk is busy
all the time but slower than raw loses to concurrency on the disk; one with idle gaps loses to its own work.

    python3 bench/disk_probe.py --dir /tmp --gb 4 --json bench/results/.../disk_probe.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.disk_vs_writer import filesystem_of, writer_write  # noqa: E402
from dflash_prep.store import writer as writer_mod  # noqa: E402

MIB = 1 << 20


def _buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # page-aligned, as O_DIRECT requires
    buf.write(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes())
    return buf


def _stream(path: Path, num_bytes: int, block: int, preallocate: bool = False) -> None:
    buf = _buffer(block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        if preallocate:
            os.posix_fallocate(fd, 0, num_bytes)
        written = 0
        while written < num_bytes:
            written += os.pwrite(fd, buf, written)
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_streams(folder: Path, num_bytes: int, block: int, streams: int = 1, preallocate: bool = False) -> dict:
    """`streams` threads, each writing num_bytes / streams into its own file; bytes/s of the whole."""
    each = -(-num_bytes // streams // block) * block
    paths = [folder / f"probe-{os.getpid()}-{i}.bin" for i in range(streams)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        list(pool.map(lambda p: _stream(p, each, block, preallocate), paths))
    seconds = time.perf_counter() - t0
    for p in paths:
        p.unlink(missing_ok=True)
    return {"bytes": each * streams, "seconds": seconds, "bytes_per_second": each * streams / seconds}


def raw_qd2(folder: Path, num_bytes: int, block: int) -> dict:
    """One file, two threads writing its even and odd blocks: two writes in flight on one stream."""
    path = folder / f"probe-{os.getpid()}-qd2.bin"
    num_blocks = -(-num_bytes // block)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    bufs = [_buffer(block), _buffer(block)]

    def half(parity: int) -> None:
        for b in range(parity, num_blocks, 2):
            os.pwrite(fd, bufs[parity], b * block)
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(half, (0, 1)))
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"bytes": num_blocks * block, "seconds": seconds, "bytes_per_second": num_blocks * block / seconds}


class _Timeline:
    """Every O_DIRECT write of the writer, timed: (lane thread, start, end, bytes)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events: list[tuple[str, float, float, int]] = []

    def record(self, name: str, t0: float, t1: float, nbytes: int) -> None:
        with self.lock:
            self.events.append((name, t0, t1, nbytes))

    def summary(self, t_start: float, t_end: float) -> dict:
        wall = t_end - t_start
        spans = sorted((a, b) for _, a, b, _ in self.events)
        busy, cur_a, cur_b = 0.0, None, None
        for a, b in spans:
            if cur_b is None or a > cur_b:
                busy += (cur_b - cur_a) if cur_b is not None else 0.0
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        busy += (cur_b - cur_a) if cur_b is not None else 0.0
        lanes: dict[str, float] = {}
        for name, a, b, _ in self.events:
            lanes[name] = lanes.get(name, 0.0) + (b - a)
        rates = [n / (b - a) for _, a, b, n in self.events if b > a]
        return {"num_writes": len(self.events), "disk_busy_fraction": busy / wall if wall else None,
                "mean_writes_in_flight": sum(b - a for _, a, b, _ in self.events) / wall if wall else None,
                "lane_write_fraction": {k: v / wall for k, v in sorted(lanes.items())},
                "median_write_bytes_per_second": statistics.median(rates) if rates else None,
                "median_write_bytes": statistics.median(n for *_, n in self.events) if self.events else None}


class _OverlappedDirectFile(writer_mod._DirectFile):
    """Two buffers: a full one is written by a helper thread while the lane fills the other (one write in flight
    per lane, so a lane's copies no longer leave its share of the disk idle)."""

    def __init__(self, path: Path, buffer_bytes: int):
        super().__init__(path, buffer_bytes)
        self._spare = mmap.mmap(-1, buffer_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=threading.current_thread().name + "-io")
        self._inflight = None

    def _wait(self) -> None:
        if self._inflight is not None:
            self._inflight.result()
            self._inflight = None

    def write(self, data) -> int:
        src = np.frombuffer(data, np.uint8)
        n, pos, cap = src.size, 0, self._view.size
        while pos < n:
            k = min(n - pos, cap - self._fill)
            np.copyto(self._view[self._fill:self._fill + k], src[pos:pos + k])
            self._fill += k
            pos += k
            if self._fill == cap:
                self._wait()  # the spare buffer's write has ended: it can take the next bytes
                full, base = self._buf, self._base
                self._inflight = self._pool.submit(self._pwrite_at, full, base, cap)
                self._buf, self._spare = self._spare, full
                self._view = np.frombuffer(self._buf, np.uint8)
                self._base += cap
                self._fill = 0
        return n

    def _pwrite_at(self, buf, base: int, nbytes: int) -> None:
        view, done = memoryview(buf)[:nbytes], 0
        t0 = time.perf_counter()
        try:
            while done < nbytes:
                done += os.pwrite(self.fd, view[done:], base + done)
        finally:
            view.release()
        if _TIMELINE is not None:
            _TIMELINE.record(threading.current_thread().name, t0, time.perf_counter(), nbytes)

    def flush(self) -> None:
        self._wait()
        super().flush()

    def close(self) -> None:
        if not self.closed:
            self._wait()
            self._pool.shutdown(wait=True)
            super().close()
            self._spare.close()


_TIMELINE: _Timeline | None = None
_ORIGINAL_PWRITE = writer_mod._DirectFile._pwrite
_ORIGINAL_INIT = writer_mod._DirectFile.__init__
_ORIGINAL_CLASS = writer_mod._DirectFile
_ORIGINAL_BUFFER_BYTES = writer_mod._DIRECT_BUFFER_BYTES


def _timed_pwrite(self, nbytes: int) -> None:
    t0 = time.perf_counter()
    _ORIGINAL_PWRITE(self, nbytes)
    if _TIMELINE is not None:
        _TIMELINE.record(threading.current_thread().name, t0, time.perf_counter(), nbytes)


def writer_step(folder: Path, num_bytes: int, lanes: int, buffer_mib: int, max_shard_bytes: int,
                fallocate: bool = False, overlap: bool = False) -> dict:
    """The real writer with `lanes` O_DIRECT lanes, the direct buffer `buffer_mib`, its writes timed."""
    global _TIMELINE
    _TIMELINE = _Timeline()
    writer_mod._DIRECT_BUFFER_BYTES = buffer_mib * MIB
    writer_mod._DirectFile = _OverlappedDirectFile if overlap else _ORIGINAL_CLASS
    _ORIGINAL_CLASS._pwrite = _timed_pwrite
    if fallocate:
        def init(self, path, buffer_bytes=writer_mod._DIRECT_BUFFER_BYTES):
            _ORIGINAL_INIT(self, path, buffer_bytes)
            os.posix_fallocate(self.fd, 0, max_shard_bytes + (64 << 20))  # ftruncate at commit trims the rest
        _ORIGINAL_CLASS.__init__ = init
    try:
        t0 = time.perf_counter()
        result = writer_write(folder, num_bytes, 20480, 512, 16, lanes, max_shard_bytes, "direct")
        result["timeline"] = _TIMELINE.summary(t0, t0 + result["seconds"])
        return result
    finally:
        _ORIGINAL_CLASS.__init__ = _ORIGINAL_INIT
        _ORIGINAL_CLASS._pwrite = _ORIGINAL_PWRITE
        writer_mod._DirectFile = _ORIGINAL_CLASS
        writer_mod._DIRECT_BUFFER_BYTES = _ORIGINAL_BUFFER_BYTES
        _TIMELINE = None


def staged(folder: Path, num_bytes: int, lanes: int, max_shard_bytes: int, block: int = 16 * MIB,
           max_pending: int = 2) -> dict:
    """A design the writer does not have yet: `lanes` threads do the CPU work (copy each shard's bytes into a
    page-aligned buffer of the whole shard, sha256 on a hashing thread of their own, in order) in parallel, and one
    disk stream writes the finished shards one after the other, two O_DIRECT writes in flight (raw-qd2's pattern),
    so the disk sees one file at a time. A lane waits when `max_pending` shards wait for the disk (memory: lanes +
    max_pending shard buffers). Same bytes and shard size as the writer steps; bytes/s of the whole."""
    import hashlib
    import queue

    shard = -(-max_shard_bytes // block) * block
    num_shards = -(-num_bytes // shard)
    src = np.random.default_rng(1).integers(0, 256, 64 * MIB, dtype=np.uint8)  # a batch's states, reused
    todo: queue.Queue = queue.Queue()
    for i in range(num_shards):
        todo.put(i)
    ready: queue.Queue = queue.Queue(maxsize=max_pending)
    digests: dict[int, str] = {}
    free: queue.Queue = queue.Queue()  # shard buffers reused (a fresh mmap's first touch faults every page)
    for _ in range(lanes + max_pending + 1):
        free.put(mmap.mmap(-1, shard))

    def lane() -> None:
        with ThreadPoolExecutor(1) as hasher:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                buf = free.get()
                view, h, pending = np.frombuffer(buf, np.uint8), hashlib.sha256(), None
                for at in range(0, shard, src.size):
                    k = min(src.size, shard - at)
                    np.copyto(view[at:at + k], src[:k])
                    if pending is not None:
                        pending.result()
                    pending = hasher.submit(h.update, memoryview(buf)[at:at + k])
                pending.result()
                digests[i] = h.hexdigest()
                ready.put((i, buf))

    def disk() -> None:
        with ThreadPoolExecutor(2) as io:
            for _ in range(num_shards):
                i, buf = ready.get()
                path = folder / f"staged-{os.getpid()}-{i}.tar"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
                try:
                    blocks = range(0, shard, block)
                    list(io.map(lambda at: os.pwrite(fd, memoryview(buf)[at:at + block], at), blocks))
                    os.fsync(fd)
                finally:
                    os.close(fd)
                free.put(buf)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=lane) for _ in range(lanes)] + [threading.Thread(target=disk)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    while not free.empty():
        free.get().close()
    for path in folder.glob(f"staged-{os.getpid()}-*.tar"):
        path.unlink()
    assert len(digests) == num_shards
    return {"bytes": shard * num_shards, "seconds": seconds, "bytes_per_second": shard * num_shards / seconds,
            "shards": num_shards, "lanes": lanes, "max_pending": max_pending}


def steps(folder: Path, num_bytes: int, max_shard_bytes: int) -> dict:
    w = lambda **kw: (lambda: writer_step(folder, num_bytes, max_shard_bytes=max_shard_bytes, **kw))  # noqa: E731
    return {
        "raw-1x8M": lambda: raw_streams(folder, num_bytes, 8 * MIB),
        "raw-1x16M": lambda: raw_streams(folder, num_bytes, 16 * MIB),
        "raw-1x64M": lambda: raw_streams(folder, num_bytes, 64 * MIB),
        "raw-2streams": lambda: raw_streams(folder, num_bytes, 16 * MIB, streams=2),
        "raw-4streams": lambda: raw_streams(folder, num_bytes, 16 * MIB, streams=4),
        "raw-fallocate": lambda: raw_streams(folder, num_bytes, 16 * MIB, preallocate=True),
        "raw-qd2": lambda: raw_qd2(folder, num_bytes, 16 * MIB),
        "writer-4lanes-16M": w(lanes=4, buffer_mib=16),
        "writer-4lanes-64M": w(lanes=4, buffer_mib=64),
        "writer-2lanes-16M": w(lanes=2, buffer_mib=16),
        "writer-2lanes-64M": w(lanes=2, buffer_mib=64),
        "writer-4lanes-16M-fallocate": w(lanes=4, buffer_mib=16, fallocate=True),
        "writer-4lanes-16M-overlap": w(lanes=4, buffer_mib=16, overlap=True),
        "writer-2lanes-32M-overlap": w(lanes=2, buffer_mib=32, overlap=True),
        "writer-1lane-32M-overlap": w(lanes=1, buffer_mib=32, overlap=True),
        "staged-4lanes": lambda: staged(folder, num_bytes, 4, max_shard_bytes),
        "staged-2lanes": lambda: staged(folder, num_bytes, 2, max_shard_bytes),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--shard-gb", type=float, default=0.5)
    p.add_argument("--only", default="", help="comma-separated step names (default: all)")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="disk-probe-", dir=args.dir))
    num_bytes, shard = int(args.gb * 1e9), int(args.shard_gb * 1e9)
    todo = steps(folder, num_bytes, shard)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    rounds: dict[str, list[dict]] = {k: [] for k in todo}
    try:
        for r in range(args.repeats):
            for name, step in todo.items():
                rounds[name].append(step())
                print(f"round {r} {name}: {rounds[name][-1]['bytes_per_second'] / 1e9:.2f} GB/s", file=sys.stderr,
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {"dir": str(Path(args.dir).resolve()), "filesystem": filesystem_of(Path(args.dir)),
              "bytes_per_step": num_bytes, "repeats": args.repeats, "max_shard_bytes": shard, "steps": {}}
    for name, rs in rounds.items():
        rate = statistics.median(x["bytes_per_second"] for x in rs)
        pick = min(rs, key=lambda x: abs(x["bytes_per_second"] - rate))
        result["steps"][name] = {**pick, "bytes_per_second": rate,
                                 "rounds_bytes_per_second": [x["bytes_per_second"] for x in rs]}
    best_raw = max(v["bytes_per_second"] for k, v in result["steps"].items() if k.startswith("raw-"))
    for v in result["steps"].values():
        v["ratio_to_best_raw"] = v["bytes_per_second"] / best_raw
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    for name, v in result["steps"].items():
        tl = v.get("timeline")
        extra = (f"  disk busy {tl['disk_busy_fraction']:.2f}, in flight {tl['mean_writes_in_flight']:.2f}, one "
                 f"write {tl['median_write_bytes_per_second'] / 1e9:.2f} GB/s") if tl and tl["num_writes"] else ""
        print(f"{name:<30} {v['bytes_per_second'] / 1e9:5.2f} GB/s ({v['ratio_to_best_raw']:.2f} of best raw){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

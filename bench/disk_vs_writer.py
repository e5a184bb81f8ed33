"""The shard writer against the raw disk: how close the writer lanes come to what the filesystem takes, in each
write mode (`output.write_mode`) and number of lanes (`output.num_writer_threads`), measured in one run on the same
filesystem with the same number of bytes.

For each of `--repeats` rounds, in this order:
  raw        `--gb` GB written sequentially into one file of `--dir` in 8 MiB writes from one buffer, then fsync
             (buffered writes through the page cache, durable at the end: what `dd conv=fsync` measures);
  direct     the same with O_DIRECT (what `dd oflag=direct` measures), where the filesystem allows it (recorded
             as unsupported where it does not);
  writers    for each `--modes` entry MODE:LANES (default buffered:4, direct:4, buffered:8, direct:8) the same bytes
             of states through the real writer (`AsyncShardWriter` over `lanes`: tar members, sha256, fsync'ed
             `.tmp` + rename commits, the rank index), batches of random bf16 states shaped like a target's records
             (`--width` = k*H values per token: 20480 is a Qwen3-8B-shaped DFlash k=5 record, 40 KB/token); its
             rate counts every byte of the shards, end-of-archive included.
The result is the median of the rounds; each writer mode gets `ratio_to_buffered` (its rate / raw) and
`ratio_to_direct` (its rate / direct, null where O_DIRECT is unsupported). `writer` is the `direct:--threads` mode
(what `output.write_mode: auto` does on a local output), `ratio` its rate / the faster of raw and direct. Files are
removed after each step.

    python3 bench/disk_vs_writer.py --dir /data/tmp --gb 4 --label disk       # a real disk
    python3 bench/disk_vs_writer.py --dir /dev/shm --gb 2 --label tmpfs       # memory: the writer's own ceiling
-> bench/results/disk_vs_writer-LABEL.json (`dflash-prep plan --storage-bench FILE` takes its `writer` rate as the
storage rate).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_prep.plan.batches import SampleInfo  # noqa: E402
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, lanes  # noqa: E402

BLOCK = 8 << 20
RESULTS = Path(__file__).resolve().parent / "results"


def filesystem_of(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/mounts: the longest mount point above it)."""
    best, fstype = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, kind, *_ = line.split()
            if str(path.resolve()).startswith(mount.rstrip("/") + "/") or str(path.resolve()) == mount:
                if len(mount) > len(best):
                    best, fstype = mount, kind
    except OSError:
        pass
    return fstype


def raw_write(folder: Path, num_bytes: int, direct: bool) -> dict:
    """Sequential 8 MiB writes of one page-aligned buffer into a new file, then fsync; seconds and bytes/s."""
    path = folder / f"raw-{os.getpid()}.bin"
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT requires
    buf.write(np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes())
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        return {"supported": False, "why": f"{type(e).__name__}: {e}"}
    try:
        written = 0
        t0 = time.perf_counter()
        while written < num_bytes:
            written += os.write(fd, buf)
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    except OSError as e:
        return {"supported": False, "why": f"{type(e).__name__}: {e}"}
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"supported": True, "bytes": written, "seconds": seconds, "bytes_per_second": written / seconds}


def writer_write(folder: Path, num_bytes: int, width: int, tokens: int, batch_size: int, num_lanes: int,
                 max_shard_bytes: int, write_mode: str = "direct") -> dict:
    """About `num_bytes` of shards through the real writer lanes; seconds from the first batch to the last commit."""
    states = torch.randn(batch_size * tokens, width).to(torch.bfloat16)  # one buffer, handed again: no RNG timed
    num_batches = max(1, round(num_bytes / states.nbytes))
    out = Path(tempfile.mkdtemp(prefix="disk-vs-writer-", dir=folder))
    try:
        writer = AsyncShardWriter(lanes(out, 0, max_shard_bytes, 0, num_lanes, write_mode=write_mode))
        t0 = time.perf_counter()
        for b in range(num_batches):
            infos = [SampleInfo(f"{b:06d}{i:04d}", b * batch_size + i, None, np.arange(tokens, dtype=np.int32),
                                np.ones(tokens, np.uint8)) for i in range(batch_size)]
            writer.submit(PendingBatch(b, infos, states, None, None, [0]))
        writer.close()
        seconds = time.perf_counter() - t0
        return {"bytes": writer.bytes_written, "seconds": seconds, "bytes_per_second": writer.bytes_written / seconds,
                "shards": len(writer.committed), "num_writer_threads": num_lanes, "write_mode": write_mode,
                "num_batches": num_batches, "producer_wait_seconds": writer.wait_seconds}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def median_of(rounds: list[dict]) -> dict:
    ok = [r for r in rounds if r.get("supported", True)]
    if not ok:
        return rounds[0]
    rate = statistics.median(r["bytes_per_second"] for r in ok)
    return {**min(ok, key=lambda r: abs(r["bytes_per_second"] - rate)), "bytes_per_second": rate,
            "rounds_bytes_per_second": [r["bytes_per_second"] for r in ok]}


def _ratios(result: dict) -> None:
    """Each writer mode's rate against both raw figures; the headline `writer` and `ratio`."""
    raw = result["raw"]["bytes_per_second"] if result["raw"].get("supported", True) else None
    direct = result["direct"]["bytes_per_second"] if result["direct"].get("supported", True) else None
    for w in result["writers"].values():
        w["ratio_to_buffered"] = w["bytes_per_second"] / raw if raw else None
        w["ratio_to_direct"] = w["bytes_per_second"] / direct if direct else None
    result["raw_bytes_per_second_best"] = max(r for r in (raw, direct) if r)
    result["ratio"] = result["writer"]["bytes_per_second"] / result["raw_bytes_per_second_best"]
    result["ratio_to_buffered_raw"] = result["writer"]["bytes_per_second"] / raw if raw else None
    result["ratio_to_direct_raw"] = result["writer"]["bytes_per_second"] / direct if direct else None


def _modes(text: str, threads: int) -> list[tuple[str, int]]:
    modes = []
    for item in text.split(","):
        mode, _, n = item.strip().partition(":")
        if mode not in ("buffered", "direct") or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--modes {text}: expected MODE:LANES items, MODE buffered or direct")
        modes.append((mode, int(n)))
    if ("direct", threads) not in modes:
        modes.append(("direct", threads))  # the headline `writer`
    return modes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a folder on the filesystem under test")
    p.add_argument("--gb", type=float, default=2.0, help="bytes of each step, GB (default 2)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=20480, help="k*H values per token (20480: Qwen3-8B shape, k=5)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch")
    p.add_argument("--threads", type=int, default=4, help="lanes of the headline `writer` (direct mode)")
    p.add_argument("--modes", default="buffered:4,direct:4,buffered:8,direct:8",
                   help="writer modes MODE:LANES, comma separated (MODE: buffered or direct)")
    p.add_argument("--shard-gb", type=float, default=0.5, help="output.max_shard_bytes, GB")
    p.add_argument("--label", required=True, help="names the result file: bench/results/disk_vs_writer-LABEL.json")
    p.add_argument("--out", default=None, help="result file (default: bench/results/disk_vs_writer-LABEL.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    folder = Path(args.dir)
    num_bytes = int(args.gb * 1e9)
    modes = _modes(args.modes, args.threads)
    rounds: dict[str, list[dict]] = {"raw": [], "direct": [], **{f"{m}:{n}": [] for m, n in modes}}
    for r in range(args.repeats):
        rounds["raw"].append(raw_write(folder, num_bytes, direct=False))
        rounds["direct"].append(raw_write(folder, num_bytes, direct=True))
        for mode, n in modes:
            rounds[f"{mode}:{n}"].append(writer_write(folder, num_bytes, args.width, args.tokens, args.batch_size,
                                                      n, int(args.shard_gb * 1e9), mode))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]['bytes_per_second'] / 1e9:.2f} GB/s" if v[-1].get(
            "supported", True) else f"{k} unsupported" for k, v in rounds.items()), file=sys.stderr, flush=True)
    medians = {k: median_of(v) for k, v in rounds.items()}
    result = {"label": args.label, "path": str(folder.resolve()), "filesystem": filesystem_of(folder),
              "host": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "bytes_per_step": num_bytes, "repeats": args.repeats,
              "bytes_per_token": args.width * 2, "num_writer_threads": args.threads,
              "max_shard_bytes": int(args.shard_gb * 1e9), "raw": medians["raw"], "direct": medians["direct"],
              "writers": {f"{m}:{n}": medians[f"{m}:{n}"] for m, n in modes},
              "writer": medians[f"direct:{args.threads}"]}
    _ratios(result)
    out = Path(args.out) if args.out else RESULTS / f"disk_vs_writer-{args.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    direct = result["direct"]
    print(f"{args.label} ({result['filesystem']}, {folder}): raw (buffered + fsync) "
          f"{result['raw']['bytes_per_second'] / 1e9:.2f} GB/s, O_DIRECT "
          + (f"{direct['bytes_per_second'] / 1e9:.2f} GB/s" if direct.get("supported", True) else "unsupported")
          + f" -> {out}")
    for name, w in result["writers"].items():
        to_direct = f"{w['ratio_to_direct']:.2f}" if w["ratio_to_direct"] is not None else "-"
        print(f"  writer {name:<12} {w['bytes_per_second'] / 1e9:.2f} GB/s: {w['ratio_to_buffered']:.2f} of raw, "
              f"{to_direct} of O_DIRECT", flush=True)
        if w.get("num_batches", 0) < 2 * w["num_writer_threads"]:  # a lane's batches go to it whole, in turn
            batch_gb = w["bytes"] / w["num_batches"] / 1e9
            print(f"    note: {w['num_batches']} batch(es) of {batch_gb:.2f} GB over {w['num_writer_threads']} lanes: "
                  f"this step measures the lanes' start and drain more than their rate; --gb "
                  f"{2 * w['num_writer_threads'] * batch_gb:.1f} or more gives each lane two batches", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shard-writer bandwidth by number of writer threads (`output.num_writer_threads`), without a model.

Feeds the real writer (`AsyncShardWriter` over `lanes`: encode, tar, sha256, fsync'ed commits) with batches of
random bf16 states shaped like a target's records, into a folder on the disk under test, and reports GB/s per
thread count. It answers "how many writer threads does this machine need so that the GPU never waits on the
disk": compare the GB/s with the GPU's rate x bytes per token (e.g. ~34k tok/s x 24.6 KB = 0.84 GB/s for the
Llama-3.1-8B shape with 3 layers, ~12k x 51.2 KB = 0.61 GB/s for the 27B with 5). It also reports how long a
GIL round trip of the main thread takes while the writers run (each CUDA call of the extraction loop releases
and re-takes the GIL, so a writer that holds it delays the loop and can leave the GPU idle).

    python3 bench/writer_bench.py --dir /data/tmp --threads 1,2,4,8 --gb 4 --width 25600 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_prep.plan.batches import SampleInfo  # noqa: E402
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, lanes  # noqa: E402


def gil_round_trip_us(n: int = 200) -> float:
    """Mean microseconds of a call that releases and re-takes the GIL (as each CUDA call of the extraction loop
    does) on this thread: when a writer thread holds the GIL, the loop waits here."""
    t0 = time.perf_counter()
    for _ in range(n):
        time.sleep(0)
    return (time.perf_counter() - t0) / n * 1e6


def run(folder: Path, num_threads: int, num_batches: int, batch_size: int, tokens: int, width: int,
        max_shard_bytes: int) -> dict:
    states = torch.randn(batch_size * tokens, width).to(torch.bfloat16)  # one buffer, re-sent: no RNG in the loop
    out = Path(tempfile.mkdtemp(prefix=f"writer-bench-{num_threads}-", dir=folder))
    try:
        idle_us = gil_round_trip_us()
        writer = AsyncShardWriter(lanes(out, 0, max_shard_bytes, 0, num_threads))
        t0 = time.perf_counter()
        probes = []
        for b in range(num_batches):
            infos = [SampleInfo(f"{b:06d}{i:04d}", b * batch_size + i, None, np.arange(tokens, dtype=np.int32),
                                np.ones(tokens, np.uint8)) for i in range(batch_size)]
            writer.submit(PendingBatch(b, infos, states, None, None, [0]))
            probes.append(gil_round_trip_us(20))  # what the loop's next CUDA calls would wait, writers busy
        writer.close()
        seconds = time.perf_counter() - t0
        return {"num_writer_threads": num_threads, "bytes": writer.bytes_written, "seconds": seconds,
                "gb_per_second": writer.bytes_written / seconds / 1e9, "busy_seconds_summed": writer.write_seconds,
                "producer_wait_seconds": writer.wait_seconds, "shards": len(writer.committed),
                "gil_round_trip_us_idle": idle_us, "gil_round_trip_us_while_writing": float(np.median(probes))}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="a folder on the disk under test (a temporary subfolder is used)")
    p.add_argument("--threads", default="1,2,4", help="comma list of writer thread counts (default 1,2,4)")
    p.add_argument("--gb", type=float, default=2.0, help="GB of records per thread count (default 2)")
    p.add_argument("--tokens", type=int, default=320, help="tokens per sample (default 320)")
    p.add_argument("--width", type=int, default=25600, help="k x hidden per token (default 25600: 5 x 5120)")
    p.add_argument("--batch-size", type=int, default=16, help="samples per batch (default 16)")
    p.add_argument("--max-shard-bytes", type=int, default=1 << 30, help="shard size (default 1 GiB)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    per_batch = args.batch_size * args.tokens * args.width * 2
    num_batches = max(1, int(args.gb * 1e9 / per_batch))
    results = []
    for n in [int(x) for x in args.threads.split(",")]:
        r = run(Path(args.dir), n, num_batches, args.batch_size, args.tokens, args.width, args.max_shard_bytes)
        results.append(r)
        print(f"{n} writer thread(s): {r['bytes'] / 1e9:.2f} GB in {r['seconds']:.2f} s = {r['gb_per_second']:.2f} GB/s "
              f"({r['shards']} shards, producer blocked {r['producer_wait_seconds']:.2f} s; GIL round trip of the "
              f"loop {r['gil_round_trip_us_while_writing']:.0f} us while writing, {r['gil_round_trip_us_idle']:.0f} "
              f"us idle)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

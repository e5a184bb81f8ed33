"""The writer lanes beside a thread busy in Python, per GIL switch interval (`output.switch_interval_seconds`).

The extraction's main thread spends the loop in Python (launching the forward's kernels) while the writer lanes
need the GIL for a moment between their copies, hashing and writes, which release it. For each `--intervals`
value and each of `--loads` (none; `thread`: a pure-Python busy loop in this process, which holds the GIL;
`process`: the same loop in another process, which takes a core but not the GIL), `--repeats` rounds of
disk_vs_writer.py's writer step (`--lanes` O_DIRECT lanes, `--gb` GB of 40 KB-a-token records into `--dir`).

    python3 bench/gil_switch_probe.py --dir /tmp --gb 1.5 --json bench/results/.../gil_switch.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.disk_vs_writer import filesystem_of, writer_write  # noqa: E402


def _busy(stop) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def one_round(folder: Path, num_bytes: int, lanes: int, load: str) -> float:
    """bytes/s of one writer step with `load` beside it."""
    if load == "thread":
        stop = threading.Event()
        worker = threading.Thread(target=_busy, args=(stop,), daemon=True)
    elif load == "process":
        stop = multiprocessing.Event()
        worker = multiprocessing.Process(target=_busy, args=(stop,), daemon=True)
    else:
        stop, worker = None, None
    if worker is not None:
        worker.start()
        time.sleep(0.2)
    try:
        return writer_write(folder, num_bytes, 20480, 512, 16, lanes, int(0.5e9), "direct")["bytes_per_second"]
    finally:
        if worker is not None:
            stop.set()
            worker.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--gb", type=float, default=1.5)
    p.add_argument("--lanes", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals, seconds")
    p.add_argument("--loads", default="none,thread,process")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    folder, default = Path(args.dir), sys.getswitchinterval()
    result = {"dir": str(folder.resolve()), "filesystem": filesystem_of(folder), "bytes_per_step": int(args.gb * 1e9),
              "lanes": args.lanes, "python_default_interval_seconds": default, "runs": []}
    try:
        for r in range(args.repeats):
            for interval in (float(x) for x in args.intervals.split(",")):
                sys.setswitchinterval(interval)
                for load in args.loads.split(","):
                    rate = one_round(folder, int(args.gb * 1e9), args.lanes, load)
                    result["runs"].append({"round": r, "interval_seconds": interval, "load": load,
                                           "bytes_per_second": rate})
                    print(f"round {r}, interval {interval * 1e3:g} ms, load {load}: {rate / 1e9:.2f} GB/s",
                          flush=True)
    finally:
        sys.setswitchinterval(default)
    result["median_bytes_per_second"] = {
        f"{i * 1e3:g} ms/{load}": statistics.median(x["bytes_per_second"] for x in result["runs"]
                                                    if x["interval_seconds"] == i and x["load"] == load)
        for i in sorted({x["interval_seconds"] for x in result["runs"]}, reverse=True)
        for load in args.loads.split(",")}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    for k, v in result["median_bytes_per_second"].items():
        print(f"{k:<22} {v / 1e9:.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

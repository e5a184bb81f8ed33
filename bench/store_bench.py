"""The `storage` scenario's own steps: the sample list, an extraction into an S3-compatible server on loopback (moto's,
started here) read back and compared with the same extraction on the local disk, and the report of the disk,
tmpfs and S3 runs.

    python3 -m bench.store_bench data DATA.parquet --num-samples N --vocab V
    python3 -m bench.store_bench s3 WORK RESULTS --local LOCAL_OUT -- --set KEY=VALUE ...   (the extraction's sets)
    python3 -m bench.store_bench report RESULTS

`s3` starts an S3-compatible server on 127.0.0.1 (its objects in `--store-tmp`, default /dev/shm: the store's disk
is not the one under test): moto's (moto.server.ThreadedMotoServer, ~0.1 GB/s) or, with `--server rclone`, `rclone
serve s3` (a Go server that takes several times that, but ignores conditional writes: the extraction then runs with
output.require_conditional_writes=false). It times `--probe-gb` uploads through s3fs alone (what the server itself
takes: one upload, then `--probe-threads` at once through one client and through a client per thread), runs
`python -m dflash_prep.commands.extract` with the given sets into
`s3://bench/out` (shards staged in WORK/staging), then downloads the S3 output and reads it and LOCAL_OUT (the
same recipe on the local disk) back through `ShardDataset`, comparing them sample by sample (ids, tokens, the
states' bytes; `read_back` says why a download): RESULTS/store_s3.json. `report` puts the runs' tokens/s side by
side: RESULTS/storage_report.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "bench"


def data(path: Path, num_samples: int, vocab: int) -> None:
    from bench.samples import make_samples, write_pretokenized

    samples = make_samples(num_samples, 5.41, 0.9, 16, 4096, vocab, seed=0)
    write_pretokenized(path, samples, num_samples)
    print(json.dumps(samples.params))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _upload_rate(fs, work: Path, num_bytes: int, threads: int) -> dict:
    """What the server takes from s3fs alone: one file of `num_bytes` through put_file (multipart, in the parts the
    uploader sends), then `threads` uploads of it at once through the one client (one event loop), then through a
    client per thread (remote.ThreadClients, as the extraction's uploader does)."""
    from dflash_prep.store.remote import MULTIPART_CHUNK_BYTES, ThreadClients

    path = work / "upload-probe.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(min(num_bytes, 64 << 20)) * max(1, num_bytes // (64 << 20)))
    size = path.stat().st_size

    def timed(clients, n: int) -> dict:
        def one(i: int) -> None:
            clients().put_file(str(path), f"{BUCKET}/probe-{i}.bin", chunksize=MULTIPART_CHUNK_BYTES)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
        seconds = time.perf_counter() - t0
        fs.rm([f"{BUCKET}/probe-{i}.bin" for i in range(n)])
        return {"uploads": n, "bytes": n * size, "seconds": seconds, "bytes_per_second": n * size / seconds}

    per_thread = ThreadClients(fs)
    try:
        out = {**timed(lambda: fs, 1), "one_client": timed(lambda: fs, threads),
               "client_per_thread": timed(per_thread.get, threads)}
    finally:
        per_thread.close()
        path.unlink()
    return out


def stop_process(proc: subprocess.Popen, timeout_seconds: float = 30) -> None:
    """SIGTERM, then SIGKILL after `timeout_seconds`; waits for the process either way."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serve_rclone_s3(rclone: str, root: Path, timeout_seconds: float = 30) -> tuple[str, subprocess.Popen]:
    """(endpoint, process) of `rclone serve s3 ROOT` on a free loopback port, once it accepts connections (each
    subfolder of `root` is a bucket; no credentials checked). RuntimeError, the process stopped, when it does not
    start within `timeout_seconds`. Also the tests' server (tests/test_conditional_writes.py)."""
    port = _free_port()
    proc = subprocess.Popen([rclone, "serve", "s3", str(root), "--addr", f"127.0.0.1:{port}", "--config", os.devnull,
                             "--vfs-cache-mode", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout_seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"http://127.0.0.1:{port}", proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                stop_process(proc)
                raise RuntimeError("rclone serve s3 did not start") from None
            time.sleep(0.2)


def _start_server(kind: str, store_tmp: Path | None, rclone: str | None):
    """(endpoint, stop, notes) of an S3-compatible server on a loopback port, its objects under `store_tmp`.
    moto: moto's server in this process (Python; ~0.1 GB/s); rclone: `rclone serve s3` over a folder (Go; ignores
    conditional writes, so the extraction runs with output.require_conditional_writes=false)."""
    if kind == "moto":
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        if store_tmp is not None:  # moto keeps objects over 5 MB in temporary files: on RAM, not the disk under test
            tempfile.tempdir = str(store_tmp)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        return f"http://{host}:{port}", server.stop, {"server": "moto"}
    root = Path(tempfile.mkdtemp(prefix="rclone-s3-", dir=store_tmp))
    (root / BUCKET).mkdir()
    endpoint, proc = serve_rclone_s3(rclone, root)

    def stop() -> None:
        stop_process(proc)
        shutil.rmtree(root, ignore_errors=True)

    version = subprocess.run([rclone, "version"], capture_output=True, text=True).stdout.splitlines()[:1]
    return endpoint, stop, {"server": "rclone serve s3", "version": version,
                            "conditional_writes": "ignored by this server: the extraction runs with "
                                                  "output.require_conditional_writes=false"}


def _samples(out: str, storage_options: dict | None) -> dict:
    """sample_id -> (input_ids, loss_mask, sha256 of the states' bytes) of an output, read through the project's
    reader (which also checks each shard's sha256 against its manifest)."""
    import hashlib

    import torch

    from dflash_prep.consume.reader import ShardDataset

    def digest(*tensors) -> str:
        h = hashlib.sha256()
        for t in tensors:
            if t is not None:
                h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    return {s["sample_id"]: (s["input_ids"].tolist(), s["loss_mask"].tolist(),
                             digest(s["hidden_states"], s.get("final_hidden_states")))
            for s in ShardDataset(out, storage_options=storage_options)}


def compare(local: str, remote: str, storage_options: dict | None) -> dict:
    a, b = _samples(local, None), _samples(remote, storage_options)
    differ = [k for k in a if k in b and a[k] != b[k]]
    return {"num_samples_local": len(a), "num_samples_s3": len(b), "same_ids": sorted(a) == sorted(b),
            "num_samples_differing": len(differ), "first_differing": differ[:5],
            "equal": sorted(a) == sorted(b) and not differ}


def read_back(fs, url: str, local: Path, copy: Path) -> dict:
    """The S3 output downloaded whole (s3fs `get`: one GET an object) into `copy`, then compared with `local`
    sample by sample through the reader. Why not the reader on the bucket itself (tests/ do that against the same
    server): it reads in 8 MiB ranges, and moto answers each range GET by copying the whole object out of its
    temporary file, so reading 3.18 GB of 800 MB shards back took over 3 minutes on the H200 machine and ran past
    the step's time. A real store serves ranges without that cost."""
    t0 = time.perf_counter()
    fs.get(url.removeprefix("s3://") + "/", str(copy) + "/", recursive=True)
    download = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in copy.rglob("*") if f.is_file())
    return {"how": "s3fs get of every object, then the reader on the copy", "download_seconds": download,
            "download_bytes": size, "download_bytes_per_second": size / download if download else None,
            **compare(str(local), str(copy), None)}


def _sample_memory(path: Path, stop: threading.Event, every_seconds: float = 2.0) -> None:
    """Every `every_seconds` until `stop`: the machine's available memory and shared memory (tmpfs: /dev/shm holds
    the server's objects) as a JSON line of `path`, flushed, so a run that exhausts memory leaves its trend."""
    t0 = time.perf_counter()
    with open(path, "a") as f:
        while not stop.is_set():
            info = {}
            with open("/proc/meminfo") as m:
                for line in m:
                    name, value = line.split(":", 1)
                    if name in ("MemAvailable", "Shmem", "Cached", "MemFree"):
                        info[name + "_bytes"] = int(value.split()[0]) * 1024
            f.write(json.dumps({"seconds": round(time.perf_counter() - t0, 1), **info}) + "\n")
            f.flush()
            stop.wait(every_seconds)


def s3(work: Path, results: Path, local: Path, sets: list[str], probe_bytes: int, store_tmp: Path | None,
       server_kind: str = "moto", rclone: str | None = None, probe_threads: int = 4) -> int:
    import s3fs

    os.environ.update(CREDENTIALS)
    sampling = threading.Event()
    if Path("/proc/meminfo").is_file():
        threading.Thread(target=_sample_memory, args=(results / "s3_memory.jsonl", sampling), daemon=True).start()
    endpoint, stop, notes = _start_server(server_kind, store_tmp, rclone)
    try:
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
        if server_kind == "moto":
            fs.mkdir(BUCKET)
        else:
            sets = [*sets, "--set", "output.require_conditional_writes=false"]
        probe = _upload_rate(fs, work, probe_bytes, probe_threads)
        print(f"s3fs put_file into {notes['server']} on loopback: one upload {probe['bytes_per_second'] / 1e9:.2f} "
              f"GB/s; {probe_threads} at once, one client {probe['one_client']['bytes_per_second'] / 1e9:.2f}, a "
              f"client per thread {probe['client_per_thread']['bytes_per_second'] / 1e9:.2f}", flush=True)
        url = f"s3://{BUCKET}/out"
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "PYTHONUNBUFFERED": "1"}  # staging: on `work`
        cmd = [sys.executable, "-m", "dflash_prep.commands.extract", "--set", f"output.dir={url}",
               "--set", f"output.staging_dir={work / 'staging'}", "--set", "output.overwrite=true", *sets]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        wall = time.perf_counter() - t0
        result = {"endpoint": endpoint, **notes, "store_tmp": str(store_tmp), "upload_probe": probe,
                  "extract_exit_code": rc, "extract_wall_seconds": wall, "sets": sets}
        out_json = results / "store_s3.json"
        if rc == 0:
            summary = json.loads(fs.cat(f"{BUCKET}/out/summary.json"))
            local_summary = json.loads((local / "summary.json").read_text())
            result.update({"s3_tokens_per_second": summary["tokens_per_second"],
                           "local_tokens_per_second": local_summary["tokens_per_second"],
                           "ratio_s3_to_local": summary["tokens_per_second"] / local_summary["tokens_per_second"],
                           "s3_summary": summary})
            print(f"s3 {summary['tokens_per_second']:.0f} tok/s, local disk {local_summary['tokens_per_second']:.0f}"
                  f" tok/s: ratio {result['ratio_s3_to_local']:.3f}", flush=True)
            out_json.write_text(json.dumps(result, indent=2) + "\n")  # the figures, should the read-back not end
            result["read_back"] = read_back(fs, url, local, work / "s3-copy")
            print(f"read back equal: {result['read_back']['equal']} ({result['read_back']['num_samples_s3']} "
                  f"samples; downloaded at {result['read_back']['download_bytes_per_second'] / 1e6:.0f} MB/s)",
                  flush=True)
        out_json.write_text(json.dumps(result, indent=2) + "\n")
        return 0 if rc == 0 and result["read_back"]["equal"] else 1
    finally:
        stop()
        sampling.set()


def report(results: Path) -> int:
    """The disk, tmpfs and S3 runs' tokens/s side by side (RESULTS/storage_report.json)."""
    runs = {}
    for name in ("8b-disk", "8b-tmpfs", "8b-disk-si"):
        path = results / f"{name}.summary.json"
        if path.is_file():
            s = json.loads(path.read_text())
            runs[name] = {k: s.get(k) for k in ("tokens_per_second", "num_tokens_written", "loop_seconds")}
            ranks = s.get("ranks") if isinstance(s.get("ranks"), list) else []
            # the loop blocked on full writer queues, and draining them after the last forward (a once-a-job tail)
            runs[name].update({k: max((r.get(k) or 0.0 for r in ranks), default=None)
                               for k in ("writer_wait_seconds", "writer_drain_seconds")})
    s3_path = results / "store_s3.json"
    if s3_path.is_file():
        s = json.loads(s3_path.read_text())
        probe = s["upload_probe"]
        runs["8b-s3"] = {"server": s.get("server"), "tokens_per_second": s.get("s3_tokens_per_second"),
                         "read_back_equal": s.get("read_back", {}).get("equal"),
                         "upload_probe_bytes_per_second": probe["bytes_per_second"],
                         "upload_probe_one_client_bytes_per_second": probe.get("one_client", {}).get(
                             "bytes_per_second"),
                         "upload_probe_client_per_thread_bytes_per_second": probe.get("client_per_thread", {}).get(
                             "bytes_per_second")}
    out = {"runs": runs}
    tps = {k: v.get("tokens_per_second") for k, v in runs.items()}
    if tps.get("8b-disk") and tps.get("8b-tmpfs"):
        out["disk_to_tmpfs"] = tps["8b-disk"] / tps["8b-tmpfs"]
    if tps.get("8b-disk-si") and tps.get("8b-disk"):  # output.switch_interval_seconds set, against unset
        out["disk_switch_interval_to_disk"] = tps["8b-disk-si"] / tps["8b-disk"]
    if tps.get("8b-s3") and tps.get("8b-disk"):
        out["s3_to_disk"] = tps["8b-s3"] / tps["8b-disk"]
    dvw = results / "disk_vs_writer-disk.json"
    if dvw.is_file():
        d = json.loads(dvw.read_text())
        out["disk_vs_writer"] = {name: {k: w.get(k) for k in ("bytes_per_second", "ratio_to_buffered",
                                                              "ratio_to_direct")} for name, w in d["writers"].items()}
    (results / "storage_report.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "runs"} | {"tokens_per_second": tps}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sets: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, sets = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python3 -m bench.store_bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data")
    d.add_argument("path", type=Path)
    d.add_argument("--num-samples", type=int, required=True)
    d.add_argument("--vocab", type=int, required=True)
    s = sub.add_parser("s3")
    s.add_argument("work", type=Path)
    s.add_argument("results", type=Path)
    s.add_argument("--local", type=Path, required=True, help="the same extraction's output on the local disk")
    s.add_argument("--probe-gb", type=float, default=1.0, help="bytes of the upload probe, GB")
    s.add_argument("--store-tmp", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                   help="where the server keeps its objects (moto: temporary files); default /dev/shm")
    s.add_argument("--server", choices=("moto", "rclone"), default="moto",
                   help="the S3-compatible server: moto's (in this process) or `rclone serve s3` (--rclone)")
    s.add_argument("--rclone", help="the rclone binary (--server rclone); a .xz file is decompressed into WORK first")
    s.add_argument("--probe-threads", type=int, default=4, help="uploads at once in the probe's parallel steps")
    r = sub.add_parser("report")
    r.add_argument("results", type=Path)
    args = p.parse_args(argv)
    if args.command == "data":
        data(args.path, args.num_samples, args.vocab)
        return 0
    if args.command == "s3":
        args.work.mkdir(parents=True, exist_ok=True)
        rclone = args.rclone
        if rclone and rclone.endswith(".xz"):  # carried compressed (the binary is 86 MB, 21 MB as xz)
            import lzma

            binary = args.work / "rclone"
            with lzma.open(rclone) as src, open(binary, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            binary.chmod(0o755)
            rclone = str(binary)
        return s3(args.work, args.results, args.local, sets, int(args.probe_gb * 1e9), args.store_tmp, args.server,
                  rclone, args.probe_threads)
    return report(args.results)


if __name__ == "__main__":
    sys.exit(main())

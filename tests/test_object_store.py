"""An output in an object store: the tiny demo extracted into a real S3-compatible server (moto's, started here on
127.0.0.1) with 1 and 2 processes, killed (SIGKILL, SIGTERM) and resumed, cut off from the server mid-upload and
resumed, read back by the readers and by a follower beside the extraction; every result is compared with a local run
of the same recipe, byte for byte. The server is reached through a loopback proxy of this file in the tests that cut
connections; nothing of the S3 client is mocked."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, raw_records

s3fs = pytest.importorskip("s3fs")  # the `s3` extra; `test` installs it
moto_server = pytest.importorskip("moto.server")

NUM_SAMPLES = 60
COMMON = ["--set", f"data.max_samples={NUM_SAMPLES}", "--set", "batching.num_workers=0",
          "--set", "batching.max_tokens_per_batch=4096", "--set", "output.max_shard_bytes=1MB"]
MEMBERS = ("input_ids.npy", "loss_mask.npy", "hidden_states.safetensors", "meta.json")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
BASE_ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **CREDENTIALS}
BASE_ENV.pop("DFLASH_PREP_FAULTS", None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """moto's S3 server on a loopback port, for this module (its request log kept off the test output)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    yield f"http://{host}:{port}"
    srv.stop()


def store(endpoint: str):
    """A fresh s3fs client of the server (no cached listing)."""
    return s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint},
                             skip_instance_cache=True)


@pytest.fixture
def bucket(server, request) -> str:
    name = "t-" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]
    store(server).mkdir(name)
    return name


def env_for(endpoint: str, **extra) -> dict:
    return {**BASE_ENV, "AWS_ENDPOINT_URL": endpoint, **extra}


def extract_cmd(out: str, tmp_path: Path, *more: str) -> list[str]:
    return [sys.executable, "extract.py", "--set", f"output.dir={out}",
            "--set", f"output.staging_dir={tmp_path / 'staging'}", *COMMON, *more]


def launch_2proc_cmd(out: str, tmp_path: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--multi_gpu", "--num_processes", "2",
            "--main_process_port", str(free_port()), "extract.py", "--set", f"output.dir={out}",
            "--set", f"output.staging_dir={tmp_path / 'staging'}", *COMMON, *more]


def run_ok(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def remote_records(fs, prefix: str) -> tuple[dict, dict]:
    """(sample id -> {member: bytes}, manifest) of an output in the store, read with s3fs and tarfile alone."""
    fs.invalidate_cache()
    manifest = json.loads(fs.cat_file(f"{prefix}/manifest.json"))
    records: dict[str, dict[str, bytes]] = {}
    for shard in manifest["shards"]:
        data = fs.cat_file(f"{prefix}/{shard['path']}")
        assert hashlib.sha256(data).hexdigest() == shard["sha256"] and len(data) == shard["num_bytes"]
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for info in tar:
                key, member = info.name.split(".", 1)
                assert member not in records.setdefault(key, {}), f"{key}.{member} written twice"
                records[key][member] = tar.extractfile(info).read()
    return records, manifest


def assert_equal_to(reference: dict, records: dict) -> None:
    assert set(records) == set(reference), "the sample ids differ from the local run"
    for key, members in reference.items():
        for member in MEMBERS:
            assert records[key][member] == members[member], f"{key}.{member} differs from the local run"


def assert_clean(fs, prefix: str) -> None:
    """Nothing but committed shards under shards/, no lease left, no multipart upload left open."""
    fs.invalidate_cache()
    manifest = json.loads(fs.cat_file(f"{prefix}/manifest.json"))
    listed = {f"{prefix}/{s['path']}" for s in manifest["shards"]}
    assert set(fs.find(f"{prefix}/shards")) == listed
    assert not fs.exists(f"{prefix}/locks/run.lease")
    bucket, _, key = prefix.partition("/")
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/").get("Uploads")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, dict]:
    """The same recipe into a local folder, one process: (its folder, its records)."""
    tmp = tmp_path_factory.mktemp("local")
    out = tmp / "out"
    run_ok(extract_cmd(str(out), tmp), BASE_ENV)
    records = raw_records(out)
    assert len(records) == NUM_SAMPLES
    return out, records


def committed_lines(fs, prefix: str) -> int:
    fs.invalidate_cache()
    try:
        indexes = fs.find(f"{prefix}/index")
    except FileNotFoundError:
        return 0
    return sum(fs.cat_file(p).count(b"\n") for p in indexes if p.endswith(".jsonl"))


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """`sig` to the process group (start_new_session) of the launched command: every process of the run."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


# ------------------------------------------------------------------------------------------------- fast checks
def test_a_url_the_project_cannot_write_is_refused_never_a_local_folder(tmp_path):
    """`foo://x` (no such protocol) and `http://` (not a store the extraction writes to): exit code 2, one line,
    and no folder named after the scheme appears (the old behaviour wrote `./foo:/x`)."""
    for url in ("foo://bucket/demo", "http://127.0.0.1:1/demo"):
        proc = subprocess.run([sys.executable, str(REPO / "extract.py"), "--set", f"output.dir={url}"],
                              cwd=tmp_path, env=BASE_ENV, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and url in proc.stderr
        assert list(tmp_path.iterdir()) == [], "a local folder was created for a URL"
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "inspect", "foo://bucket/demo"],
                          cwd=REPO, env=BASE_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown protocol foo://" in proc.stderr


def test_credentials_never_come_from_the_recipe():
    from dflash_prep.recipe.schema import RecipeError, load_recipe

    recipe = load_recipe(None, ["output.dir=s3://bucket/x", "output.storage_options={endpoint_url: 'http://h:1'}"])
    assert recipe.output.dir == "s3://bucket/x" and recipe.output.storage_options == {"endpoint_url": "http://h:1"}
    for secret in ("{secret: s}", "{key: k, secret: s}", "{client_kwargs: {aws_secret_access_key: s}}",
                   "{token: t}"):
        with pytest.raises(RecipeError, match="credentials never go into a recipe"):
            load_recipe(None, ["output.dir=s3://bucket/x", f"output.storage_options={secret}"])


def test_the_lease_admits_one_run_and_is_taken_over_from_a_dead_holder(server, bucket):
    """Conditional writes of the real server: a second holder is refused while the first renews; a lease whose
    holder died on this host is taken over at once; the holder that lost it notices (If-Match refused)."""
    from dflash_prep.store.lease import Lease

    fs = store(server)
    path = f"{bucket}/out/locks/run.lease"
    first = Lease(fs, path, ttl_seconds=1.0)
    assert first.try_acquire()
    second = Lease(fs, path, ttl_seconds=1.0)
    assert not second.try_acquire() and second.held_elsewhere()
    time.sleep(1.5)  # several renewals: still held, still refused
    assert not second.try_acquire() and not first.lost.is_set()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe_file(path, json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "holder": "dead",
                                   "renewed_at": time.time(), "ttl_seconds": 3600}).encode())
    assert second.try_acquire()  # its holder's process is gone: taken over without waiting for the TTL
    deadline = time.time() + 5
    while not first.lost.is_set() and time.time() < deadline:
        time.sleep(0.05)
    assert first.lost.is_set()
    first.release()
    second.release()
    fs.invalidate_cache()
    assert not fs.exists(path)



def test_each_upload_thread_has_its_own_client_on_its_own_loop_and_close_ends_them(server, bucket, tmp_path):
    """The uploader's clients (remote.ThreadClients): threads that upload at once get distinct clients on distinct,
    running event loops with the output's endpoint and credentials; a thread's second call reuses its client; the
    objects land whole; close() closes them and stops their loop threads; a thread asking again after close() gets
    a new client that works."""
    from dflash_prep.store.remote import ThreadClients

    shared = store(server)
    clients = ThreadClients(shared)
    payloads = {i: os.urandom(300_000 + i) for i in range(3)}
    seen, barrier = {}, threading.Barrier(3)

    def upload(i: int) -> None:
        src = tmp_path / f"p{i}.bin"
        src.write_bytes(payloads[i])
        fs = clients.get()
        barrier.wait()  # all three threads hold a client at once
        fs.put_file(str(src), f"{bucket}/p{i}.bin")
        seen[i] = (fs, clients.get(), fs.loop, threading.current_thread())

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seen) == [0, 1, 2] and clients.num_made == 3
    assert all(first is again for first, again, _, _ in seen.values())
    assert len({id(fs) for fs, _, _, _ in seen.values()}) == 3 and shared not in [fs for fs, *_ in seen.values()]
    loops = [loop for _, _, loop, _ in seen.values()]
    assert len(set(map(id, loops))) == 3 and shared.loop not in loops and all(loop.is_running() for loop in loops)
    loop_threads = [t for t in threading.enumerate() if t.name == "object-store-loop" and any(
        loop.is_running() and getattr(loop, "_thread_id", None) == t.ident for loop in loops)]
    assert len(loop_threads) == 3  # each loop runs on a thread of its own, none of the callers'
    clients.close()
    assert not any(t.is_alive() for t in loop_threads) and all(loop.is_closed() for loop in loops)
    check = store(server)
    for i, data in payloads.items():
        assert check.cat_file(f"{bucket}/p{i}.bin") == data
    again = clients.get()  # this thread's first client: made after close(), on a running loop
    again.pipe_file(f"{bucket}/again.bin", b"x")
    assert clients.num_made == 4 and again.loop.is_running() and check.cat_file(f"{bucket}/again.bin") == b"x"
    clients.close()


def test_the_shard_uploader_sends_through_a_client_per_thread_and_closes_them(server, bucket, tmp_path, monkeypatch):
    """A rank's ShardUploader (what the lanes hand shards to): its uploads go through clients of its own
    (ThreadClients), not the output's; close() ends them; the shards are committed and whole."""
    from dflash_prep.store.records import ShardRecord
    from dflash_prep.store.remote import RemoteOutput, ShardUploader

    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": server}.items():
        monkeypatch.setenv(key, value)
    remote = RemoteOutput(f"s3://{bucket}/out", None, tmp_path)
    uploader = ShardUploader(remote, 0, 2)
    data = {}
    for i in range(4):
        local = tmp_path / "shards" / "rank-00000" / f"shard-{i:06d}-aaaaaaaa.tar"
        local.parent.mkdir(parents=True, exist_ok=True)
        data[local.name] = os.urandom(2048 + i)
        local.write_bytes(data[local.name])
        uploader.publish(local, ShardRecord(str(local.relative_to(tmp_path)), 1, 1, len(data[local.name]), "0" * 64,
                                            sample_ids=[f"s{i}"]))
    clients = uploader._clients
    uploader.close()
    assert 1 <= clients.num_made <= 2 and clients._made == []  # at most one a pool thread, all closed
    assert not [t for t in threading.enumerate() if t.name == "object-store-loop" and t.is_alive()]
    assert sorted(r["path"].rsplit("/", 1)[1] for r in map(json.loads, remote.cat(
        "index/rank-00000.jsonl").decode().splitlines())) == sorted(data)
    for name, content in data.items():
        assert remote.cat(f"shards/rank-00000/{name}") == content


@pytest.mark.slow
def test_a_follower_yields_each_committed_shard_once_and_ends_at_the_manifest(local_run, tmp_path):
    """A follower on a folder whose shards and index lines arrive one by one (copied from a real run's output):
    nothing before its index line (a shard file alone, a torn line), everything once, the end at the manifest."""
    from dflash_prep.consume.reader import ShardDataset

    out, reference = local_run
    live = tmp_path / "live"
    (live / "index").mkdir(parents=True)
    (live / "run_state.json").write_bytes((out / "run_state.json").read_bytes())
    lines = [line for p in sorted((out / "index").glob("rank-*.jsonl")) for line in p.read_bytes().splitlines(True)]
    got: list[str] = []
    error: list[BaseException] = []

    def follow():
        try:
            for s in ShardDataset(live, follow=True, poll_seconds=0.05, timeout_seconds=30):
                got.append(s["sample_id"])
        except BaseException as e:  # noqa: BLE001
            error.append(e)

    thread = threading.Thread(target=follow)
    thread.start()
    index = live / "index" / "rank-00000.jsonl"
    expected = 0
    for line in lines:
        record = json.loads(line)
        (live / record["path"]).parent.mkdir(parents=True, exist_ok=True)
        (live / record["path"]).write_bytes((out / record["path"]).read_bytes())  # the shard, not yet committed
        time.sleep(0.15)
        assert len(got) == expected, "a shard was read before its index line"
        with open(index, "ab") as f:
            f.write(line[:20])  # a torn line: not a commit
            f.flush()
            time.sleep(0.15)
            assert len(got) == expected
            f.write(line[20:])
        expected += record["num_samples"]
        deadline = time.time() + 10
        while len(got) < expected and time.time() < deadline:
            time.sleep(0.02)
        assert len(got) == expected
    assert thread.is_alive(), "the follower ended before the manifest"
    for name in ("manifest.json",):
        (live / name).write_bytes((out / name).read_bytes())
    thread.join(timeout=30)
    assert not error, error
    assert sorted(got) == sorted(reference) and len(got) == len(set(got))


# ---------------------------------------------------------------------------------------------- extractions
@pytest.mark.slow
def test_one_and_two_processes_into_the_store_equal_a_local_run(server, bucket, local_run, tmp_path):
    """The same recipe into s3://: one process gives the local run's shards byte for byte (same paths, sha256);
    two processes give the same samples, byte for byte; inspect --check and the readers take the URL."""
    from dflash_prep.commands.inspect import check_output
    from dflash_prep.consume.reader import ShardDataset

    out, reference = local_run
    fs = store(server)
    env = env_for(server)
    run_ok(extract_cmd(f"s3://{bucket}/one", tmp_path), env)
    records, manifest = remote_records(fs, f"{bucket}/one")
    assert_equal_to(reference, records)
    local_manifest = json.loads((out / "manifest.json").read_text())
    # the same layout: paths (less each run's own id in the shard names), sizes, sha256
    assert [{**s, "path": re.sub(r"-[0-9a-f]{8}\.tar$", ".tar", s["path"])} for s in manifest["shards"]] == \
        [{**s, "path": re.sub(r"-[0-9a-f]{8}\.tar$", ".tar", s["path"])} for s in local_manifest["shards"]]
    assert_clean(fs, f"{bucket}/one")
    assert not list((tmp_path / "staging").rglob("*.tar*")), "a shard was left in the staging folder"

    run_ok(launch_2proc_cmd(f"s3://{bucket}/two", tmp_path / "2"), env)
    records, manifest = remote_records(fs, f"{bucket}/two")
    assert_equal_to(reference, records)
    assert {s["path"].split("/")[1] for s in manifest["shards"]} == {"rank-00000", "rank-00001"}
    assert_clean(fs, f"{bucket}/two")

    os.environ.update(AWS_ENDPOINT_URL=server, **CREDENTIALS)  # the readers in this process: the store's config
    try:
        assert check_output(f"s3://{bucket}/two") == []
        samples = {s["sample_id"]: s for s in ShardDataset(f"s3://{bucket}/two")}
        local = {s["sample_id"]: s for s in ShardDataset(out)}
        assert set(samples) == set(local)
        for key, s in local.items():
            for name in ("input_ids", "loss_mask", "hidden_states"):
                assert s[name].dtype == samples[key][name].dtype and s[name].equal(samples[key][name])
    finally:
        os.environ.pop("AWS_ENDPOINT_URL")


@pytest.mark.slow
def test_a_second_run_into_the_same_store_output_is_refused(server, bucket, tmp_path):
    """A live lease (held here, renewed) refuses a run into the output with exit code 2, naming the holder."""
    from dflash_prep.store.lease import Lease

    lease = Lease(store(server), f"{bucket}/busy/locks/run.lease")
    assert lease.try_acquire()
    try:
        proc = subprocess.run(extract_cmd(f"s3://{bucket}/busy", tmp_path), cwd=REPO, env=env_for(server),
                              capture_output=True, text=True, timeout=300)
    finally:
        lease.release()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"another run is writing into s3://{bucket}/busy (pid {os.getpid()}" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_killed_then_resumed_equals_a_local_run(server, bucket, local_run, tmp_path, sig):
    """Two processes into the store, stopped mid-run (SIGTERM: a clean stop that commits what was captured; the
    follower test below SIGKILLs the same run anywhere, an upload or an index rewrite included), then resumed by one
    process: the local run's samples, byte for byte."""
    fs = store(server)
    prefix = f"{bucket}/out"
    env = env_for(server, DFLASH_PREP_FAULTS=json.dumps({"forward_delay_seconds": 0.2}))
    workers = ["--set", "batching.num_workers=2"]  # DataLoader workers, as users run them: they must not hold on
    proc = subprocess.Popen(launch_2proc_cmd(f"s3://{prefix}", tmp_path, *workers), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and committed_lines(fs, prefix) < 3:
        time.sleep(0.05)
    time.sleep(random.Random(int(sig)).uniform(0.0, 0.4))
    assert proc.poll() is None, "the run ended before the kill: the test proved nothing"
    kill_tree(proc, sig)
    if sig == signal.SIGTERM:
        assert proc.returncode == 1, proc.stderr.read()[-2000:]
    assert not fs.exists(f"{prefix}/manifest.json")
    run_ok(extract_cmd(f"s3://{prefix}", tmp_path), env_for(server))
    assert_equal_to(local_run[1], remote_records(fs, prefix)[0])
    assert_clean(fs, prefix)


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of the server that, once `cut_after_bytes` bytes went from clients to the
    server, closes every connection and refuses new ones (a network that drops mid-upload) until `restore()`."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut_after_bytes: int | None = None
        self.sent = 0
        self.cut = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self.lock:
                self.sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src, dst, counted):
        try:
            while data := src.recv(65536):
                if counted:
                    with self.lock:
                        self.sent += len(data)
                        if self.cut_after_bytes is not None and self.sent >= self.cut_after_bytes:
                            self._cut()
                            return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def _cut(self):
        self.cut.set()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
        self.sockets = []

    def restore(self):
        self.cut_after_bytes = None
        self.cut.clear()

    def close(self):
        self.listener.close()
        self._cut()


@pytest.mark.slow
def test_connections_dropped_mid_upload_leave_no_partial_object_and_the_resume_completes(server, bucket, tmp_path):
    """Shards of ~12 MB (float32 states: 15 MB in all) uploaded as multipart uploads of 5 MiB parts through a
    proxy that drops every connection in the middle of the first one: the run stops (exit code 1, one line), every
    object under shards/ is absent or a whole shard, and the resume (connections back) gives the local run's
    samples."""
    fs = store(server)
    prefix = f"{bucket}/out"
    big = ["--set", "output.max_shard_bytes=12MB", "--set", "output.num_writer_threads=1",
           "--set", "output.dtype=float32"]
    run_ok(extract_cmd(str(tmp_path / "local"), tmp_path / "l", *big), BASE_ENV)
    reference = raw_records(tmp_path / "local")
    proxy = CuttingProxy(int(server.rsplit(":", 1)[1]))
    proxy.cut_after_bytes = 8 << 20  # past the small files, inside the first shard's parts
    try:
        faults = json.dumps({"upload_part_bytes": 5 << 20})
        env = env_for(f"http://127.0.0.1:{proxy.port}", DFLASH_PREP_FAULTS=faults, AWS_MAX_ATTEMPTS="2")
        proc = subprocess.run(extract_cmd(f"s3://{prefix}", tmp_path, *big), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proxy.cut.is_set(), "the connection was never cut: the test proved nothing"
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "re-run the same command" in proc.stderr
        fs.invalidate_cache()
        assert not fs.exists(f"{prefix}/manifest.json")
        for key in fs.find(f"{prefix}/shards"):  # whatever is there is a whole tar
            with tarfile.open(fileobj=io.BytesIO(fs.cat_file(key))) as tar:
                assert all(m.size >= 0 for m in tar.getmembers())
        proxy.restore()
        run_ok(extract_cmd(f"s3://{prefix}", tmp_path, *big), {**env, "AWS_MAX_ATTEMPTS": "5"})
    finally:
        proxy.close()
    assert_equal_to(reference, remote_records(fs, prefix)[0])
    assert_clean(fs, prefix)


FOLLOWER = """
import hashlib, json, sys
from dflash_prep.consume.reader import ShardDataset
with open(sys.argv[2], "w") as f:
    for s in ShardDataset(sys.argv[1], follow=True, poll_seconds=0.2, timeout_seconds=300):
        digest = hashlib.sha256(s["hidden_states"].view(-1).view(dtype=__import__("torch").uint8).numpy()).hexdigest()
        f.write(json.dumps({"id": s["sample_id"], "states": digest, "tokens": s["input_ids"].tolist()}) + "\\n")
        f.flush()
print("follower done")
"""


@pytest.mark.slow
def test_a_follower_beside_a_killed_and_resumed_two_process_extraction(server, bucket, local_run, tmp_path):
    """A follower in its own process reads the store while 2 processes extract, are SIGKILLed and resumed: every
    sample once, each equal to the local run's, none from a shard that was not committed; it ends at the
    manifest."""
    from safetensors.torch import load

    fs = store(server)
    prefix = f"{bucket}/out"
    seen_file = tmp_path / "seen.jsonl"
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, f"s3://{prefix}", str(seen_file)], cwd=REPO,
                                env=env_for(server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    env = env_for(server, DFLASH_PREP_FAULTS=json.dumps({"forward_delay_seconds": 0.2}))
    proc = subprocess.Popen(launch_2proc_cmd(f"s3://{prefix}", tmp_path), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    def lines_seen() -> int:
        return seen_file.read_text().count("\n") if seen_file.exists() else 0

    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and (committed_lines(fs, prefix) < 3 or not lines_seen()):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the kill"
    kill_tree(proc)
    seen_before_resume = lines_seen()
    run_ok(launch_2proc_cmd(f"s3://{prefix}", tmp_path), env_for(server))
    out, err = follower.communicate(timeout=300)
    assert follower.returncode == 0 and "follower done" in out, err[-3000:]
    seen = [json.loads(line) for line in seen_file.read_text().splitlines()]
    ids = [s["id"] for s in seen]
    assert len(ids) == len(set(ids)) == NUM_SAMPLES, "a sample missing or yielded twice"
    assert 0 < seen_before_resume < NUM_SAMPLES  # it read while the extraction ran, before the resume
    reference = local_run[1]
    assert_equal_to(reference, remote_records(fs, prefix)[0])  # the resumed output itself, byte for byte
    assert_clean(fs, prefix)
    for s in seen:
        states = load(reference[s["id"]]["hidden_states.safetensors"])["hidden_states"]
        assert hashlib.sha256(states.view(-1).view(dtype=__import__("torch").uint8).numpy()).hexdigest() == \
            s["states"], f"sample {s['id']} differs from the local run"


FROZEN_UPLOADER = """
import sys, time
from pathlib import Path
from dflash_prep.store.lease import Lease
from dflash_prep.store.locks import LeaseLostError
from dflash_prep.store.records import ShardRecord
from dflash_prep.store.remote import RemoteFence, RemoteOutput, ShardUploader
url, staging = sys.argv[1], Path(sys.argv[2])
remote = RemoteOutput(url, None, staging)
lease = Lease(remote.fs, remote.key("locks/run.lease"), ttl_seconds=1.0)
assert lease.try_acquire(min_generation=remote.max_fence() + 1)
uploader = ShardUploader(remote, 0, 1, fence=RemoteFence(remote, lease.generation))
local = staging / "shards" / "rank-00000" / "shard-000000-aaaaaaaa.tar"
local.parent.mkdir(parents=True)
local.write_bytes(b"a" * 2048)
print("ready", lease.generation, flush=True)
sys.stdin.readline()  # SIGSTOPped here past its TTL; woken, it tries to commit
try:
    uploader.publish(local, ShardRecord(str(local.relative_to(staging)), 1, 1, 2048, "0" * 64, sample_ids=["s0"]))
    uploader.close()
    print("committed", flush=True)
except LeaseLostError as e:
    print("lost:", e, flush=True)
"""


def test_a_run_frozen_past_its_lease_commits_nothing_to_the_store(server, bucket, tmp_path, monkeypatch):
    """Run A (host node-a) is stopped past its lease's TTL; run B takes the run lease over (a higher generation,
    judged by the store's clock) and commits the same sample; A, woken, uploads and commits nothing."""
    from dflash_prep.store.lease import Lease
    from dflash_prep.store.records import ShardRecord
    from dflash_prep.store.remote import RemoteFence, RemoteOutput, ShardUploader

    url = f"s3://{bucket}/out"
    env = {**env_for(server), "PYTHONPATH": str(REPO)}
    a = subprocess.Popen([sys.executable, str(REPO / "tests" / "other_host.py"), "node-a", "-c", FROZEN_UPLOADER,
                          url, str(tmp_path / "a")], cwd=REPO, env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    ready, generation = a.stdout.readline().split()
    assert ready == "ready"
    a.send_signal(signal.SIGSTOP)
    time.sleep(2.5)  # past its TTL of 1 s (the store's clock has whole seconds)
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": server}.items():
        monkeypatch.setenv(key, value)
    try:
        remote = RemoteOutput(url, None, tmp_path / "b")
        lease = Lease(remote.fs, remote.key("locks/run.lease"), ttl_seconds=1.0)
        assert lease.try_acquire(min_generation=remote.max_fence() + 1)
        assert lease.generation > int(generation)
        uploader = ShardUploader(remote, 0, 1, fence=RemoteFence(remote, lease.generation))
        local = tmp_path / "b" / "shards" / "rank-00000" / "shard-000000-bbbbbbbb.tar"
        local.parent.mkdir(parents=True)
        local.write_bytes(b"b" * 1024)
        uploader.publish(local, ShardRecord(str(local.relative_to(tmp_path / "b")), 1, 1, 1024, "0" * 64,
                                            sample_ids=["s0"]))
        uploader.close()
        a.send_signal(signal.SIGCONT)
        a.stdin.write("go\n")
        a.stdin.flush()
        answer = a.stdout.readline()
        assert answer.startswith("lost:") and "no longer holds the output" in answer, answer
        assert a.wait(timeout=60) == 0
        lines = [json.loads(line) for line in remote.cat("index/rank-00000.jsonl").decode().splitlines()]
        assert [(r["path"], r["fence"]) for r in lines] == [("shards/rank-00000/shard-000000-bbbbbbbb.tar",
                                                            lease.generation)]
        assert sorted(remote.shard_sizes()) == ["shards/rank-00000/shard-000000-bbbbbbbb.tar"]
        lease.release()
    finally:
        if a.poll() is None:
            a.kill()


def test_a_run_that_lost_the_output_before_its_repair_deletes_and_rewrites_nothing(server, bucket, tmp_path,
                                                                                   monkeypatch):
    """Run A read the indexes when it claimed the output (nothing committed then), then stopped; run B took the
    output over and committed a shard. A, woken, goes on with its repair: its listing holds B's shard, which A's
    stale indexes do not list. The repair stops at the fence (LeaseLostError) with B's shard, index and every
    object as they were. The holder's own repair (control) still deletes a stray object and keeps B's shard."""
    from dflash_prep.commands.extract.claim import repair_output
    from dflash_prep.store.lease import Lease
    from dflash_prep.store.locks import LeaseLostError
    from dflash_prep.store.records import ShardRecord
    from dflash_prep.store.remote import RemoteFence, RemoteOutput, ShardUploader

    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": server}.items():
        monkeypatch.setenv(key, value)
    url = f"s3://{bucket}/out"
    remote_b = RemoteOutput(url, None, tmp_path / "b")
    lease_b = Lease(remote_b.fs, remote_b.key("locks/run.lease"), ttl_seconds=30.0)
    assert lease_b.try_acquire(min_generation=5)  # A held generation 4 before B took the output over
    try:
        uploader = ShardUploader(remote_b, 0, 1, fence=RemoteFence(remote_b, lease_b.generation))
        local = tmp_path / "b" / "shards" / "rank-00000" / "shard-000000-bbbbbbbb.tar"
        local.parent.mkdir(parents=True)
        local.write_bytes(b"s0.hidden_states.npy\0".ljust(1024, b"b"))  # a tar's first member name: sample s0
        record = ShardRecord(str(local.relative_to(tmp_path / "b")), 1, 1, 1024, "0" * 64, sample_ids=["s0"])
        uploader.publish(local, record)
        uploader.close()
        before = {rel: remote_b.cat(rel) for rel in remote_b._objects() if not rel.startswith("locks/")}
        assert record.path in before and "index/rank-00000.jsonl" in before

        staging_a = tmp_path / "a"  # A's copy of the indexes, read at its claim: none committed
        (staging_a / "index").mkdir(parents=True)
        remote_a = RemoteOutput(url, None, staging_a)
        with pytest.raises(LeaseLostError, match="no longer holds the output"):
            repair_output(staging_a, remote_a, RemoteFence(remote_a, lease_b.generation - 1))
        after = {rel: remote_b.cat(rel) for rel in remote_b._objects() if not rel.startswith("locks/")}
        assert after == before, "a run that lost the output changed the store"

        # control: the holder's repair (its fence is the lease's) removes what no index lists, keeps the committed
        remote_b.put_bytes("shards/rank-00000/shard-000001-aaaaaaaa.tar", b"stray")
        staging_c = tmp_path / "c"
        remote_c = RemoteOutput(url, None, staging_c)
        remote_c.pull("index/")
        assert repair_output(staging_c, remote_c, RemoteFence(remote_c, lease_b.generation))
        assert sorted(remote_c.shard_sizes()) == [record.path]
    finally:
        lease_b.release()


@pytest.mark.parametrize("lose", [1, 2], ids=["the create", "the first renewal"])
def test_a_lease_write_whose_answer_is_lost_is_still_held(server, bucket, lose):
    """The store applies the lease's create (or a renewal) but the answer is lost; botocore retries the same
    conditional PUT and the store refuses it (412): the run still holds its lease, neither refused as busy by its
    own write nor taken for lost."""
    from lost_answer_proxy import LostAnswerProxy

    from dflash_prep.store.lease import Lease

    with LostAnswerProxy(server, "PUT", "locks/run.lease", {lose}) as proxy:
        lease = Lease(store(proxy.url), f"{bucket}/out/locks/run.lease", ttl_seconds=1.0)
        try:
            assert lease.try_acquire(), proxy.lost
            time.sleep(1.5)  # six renewals
            assert [status.split()[1] for _, _, status in proxy.lost] == ["200"], proxy.lost
            assert not lease.lost.is_set()
            lease.check_held()
        finally:
            lease.release()


def test_an_index_commit_whose_answer_is_lost_is_committed_once(server, bucket, tmp_path, monkeypatch):
    """The store applies the rewrite of the rank index that commits a shard, the answer is lost, the retry is
    refused (412): the commit stands, and the index holds its line once."""
    from lost_answer_proxy import LostAnswerProxy

    from dflash_prep.store.records import ShardRecord
    from dflash_prep.store.remote import RemoteOutput, ShardUploader

    with LostAnswerProxy(server, "PUT", "index/rank-00000.jsonl", {1}) as proxy:
        for key, value in CREDENTIALS.items():
            monkeypatch.setenv(key, value)
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True}  # not a cached client
        remote = RemoteOutput(f"s3://{bucket}/out", options, tmp_path)
        uploader = ShardUploader(remote, 0, 1)
        local = tmp_path / "shards" / "rank-00000" / "shard-000000-aaaaaaaa.tar"
        local.parent.mkdir(parents=True)
        local.write_bytes(b"s0.hidden_states.npy\0".ljust(1024, b"a"))
        record = ShardRecord(str(local.relative_to(tmp_path)), 1, 1, 1024, "0" * 64, sample_ids=["s0"])
        uploader.publish(local, record)
        uploader.close()
    assert len(proxy.lost) == 1, proxy.lost
    lines = store(server).cat_file(f"{bucket}/out/index/rank-00000.jsonl").decode().splitlines()
    assert [json.loads(line)["path"] for line in lines] == [record.path]


def test_a_shard_uploaded_by_a_run_that_lost_the_output_meanwhile_is_deleted(server, bucket, tmp_path, monkeypatch):
    """Run A's upload is in flight when run B takes the output over; the upload lands, A's commit is refused by the
    fence (LeaseLostError), and A deletes the object it uploaded: no unlisted object of A is left in B's output
    (B's resume, the one that deletes such objects, is not coming)."""
    from lost_answer_proxy import LostAnswerProxy

    from dflash_prep.store.lease import Lease
    from dflash_prep.store.locks import LeaseLostError
    from dflash_prep.store.records import ShardRecord
    from dflash_prep.store.remote import RemoteFence, RemoteOutput, ShardUploader

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    fs = store(server)
    lease_path = f"{bucket}/out/locks/run.lease"
    lease_a = Lease(fs, lease_path, ttl_seconds=30.0)
    assert lease_a.try_acquire(min_generation=3)
    with LostAnswerProxy(server, "PUT", "shards/", hold={1}) as proxy:
        options = {"client_kwargs": {"endpoint_url": proxy.url}, "skip_instance_cache": True}
        remote_a = RemoteOutput(f"s3://{bucket}/out", options, tmp_path)
        uploader = ShardUploader(remote_a, 0, 1, fence=RemoteFence(remote_a, lease_a.generation))
        local = tmp_path / "shards" / "rank-00000" / "shard-000000-aaaaaaaa.tar"
        local.parent.mkdir(parents=True)
        local.write_bytes(b"s0.hidden_states.npy\0".ljust(1024, b"a"))
        record = ShardRecord(str(local.relative_to(tmp_path)), 1, 1, 1024, "0" * 64, sample_ids=["s0"])
        uploader.publish(local, record)
        assert proxy.held.wait(30)  # A's upload is on its way to the store
        lease_a.release()  # A stopped past its lease: B takes the output over
        lease_b = Lease(fs, lease_path, ttl_seconds=30.0)
        assert lease_b.try_acquire(min_generation=4)
        try:
            proxy.release_held()
            with pytest.raises(LeaseLostError, match="no longer holds the output"):
                uploader.close()
            fs.invalidate_cache()
            assert not fs.exists(f"{bucket}/out/{record.path}"), "A's upload was left in B's output"
            assert not fs.exists(f"{bucket}/out/index/rank-00000.jsonl")
        finally:
            lease_b.release()


def test_a_bucket_deleted_under_a_run_is_said_as_such(server, tmp_path, monkeypatch):
    """The fence of a run whose bucket was deleted (with everything in it) says that, not that another run took
    the output over."""
    from dflash_prep.store.locks import LeaseLostError
    from dflash_prep.store.remote import RemoteFence, RemoteOutput

    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": server}.items():
        monkeypatch.setenv(key, value)
    fs = store(server)
    fs.mkdir("t-gone")
    remote = RemoteOutput("s3://t-gone/out", {"skip_instance_cache": True}, tmp_path)
    lease = remote.lease("run")
    assert lease.try_acquire(min_generation=2)
    lease.release()
    fs.rm("t-gone", recursive=True)
    with pytest.raises(LeaseLostError, match="its bucket no longer exists"):
        RemoteFence(remote, 2).check()

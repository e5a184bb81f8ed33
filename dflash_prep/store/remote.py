"""An extraction output in an object store (`output.dir: s3://bucket/prefix`, or any protocol of
recipe/location.py's WRITABLE_PROTOCOLS), through fsspec.

The output's layout in the store is the local one (docs/STORAGE.md, "Output layout"): the same relative names under the
prefix. A run works in a local staging folder (`output.staging_dir`), which holds the shards being written and
uploaded and a copy of the output's small files (plan, run state, indexes), and this module moves things between the
two:

- shards: a lane writes and commits its shard locally as always (`.tmp`, fsync, rename), then hands it to the rank's
  `ShardUploader`, which uploads it to its final key (`fs.put_file`: one PUT, or a multipart upload above
  `MULTIPART_CHUNK_BYTES`, which the store completes atomically: the object appears whole under its name or not at
  all), then commits it by rewriting the rank's index object `index/rank-RRRRR.jsonl` with one more line (a
  whole-object PUT, also atomic), then deletes the local file. At most `output.max_uploads_in_flight` uploads run
  per rank; a lane that closes a shard beyond that waits, so the staging folder holds at most (lanes + uploads)
  shards per rank, never the output;
- the committed state is what the rank indexes in the store list, as for a local output: a resume lists them,
  deletes shard objects no index lists (an upload finished but not indexed when the run died) and aborts the
  multipart uploads a killed run left (S3), and redoes exactly the rest;
- the small files: pulled into the staging folder when a run claims the output (`pull_state`), pushed back after
  the stage that wrote them (`push`), the manifest last of all.

Fencing: each commit first checks the run's fence (`RemoteFence`: the output's run lease still carries this run's
generation), and the index object is rewritten only if it is still the version this rank last read or wrote
(`If-Match` on its ETag; `If-None-Match: *` for a new one): a run that lost the output and wakes finds the index
changed and its fence gone, and commits nothing. A rewrite refused while the fence holds (a frozen run's late line
landed meanwhile) is redone over the index as it is now, that line kept (the record store keeps one of two runs'
records of a sample).

Why a rewrite of the whole index per shard (not an append, which object stores do not have): it keeps the index
format of a local output (`read_committed`, `inspect`, the follower read it alike); its size grows with the
shards, ~600 bytes a shard plus its sample ids, so a rank of 1,000 shards re-uploads about 0.6 GB of index over a
whole run, against terabytes of shards.

Credentials: the filesystem's own configuration (recipe/location.py); nothing secret is stored here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from dflash_prep.recipe.location import ConditionalWritesIgnoredError, check_store
from dflash_prep.store.lease import (Lease, LeaseLostError, StoreError, _is_s3, _precondition_failed, store_call,
                                    within_seconds)
from dflash_prep.store.locks import LOCKS_DIR, OutputBusyError
from dflash_prep.store.manifest import MANIFEST_NAME, read_committed, shard_store
from dflash_prep.store.record_store import SUPERSEDED_NAME
from dflash_prep.store.records import INDEX_DIR, SHARDS_DIR, ShardRecord, rank_name

log = logging.getLogger("dflash_prep")

LOGS_DIR = "logs"
LOG_PUSH_SECONDS = 30.0  # a stopping run's wait for the upload of its logs
MULTIPART_CHUNK_BYTES = 64 << 20  # a shard above 2x this is uploaded as a multipart upload of parts of this size
SLOT_POLL_SECONDS = 1.0  # a lane waiting for an upload slot checks its lease this often
ABORT_WAIT_SECONDS = 30.0  # a stopping run's wait for its uploads in flight
_NOT_STATE = (SHARDS_DIR + "/", LOCKS_DIR + "/", LOGS_DIR + "/")  # folders pull_state leaves out
_PROGRESS_SUFFIX = ".progress.json"  # progress.py's per-rank figures: advisory, node-local, never pushed


def _quiet_client_loop(fs) -> None:
    """An async client's failed requests (a dropped connection) leave tasks whose errors asyncio prints to stderr
    ("Task exception was never retrieved", with a traceback): the error that matters reaches the run through the
    call that failed, so these go to the log file only."""
    loop = getattr(fs, "loop", None)
    if loop is not None:
        loop.set_exception_handler(lambda _loop, context: log.debug(
            "object store client: %s", context.get("exception") or context.get("message"),
            extra={"console": False}))


def default_staging_dir(url: str) -> Path:
    """A per-output folder under the system's temporary directory (the same on every process of a node)."""
    import hashlib

    return Path(tempfile.gettempdir()) / "dflash-prep-staging" / hashlib.sha256(url.encode()).hexdigest()[:16]


class RemoteOutput:
    """The output at `url` in an object store, and this node's staging folder for it."""

    def __init__(self, url: str, storage_options: dict | None, staging: Path):
        import fsspec

        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.url_to_fs(self.url, **(storage_options or {}))
        _quiet_client_loop(self.fs)
        self.root = self.root.rstrip("/")
        self.staging = Path(staging)
        self.rank_lease: Lease | None = None  # this process's rank lease, once it writes (claim_rank)
        self.fence: RemoteFence | None = None  # the run's fence, once the output is claimed (claim.py)
        self.fd = None  # kept with the run's locks (run.py), released last: `release` uploads the logs

    # -- names -------------------------------------------------------------------------------------------------
    def key(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def name(self, rel: str = "") -> str:
        """The URL of `rel` (for messages)."""
        return f"{self.url}/{rel}" if rel else self.url

    def _rel(self, key: str) -> str:
        return key[len(self.root) + 1:]

    @store_call
    def _objects(self, prefix: str = "") -> dict[str, int]:
        """{relative name: size} of every object under the prefix (a fresh listing)."""
        self.fs.invalidate_cache()
        base = self.key(prefix).rstrip("/") if prefix else self.root
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {self._rel(k): int(v.get("size") or 0) for k, v in found.items()
                if v.get("type", "file") == "file" and k.startswith(self.root + "/")}

    # -- small files ---------------------------------------------------------------------------------------------
    @store_call
    def cat(self, rel: str) -> bytes | None:
        try:
            return self.fs.cat_file(self.key(rel))
        except FileNotFoundError:
            return None

    @store_call
    def put_bytes(self, rel: str, data: bytes) -> None:
        """One PUT of the whole object: it is replaced atomically."""
        self.fs.pipe_file(self.key(rel), data)

    @store_call
    def _download(self, rel: str, dest: Path) -> bool:
        """`rel` into `dest` (tmp, rename: a reader never sees part of it); False when the object is absent."""
        data = self.cat(rel)
        if data is None:
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}.pull")
        tmp.write_bytes(data)
        os.replace(tmp, dest)
        return True

    def pull_state(self) -> list[str]:
        """Main process, as it claims the output: empty the staging folder (but this run's logs and locks) and copy
        in every object of the output that is not a shard, a lock or a log. -> the names copied."""
        self.staging.mkdir(parents=True, exist_ok=True)
        for child in self.staging.iterdir():
            if child.name not in (LOGS_DIR, LOCKS_DIR):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        names = [rel for rel in self._objects() if not rel.startswith(_NOT_STATE)]
        for rel in names:
            self._download(rel, self.staging / rel)
        return names

    def pull_file(self, rel: str) -> bool:
        """Copy one object into the staging folder (atomically); False when it is absent."""
        return self._download(rel, self.staging / rel)

    def pull(self, prefix: str) -> list[str]:
        """Copy the objects under `prefix` (e.g. `index/`) into the staging folder; -> their names."""
        names = list(self._objects(prefix))
        for rel in names:
            self._download(rel, self.staging / rel)
        return names

    @store_call
    def push(self, rels) -> None:
        """Upload these staging files (relative names; those absent are skipped), each one PUT."""
        for rel in rels:
            path = self.staging / rel
            if path.is_file():
                self.fs.put_file(str(path), self.key(rel))

    def push_state(self, last: tuple[str, ...] = (MANIFEST_NAME,), fence=None) -> None:
        """Upload the staging folder's small files: every file but shards, locks, logs, the rank indexes (their
        ranks write them) and progress files; the names in `last` after all others (the manifest last), once
        `fence` (RemoteFence) says this run still holds the output (checked before the others too: a run that lost
        the output must not replace the summary or the token counts of the run that holds it)."""
        rels = sorted(str(p.relative_to(self.staging)) for p in self.staging.rglob("*") if p.is_file())
        rels = [r for r in rels if not r.startswith(_NOT_STATE + (INDEX_DIR + "/",))
                and not r.endswith((".tmp", ".pull", _PROGRESS_SUFFIX))]
        if fence is not None:
            fence.check()
        self.push([r for r in rels if r not in last])
        if fence is not None:
            fence.check()
        self.push([r for r in last if r in rels])

    def push_rank_file(self, rel: str) -> None:
        """A rank's own file under index/ (its done report)."""
        self.push([rel])

    def release(self) -> None:
        """The run is over on this process: upload the node's logs, waiting at most LOG_PUSH_SECONDS for the store;
        not when another run took the output over (`fence`): the logs there are that run's."""
        within_seconds(self._push_logs_if_held, LOG_PUSH_SECONDS, "uploading this node's logs")

    def _push_logs_if_held(self) -> None:
        if self.fence is not None and self.fence.taken_over():
            log.warning("this node's logs are not uploaded: another run holds %s now (the logs there are its "
                        "own); they are in %s", self.url, self.staging / LOGS_DIR)
            return
        self.push_logs()

    def push_logs(self) -> None:
        """This node's rank logs (best effort: a log is a record, not part of the output)."""
        folder = self.staging / LOGS_DIR
        for path in sorted(folder.glob("*.log")) if folder.is_dir() else []:
            try:
                self.push([f"{LOGS_DIR}/{path.name}"])
            except OSError as e:
                log.warning("could not upload %s: %s", path.name, e)

    # -- the committed state ---------------------------------------------------------------------------------------
    def committed(self) -> list[ShardRecord]:
        """The committed shards as the rank indexes in the store list them now (`read_committed`'s rules)."""
        with tempfile.TemporaryDirectory(prefix="dflash-prep-index-") as tmp:
            for rel in self._objects(INDEX_DIR + "/"):
                if rel.endswith(".jsonl"):
                    self._download(rel, Path(tmp) / rel)
            return read_committed(tmp)

    def max_fence(self) -> int:
        """The highest fencing token of the rank indexes in the store (RecordStore.max_fence; -1: none)."""
        with tempfile.TemporaryDirectory(prefix="dflash-prep-index-") as tmp:
            for rel in self._objects(INDEX_DIR + "/"):
                if rel.endswith(".jsonl"):
                    self._download(rel, Path(tmp) / rel)
            return shard_store(Path(tmp)).max_fence()

    @store_call
    def cat_versioned(self, rel: str) -> tuple[bytes | None, str | None]:
        """(the object's bytes, its ETag) in one GET; (None, None) when absent; the ETag None off S3."""
        if not _is_s3(self.fs):
            return self.cat(rel), None
        bucket, _, key = self.key(rel).partition("/")
        try:
            resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None, None
        from dflash_prep.store.lease import _read_body

        return _read_body(self.fs, resp), resp.get("ETag")

    @store_call
    def put_if(self, rel: str, data: bytes, etag: str | None, absent: bool) -> str | None:
        """One PUT of the whole object, only if it is still the version `etag` (`absent`: only if there is none);
        a FileExistsError-like precondition error otherwise (lease._precondition_failed). -> its new ETag. Off S3:
        unconditional."""
        if not _is_s3(self.fs):
            self.fs.pipe_file(self.key(rel), data)
            return None
        bucket, _, key = self.key(rel).partition("/")
        condition = {"IfNoneMatch": "*"} if absent else {"IfMatch": etag}
        return self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition).get("ETag")

    def shard_sizes(self) -> dict[str, int]:
        return {rel: size for rel, size in self._objects(SHARDS_DIR + "/").items()}

    @store_call
    def damaged_shards(self, committed: list[ShardRecord]) -> dict[str, str]:
        """Committed shards whose object is missing, of another size than its record, or (first 512 bytes read)
        starting with another sample than the record's first: manifest.damaged_shards for the store."""
        sizes = self.shard_sizes()
        bad = {}
        for record in committed:
            size = sizes.get(record.path)
            if size is None:
                bad[record.path] = "missing"
            elif size != record.num_bytes:
                bad[record.path] = f"{size} bytes, its index record says {record.num_bytes}"
            elif record.sample_ids:
                head = self.fs.cat_file(self.key(record.path), start=0, end=100)
                name = head.split(b"\0", 1)[0].decode("utf-8", "replace")
                if name.split(".", 1)[0] != record.sample_ids[0]:
                    bad[record.path] = f"starts with {name!r}, not with sample {record.sample_ids[0]}"
        return bad

    def drop(self, paths: set[str], fence=None) -> None:
        """After `manifest.drop_records` rewrote the staging indexes: push them, delete those shard objects; first,
        `fence` (RemoteFence) says this run still holds the output (LeaseLostError otherwise, nothing changed): the
        indexes were read when the run claimed it, and a run frozen since then must not roll back another's."""
        if fence is not None:
            fence.check()
        self.push([f"{INDEX_DIR}/{SUPERSEDED_NAME}"]  # first (when there): a follower needs it before the redo
                  + sorted(str(p.relative_to(self.staging)) for p in (self.staging / INDEX_DIR).glob("rank-*.jsonl")))
        for rel in sorted(paths):
            self._rm(rel)

    def remove_uncommitted(self, committed: list[ShardRecord], fence=None) -> list[str]:
        """Delete the shard objects no index lists, and abort the multipart uploads a killed run left under the
        prefix (S3; invisible, but billed). -> the objects deleted.

        `committed` was read after this run claimed the output; the listing is taken now, then `fence`
        (RemoteFence) checked: it raises LeaseLostError, nothing deleted, when another run took the output over
        since, whose committed shards the listing may hold (a run frozen during its repair once deleted them).
        When it passes, no other run held the output from the claim to the listing (a takeover moves the run
        lease's generation for good), so every listed object is committed, or left by an earlier run, or this
        run's: deleting the uncommitted ones is safe even if this process stops before the deletes."""
        keep = {r.path for r in committed}
        removed = [rel for rel in sorted(self.shard_sizes()) if rel not in keep]
        if fence is not None:
            fence.check()
        for rel in removed:
            self._rm(rel)
        self._abort_multipart_uploads()
        return removed

    @store_call
    def _rm(self, rel: str) -> None:
        try:
            self.fs.rm_file(self.key(rel))
        except FileNotFoundError:
            pass

    @store_call
    def _abort_multipart_uploads(self) -> None:
        if not _is_s3(self.fs):
            return
        bucket, _, prefix = self.root.partition("/")
        try:
            uploads = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])
        except OSError as e:
            log.warning("could not list unfinished multipart uploads under %s: %s", self.url, e)
            return
        for upload in uploads:
            self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
        if uploads:
            log.info("aborted %d unfinished multipart upload(s) left by an interrupted run", len(uploads))

    def names(self) -> set[str]:
        """The top-level names under the prefix (files and folders), e.g. {'manifest.json', 'shards'}."""
        return {rel.split("/", 1)[0] for rel in self._objects()}

    def clear(self) -> None:
        """`output.overwrite`: delete every object under the prefix but the locks (this run's lease)."""
        for rel in sorted(self._objects()):
            if not rel.startswith(LOCKS_DIR + "/"):
                self._rm(rel)

    # -- leases ---------------------------------------------------------------------------------------------------
    def lease(self, name: str) -> Lease:
        """The lease object `locks/NAME.lease` (lease.py)."""
        return Lease(self.fs, self.key(f"{LOCKS_DIR}/{name}.lease"))

    @store_call
    def live_leases(self, prefix: str = "rank-") -> dict[str, str]:
        """{lease name: holder} of the leases under locks/ starting with `prefix` that a live holder has now."""
        held = {}
        for rel in self._objects(LOCKS_DIR + "/"):
            name = rel.rsplit("/", 1)[1]
            if name.startswith(prefix) and name.endswith(".lease"):
                lease = Lease(self.fs, self.key(rel))
                content, _ = lease.read()
                if content is not None and not lease.stale(content):
                    held[name[:-len(".lease")]] = content.get("holder", "unknown")
        return held


class ThreadClients:
    """One client of an async object store (s3fs) per calling thread, each on its own event loop thread.

    Why not the output's one client: fsspec runs every request of an async filesystem on a single event loop thread,
    and an upload's CPU work runs there, in the loop: botocore's SigV4 SHA-256 of each body over http (the payload
    is signed whenever TLS is off), the CRC32 checksum, aiohttp's copies of the body. Measured on a 2-core machine
    (AMD EPYC, sha_ni) against `rclone serve s3` on loopback: 2.6-3.2 CPU seconds a GB in the client, so one loop
    tops out near one core's ~0.3 GB/s whatever `output.max_uploads_in_flight` is, below the 1.2-1.4 GB/s an 8B
    target with DFlash's 5 layers writes. With a loop per upload thread the hashing runs in parallel (hashlib and
    zlib release the GIL on large buffers). Each client is a new instance of the output's filesystem class with the
    same storage options (so the same credentials and endpoint)."""

    def __init__(self, fs):
        self.fs = fs
        self._local = threading.local()
        self._made: list[tuple[object, asyncio.AbstractEventLoop, threading.Thread]] = []
        self._lock = threading.Lock()
        self._generation = 0  # bumped by close(): a thread's client of an earlier generation is closed
        self.num_made = 0  # clients made so far (all generations)

    def get(self):
        """This thread's client (made on its first call, or its first since `close`)."""
        fs = getattr(self._local, "fs", None)
        if fs is None or getattr(self._local, "generation", None) != self._generation:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="object-store-loop", daemon=True)
            thread.start()
            fs = type(self.fs)(**{**self.fs.storage_options, "loop": loop, "skip_instance_cache": True})
            _quiet_client_loop(fs)
            with self._lock:
                self._made.append((fs, loop, thread))
                self.num_made += 1
                self._local.fs, self._local.generation = fs, self._generation
        return fs

    def close(self) -> None:
        """Close every client's connections and stop its loop thread (after the uploads that use them ended)."""
        from fsspec.asyn import sync

        with self._lock:
            made, self._made = self._made, []
            self._generation += 1
        for fs, loop, thread in made:
            creator = getattr(fs, "_s3creator", None)  # s3fs's client context, opened by its first request
            try:
                if creator is not None:
                    sync(loop, creator.__aexit__, None, None, None, timeout=10)
            except Exception as e:  # noqa: BLE001 - a connection that fails to close costs nothing kept
                log.debug("closing an upload client: %s", e, extra={"console": False})
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if thread.is_alive():  # a request that never ends: left to the process's exit (a daemon thread)
                log.warning("an upload client's event loop did not stop within 10 s; left running")
            else:
                loop.close()


class UploadThreads:
    """`max_workers` daemon threads running submitted calls in submission order: the part of ThreadPoolExecutor's
    contract the uploader uses. Why not ThreadPoolExecutor: the interpreter joins its worker threads at exit, so
    an upload blocked on a store that stopped answering (each request waits for the client's timeouts and
    retries) kept a stopped run from exiting until the store answered again, minutes later; daemon threads do not
    hold the exit, and `shutdown` waits a bounded time."""

    def __init__(self, max_workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"{name}_{i}")
                         for i in range(max_workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            fn(*args)  # the uploader's calls keep their own errors

    def submit(self, fn, *args) -> None:
        self._queue.put((fn, args))

    def shutdown(self, cancel_pending: bool = False, timeout_seconds: float | None = None,
                 while_waiting=None) -> bool:
        """Stop the threads after the calls submitted (`cancel_pending`: after those running only); wait at most
        `timeout_seconds` (None: until they end), calling `while_waiting()` every SLOT_POLL_SECONDS meanwhile (an
        error it raises ends the wait). -> whether every thread ended."""
        if cancel_pending:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
        for _ in self._threads:
            self._queue.put(None)
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        for t in self._threads:
            while t.is_alive() and (deadline is None or time.monotonic() < deadline):
                left = SLOT_POLL_SECONDS if deadline is None else min(SLOT_POLL_SECONDS, deadline - time.monotonic())
                t.join(max(0.0, left))
                if t.is_alive() and while_waiting is not None:
                    while_waiting()
        return not any(t.is_alive() for t in self._threads)


class ShardUploader:
    """Uploads the shards a rank's lanes commit locally, then commits each in the store (module docstring).

    `publish` is called by a lane right after its local rename; it blocks while `max_in_flight` uploads run. An
    upload or commit error is kept and raised by the next `publish` or by `close`; nothing is committed after it
    (a shard whose upload failed is absent or whole under its name, and unlisted: a resume deletes it)."""

    def __init__(self, remote: RemoteOutput, rank: int, max_in_flight: int, lease: Lease | None = None,
                 chunk_bytes: int = MULTIPART_CHUNK_BYTES, fence=None):
        self.remote, self.lease, self.chunk_bytes, self.fence = remote, lease, chunk_bytes, fence
        self.index_rel = f"{INDEX_DIR}/{rank_name(rank)}.jsonl"
        self._read_index()  # this rank's committed lines, and the version this rank may rewrite
        self._slots = threading.Semaphore(max_in_flight)
        self._pool = UploadThreads(max_in_flight, f"shard-upload-{rank}")
        # S3: a client per upload thread (ThreadClients says why); other stores: the output's client
        self._clients = ThreadClients(remote.fs) if _is_s3(remote.fs) else None
        self._lock = threading.Lock()  # one index rewrite at a time, in commit order
        self.committed: list[ShardRecord] = []
        self.error: BaseException | None = None
        self.bytes_uploaded = 0
        self.upload_seconds = 0.0  # summed over the uploads (they overlap)

    def _read_index(self) -> None:
        existing, self._etag = self.remote.cat_versioned(self.index_rel)
        self._absent = existing is None
        existing = existing or b""
        self._lines = existing.decode() if existing.endswith(b"\n") or not existing else existing.decode() + "\n"

    def _commit(self, record: ShardRecord) -> None:
        """The commit: the index rewritten with one more line, only while the fence holds and the index is the
        version read (module docstring). Under `_lock`."""
        if self.fence is not None:
            record.fence = self.fence.token
        line = json.dumps(record.to_json()) + "\n"
        for _ in range(5):
            if self.lease is not None:
                self.lease.check()
            if self.fence is not None:
                self.fence.check()
            lines = self._lines + line
            try:
                self._etag = self.remote.put_if(self.index_rel, lines.encode(), self._etag, self._absent)
            except OSError as e:
                if not _precondition_failed(e):
                    raise
                self._read_index()  # written meanwhile: judged again by the fence
                if self._lines == lines:
                    # this very write, applied by the store, whose answer was lost: the client's retry of it was
                    # refused (412), the index now being the version it wrote. Committed; not appended twice.
                    self._absent = False
                    return
                continue
            self._lines, self._absent = lines, False
            return
        raise StoreError(f"{self.remote.name(self.index_rel)} keeps changing under this run: nothing committed")

    def publish(self, local: Path, record: ShardRecord) -> None:
        """Start the upload of a shard the lane committed locally; blocks while `max_in_flight` run. While it
        waits, a lost lease (or one not renewed for its TTL: a store that stopped answering) raises
        LeaseLostError, so that a hung store stops the run instead of holding it."""
        self._raise_if_failed()
        while not self._slots.acquire(timeout=SLOT_POLL_SECONDS):
            self._raise_if_failed()
            self._check_lease()
        if self.error is not None:
            self._slots.release()
            self._raise_if_failed()
        self._pool.submit(self._upload, Path(local), record)

    def _upload(self, local: Path, record: ShardRecord) -> None:
        try:
            if self.error is not None:
                return
            t0 = time.perf_counter()
            if self.fence is not None:
                self.fence.check()  # a run that lost the output uploads nothing more
            # complete or absent under its final name: one PUT, or a multipart upload the store completes at once
            fs = self.remote.fs if self._clients is None else self._clients.get()
            extra = {"chunksize": self.chunk_bytes} if _is_s3(fs) else {}
            fs.put_file(str(local), self.remote.key(record.path), **extra)
            with self._lock:
                self.upload_seconds += time.perf_counter() - t0
                if self.error is not None:
                    return
                try:
                    self._commit(record)  # the index after its shard
                except LeaseLostError:
                    # another run holds the output now: this object, named with this run's id, would be left
                    # unlisted in that run's output (its resume is not coming to delete it)
                    fs.rm_file(self.remote.key(record.path))
                    raise
                self.committed.append(record)
                self.bytes_uploaded += record.num_bytes
            local.unlink(missing_ok=True)
        except BaseException as e:  # noqa: BLE001 - handed to the lanes and to close()
            if self.error is None:
                self.error = e if isinstance(e, (OSError, LeaseLostError)) or not isinstance(e, Exception) \
                    else StoreError(f"uploading {record.path} failed: {type(e).__name__}: {e}")
        finally:
            self._slots.release()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait for every upload; raise the first error. A lease lost meanwhile (or not renewed for its TTL: a
        store that stopped answering) raises LeaseLostError instead of waiting on: the caller aborts."""
        self._pool.shutdown(while_waiting=self._check_lease)
        self._close_clients()
        self._raise_if_failed()

    def _check_lease(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def abort(self, timeout_seconds: float = ABORT_WAIT_SECONDS) -> None:
        """Start no queued upload; wait at most `timeout_seconds` for those running (each ends whole or absent,
        committed or not). Uploads still blocked on the store then are left to the process's end (daemon threads):
        whatever they leave is not committed, and a resume deletes it."""
        if self._pool.shutdown(cancel_pending=True, timeout_seconds=timeout_seconds):
            self._close_clients()
        else:
            log.warning("uploads still waiting on the store after %.0f s: left to end with the process (nothing "
                        "they write is committed; a resume deletes it)", timeout_seconds)

    def _close_clients(self) -> None:
        if self._clients is not None:
            self._clients.close()


class RemoteFence:
    """A run's fencing token on an object-store output, its run lease's generation, and the check every commit
    makes (locks.OutputFence's, for the store): the run lease object still carries that generation."""

    def __init__(self, remote: RemoteOutput, token: int):
        self.remote, self.token = remote, int(token)

    def check(self) -> None:
        content, _ = self.remote.lease("run").read()
        if content is None and not self._bucket_exists():
            raise LeaseLostError(f"{self.remote.url}: its bucket no longer exists (deleted while this run wrote "
                                 f"into it, with everything committed there): this run commits nothing more")
        if content is None or content.get("generation") != self.token:
            holder = "no run" if content is None else f"generation {content.get('generation')!r}"
            raise LeaseLostError(f"{self.remote.name('locks/run.lease')}: this run (generation {self.token}) no "
                                 f"longer holds the output ({holder} holds it now: it was taken over while this "
                                 f"process was stopped or cut off past its lease); it commits nothing more, and what "
                                 f"is committed is intact")


    def taken_over(self) -> bool:
        """Whether another run holds the output now (the run lease carries another generation). An absent lease is
        not: this run released it at its end (or it expired with no run taking it)."""
        content, _ = self.remote.lease("run").read()
        return content is not None and content.get("generation") != self.token

    @store_call
    def _bucket_exists(self) -> bool:
        bucket = self.remote.root.split("/", 1)[0]
        self.remote.fs.invalidate_cache()
        return bool(self.remote.fs.exists(bucket))


def claim_run(remote: RemoteOutput, require_conditional_writes: bool = True) -> Lease:
    """The main process's lease of the output (`locks/run.lease`); OutputBusyError when another live run holds it
    or a rank of an earlier run still holds its rank lease (an orphaned process of a killed launcher). Its
    generation, the run's fencing token, is above every token the store's indexes carry. First the store itself:
    reachable, and honouring conditional writes (`check_conditional_writes`)."""
    _check_reachable(remote)
    check_conditional_writes(remote, require_conditional_writes)
    lease = remote.lease("run")
    if not lease.try_acquire(min_generation=remote.max_fence() + 1):
        raise OutputBusyError(f"another run is writing into {remote.url} ({lease.holder()}): wait for it to "
                              f"end (or stop it), then re-run this command to resume; or use another output.dir")
    busy = remote.live_leases("rank-")
    if busy:
        lease.release()
        name, holder = next(iter(busy.items()))
        raise OutputBusyError(f"{name} of an earlier run into {remote.url} is still running ({holder}), e.g. "
                              f"a process left behind when its launcher was killed: stop it, then re-run this command "
                              f"to resume")
    return lease


# an ETag no object has (an MD5's 32 hex digits, all zeros): an If-Match on it must be refused
_NO_SUCH_ETAG = '"' + "0" * 32 + '"'


@store_call
def check_conditional_writes(remote: RemoteOutput, required: bool = True) -> None:
    """S3: whether the store honours the conditional writes the leases and the fenced commits rest on (lease.py).
    A probe object `locks/conditional-write-probe-<uuid>` is created with `If-None-Match: *`, then written again
    with `If-None-Match: *` and with `If-Match` on an ETag it does not have: both must be refused (HTTP 412), as AWS
    S3, MinIO and moto refuse them. The probe is deleted after. A store that accepts either: raise
    ConditionalWritesIgnoredError (exit code 2), or with `required` false say it in the log and go on. Other stores
    (gcsfs, adlfs: exclusive creates through fsspec) are not probed."""
    if not _is_s3(remote.fs):
        return
    bucket, _, key = remote.key(f"{LOCKS_DIR}/conditional-write-probe-{uuid.uuid4().hex}").partition("/")
    ignored = []
    try:
        remote.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"probe", IfNoneMatch="*")
        for header, condition in (("If-None-Match: *", {"IfNoneMatch": "*"}), ("If-Match", {"IfMatch": _NO_SUCH_ETAG})):
            try:
                remote.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"probe", **condition)
                ignored.append(header)
            except Exception as e:  # noqa: BLE001 - refused as it should be; anything else is the store failing
                if not _precondition_failed(e):
                    raise
    finally:
        try:
            remote.fs.call_s3("delete_object", Bucket=bucket, Key=key)
        except Exception as e:  # noqa: BLE001 - a probe left under locks/ is harmless
            log.warning("could not delete the probe object %s: %s", key, e)
    if not ignored:
        return
    what = (f"the object store of {remote.url} ignores conditional writes (a write under {' and under '.join(ignored)} "
            f"that must be refused was accepted)")
    if required:
        raise ConditionalWritesIgnoredError(
            f"{what}: the output's leases and fenced commits rest on them, and without them two runs into it could "
            f"overwrite each other's shards; use a store that honours them (AWS S3, MinIO), or set "
            f"output.require_conditional_writes: false to run anyway, one run at a time")
    log.warning("%s; output.require_conditional_writes is false: nothing keeps two runs into this output apart, run "
                "one at a time", what)


def claim_rank(remote: RemoteOutput, rank: int) -> Lease:
    """Rank `rank`'s lease for the time it writes (`locks/rank-RRRRR.lease`); OutputBusyError when held."""
    lease = remote.lease(rank_name(rank))
    if not lease.try_acquire():
        raise OutputBusyError(f"rank {rank} of another run is writing into {remote.url} ({lease.holder()}): "
                              f"stop it, then re-run this command to resume")
    return lease


def _check_reachable(remote: RemoteOutput) -> None:
    """A bucket that does not exist, or credentials the store refuses: BucketMissingError / CredentialsRefusedError
    (exit 2, nothing a re-run fixes); a store that does not answer: StoreUnreachableError (exit 1: resumable once it
    is back). One request (recipe/location.py `check_store`)."""
    check_store(remote.fs, remote.url)

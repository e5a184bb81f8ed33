"""One run per object-store output: a lease object, created only if absent, renewed while its holder lives.

An object store has no `flock` (locks.py guards local and shared folders): two runs into one bucket prefix would
number their shards alike and overwrite each other's rank indexes. So the main process of a run holds
`OUT/locks/run.lease`, and each writing rank `OUT/locks/rank-RRRRR.lease`, a small JSON object
{holder, host, pid, run_id, renewed_at, ttl_seconds}:

- taken with a conditional write that succeeds only when the object is absent (S3 `PUT` with `If-None-Match: *`,
  which AWS S3 and S3-compatible servers such as moto and MinIO honour: a second run gets HTTP 412 and is refused);
- renewed every `ttl_seconds / 4`, at most RENEW_MAX_SECONDS apart (the renewals are the other nodes' sign of
  its life, commands/extract/peers.py), by a thread of its holder, each renewal conditional on the object being the
  one it wrote last (S3 `If-Match: <ETag>`); a renewal refused (another run took the lease over) or impossible for a
  whole TTL (the store unreachable) marks the lease `lost`, and the holder's uploader then commits nothing more;
- taken over when its holder is gone: a holder on this host whose process no longer exists (a SIGKILLed run
  resumes at once), or a lease not renewed for `ttl_seconds` (another host: clocks must agree to within the TTL).
  The take-over deletes the stale object only if it is still the one read (`If-Match`), then creates its own
  with `If-None-Match: *`: of two runs taking over at once, one wins;
- released (deleted, `If-Match`) when the run ends.

Other stores: gcsfs and adlfs accept an exclusive create through fsspec's `open(path, "xb")`; the renewals and the
take-over's delete are then unconditional (a run that lost its lease while cut off from the store may write one
more index before it notices), which the README states. Fencing is not perfect on any store: a holder paused
longer than the TTL (a frozen VM) can still complete an upload it had started before it sees the lease is lost.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
import uuid

log = logging.getLogger("dflash_prep")

LEASE_TTL_SECONDS = 120.0
RENEW_MAX_SECONDS = 10.0  # output.peer_timeout_seconds may be as short as 15 s


class StoreError(ConnectionError):
    """The object store failed or could not be reached: the client's own error (botocore, aiohttp, ...) as an
    OSError, whose commands' answer is exit code 1 (stopped, resumable once the store answers again)."""


_CLIENT_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure", "s3fs",
                    "gcsfs", "adlfs")


def store_call(fn):
    """Turn an error of the store's client into a StoreError (an OSError), its own error kept as the cause."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if isinstance(e, OSError) or type(e).__module__.split(".")[0] not in _CLIENT_PACKAGES:
                raise
            raise StoreError(f"the object store failed: {type(e).__name__}: {e}") from e
    return wrapper


class LeaseLostError(RuntimeError):
    """This process no longer holds its lease of the output (another run took it over, or the store was
    unreachable for a whole TTL): it must not commit anything more."""


def _precondition_failed(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, FileExistsError) or "precondition" in text or "pre-condition" in text or "412" in text


def _is_s3(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


class Lease:
    """A lease object at `path` (a path of the fsspec filesystem `fs`, without protocol)."""

    def __init__(self, fs, path: str, ttl_seconds: float = LEASE_TTL_SECONDS):
        self.fs, self.path, self.ttl_seconds = fs, path, ttl_seconds
        self.run_id = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed_at = 0.0
        self.fd = None  # the interface of locks.FileLock where the run keeps its held locks

    # -- the store's conditional operations -------------------------------------------------------------------
    def _bucket_key(self) -> tuple[str, str]:
        bucket, _, key = self.path.partition("/")
        return bucket, key

    def _body(self) -> bytes:
        host = socket.gethostname()
        return json.dumps({"holder": f"pid {os.getpid()} on {host}", "host": host, "pid": os.getpid(),
                           "run_id": self.run_id, "renewed_at": time.time(),
                           "ttl_seconds": self.ttl_seconds}).encode()

    @store_call
    def _create(self) -> None:
        """Create the object only if absent (FileExistsError-like when it exists)."""
        body = self._body()
        if _is_s3(self.fs):
            bucket, key = self._bucket_key()
            self.etag = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")["ETag"]
        else:
            with self.fs.open(self.path, "xb") as f:
                f.write(body)
            self.etag = None
        self._renewed_at = time.time()

    @store_call
    def _overwrite_own(self) -> None:
        body = self._body()
        if _is_s3(self.fs):
            bucket, key = self._bucket_key()
            self.etag = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, IfMatch=self.etag)["ETag"]
        else:
            self.fs.pipe_file(self.path, body)
        self._renewed_at = time.time()

    @store_call
    def _delete_if(self, etag: str | None) -> None:
        if _is_s3(self.fs) and etag is not None:
            bucket, key = self._bucket_key()
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
        else:
            self.fs.rm_file(self.path)

    @store_call
    def read(self) -> tuple[dict | None, str | None]:
        """(the lease's content, its ETag), (None, None) when absent; a body that is not JSON reads as {}."""
        try:
            if _is_s3(self.fs):
                bucket, key = self._bucket_key()
                resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
                body, etag = _read_body(self.fs, resp), resp.get("ETag")
            else:
                body, etag = self.fs.cat_file(self.path), None
        except FileNotFoundError:
            return None, None
        try:
            content = json.loads(body)
        except ValueError:
            content = {}
        return (content if isinstance(content, dict) else {}), etag

    # -- the lease ---------------------------------------------------------------------------------------------
    def stale(self, content: dict) -> bool:
        """Whether a lease read back has no live holder: its process is gone (same host), or it was not renewed
        for its TTL."""
        if content.get("host") == socket.gethostname() and isinstance(content.get("pid"), int):
            if content["pid"] == os.getpid():
                return False
            try:
                os.kill(content["pid"], 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        renewed, ttl = content.get("renewed_at"), content.get("ttl_seconds", self.ttl_seconds)
        return not isinstance(renewed, (int, float)) or time.time() - renewed > float(ttl)

    def try_acquire(self) -> bool:
        """Take the lease when it is absent or stale (True); False when a live holder has it."""
        for _ in range(2):
            try:
                self._create()
                self._start_heartbeat()
                return True
            except OSError as e:
                if not _precondition_failed(e):
                    raise
            content, etag = self.read()
            if content is None:
                continue  # released meanwhile: try again
            if not self.stale(content):
                return False
            log.warning("%s: taking over the lease of %s (%s)", self.path, content.get("holder", "an unknown holder"),
                        "its process is gone" if content.get("host") == socket.gethostname()
                        else f"not renewed for {content.get('ttl_seconds')} s")
            try:
                self._delete_if(etag)
            except OSError as e:
                if _precondition_failed(e):
                    return False  # another run took it over first
                raise
        return False

    def holder(self) -> str:
        content, _ = self.read()
        return (content or {}).get("holder", "unknown")

    def held_elsewhere(self) -> bool:
        """Whether a live holder other than this object holds the lease now (reads it; writes nothing)."""
        content, _ = self.read()
        return content is not None and content.get("run_id") != self.run_id and not self.stale(content)

    def check(self) -> None:
        """Raise LeaseLostError when the lease is lost (see the module docstring)."""
        if self.lost.is_set():
            raise LeaseLostError(f"{self.path}: this run no longer holds the output's lease (another run took it "
                                 f"over, or the store was unreachable for {self.ttl_seconds:.0f} s): it stopped "
                                 f"committing; what is committed is intact")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name=f"lease-{self.path}")
        self._thread.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self.ttl_seconds / 4, RENEW_MAX_SECONDS)):
            try:
                self._overwrite_own()
            except OSError as e:
                if _precondition_failed(e) or time.time() - self._renewed_at > self.ttl_seconds:
                    log.error("%s: lease lost (%s)", self.path, e)
                    self.lost.set()
                    return

    def release(self, remove: bool = True) -> None:
        """Stop renewing and delete the lease (only if it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
            if not self.lost.is_set():
                try:
                    self._delete_if(self.etag)
                except OSError as e:  # already taken over, or the store is down: the TTL frees it
                    log.warning("%s: could not release the lease (%s)", self.path, e)


def _read_body(fs, resp) -> bytes:
    """The bytes of a `get_object` response of s3fs's client (its Body is an aiobotocore stream)."""
    from fsspec.asyn import sync

    async def read():
        async with resp["Body"] as stream:
            return await stream.read()

    return sync(fs.loop, read)

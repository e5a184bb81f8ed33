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
- taken over when its holder is gone: a holder on this host whose run no longer holds the host's lock of this lease
  (a flock on a file of the system's temporary folder named after the lease, holding the holder's run id: the
  kernel drops it when the process dies, so a pid alive again is not the dead run), or a lease not renewed for `ttl_seconds`, judged by the store's clock (the object's
  LastModified against the Date of the same answer), never the reader's: hosts whose clocks differ judge it alike.
  A lease object that does not read as a record (garbage, wrong types) is damaged, named so and taken over
  `ttl_seconds` after it was written. The take-over deletes the stale object only if it is still the one read
  (`If-Match`), then creates its own with `If-None-Match: *`: of two runs taking over at once, one wins;
- a generation in every lease record: a take-over's is above the stale one's and above every fencing token in
  the output's indexes; the run lease's generation is the run's fencing token (remote.RemoteFence);
- released (deleted, `If-Match`) when the run ends.

Other stores: gcsfs and adlfs accept an exclusive create through fsspec's `open(path, "xb")`; the renewals and the
take-over's delete are then unconditional (a run that lost its lease while cut off from the store may write one
more index before it notices). The commits themselves are fenced (remote.py): each checks the run lease and
rewrites the index object only if it is the version this run last wrote (`If-Match`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
import tempfile
import uuid
from email.utils import parsedate_to_datetime
from pathlib import Path

from dflash_prep.store.locks import MAX_LEASE_SECONDS, MAX_UNIX_SECONDS, LeaseLostError, _clock

log = logging.getLogger("dflash_prep")

LEASE_TTL_SECONDS = 120.0
RENEW_MAX_SECONDS = 10.0  # output.peer_timeout_seconds may be as short as 15 s
RELEASE_WAIT_SECONDS = 10.0  # a stopping run's wait for a store call that may never be answered (within_seconds)


class NoAnswerInTime(TimeoutError):
    """`call_within`'s call did not return in its time (a TimeoutError, so an OSError)."""


def call_within(fn, seconds: float, name: str = "bounded call"):
    """`fn()`'s result, computed on a daemon thread (`name`); its error re-raised here; NoAnswerInTime after
    `seconds`, the thread left to end by itself or with the process. For the calls a stopping run makes to a store
    that may have stopped answering: a request there waits for the client's timeouts and retries (botocore:
    minutes), and the run has already said why it stops."""
    box: dict = {}

    def call() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, daemon=True, name=name)
    thread.start()
    thread.join(seconds)
    if "error" in box:
        raise box["error"]
    if thread.is_alive():
        raise NoAnswerInTime(f"no answer within {seconds:.0f} s")
    return box.get("result")


def within_seconds(fn, seconds: float, what: str) -> bool:
    """`call_within` for the best-effort calls of a stopping run (a lease's delete, the logs' upload): True when
    `fn` returned, False (logged) when it still runs after `seconds`. An error of `fn` is logged, not raised."""
    try:
        call_within(fn, seconds, f"bounded: {what}")
    except NoAnswerInTime:
        log.warning("%s: the store did not answer within %.0f s; left to the process's end", what, seconds)
        return False
    except Exception as e:  # noqa: BLE001 - best effort: said, not raised
        log.warning("%s: %s", what, e)
    return True


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


def _precondition_failed(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, FileExistsError) or "precondition" in text or "pre-condition" in text or "412" in text


def _is_s3(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


_FIELDS = {"host": str, "pid": int, "renewed_at": (int, float), "ttl_seconds": (int, float)}


def damaged_because(content: dict) -> str | None:
    """Why a lease object's content is not a lease record (a field missing or of a wrong type), or None."""
    if content.get("_not_json") is not None:
        return f"not JSON: {content['_not_json']!r}"
    for name, kind in _FIELDS.items():
        value = content.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is {value!r}"
    if not isinstance(content.get("run_id", ""), str):
        return f"run_id is {content['run_id']!r}"
    if not 0 < content["ttl_seconds"] <= MAX_LEASE_SECONDS:  # NaN and Infinity fail too (JSON reads them)
        return f"ttl_seconds is {content['ttl_seconds']!r}"
    renewed = content.get("renewed_at")
    if isinstance(renewed, (int, float)) and not 0 <= renewed < MAX_UNIX_SECONDS:
        return f"renewed_at is {renewed!r}"
    return None


class _HostLock:
    """This host's lock of one lease: a flock on `<tmp>/dflash-prep-leases/<digest of the lease's name>.lock`,
    holding the run id of the process that holds it. It tells a lease naming this host whose run is alive (its
    flock held, with its run id) from one whose run has ended (the kernel dropped its flock), whatever its pid."""

    def __init__(self, fs, path: str):
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        digest = hashlib.sha256(f"{protocol}://{path}".encode()).hexdigest()[:24]
        self.path = Path(tempfile.gettempdir()) / "dflash-prep-leases" / f"{digest}.lock"
        self.fd: int | None = None

    def try_acquire(self, run_id: str) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, run_id.encode())
        self.fd = fd
        return True

    def holder_run_id(self) -> str | None:
        """The run id of the live process holding this lock; None when no process of this host holds it."""
        if self.fd is not None:
            return None  # this object holds it
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


class Lease:
    """A lease object at `path` (a path of the fsspec filesystem `fs`, without protocol)."""

    def __init__(self, fs, path: str, ttl_seconds: float = LEASE_TTL_SECONDS):
        self.fs, self.path, self.ttl_seconds = fs, path, ttl_seconds
        self.host_lock = _HostLock(fs, path)
        self.run_id = uuid.uuid4().hex
        self.generation: int | None = None
        self.etag: str | None = None
        self._read_age: tuple[dict, float] | None = None  # (the content last read, its age by the store's clock)
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed_at = 0.0

    @property
    def fd(self) -> int | None:
        """The descriptor of the host's lock of this lease (a forked child must close its copy), as locks.FileLock."""
        return self.host_lock.fd

    # -- the store's conditional operations -------------------------------------------------------------------
    def _bucket_key(self) -> tuple[str, str]:
        bucket, _, key = self.path.partition("/")
        return bucket, key

    def _body(self) -> bytes:
        host = socket.gethostname()
        return json.dumps({"holder": f"pid {os.getpid()} on {host}", "host": host, "pid": os.getpid(),
                           "run_id": self.run_id, "renewed_at": time.time(), "ttl_seconds": self.ttl_seconds,
                           "generation": self.generation}).encode()

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
        """(the lease's content, its ETag), (None, None) when absent; a body that is not JSON reads as
        {"_not_json": its first bytes} (damaged_because names it)."""
        try:
            if _is_s3(self.fs):
                bucket, key = self._bucket_key()
                resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
                body, etag = _read_body(self.fs, resp), resp.get("ETag")
                age = _age_by_store_clock(resp)
            else:
                body, etag = self.fs.cat_file(self.path), None
                age = None
        except FileNotFoundError:
            return None, None
        try:
            content = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            content = {"_not_json": bytes(body[:40])}
        content = content if isinstance(content, dict) else {"_not_json": bytes(body[:40])}
        if age is None and isinstance(content.get("renewed_at"), (int, float)):
            age = time.time() - content["renewed_at"]
        self._read_age = (content, max(0.0, age) if age is not None else float("inf"))
        return content, etag

    # -- the lease ---------------------------------------------------------------------------------------------
    def age_seconds(self, content: dict) -> float:
        """Seconds since `content` (as `read` returned it) was written, by the store's clock."""
        return self._read_age[1] if self._read_age is not None and self._read_age[0] is content else float("inf")

    def stale(self, content: dict) -> bool:
        """Whether a lease read back has no live holder (module docstring): this host's run whose lock is free,
        or not renewed for its TTL by the store's clock; a damaged one judged by its age against our TTL."""
        if content.get("run_id") == self.run_id:
            return False
        if damaged_because(content) is not None:
            return self.age_seconds(content) > self.ttl_seconds
        if content["host"] == socket.gethostname():
            if self.host_lock.fd is not None:
                return True  # this object holds the host's lock of this lease: no other run of this host is live
            holder = self.host_lock.holder_run_id()
            if holder != content.get("run_id"):
                return True  # the host's lock is free, or held by another run: the lease's run has ended
        return self.age_seconds(content) > float(content["ttl_seconds"])

    def describe(self, content: dict) -> str:
        """The holder of a lease read back, with its clock skew when its renewal time is off this host's clock."""
        why = damaged_because(content)
        if why is not None:
            ends = time.time() + max(0.0, self.ttl_seconds - self.age_seconds(content))
            return f"a damaged lease object ({why}), taken over at {_clock(ends)}"
        text = content.get("holder") if isinstance(content.get("holder"), str) else f"pid {content['pid']}"
        ours = time.time() - self.age_seconds(content)
        theirs = content["renewed_at"]
        if ours != float("-inf") and abs(theirs - ours) > max(2.0, self.ttl_seconds / 4):
            way = "ahead of" if theirs > ours else "behind"
            text += (f"; its clock is {abs(theirs - ours):.0f} s {way} this host's (clock skew: its last renewal "
                     f"says {_clock(theirs)}, this host's clock said {_clock(ours)}); judged by the store's clock")
        return text

    def try_acquire(self, min_generation: int = 0) -> bool:
        """Take the lease when it is absent or stale (True); False when a live holder has it. Its generation: at
        least `min_generation`, and above the stale lease's."""
        self.host_lock.try_acquire(self.run_id)  # may fail: a live run of this host holds it (judged below)
        for _ in range(2):
            self.generation = max(min_generation, self.generation or 0)
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
            if self._own_write(content, etag):  # the create was applied, its answer lost: the retry got 412
                self._start_heartbeat()
                return True
            if not self.stale(content):
                self.host_lock.release()
                return False
            if isinstance(content.get("generation"), int):
                self.generation = max(self.generation, content["generation"] + 1)
            log.warning("%s: taking over the lease of %s (%s)", self.path, self.describe(content),
                        _why_stale(content, self.age_seconds(content)))
            try:
                self._delete_if(etag)
            except OSError as e:
                if _precondition_failed(e):
                    self.host_lock.release()
                    return False  # another run took it over first
                raise
        self.host_lock.release()
        return False

    def holder(self) -> str:
        content, _ = self.read()
        return self.describe(content) if content is not None else "unknown"

    def held_elsewhere(self) -> bool:
        """Whether a live holder other than this object holds the lease now (reads it; writes nothing)."""
        content, _ = self.read()
        return content is not None and content.get("run_id") != self.run_id and not self.stale(content)

    def check_held(self) -> None:
        """Raise LeaseLostError unless the lease object is still this one's (reads it: one GET)."""
        content, _ = self.read()
        if content is None or content.get("run_id") != self.run_id:
            self.lost.set()
        self.check()

    def check(self) -> None:
        """Raise LeaseLostError when the lease is lost (see the module docstring), or not renewed for its TTL: the
        renewal is blocked on a store that stopped answering, and by the store's rules another run may hold the
        lease now; the request may not end for minutes (the client's timeouts and retries)."""
        if self._thread is not None and not self._stop.is_set() and time.time() - self._renewed_at > self.ttl_seconds:
            self.lost.set()
        if self.lost.is_set():
            raise LeaseLostError(f"{self.path}: this run no longer holds the output's lease (another run took it "
                                 f"over, or the store was unreachable for {self.ttl_seconds:.0f} s): it stopped "
                                 f"committing; what is committed is intact")

    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name=f"lease-{self.path}")
        self._thread.start()

    def _own_write(self, content: dict, etag: str | None) -> bool:
        """Whether the lease read back (`content`, `etag`) is this object's own latest write, though its PUT was
        refused: a write the store applied but whose answer was lost, which the client retried (botocore does)
        and the store then refused (412: the object is no longer the version, or no longer absent). Only this
        object writes its `run_id`, so the lease is held: its ETag is taken as current."""
        if content.get("run_id") != self.run_id or content.get("generation") != self.generation:
            return False
        self.etag, self._renewed_at = etag, time.time()
        return True

    def _renew(self) -> None:
        """One renewal; a refusal that is this object's own write applied (`_own_write`) is a renewal too."""
        try:
            self._overwrite_own()
        except OSError as e:
            if not _precondition_failed(e):
                raise
            content, etag = self.read()
            if content is None or not self._own_write(content, etag):
                raise

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(self.ttl_seconds / 4, RENEW_MAX_SECONDS)):
            try:
                self._renew()
            except OSError as e:
                if _precondition_failed(e) or time.time() - self._renewed_at > self.ttl_seconds:
                    log.error("%s: lease lost (%s)", self.path, e)
                    self.lost.set()
                    return

    def release(self, remove: bool = True) -> None:
        """Stop renewing and delete the lease (only if it is still ours), waiting at most RELEASE_WAIT_SECONDS for
        a store that stopped answering (the TTL frees the lease then)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RELEASE_WAIT_SECONDS)  # a renewal in flight
            self._thread = None
            if not self.lost.is_set():
                within_seconds(lambda: self._delete_if(self.etag), RELEASE_WAIT_SECONDS,
                               f"{self.path}: could not release the lease (the TTL frees it)")
        self.host_lock.release()


def _why_stale(content: dict, age: float) -> str:
    why = damaged_because(content)
    if why is not None:
        return f"damaged, not renewed for {age:.0f} s"
    if content["host"] == socket.gethostname():
        return "its run on this host has ended"
    return f"not renewed for {age:.0f} s, past its TTL of {content['ttl_seconds']:.0f} s"


def _age_by_store_clock(resp) -> float | None:
    """Seconds between an object's LastModified and the Date of the answer that returned it: both the store's
    clock (None when the answer lacks either)."""
    modified = resp.get("LastModified")
    date = (resp.get("ResponseMetadata") or {}).get("HTTPHeaders", {}).get("date")
    if modified is None or not date:
        return None
    try:
        return (parsedate_to_datetime(date) - modified).total_seconds()
    except (TypeError, ValueError):
        return None


def _read_body(fs, resp) -> bytes:
    """The bytes of a `get_object` response of s3fs's client (its Body is an aiobotocore stream)."""
    from fsspec.asyn import sync

    async def read():
        async with resp["Body"] as stream:
            return await stream.read()

    return sync(fs.loop, read)

"""Where an output lives: a local folder, or a folder of an object store named by a URL (`s3://bucket/prefix`,
`gs://...`, `az://...`) and reached through fsspec.

A string is a URL when it starts with `PROTOCOL://`; `file://` is a local path. A URL is never taken for a local
path: one whose protocol fsspec does not know, or whose implementation is not installed, is refused with a
`LocationError` (a `ValueError`; the commands turn it into exit code 2) naming the package to install. The
extraction writes only to the protocols of `WRITABLE_PROTOCOLS` (object stores with a well-kept fsspec
implementation: s3fs, gcsfs, adlfs); the readers (`ShardDataset`, `inspect`, `verify`, `export`, `vocab`) take any
protocol fsspec can open.

Credentials come from the store's own configuration (for S3: the AWS environment variables, `~/.aws`, an
instance profile; `AWS_ENDPOINT_URL` for an S3-compatible server), never from a recipe: `output.storage_options`
holds non-secret options only (`endpoint_url`, `region_name`, ...), and keys that name a secret are refused.
"""

from __future__ import annotations

import re
from pathlib import Path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
LOCAL_PROTOCOLS = ("file", "local")
# protocol -> the package that implements it (fsspec's registry names the same ones)
WRITABLE_PROTOCOLS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                      "abfss": "adlfs"}
# Keys of storage options that carry a secret: refused in a recipe (the store's own configuration holds them).
_SECRET_WORDS = ("secret", "password", "token", "credential", "key_id", "access_key", "account_key", "sas",
                 "connection_string", "private_key")


class LocationError(ValueError):
    """An output location the project cannot use (unknown or uninstalled protocol, a secret in the options)."""


class StoreRefusedError(LocationError):
    """The object store answered and refused: nothing a re-run fixes (exit code 2). One line, naming which."""

    exit_code = 2


class BucketMissingError(StoreRefusedError):
    """The URL's bucket (container) does not exist in the store."""


class CredentialsRefusedError(StoreRefusedError):
    """The store refused the credentials (unknown key, bad signature, access denied, none found)."""


class ConditionalWritesIgnoredError(StoreRefusedError):
    """The store accepted a write its `If-None-Match` / `If-Match` condition should have refused (store/remote.py
    `check_conditional_writes`): leases could not keep two runs apart there."""


class StoreUnreachableError(ConnectionError):
    """The store did not answer (no server at the endpoint, DNS, a timeout): exit code 1, resumable once it is back.
    One line, naming the endpoint."""

    exit_code = 1


# botocore/S3 error codes of refused credentials, and of a missing bucket
_REFUSED_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
                  "InvalidClientTokenId", "AllAccessDisabled", "AccountProblem", "403", "Forbidden")
_MISSING_BUCKET_CODES = ("NoSuchBucket",)
# client errors that mean "no answer" (botocore's endpoint and timeout errors, aiohttp's connector errors)
_UNREACHABLE_NAMES = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                      "ClientConnectorError", "ServerDisconnectedError", "ServerTimeoutError", "ProxyConnectionError")
_CREDENTIALS_HELP = ("they come from the store's own configuration (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                     "AWS_PROFILE, ~/.aws, an instance role)")


def url_protocol(location: str | Path) -> str | None:
    """`s3` for `s3://bucket/x`, None for a plain path."""
    match = _URL.match(str(location)) if isinstance(location, str) else None
    return match.group(1).lower() if match else None


def is_remote(location: str | Path) -> bool:
    """Whether `location` is a URL of a store other than the local filesystem."""
    protocol = url_protocol(location)
    return protocol is not None and protocol not in LOCAL_PROTOCOLS


def local_path(location: str | Path) -> Path:
    """A local location as a Path (`file://` stripped)."""
    text = str(location)
    return Path(text.split("://", 1)[1]) if url_protocol(text) in LOCAL_PROTOCOLS else Path(text)


def check_storage_options(options: dict | None, key: str = "output.storage_options") -> None:
    """Refuse (LocationError) a storage option that names a secret, at any depth (e.g. client_kwargs)."""
    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            name = f"{prefix}.{k}"
            if any(word in str(k).lower() for word in _SECRET_WORDS):
                raise LocationError(f"recipe key `{name}`: credentials never go into a recipe; give them through the "
                                    f"store's own configuration (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                                    f"AWS_PROFILE, ~/.aws or an instance role)")
            if isinstance(v, dict):
                walk(v, name)
    walk(options or {}, key)


def check_location(location: str | Path, writable: bool, key: str = "output.dir") -> None:
    """Raise LocationError when `location` is a URL this installation cannot use: an unknown protocol, an fsspec
    implementation that is not installed, or (`writable`) a protocol the extraction does not write to. A plain path
    passes."""
    protocol = url_protocol(location)
    if protocol is None or protocol in LOCAL_PROTOCOLS:
        return
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        package = WRITABLE_PROTOCOLS.get(protocol)
        extra = " (pip install '.[s3]' in a checkout of dflash-prep)" if package == "s3fs" else ""
        raise LocationError(f"`{key}` = {str(location)!r}: protocol {protocol}:// needs "
                            f"{package or 'its fsspec implementation'}, which is not installed{extra} ({e})") from None
    except ValueError:
        raise LocationError(f"`{key}` = {str(location)!r}: unknown protocol {protocol}:// (fsspec knows no such "
                            f"filesystem); it is not taken for a local path either") from None
    if writable and protocol not in WRITABLE_PROTOCOLS:
        raise LocationError(f"`{key}` = {str(location)!r}: the extraction writes to a local folder or to an object "
                            f"store ({', '.join(sorted(WRITABLE_PROTOCOLS))}://), not to {protocol}://")


def as_location(location, storage_options: dict | None = None):
    """A local folder as a `pathlib.Path`, a URL as a `upath.UPath` (universal-pathlib: the pathlib API over the
    fsspec filesystem, so `/`, `open`, `exists`, `glob`, `read_bytes` work on both). An object that already is a
    Path or UPath is returned as it is. Raises LocationError for a URL this installation cannot read; for a URL,
    one request checks its bucket first (`check_store`: BucketMissingError, CredentialsRefusedError,
    StoreUnreachableError)."""
    if isinstance(location, Path) or type(location).__module__.startswith("upath"):
        return location
    if not is_remote(location):
        return local_path(location)
    check_location(location, writable=False, key="output")
    from upath import UPath

    path = UPath(str(location), **(storage_options or {}))
    check_store(path.fs, str(location))  # a missing bucket, refused credentials, no answer: one line, here
    return path


def is_remote_path(path) -> bool:
    """Whether a Path/UPath from `as_location` lives in a remote store."""
    return not isinstance(path, Path)


def read_whole(path) -> bytes:
    """The bytes of a file, or of an object in one GET: an object rewritten meanwhile (a rank index) is read as one
    version or the other, never as parts of two (fsspec's file would read it in ranges pinned to the first ETag, and
    fail when it changes)."""
    if is_remote_path(path):
        return path.fs.cat_file(path.path)
    return path.read_bytes()


def fresh_listing(path) -> None:
    """Drop the fsspec filesystem's cached listings (s3fs caches them): a poll must see objects written since."""
    fs = getattr(path, "fs", None)
    if fs is not None and hasattr(fs, "invalidate_cache"):
        fs.invalidate_cache()


def store_endpoint(fs) -> str:
    """The endpoint an fsspec filesystem talks to, for messages (s3fs: its endpoint_url, else AWS's default)."""
    import os

    kwargs = getattr(fs, "client_kwargs", None) or {}
    endpoint = kwargs.get("endpoint_url") or getattr(fs, "endpoint_url", None)
    if not endpoint and type(fs).__module__.startswith("s3fs"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (default)"
    return str(endpoint or getattr(fs, "protocol", "the store"))


def _error_chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _client_code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def store_access_error(e: BaseException, url: str, fs=None) -> "StoreRefusedError | StoreUnreachableError | None":
    """What a client error of the store means for `url`, as one of the one-line errors above, or None when it is
    none of them (a missing object, a damaged file: the caller's own error). Reads the error and its causes: s3fs
    turns botocore's ClientError into PermissionError/FileNotFoundError and keeps it as the cause."""
    if isinstance(e, (StoreRefusedError, StoreUnreachableError)):
        return e
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    chain = list(_error_chain(e))
    codes = {_client_code(c) for c in chain} | {type(c).__name__ for c in chain}
    text = " ".join(str(c) for c in chain)
    if codes & set(_MISSING_BUCKET_CODES) or "specified bucket does not exist" in text:
        return BucketMissingError(f"{url}: bucket {bucket!r} does not exist in the store at "
                                  f"{store_endpoint(fs)}; create it first (nothing here creates buckets)")
    if "NoCredentialsError" in codes or "PartialCredentialsError" in codes:
        return CredentialsRefusedError(f"{url}: no credentials found for the store at {store_endpoint(fs)}; "
                                       f"{_CREDENTIALS_HELP}")
    if codes & set(_REFUSED_CODES) or any(isinstance(c, PermissionError) for c in chain):
        reason = next((_client_code(c) for c in chain if _client_code(c)), "") or type(chain[-1]).__name__
        return CredentialsRefusedError(f"{url}: the store at {store_endpoint(fs)} refused the credentials for bucket "
                                       f"{bucket!r} ({reason}); {_CREDENTIALS_HELP}")
    if codes & set(_UNREACHABLE_NAMES) or any(isinstance(c, (ConnectionError, TimeoutError)) for c in chain):
        return StoreUnreachableError(f"{url}: the object store at {store_endpoint(fs)} does not answer "
                                     f"({type(chain[0]).__name__}); re-run once it is reachable")
    return None


STORE_CHECK_SECONDS = 30.0  # a store that answers lists one key in milliseconds; a frozen one never answers


def check_store(fs, url: str, timeout_seconds: float = STORE_CHECK_SECONDS) -> None:
    """One request to the store holding `url` (an fsspec filesystem of it): raise BucketMissingError,
    CredentialsRefusedError (exit 2) or StoreUnreachableError (exit 1) when the bucket cannot be used; a bucket
    that answers passes (its prefix may be empty). S3: a ListObjectsV2 of at most one key under the prefix (the
    read right every reader needs; a HeadBucket answers a bare 403 with no reason), given `timeout_seconds` in all
    (fsspec's own deadline on its event loop): a server that accepts connections and never answers would otherwise
    hold the command for botocore's read timeouts times its retries, minutes with no line."""
    root = url.split("://", 1)[-1].rstrip("/")
    bucket, _, prefix = root.partition("/")
    try:
        if hasattr(fs, "_call_s3") and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1,
                 timeout=timeout_seconds)
        elif hasattr(fs, "call_s3"):
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
        else:
            fs.ls(bucket)
    except Exception as e:  # noqa: BLE001 - classified here; anything else is the caller's to see
        known = store_access_error(e, url, fs)
        if known is None:
            raise
        raise known from None


def one_line_store_errors(main):
    """A command's `main(argv) -> int`, with the store's errors as one line on stderr and their exit codes: refused
    (a missing bucket, refused credentials) 2, no answer 1; also an error of the store's client met later (a store
    that stops answering mid-read) that the command did not catch, classified the same way."""
    import functools
    import sys

    @functools.wraps(main)
    def wrapper(argv=None):
        try:
            return main(argv)
        except (StoreRefusedError, StoreUnreachableError) as e:
            print(f"error: {e}", file=sys.stderr)
            return e.exit_code
        except OSError as e:
            if not _from_store_client(e):
                raise
            known = store_access_error(e, "the output")
            code = known.exit_code if known is not None else 1
            print(f"error: the object store failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                  file=sys.stderr)
            return code
    return wrapper


def _from_store_client(e: BaseException) -> bool:
    """Whether an error (or its cause) comes from an object store's client package."""
    return any(type(c).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs")
               or type(c).__name__ == "StoreError" for c in _error_chain(e))


# ------------------------------------------------------------------------------------- package-relative names
# The package's own folder (the shipped demo's assets live in it). A path inside it is written, in a resolved recipe
# and in a job's identity, as `dflash_prep:RELATIVE` (no `://`: not a URL), so reinstalling the package elsewhere
# (a wheel, then an editable install of a checkout) leaves the name, and so the job, the same.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_PREFIX = "dflash_prep:"
_OTHER_INSTALL = "/dflash_prep/demo/"  # where an install of the package keeps the shipped demo's assets


def portable_path(value: str) -> str:
    """`value` with a path (or glob) inside the installed package written as `dflash_prep:RELATIVE`; any other
    value (a path elsewhere, a hub id, inline text) as it is."""
    if not isinstance(value, str) or value.startswith(PACKAGE_PREFIX) or url_protocol(value) is not None:
        return value
    try:
        relative = Path(value).relative_to(PACKAGE_ROOT).as_posix()
    except ValueError:  # another install's demo assets (an output made before the package was reinstalled)
        posix = Path(value).as_posix()
        if not posix.startswith("/") or _OTHER_INSTALL not in posix:
            return value
        relative = "demo/" + posix.rsplit(_OTHER_INSTALL, 1)[1]
    return PACKAGE_PREFIX + relative


def package_path(value: str) -> str:
    """The inverse of `portable_path`: `dflash_prep:RELATIVE` -> the absolute path under this install, and so an
    absolute path into another install's demo assets that no longer exists (a resolved recipe of an earlier
    version); any other value as it is."""
    if isinstance(value, str) and not value.startswith(PACKAGE_PREFIX) and value.startswith("/") \
            and _OTHER_INSTALL in value and not Path(value).parent.exists():
        value = portable_path(value)
    if isinstance(value, str) and value.startswith(PACKAGE_PREFIX):
        return str(PACKAGE_ROOT / value[len(PACKAGE_PREFIX):])
    return value

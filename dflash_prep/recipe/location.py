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
        extra = " (pip install 'dflash-prep[s3]')" if package == "s3fs" else ""
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
    Path or UPath is returned as it is. Raises LocationError for a URL this installation cannot read."""
    if isinstance(location, Path) or type(location).__module__.startswith("upath"):
        return location
    if not is_remote(location):
        return local_path(location)
    check_location(location, writable=False, key="output")
    from upath import UPath

    return UPath(str(location), **(storage_options or {}))


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

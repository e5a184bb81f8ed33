"""The ground floor: atomic file writes and fsync, imported by every stage and importing none of them.

A kill at any instant leaves either the old file or the new one under the final name, never a torn one: each write
goes to `NAME.tmp`, is fsynced, renamed over `NAME`, and the folder is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """fsync a file or a folder by its path (a file written by a library that does not fsync, e.g. pyarrow's
    writers, before its commit renames it; a folder after a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file  # the same call on a folder: a rename in it is durable once it returns


def _atomic_write(path: Path, write, mode: str = "w") -> None:
    """`write(f)` into `NAME.tmp`, fsync, rename over `NAME`, fsync the folder. A failed write (a full disk, a
    quota) removes the tmp file (an unlink needs no space) and raises the OSError: nothing is left behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    def write(f):
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    _atomic_write(path, write)


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """A safetensors file written like `atomic_write_json`. Serialized in memory (`safetensors.torch.save`) and
    written here, so a full disk raises an OSError (its errno kept), not safetensors' own SafetensorError; only
    small files go through here (token counts, a final norm: a vocabulary's or a hidden size's worth)."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    _atomic_write(path, lambda f: f.write(data), "wb")


def atomic_write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, written like `atomic_write_json` (a kill leaves the old file or the new one)."""
    _atomic_write(path, lambda f: f.writelines(json.dumps(row) + "\n" for row in rows))


def atomic_write_lines(path: Path, lines: list[bytes]) -> None:
    """`lines` (bytes, each with its own newline) as the whole of `path`, written like `atomic_write_json`: a rank
    index rewritten without some records (store/manifest.py, regen/output.py)."""
    _atomic_write(path, lambda f: f.writelines(lines), "wb")

"""The ground floor: atomic file writes and fsync, imported by every stage and importing none of them.

A kill at any instant leaves either the old file or the new one under the final name, never a torn one: each write
goes to `NAME.tmp`, is fsynced, renamed over `NAME`, and the folder is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_save_safetensors(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """`safetensors.torch.save_file` written like `atomic_write_json` (tmp, fsync, rename, fsync the folder)."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_jsonl(path: Path, rows: list[dict]) -> None:
    """One JSON object per line, written like `atomic_write_json` (a kill leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_lines(path: Path, lines: list[bytes]) -> None:
    """`lines` (bytes, each with its own newline) as the whole of `path`, written like `atomic_write_json`: a rank
    index rewritten without some records (store/manifest.py, regen/output.py)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)

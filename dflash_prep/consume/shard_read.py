"""Reading one shard: its tar parsed and grouped into samples by webdataset, every byte hashed on the way
(`HashingReader`), each sample's members decoded without pickle and checked against the output's layout, the counts
and digest checked against the manifest at the shard's end."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as safetensors_load
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from dflash_prep.consume.shard_format import (
    FP8_MODES,
    MEMBER_INPUT_IDS,
    MEMBER_LOSS_MASK,
    MEMBER_META,
    MEMBER_STATES,
    REQUIRED_MEMBERS,
    TORCH_DTYPES,
    OutputLayout,
    ShardFormatError,
    ShardInfo,
)
from dflash_prep.recipe.location import is_remote_path
from dflash_prep.target.fp8 import dequantize as fp8_dequantize


# ------------------------------------------------------------------------------------------------ tar level
def open_for_reading(path, chunk_bytes: int = 8 << 20):
    """A binary file read front to back: a local file with a `chunk_bytes` buffer, or an object of a store (a
    `upath.UPath`: fsspec's file, fetched in `chunk_bytes` blocks with read-ahead)."""
    if is_remote_path(path):
        return path.open("rb", block_size=chunk_bytes)
    return open(path, "rb", buffering=chunk_bytes)


def sample_key(member_name: str) -> tuple[str, str]:
    """webdataset naming (`webdataset.tariterators.base_plus_ext`): `dir/KEY.suffix.ext` -> (`dir/KEY`,
    `suffix.ext`); the key ends at the first dot of the base name; a name without one is its own key."""
    key, suffix = base_plus_ext(member_name)
    return (member_name, "") if key is None else (key, suffix)


class HashingReader(io.RawIOBase):
    """A read-only, forward-only file that passes every byte it reads through sha256; `finish()` reads the rest
    (the tar's end blocks and padding), so the digest covers the whole file.

    Why ours: webdataset's opener (`gopen`) has no digest, and `hashlib.file_digest` before reading is a second
    pass over each shard (2x the I/O of a multi-GB shard); this hashes the bytes webdataset's tar reader reads
    anyway (it reads a tar as a stream, never seeking)."""

    def __init__(self, path: str | Path, chunk_bytes: int = 8 << 20):
        super().__init__()
        self._f = open_for_reading(path, chunk_bytes)
        self._sha = hashlib.sha256()
        self._pos = 0
        self._chunk = chunk_bytes

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        data = self._f.read() if size is None or size < 0 else self._f.read(size)
        self._sha.update(data)
        self._pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def finish(self) -> tuple[str, int]:
        """Read the rest of the file; (sha256 hex, size in bytes) of the whole file."""
        while self.read(self._chunk):
            pass
        return self._sha.hexdigest(), self._pos

    def close(self) -> None:
        self._f.close()
        super().close()


def _tar_error(path: str | Path):
    """A webdataset exception handler that turns any tar or grouping error into one `ShardFormatError`."""

    def handler(exn: Exception) -> bool:
        if isinstance(exn, ShardFormatError):  # ours, passing through an outer webdataset stage that added args
            exn.args = exn.args[:1]
            raise exn
        what = str(exn.args[0]).split(" @ ")[0] if exn.args else type(exn).__name__  # webdataset appends " @ stream"
        if isinstance(exn, ValueError) and ": duplicate file name" in what:  # group_by_keys: "KEY.SUFFIX: dup..."
            key, suffix = sample_key(what.split(": duplicate file name")[0])
            raise ShardFormatError(f"{path}: sample {key!r} has two {suffix!r} members") from exn
        raise ShardFormatError(f"{path}: not a readable tar ({type(exn).__name__}: {what})") from exn

    return handler


def iter_tar_samples(path: str | Path, wanted=None, member_names: Iterable[str] | None = None,
                     expected_sha256: str | None = None, expected_bytes: int | None = None,
                     ) -> Iterator[tuple[int, str, dict[str, bytes] | None]]:
    """Yield `(position, key, members)` for each sample of one tar, in file order.

    The tar is parsed and grouped into samples by webdataset (`tar_file_expander` + `group_by_keys`: a stream
    read of the whole file). `position` counts samples from 0. `members` maps member suffix (e.g.
    `input_ids.npy`) to its bytes; only suffixes in `member_names` are kept (all when None). When
    `wanted(position)` is false, `members` is None (the bytes were read, not decoded).

    With `expected_sha256` every byte of the file is hashed as it is read (`HashingReader`), and after the last
    sample a digest (or a size, with `expected_bytes`) that differs raises `ShardFormatError`.

    Raises `ShardFormatError` naming the file when a key appears in two separate runs of members (a sample split
    in two), a sample has two members of one name, or the tar cannot be parsed.
    """
    keep = None if member_names is None else set(member_names)
    handler = _tar_error(path)
    seen: set[str] = set()
    stream = HashingReader(path) if expected_sha256 is not None else open_for_reading(path)
    with stream:
        files = tar_file_expander([{"url": str(path), "stream": stream}], handler=handler)
        for position, record in enumerate(group_by_keys(files, handler=handler)):
            key = record["__key__"]
            if key in seen:
                raise ShardFormatError(f"{path}: sample key {key!r} appears twice (its members are not "
                                       f"contiguous or the key is repeated)")
            seen.add(key)
            members = None
            if wanted is None or wanted(position):
                members = {name: data for name, data in record.items()
                           if not name.startswith("__") and (keep is None or name in keep)}
            yield position, key, members
        if expected_sha256 is not None:
            _check_digest(path, stream.finish(), expected_sha256, expected_bytes)


def _check_digest(path, digest_size: tuple[str, int], sha256: str, num_bytes: int | None) -> None:
    digest, size = digest_size
    if num_bytes is not None and size != num_bytes:
        raise ShardFormatError(f"{path}: {size} bytes, the manifest says {num_bytes} (truncated or replaced shard)")
    if digest != sha256:
        raise ShardFormatError(f"{path}: sha256 {digest[:16]}... differs from the manifest's {sha256[:16]}... "
                               f"(corrupt or replaced shard)")


# --------------------------------------------------------------------------------------------- sample level
def _npy(shard: Path | str, key: str, name: str, data: bytes, dtype: np.dtype) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as e:
        raise ShardFormatError(f"{shard}: sample {key!r}: {name} is not a plain .npy array ({e})") from e
    if array.dtype != dtype or array.ndim != 1:
        raise ShardFormatError(f"{shard}: sample {key!r}: {name} is {array.dtype} {list(array.shape)}, "
                               f"expected {np.dtype(dtype)} [T]")
    return array


def decode_sample(members: dict[str, bytes], key: str, layout: OutputLayout, shard: Path | str = "<shard>",
                  include_meta: bool = False, fp8: str = "bfloat16") -> dict[str, Any]:
    """Decode one sample's members (no pickle) and check them against `layout`.

    Returns `sample_id`, `input_ids` int64 [T], `loss_mask` int64 [T], `hidden_states` [T, k*H] (storage dtype),
    `final_hidden_states` [T, H] when the layout has it, and `meta` (dict) with `include_meta`. fp8 outputs: see
    reader.py's docstring (`fp8` = "bfloat16", "float32" or "raw").
    """
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be one of {FP8_MODES}, got {fp8!r}")
    missing = [m for m in REQUIRED_MEMBERS if m not in members]
    if missing:
        raise ShardFormatError(f"{shard}: sample {key!r} lacks member(s) {missing}")
    input_ids_T = _npy(shard, key, MEMBER_INPUT_IDS, members[MEMBER_INPUT_IDS], np.dtype(np.int32))
    loss_mask_T = _npy(shard, key, MEMBER_LOSS_MASK, members[MEMBER_LOSS_MASK], np.dtype(np.uint8))
    T = input_ids_T.shape[0]
    if loss_mask_T.shape[0] != T:
        raise ShardFormatError(f"{shard}: sample {key!r}: loss_mask has {loss_mask_T.shape[0]} tokens, "
                               f"input_ids {T}")
    try:
        tensors = safetensors_load(members[MEMBER_STATES])
    except Exception as e:  # safetensors raises its own error types on malformed headers
        raise ShardFormatError(f"{shard}: sample {key!r}: {MEMBER_STATES} cannot be decoded ({e})") from e
    expected = layout.expected_tensors(T)
    if set(tensors) != set(expected):
        raise ShardFormatError(f"{shard}: sample {key!r}: {MEMBER_STATES} holds {sorted(tensors)}, expected "
                               f"{sorted(expected)} (capture_final={layout.capture_final!r}, "
                               f"dtype={layout.dtype_name!r})")
    for name, (dtype, shape) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ShardFormatError(f"{shard}: sample {key!r}: {name} is {t.dtype} {list(t.shape)}, expected "
                                   f"{dtype} {list(shape)}")
    if layout.is_fp8 and fp8 != "raw":
        dtype = TORCH_DTYPES[fp8]
        for name in [n for n in expected if not n.endswith("_scales")]:
            tensors[name] = fp8_dequantize(tensors[name], tensors.pop(f"{name}_scales"), dtype)
    sample: dict[str, Any] = {
        "sample_id": key,
        "input_ids": torch.from_numpy(input_ids_T.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask_T.astype(np.int64)),
    }
    sample.update((name, tensors[name]) for name in expected if name in tensors)  # in docs/FORMAT.md order
    if include_meta:
        sample["meta"] = json.loads(members[MEMBER_META]) if MEMBER_META in members else None
    return sample


def iter_shard(shard: ShardInfo, layout: OutputLayout, wanted=None, include_meta: bool = False,
               check_tokens: bool = True, fp8: str = "bfloat16", verify_sha256: bool = True,
               ) -> Iterator[dict[str, Any]]:
    """Decoded samples of one shard (those with `wanted(position)`, all when None), in file order.

    At the end of the shard, raises `ShardFormatError` when its size or sha256 (`verify_sha256`, hashed while
    streaming), its sample count or (when every sample was decoded and `check_tokens`) its token count differs
    from the manifest's.
    """
    names = REQUIRED_MEMBERS + ((MEMBER_META,) if include_meta else ())
    count = tokens = 0
    decoded_all = True
    digest = dict(expected_sha256=shard.sha256, expected_bytes=shard.num_bytes) if verify_sha256 else {}
    for position, key, members in iter_tar_samples(shard.path, wanted, names, **digest):
        count = position + 1
        if members is None:
            decoded_all = False
            continue
        sample = decode_sample(members, key, layout, shard.path, include_meta, fp8)
        tokens += sample["input_ids"].shape[0]
        yield sample
    if count != shard.num_samples:
        raise ShardFormatError(f"{shard.path}: holds {count} samples, the manifest says {shard.num_samples}")
    if decoded_all and check_tokens and tokens != shard.num_tokens:
        raise ShardFormatError(f"{shard.path}: holds {tokens} tokens, the manifest says {shard.num_tokens}")


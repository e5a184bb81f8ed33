"""Read an extraction output: the shards listed in `OUT/manifest.json` -> per-sample tensors -> DFlash batches.

`ShardDataset(out_dir)` is a torch `IterableDataset`; `DFlashCollator` turns its samples into trainer batches.

Guarantees of `ShardDataset`:
- it reads `OUT/manifest.json` once, at construction, and reads only the shards it lists (the manifest lists
  committed shards only, so a partial shard is never read); it never lists folders nor opens every shard up
  front: a shard is opened when its consumer reaches it;
- each sample is one dict: `sample_id` (str), `input_ids` int64 [T], `loss_mask` int64 [T], `hidden_states`
  [T, k*H] in the output's storage dtype (`manifest["dtype"]`, bf16 by default; the k captured layers
  concatenated in ascending `layer_ids` order, after-layer 0-based ids), and `final_hidden_states` [T, H] when
  the extraction captured it (`manifest["capture_final"]` != "none"); values are exactly the stored bytes;
- fp8 outputs (`manifest["dtype"] == "fp8_e4m3"`): by default (`fp8="bfloat16"`) the states come back
  dequantized to bf16 (e4m3 value x its token's fp32 scale, formed in fp32, then rounded to bf16), with the same
  keys and shapes as a bf16 output; `fp8="float32"` gives float32; `fp8="raw"` gives the stored tensors:
  `hidden_states` float8_e4m3fn [T, k*H] + `hidden_states_scales` float32 [T, k] (and `final_hidden_states`
  [T, H] + `final_hidden_states_scales` [T, 1]); `fp8.dequantize` turns them into values;
- safetensors members are decoded with `safetensors.torch.load` (bytes) and npy members with
  `np.load(allow_pickle=False)`: no pickle, no code execution; `meta.json` is parsed only with `include_meta`;
- a shard whose content disagrees with the manifest or the format (missing member, wrong dtype or shape,
  repeated key, sample count different from the manifest) raises `ShardFormatError` naming the shard;
- integrity (`verify_sha256=True`, the default): at construction, the manifest's shard list must name each
  path once and its sample counts must add up to `num_samples` (else `ShardFormatError`, before any shard is
  opened); while a shard is streamed, every byte of it (also the bytes of samples another consumer keeps, and
  the tar's end blocks) goes through sha256, and at the end of the shard a size or digest different from the
  manifest's raises `ShardFormatError` naming the shard. The check cannot come before the shard's samples
  (that would read every shard twice): a corrupted sample is yielded, then the error ends the iteration, so a
  training loop or an export stops instead of going on. Cost: one sha256 pass over the bytes read (about
  1-2 GB/s per consumer). `verify_sha256=False` skips the digest (the counts are still checked);
- work split ("consumers" = distributed ranks x DataLoader workers; rank/world from the explicit arguments,
  else from `torch.distributed` when it is initialized, else 0/1; the worker from
  `torch.utils.data.get_worker_info()`): all consumers of an epoch together yield every sample of the
  manifest exactly once. The rule (`split="auto"`): when the output has at least as many shards as consumers,
  whole shards are dealt: walking the epoch's shard order, each shard goes to the consumer with the fewest
  samples so far (manifest counts; ties to the lowest consumer), so no consumer opens a shard it does not
  read; otherwise every consumer walks every shard and keeps the samples whose global position p (in the
  epoch's shard order) has p % C == c (it reads the others' bytes too, not decoding them: tars are read as
  streams). `split="shard"` / `split="sample"` force one rule. With shard granularity,
  consumers' sample counts can differ by up to one shard's worth; with sample striding, by at most one (use
  `split="sample"` when a DDP loop needs equal step counts). `num_samples_for()` gives the exact count of a
  rank for the current epoch;
- shuffle (`shuffle=True`): the shard order is a permutation seeded by (seed, epoch), the same on every
  consumer, and each consumer passes its samples through a buffer of `shuffle_buffer` samples seeded by
  (seed, epoch, consumer). It changes the order, never the content. Call `set_epoch(e)` before creating the
  epoch's iterator (DataLoader workers get a copy of the dataset when the iterator is created, so with
  `persistent_workers=True` they do not see later `set_epoch` calls: use non-persistent workers to reshuffle).

Built on webdataset (1.0): each consumer's epoch is a `webdataset.DataPipeline` (`ShardDataset.pipeline`):
`SimpleShardList` (the seeded shard order) -> `SplitByConsumer` -> tar parsing and grouping into samples
(`tariterators.tar_file_expander` + `group_by_keys`, in `iter_tar_samples`) -> our decoding and checks ->
`webdataset.shuffle` (a `random.Random` seeded by (seed, epoch, consumer)). What stays ours, and why:
- the split (`SplitByConsumer`, one stage for ranks and workers): `split_by_node` / `split_by_worker` deal shards
  round-robin (`islice`), take the rank from the RANK/WORLD_SIZE environment variables before torch.distributed
  and accept no explicit rank. Round-robin loses the bound above (up to one shard's worth between consumers;
  with shards of 600, 10, 600, 10 samples and 2 consumers it gives 1200 and 20), and with fewer shards than
  consumers some consumers would get nothing. The sample-level split is a position filter given to the shard
  reader, so the others' samples are not decoded (`webdataset.slice` would stride only after decoding);
- no `with_epoch`: it re-runs the pipeline until n samples are out (a second pass repeats samples) and stops
  with `islice` right after the n-th sample, before the last shard's end, so that shard's digest and count would
  never be checked. An epoch here is one pass, its length known exactly (`num_samples_for`);
- integrity: webdataset's opener has no digest (`HashingReader` hashes the stream it reads), and its grouping
  yields a key repeated later in a shard as a second sample: both are checked here, as are the manifest's counts.
Cost, measured on the demo output (700 samples, 91 MB in 6 shards, one process, no workers, best of 3 x 5 runs
on a shared 2-core CPU): webdataset reads a tar as a stream (10 KB chunks, member bytes copied more often than a
seeking reader's one read): 3,682 samples/s against 4,321 before with sha256 (-15%), 4,837 against 6,386 with
`verify_sha256=False` (-24%); one consumer of 4 with `split="sample"` 1,187 against 1,494 (sha256) and 1,657
against 2,792 (no hash: it used to seek over the others' samples).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds
from safetensors.torch import load as safetensors_load
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from dflash_prep.store.manifest import read_manifest
from dflash_prep.target.fp8 import FP8_DTYPE
from dflash_prep.target.fp8 import dequantize as fp8_dequantize
from dflash_prep.target.norms import can_derive_after_norm, read_final_norm, with_after_norm_final

MEMBER_INPUT_IDS = "input_ids.npy"
MEMBER_LOSS_MASK = "loss_mask.npy"
MEMBER_STATES = "hidden_states.safetensors"
MEMBER_META = "meta.json"
REQUIRED_MEMBERS = (MEMBER_INPUT_IDS, MEMBER_LOSS_MASK, MEMBER_STATES)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8_e4m3": FP8_DTYPE}
SPLIT_MODES = ("auto", "shard", "sample")
FP8_MODES = ("bfloat16", "float32", "raw")  # what the reader returns for an fp8 output
FINAL_MODES = ("as_stored", "before_norm", "after_norm")  # the final layer the reader returns


class ShardFormatError(ValueError):
    """A shard disagrees with the manifest or the shard format; the message names the shard (and sample)."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest. `path` is absolute; `rel_path` is the manifest's (relative to OUT)."""

    path: Path
    rel_path: str
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str


@dataclass(frozen=True)
class OutputLayout:
    """What every sample of an output must look like, from its manifest."""

    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: torch.dtype
    capture_final: str
    dtype_name: str = "bfloat16"  # the manifest's spelling of `dtype`

    @property
    def width(self) -> int:
        """Columns of `hidden_states`: k * H."""
        return len(self.layer_ids) * self.hidden_size

    @property
    def has_final(self) -> bool:
        return self.capture_final != "none"

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    def expected_tensors(self, T: int) -> dict[str, tuple[torch.dtype, tuple[int, int]]]:
        """name -> (dtype, shape) of the tensors in a T-token sample's `hidden_states.safetensors`."""
        k = len(self.layer_ids)
        out = {"hidden_states": (self.dtype, (T, self.width))}
        if self.is_fp8:
            out["hidden_states_scales"] = (torch.float32, (T, k))
        if self.has_final:
            out["final_hidden_states"] = (self.dtype, (T, self.hidden_size))
            if self.is_fp8:
                out["final_hidden_states_scales"] = (torch.float32, (T, 1))
        return out

    @classmethod
    def from_manifest(cls, manifest: dict) -> "OutputLayout":
        dtype_name = manifest["dtype"]
        if dtype_name not in TORCH_DTYPES:
            raise ValueError(f"manifest dtype {dtype_name!r} is not one of {sorted(TORCH_DTYPES)}")
        return cls(layer_ids=tuple(int(i) for i in manifest["layer_ids"]), hidden_size=int(manifest["hidden_size"]),
                   dtype=TORCH_DTYPES[dtype_name], capture_final=manifest.get("capture_final", "none"),
                   dtype_name=dtype_name)


def manifest_shard_problems(manifest: dict) -> list[str]:
    """What is wrong with the manifest's shard list on its own (no shard read): a path listed more than once, or
    shard sample / token counts that do not add up to `num_samples` / `num_tokens`. Empty: consistent."""
    problems = []
    paths = [s["path"] for s in manifest["shards"]]
    for p in sorted({p for p in paths if paths.count(p) > 1}):
        problems.append(f"{p}: listed {paths.count(p)} times in the manifest")
    for name in ("num_samples", "num_tokens"):
        total = sum(int(s[name]) for s in manifest["shards"])
        if name in manifest and int(manifest[name]) != total:
            problems.append(f"manifest.json: {name} is {manifest[name]}, its shards add up to {total}")
    return problems


def shards_of(out_dir: str | Path, manifest: dict) -> list[ShardInfo]:
    """The manifest's shard list, in manifest order, with absolute paths."""
    out_dir = Path(out_dir)
    return [ShardInfo(path=out_dir / s["path"], rel_path=s["path"], num_samples=int(s["num_samples"]),
                      num_tokens=int(s["num_tokens"]), num_bytes=int(s["num_bytes"]), sha256=s["sha256"])
            for s in manifest["shards"]]


# ------------------------------------------------------------------------------------------------ tar level
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
        self._f = open(path, "rb", buffering=chunk_bytes)
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
    stream = HashingReader(path) if expected_sha256 is not None else open(path, "rb")
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
    the module docstring (`fp8` = "bfloat16", "float32" or "raw").
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


# ---------------------------------------------------------------------------------------------- work split
def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): the explicit values, else torch.distributed's when initialized, else (0, 1)."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world_size = 0, 1
    if not (world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return int(rank), int(world_size)


@dataclass(frozen=True)
class ConsumerPlan:
    """What one consumer reads in one epoch.

    `shards` in reading order. Mode "shard": every sample of each listed shard. Mode "sample": the shards are
    all shards of the epoch, `first_positions[i]` is the global position of shard i's first sample, and the
    consumer keeps the samples with `(first_positions[i] + j) % num_consumers == consumer`.
    """

    mode: str
    consumer: int
    num_consumers: int
    shards: tuple[ShardInfo, ...]
    first_positions: tuple[int, ...]

    def wanted(self, shard_index: int):
        """The `wanted(position)` filter for `iter_tar_samples` on `shards[shard_index]` (None: all)."""
        if self.mode == "shard":
            return None
        base, C, c = self.first_positions[shard_index], self.num_consumers, self.consumer
        return lambda j: (base + j) % C == c

    @property
    def num_samples(self) -> int:
        if self.mode == "shard":
            return sum(s.num_samples for s in self.shards)
        total = sum(s.num_samples for s in self.shards)
        C, c = self.num_consumers, self.consumer
        return total // C + (1 if c < total % C else 0)


def epoch_shard_order(shards: list[ShardInfo], shuffle: bool, seed: int, epoch: int) -> list[ShardInfo]:
    """The epoch's shard order: manifest order, or a permutation seeded by (seed, epoch), the same on every
    consumer (`webdataset.SimpleShardList`, seeded with a string of seed and epoch)."""
    by_url = {str(s.path): s for s in shards}
    return [by_url[d["url"]] for d in _shard_list(shards, shuffle, seed, epoch)] if shards else []


def _shard_list(shards: list[ShardInfo], shuffle: bool, seed: int, epoch: int) -> wds.SimpleShardList:
    return wds.SimpleShardList([str(s.path) for s in shards],
                               seed=f"dflash-prep:shards:{seed}:{epoch}" if shuffle else None)


def plan_consumer(shards: list[ShardInfo], consumer: int, num_consumers: int, split: str = "auto",
                  shuffle: bool = False, seed: int = 0, epoch: int = 0) -> ConsumerPlan:
    """Consumer `consumer` of `num_consumers`'s share of one epoch (see the module docstring for the rule)."""
    return plan_from_order(epoch_shard_order(shards, shuffle, seed, epoch), consumer, num_consumers, split)


def plan_from_order(order: list[ShardInfo], consumer: int, num_consumers: int, split: str = "auto") -> ConsumerPlan:
    """Consumer `consumer`'s share of an epoch whose shards come in `order`: whole shards dealt to the least
    loaded consumer, or every shard with sample striding (the module docstring's rule)."""
    if split not in SPLIT_MODES:
        raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
    if not 0 <= consumer < num_consumers:
        raise ValueError(f"consumer {consumer} is not in [0, {num_consumers})")
    mode = split if split != "auto" else ("shard" if len(order) >= num_consumers else "sample")
    if mode == "shard":
        load = [0] * num_consumers
        mine = []
        for shard in order:
            c = min(range(num_consumers), key=lambda j: (load[j], j))
            load[c] += shard.num_samples
            if c == consumer:
                mine.append(shard)
        return ConsumerPlan("shard", consumer, num_consumers, tuple(mine), ())
    firsts, position = [], 0
    for s in order:
        firsts.append(position)
        position += s.num_samples
    return ConsumerPlan("sample", consumer, num_consumers, tuple(order), tuple(firsts))


class SplitByConsumer:
    """A webdataset pipeline stage, in place of `split_by_node` + `split_by_worker`: from the epoch's stream of
    `{"url": ...}` (every consumer sees the same order), yield this consumer's shards as
    `{"url", "shard": ShardInfo, "wanted": position filter or None}` (`plan_from_order`'s rule)."""

    def __init__(self, shards: list[ShardInfo], consumer: int, num_consumers: int, split: str):
        self.by_url = {str(s.path): s for s in shards}
        self.consumer, self.num_consumers, self.split = consumer, num_consumers, split

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        order = [self.by_url[d["url"]] for d in src]
        plan = plan_from_order(order, self.consumer, self.num_consumers, self.split)
        for i, shard in enumerate(plan.shards):
            yield {"url": str(shard.path), "shard": shard, "wanted": plan.wanted(i)}


class ShardDataset(IterableDataset):
    """Samples of an extraction output, split across ranks and DataLoader workers (see the module docstring).

    Args:
        out_dir: the extraction's output folder (holding `manifest.json`).
        shuffle: shuffle shard order and samples (per epoch, seeded); off: manifest order, file order.
        seed: shuffle seed.
        shuffle_buffer: samples held by each consumer's shuffle buffer (memory: this many samples).
        rank, world_size: this process's place among the readers; default: torch.distributed, else 0 of 1.
        split: "auto" (shards when shards >= consumers, else samples), "shard" or "sample".
        include_meta: also yield `meta` (the sample's meta.json).
        fp8: for an fp8 output, "bfloat16" (default: dequantized to bf16), "float32", or "raw" (e4m3 tensors +
            their fp32 `*_scales`).
        final: "as_stored" (default) or "after_norm": on a `capture_final: before_norm` output, the after-norm
            final states derived with the stored final norm (norms.py; exact to the storage dtype's rounding,
            returned in the stored dtype); "before_norm"/"after_norm" matching what is stored is a no-op.
            Raises ValueError when the asked form cannot be had (a norm cannot be undone).
        verify_sha256: hash each shard while streaming it and raise `ShardFormatError` at its end when the
            digest differs from the manifest's (default); False skips the hash (sample and token counts are still
            checked).

    Raises `ShardFormatError` at construction when the manifest names a shard twice or its shards' sample
    counts do not add up to `num_samples`.
    """

    def __init__(self, out_dir: str | Path, *, shuffle: bool = False, seed: int = 0, shuffle_buffer: int = 256,
                 rank: int | None = None, world_size: int | None = None, split: str = "auto",
                 include_meta: bool = False, fp8: str = "bfloat16", verify_sha256: bool = True,
                 final: str = "as_stored"):
        super().__init__()
        if fp8 not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {fp8!r}")
        if split not in SPLIT_MODES:
            raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        self.out_dir = Path(out_dir)
        self.manifest = read_manifest(self.out_dir)
        self.layout = OutputLayout.from_manifest(self.manifest)
        problems = manifest_shard_problems(self.manifest)
        if problems:
            raise ShardFormatError(f"{self.out_dir / 'manifest.json'}: {'; '.join(problems[:5])}")
        self.shards = shards_of(self.out_dir, self.manifest)
        self.verify_sha256 = verify_sha256
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.split = split
        self.include_meta = include_meta
        self.fp8 = fp8
        self.final_norm = self._final_norm_to_apply(final)
        self.epoch = 0

    def _final_norm_to_apply(self, final: str) -> dict | None:
        """The final norm to apply to `final_hidden_states` (final="after_norm" on a before-norm output), or None."""
        if final not in FINAL_MODES:
            raise ValueError(f"final must be one of {FINAL_MODES}, got {final!r}")
        stored = self.layout.capture_final
        if final == "as_stored" or final == stored:
            return None
        if stored == "none":
            raise ValueError(f"final={final!r}: the output did not capture the final layer; re-extract with "
                             f"layers.capture_final=before_norm (gives both) or {final}")
        if final == "before_norm":
            raise ValueError("final='before_norm': the output stores the final layer after the norm, which cannot "
                             "be undone; re-extract with layers.capture_final=before_norm")
        if not can_derive_after_norm(self.manifest):
            raise ValueError(f"final='after_norm': {self.out_dir} stores no supported final norm "
                             f"(final_norm={self.manifest.get('final_norm')}); re-extract with "
                             f"layers.capture_final=after_norm")
        if self.layout.is_fp8 and self.fp8 == "raw":
            raise ValueError("final='after_norm' needs values: use fp8='bfloat16' or 'float32', not 'raw'")
        return read_final_norm(self.out_dir)

    # -- facts ---------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples in the whole output (all ranks together) per epoch."""
        return int(self.manifest["num_samples"])

    @property
    def layer_ids(self) -> list[int]:
        """Captured layers, after-layer 0-based ids, in the column order of `hidden_states`."""
        return list(self.layout.layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.layout.hidden_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (seeded) order the next iterator yields."""
        self.epoch = int(epoch)

    def plan(self, consumer: int, num_consumers: int) -> ConsumerPlan:
        """One consumer's share of the current epoch."""
        return plan_consumer(self.shards, consumer, num_consumers, self.split, self.shuffle, self.seed, self.epoch)

    def num_samples_for(self, rank: int | None = None, world_size: int | None = None, num_workers: int = 1) -> int:
        """Exact number of samples rank `rank` (all its `num_workers` workers together) yields this epoch."""
        if rank is None and world_size is None:
            rank, world_size = resolve_rank_world(self.rank, self.world_size)
        else:
            rank, world_size = resolve_rank_world(rank, world_size)
        workers = max(num_workers, 1)  # num_workers=0: the main process is the one consumer
        return sum(self.plan(rank * workers + w, world_size * workers).num_samples for w in range(workers))

    # -- iteration -----------------------------------------------------------------------------------------
    def _consumer(self) -> tuple[int, int]:
        rank, world_size = resolve_rank_world(self.rank, self.world_size)
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * num_workers + worker, world_size * num_workers

    def _decode_shards(self, src: Iterable[dict]) -> Iterator[dict[str, Any]]:
        """Pipeline stage: this consumer's shards -> its decoded, checked samples (`iter_shard`)."""
        for item in src:
            for sample in iter_shard(item["shard"], self.layout, item["wanted"], self.include_meta, fp8=self.fp8,
                                     verify_sha256=self.verify_sha256):
                yield sample if self.final_norm is None else with_after_norm_final(sample, self.final_norm)

    def pipeline(self, consumer: int, num_consumers: int) -> wds.DataPipeline:
        """The webdataset pipeline of one consumer for the current epoch: shard list (seeded order) -> this
        consumer's shards -> tar -> decoded samples -> seeded shuffle buffer (with `shuffle`)."""
        stages = [_shard_list(self.shards, self.shuffle, self.seed, self.epoch) if self.shards else [],
                  SplitByConsumer(self.shards, consumer, num_consumers, self.split), self._decode_shards]
        if self.shuffle:
            rng = random.Random(f"dflash-prep:samples:{self.seed}:{self.epoch}:{consumer}")
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng))
        return wds.DataPipeline(*stages)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.pipeline(*self._consumer()))


# ------------------------------------------------------------------------------------------ DFlash batches
def has_supervised_pair(loss_mask_T: torch.Tensor) -> bool:
    """True when some p has loss_mask[p] and loss_mask[p+1] both nonzero (a DFlash anchor exists)."""
    m = loss_mask_T.bool()
    return bool((m[:-1] & m[1:]).any()) if m.shape[0] >= 2 else False


SEQUENCE_KEYS = ("input_ids", "loss_mask", "hidden_states", "final_hidden_states", "hidden_states_scales",
                 "final_hidden_states_scales")


def truncate_sample(sample: dict[str, Any], max_length: int) -> dict[str, Any]:
    """The sample's first `max_length` tokens (views; every per-token tensor cut alike)."""
    out = dict(sample)
    for name in SEQUENCE_KEYS:
        if name in out:
            out[name] = out[name][:max_length]
    return out


class DFlashCollator:
    """Build DFlash trainer batches from `ShardDataset` samples.

    Each sample is first truncated to `max_length` tokens; samples that then lack two consecutive supervised
    tokens (no DFlash anchor) are dropped (counted in `num_dropped`). Returns None when every sample was
    dropped.

    mode="padded" (SpecForge-style `[B, T]`, T = longest kept sample, or rounded up to `pad_to_multiple_of`):
        input_ids int64 [B, T] (pad_token_id on padding), loss_mask int64 [B, T] (0 on padding),
        attention_mask int64 [B, T] (1 on real tokens, a prefix of each row), position_ids int64 [B, T]
        (0..len-1, 0 on padding), hidden_states [B, T, k*H] (zeros on padding), final_hidden_states
        [B, T, H] when present, lengths int64 [B].
    mode="packed" (speculators-style `[1, N]`: documents back to back, N = total kept tokens, or rounded up to
    `pad_to_multiple_of`):
        input_ids / loss_mask / position_ids (restart at 0 per document) / document_ids (0..D-1, -1 on
        padding) int64 [1, N], hidden_states [1, N, k*H], final_hidden_states [1, N, H] when present,
        lengths int64 [D], cu_seqlens int32 [D+1] (document boundaries, for varlen attention kernels).
    Both: sample_ids list[str] (batch order), num_dropped int.
    Guarantee: row b (padded) / document d (packed) holds exactly the tokens and states of the b-th/d-th kept
    sample after truncation, bit for bit; padding never carries loss.
    """

    def __init__(self, max_length: int, mode: str = "padded", pad_token_id: int = 0,
                 pad_to_multiple_of: int | None = None):
        if mode not in ("padded", "packed"):
            raise ValueError(f"mode must be 'padded' or 'packed', got {mode!r}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.max_length = max_length
        self.mode = mode
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def _round_up(self, n: int) -> int:
        m = self.pad_to_multiple_of
        return n if m is None else -(-n // m) * m

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any] | None:
        kept = []
        for s in samples:
            s = truncate_sample(s, self.max_length)
            if has_supervised_pair(s["loss_mask"]):
                kept.append(s)
        num_dropped = len(samples) - len(kept)
        if not kept:
            return None
        has_final = all("final_hidden_states" in s for s in kept)
        if not has_final and any("final_hidden_states" in s for s in kept):
            raise ValueError("some samples carry final_hidden_states and some do not")
        batch = self._padded(kept, has_final) if self.mode == "padded" else self._packed(kept, has_final)
        batch["sample_ids"] = [s["sample_id"] for s in kept]
        batch["num_dropped"] = num_dropped
        return batch

    def _padded(self, kept: list[dict[str, Any]], has_final: bool) -> dict[str, Any]:
        lengths_B = torch.tensor([s["input_ids"].shape[0] for s in kept], dtype=torch.int64)
        B, T = len(kept), self._round_up(int(lengths_B.max()))
        first = kept[0]
        input_ids_BT = torch.full((B, T), self.pad_token_id, dtype=torch.int64)
        loss_mask_BT = torch.zeros(B, T, dtype=torch.int64)
        attention_mask_BT = torch.zeros(B, T, dtype=torch.int64)
        position_ids_BT = torch.zeros(B, T, dtype=torch.int64)
        hidden_states_BTK = first["hidden_states"].new_zeros(B, T, first["hidden_states"].shape[1])
        final_BTH = first["final_hidden_states"].new_zeros(B, T, first["final_hidden_states"].shape[1]) \
            if has_final else None
        for b, s in enumerate(kept):
            n = s["input_ids"].shape[0]
            input_ids_BT[b, :n] = s["input_ids"]
            loss_mask_BT[b, :n] = s["loss_mask"]
            attention_mask_BT[b, :n] = 1
            position_ids_BT[b, :n] = torch.arange(n)
            hidden_states_BTK[b, :n] = s["hidden_states"]
            if final_BTH is not None:
                final_BTH[b, :n] = s["final_hidden_states"]
        out = {"input_ids": input_ids_BT, "loss_mask": loss_mask_BT, "attention_mask": attention_mask_BT,
               "position_ids": position_ids_BT, "hidden_states": hidden_states_BTK, "lengths": lengths_B}
        if final_BTH is not None:
            out["final_hidden_states"] = final_BTH
        return out

    def _packed(self, kept: list[dict[str, Any]], has_final: bool) -> dict[str, Any]:
        lengths_D = torch.tensor([s["input_ids"].shape[0] for s in kept], dtype=torch.int64)
        total = int(lengths_D.sum())
        N = self._round_up(total)
        pad = N - total
        cu_seqlens = torch.zeros(len(kept) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths_D, 0).to(torch.int32)

        def cat(name: str, fill=0, dtype=None) -> torch.Tensor:
            parts = [s[name] for s in kept]
            if pad:
                parts.append(parts[0].new_full((pad, *parts[0].shape[1:]), fill))
            t = torch.cat(parts, 0)
            return (t if dtype is None else t.to(dtype)).unsqueeze(0)

        document_ids_N = torch.repeat_interleave(torch.arange(len(kept), dtype=torch.int64), lengths_D)
        position_ids_N = torch.cat([torch.arange(int(n), dtype=torch.int64) for n in lengths_D])
        if pad:
            document_ids_N = torch.cat([document_ids_N, torch.full((pad,), -1, dtype=torch.int64)])
            position_ids_N = torch.cat([position_ids_N, torch.zeros(pad, dtype=torch.int64)])
        out = {"input_ids": cat("input_ids", self.pad_token_id), "loss_mask": cat("loss_mask", 0),
               "position_ids": position_ids_N.unsqueeze(0), "document_ids": document_ids_N.unsqueeze(0),
               "hidden_states": cat("hidden_states"), "lengths": lengths_D, "cu_seqlens": cu_seqlens}
        if has_final:
            out["final_hidden_states"] = cat("final_hidden_states")
        return out

"""Bytes on disk, exactly as the shard writer lays them out: per record (one sample) and per run.

Shared by `dflash-prep plan` (the bytes and shard counts it reports) and the extraction (the free-space check
before the model loads), so both give the writer's own figures (tests compare them byte for byte).
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from dflash_prep.plan.planner import PlannedBatch
from dflash_prep.recipe.schema import Recipe
from dflash_prep.store.writer import ST_CODE as _ST_CODE
from dflash_prep.store.writer import ST_ITEMSIZE as _ST_ITEMSIZE
from dflash_prep.units import format_bytes

log = logging.getLogger("dflash_prep")


def safetensors_num_bytes(tensors: list[tuple[str, str, tuple[int, ...]]]) -> int:
    """Size of `safetensors.torch.save` of tensors given as (name, dtype code, shape): the writer's own header
    plus the data."""
    from dflash_prep.store.writer import safetensors_header

    header, _ = safetensors_header(tensors)
    return len(header) + sum(math.prod(shape) * _ST_ITEMSIZE[code] for _, code, shape in tensors)


def states_tensors(T: int, k: int, H: int, dtype: str, has_final: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors of a T-token sample's `hidden_states.safetensors` (docs/FORMAT.md)."""
    code = _ST_CODE[dtype]
    out = [("hidden_states", code, (T, k * H))]
    if dtype == "fp8_e4m3":
        out.append(("hidden_states_scales", "F32", (T, k)))
    if has_final:
        out.append(("final_hidden_states", code, (T, H)))
        if dtype == "fp8_e4m3":
            out.append(("final_hidden_states_scales", "F32", (T, 1)))
    return out


@functools.lru_cache(maxsize=1)
def tar_member_overhead() -> dict[str, int]:
    """Tar header bytes the shard writer puts before each member's data, by member suffix.

    Measured, not assumed: one probe sample is written through `ShardWriter` into a temporary folder and its
    tar is parsed (a float mtime, for instance, would add a PAX header to every member)."""
    import torch

    from dflash_prep.plan.batches import SampleInfo
    from dflash_prep.store.writer import ShardWriter, encode_sample, sample_meta

    with tempfile.TemporaryDirectory(prefix="dflash-prep-probe-") as tmp:
        writer = ShardWriter(tmp, 0, max_shard_bytes=1 << 62)
        info = SampleInfo("0" * 10, 0, None, np.zeros(2, np.int32), np.ones(2, np.uint8))
        writer.write_batch(0, [(encode_sample(info, torch.zeros(2, 1), None, sample_meta(info, [0], 0)), 2)])
        writer.close()
        path = Path(tmp) / writer.committed[0].path
        out = {}
        with tarfile.open(path, "r:") as tar:
            for m in tar:
                out[m.name.split(".", 1)[1]] = m.offset_data - m.offset
    return out


def _padded(n: int) -> int:
    return -(-n // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class RecordSizer:
    """Bytes one sample adds to a shard, exactly as the writer encodes it, per storage dtype."""

    def __init__(self, layer_ids: list[int], hidden_size: int, capture_final: str):
        self.layer_ids = list(layer_ids)
        self.k = len(layer_ids)
        self.H = hidden_size
        self.has_final = capture_final != "none"
        self.header = tar_member_overhead()

    @functools.lru_cache(maxsize=None)  # noqa: B019 - one sizer per plan; T takes a few thousand values
    def _fixed(self, T: int, dtype: str) -> int:
        from dflash_prep.store.writer import _npy_bytes

        sizes = {"input_ids.npy": len(_npy_bytes(np.zeros(T, np.int32))),
                 "loss_mask.npy": len(_npy_bytes(np.zeros(T, np.uint8))),
                 "hidden_states.safetensors": safetensors_num_bytes(
                     states_tensors(T, self.k, self.H, dtype, self.has_final))}
        return sum(self.header[m] + _padded(n) for m, n in sizes.items())

    def record_bytes(self, T: int, meta_len: int, dtype: str) -> int:
        return self._fixed(T, dtype) + self.header["meta.json"] + _padded(meta_len)

    def states_bytes_per_token(self, dtype: str) -> float:
        """Bytes of hidden states per token (data only: no headers)."""
        blocks = self.k + (1 if self.has_final else 0)
        item = _ST_ITEMSIZE[_ST_CODE[dtype]]
        return blocks * self.H * item + (4 * blocks if dtype == "fp8_e4m3" else 0)


def shard_sizes(record_bytes_in_order: list[list[int]], max_shard_bytes: int, num_lanes: int = 1) -> list[int]:
    """Shard files one rank writes, given its batches (in the order it runs them) as lists of record sizes.

    Replays `ShardWriter` and its lanes: batch i goes to lane i mod `num_lanes`; a lane closes its shard after the
    first batch that brings it to `max_shard_bytes` or more; closing adds two zero blocks and pads the file to a
    multiple of RECORDSIZE."""
    rec = tarfile.RECORDSIZE
    sizes = []
    for lane in range(num_lanes):
        content = 0
        for batch in record_bytes_in_order[lane::num_lanes]:
            content += sum(batch)
            if content >= max_shard_bytes:
                sizes.append(-(-(content + 2 * tarfile.BLOCKSIZE) // rec) * rec)
                content = 0
        if content:
            sizes.append(-(-(content + 2 * tarfile.BLOCKSIZE) // rec) * rec)
    return sizes


def check_free_space(out_dir: Path, lengths: list[int], shares: list[list[PlannedBatch]], layer_ids: list[int],
                      hidden_size: int, recipe: Recipe) -> int:
    """Log the bytes the batches left to do will write (each rank's share in its order: the writer's own record
    sizes, `meta.json` taken as one block, and its shards' closing as `shard_sizes` replays it: `plan`'s figure
    wherever a sample's meta.json fits one 512-byte block, as the demo's ~130 bytes do),
    and warn, before the model loads, when they exceed the free space of the output's filesystem (the run would
    stop, cleanly and resumably, when the disk fills). Returns the estimate."""
    sizer = RecordSizer(layer_ids, hidden_size, recipe.layers.capture_final)
    dtype, out = recipe.output.dtype, recipe.output
    need = sum(sum(shard_sizes([[sizer.record_bytes(lengths[i], 1, dtype) for i in p.sample_indices] for p in share],
                               out.max_shard_bytes, out.num_writer_threads)) for share in shares)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        log.warning("this run will write about %s into %s but only %s are free there: it will stop "
                    "(cleanly, resumable) when the disk is full; free space first%s", format_bytes(need), out_dir,
                    format_bytes(free), "" if dtype == "fp8_e4m3" else
                    ", or store fp8 (output.dtype: fp8_e4m3, half the bytes)")
    else:
        log.info("output: about %s to write, %s free", format_bytes(need), format_bytes(free))
    return need

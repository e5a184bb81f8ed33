"""The shard format as the readers see it: member names, what a sample's tensors must look like (`OutputLayout`,
from the manifest), the manifest's shard list, and the error a shard that disagrees raises (docs/FORMAT.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_prep.recipe.location import as_location
from dflash_prep.target.fp8 import FP8_DTYPE

MEMBER_INPUT_IDS = "input_ids.npy"
MEMBER_LOSS_MASK = "loss_mask.npy"
MEMBER_STATES = "hidden_states.safetensors"
MEMBER_META = "meta.json"
REQUIRED_MEMBERS = (MEMBER_INPUT_IDS, MEMBER_LOSS_MASK, MEMBER_STATES)

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                "fp8_e4m3": FP8_DTYPE}
FP8_MODES = ("bfloat16", "float32", "raw")  # what the reader returns for an fp8 output


class ShardFormatError(ValueError):
    """A shard disagrees with the manifest or the shard format; the message names the shard (and sample)."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard as listed in the manifest. `path` is absolute (a Path, or a UPath in an object store); `rel_path`
    is the manifest's (relative to OUT)."""

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
    """The manifest's shard list, in manifest order, with absolute paths (local or in an object store)."""
    out_dir = as_location(out_dir)
    return [ShardInfo(path=out_dir / s["path"], rel_path=s["path"], num_samples=int(s["num_samples"]),
                      num_tokens=int(s["num_tokens"]), num_bytes=int(s["num_bytes"]), sha256=s["sha256"])
            for s in manifest["shards"]]


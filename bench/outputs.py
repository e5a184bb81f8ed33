"""What each mode wrote, read back from disk: {sample_id: (input_ids int64 [T], hidden_states [T, k*H])}, and
the comparison of two modes' states."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch


def fixed_batch_path(root: Path, index: int) -> Path:
    g = index // 2000 * 2000
    return root / f"rows_{g}-{g + 2000}" / f"data_{index}.ckpt"


def written_ids(mode: str, root: Path) -> list[str]:
    """Sample ids a mode's output holds, sorted."""
    if mode == "per_sample":
        return sorted(p.stem for p in root.glob("*.safetensors"))
    if mode == "fixed_batch":
        return sorted(f"{int(p.stem.split('_')[1]):010d}" for p in root.glob("rows_*/data_*.ckpt"))
    return sorted(key for path in dflash_shards(root) for key in tar_keys(path))


def dflash_shards(root: Path) -> list[Path]:
    """The committed shards of a dflash-prep output, as its manifest lists them."""
    with open(root / "manifest.json") as f:
        return [root / shard["path"] for shard in json.load(f)["shards"]]


def tar_keys(path: Path) -> set[str]:
    """webdataset sample keys in a tar: member names up to the first dot."""
    with tarfile.open(path) as tar:
        return {name.partition(".")[0] for name in tar.getnames()}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_samples(mode: str, root: Path, sample_ids: list[str]) -> dict:
    """Read `sample_ids` (those present) back from a mode's output."""
    from safetensors.torch import load as st_load
    from safetensors.torch import load_file

    out = {}
    if mode == "per_sample":
        for sid in sample_ids:
            p = root / f"{sid}.safetensors"
            if p.exists():
                t = load_file(str(p))
                out[sid] = (t["input_ids"].numpy().astype(np.int64), t["hidden_states"])
        return out
    if mode == "fixed_batch":
        for sid in sample_ids:
            p = fixed_batch_path(root, int(sid))
            if p.exists():
                d = torch.load(p, weights_only=True)
                out[sid] = (d["input_ids"].numpy().astype(np.int64), d["hidden_states"][0])
        return out
    # dflash-prep: webdataset tar shards (read with the standard library: members `{key}.{suffix}`).
    wanted = set(sample_ids)
    for path in dflash_shards(root):
        with tarfile.open(path) as tar:
            for member in tar:
                key, _, suffix = member.name.partition(".")
                if key not in wanted or suffix not in ("input_ids.npy", "hidden_states.safetensors"):
                    continue
                data = tar.extractfile(member).read()
                ids, hs = out.get(key, (None, None))
                if suffix == "input_ids.npy":
                    ids = np.load(io.BytesIO(data), allow_pickle=False).astype(np.int64)
                else:
                    hs = st_load(data)["hidden_states"]
                out[key] = (ids, hs)
    return out


def compare(a: dict, b: dict, k: int) -> dict:
    """States of two modes on their common samples: max |a-b|, relative L2 error (worst sample and layer)."""
    common = sorted(set(a) & set(b))
    res = {"samples_compared": len(common), "input_ids_equal": True, "shapes_equal": True,
           "max_abs_diff": 0.0, "max_rel_l2": 0.0, "max_abs_ref": 0.0, "max_rel_l2_per_layer": [0.0] * k}
    for sid in common:
        (ia, ha), (ib, hb) = a[sid], b[sid]
        res["input_ids_equal"] &= bool(np.array_equal(ia, ib))
        if ha.shape != hb.shape:
            res["shapes_equal"] = False
            continue
        ha, hb = ha.float(), hb.float()
        res["max_abs_diff"] = max(res["max_abs_diff"], float((ha - hb).abs().max()))
        res["max_abs_ref"] = max(res["max_abs_ref"], float(ha.abs().max()))
        for slot, (la, lb) in enumerate(zip(ha.chunk(k, dim=-1), hb.chunk(k, dim=-1))):  # per captured layer
            rel = float((la - lb).norm() / la.norm().clamp_min(1e-30))
            res["max_rel_l2"] = max(res["max_rel_l2"], rel)
            res["max_rel_l2_per_layer"][slot] = max(res["max_rel_l2_per_layer"][slot], rel)
    return res

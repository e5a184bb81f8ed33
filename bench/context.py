"""The run context every mode gets (arguments, device, model section, samples, output folder), and the
facts about the machine the report records (device, filesystem, library versions)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.models import ModelSpec
from bench.samples import Samples
from bench.timing import sync
from dflash_prep.recipe.schema import ModelSection
from dflash_prep.target.model import load_model


@dataclass
class Ctx:
    args: argparse.Namespace
    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    storage_dtype: torch.dtype
    section: ModelSection  # the model section every mode builds from
    config: object
    layer_ids: list[int]
    info: dict
    samples: Samples
    out_root: Path
    token_budget: int
    token_budget_how: str
    disk_reserve: int = 2 * 1024**3

    @property
    def bytes_per_token(self) -> int:
        return len(self.layer_ids) * self.info["hidden_size"] * self.storage_dtype.itemsize

    def build_model(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        model = load_model(self.section, self.config, self.device)
        sync(self.device)
        return model, time.perf_counter() - t0

    def disk_ok(self, path: Path, next_bytes: int) -> bool:
        return shutil.disk_usage(path).free > self.disk_reserve + next_bytes


def logits_kwargs(ctx: Ctx) -> dict:
    return {"logits_to_keep": 1} if ctx.args.logits == "last" else {}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def fs_info(path: Path) -> dict:
    """Filesystem type (from /proc/mounts) and free space of `path`."""
    path = path.resolve()
    fstype, mount = None, None
    try:
        best = ""
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) >= len(best):
                    best, fstype = parts[1], parts[2]
        mount = best or None
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    return {"path": str(path), "mount": mount, "fstype": fstype, "free_bytes": usage.free,
            "total_bytes": usage.total}


def environment(device: torch.device) -> dict:
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "host": socket.gethostname(),
           "cpu_count": os.cpu_count(), "device": str(device),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
           "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING")}
    for mod in ("fla", "causal_conv1d", "liger_kernel", "triton", "datasets", "webdataset", "accelerate",
                "safetensors"):
        spec = importlib.util.find_spec(mod)
        if spec is None:
            env[mod] = None
            continue
        try:
            from importlib.metadata import version

            name = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d",
                    "liger_kernel": "liger-kernel"}.get(mod, mod)
            env[mod] = version(name)
        except Exception:  # noqa: BLE001 - installed without metadata
            env[mod] = "installed"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   sm_count=props.multi_processor_count)
    return env

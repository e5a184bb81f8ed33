"""Shared fixtures: tiny real architectures (Llama-style and the Qwen3.5 Gated DeltaNet hybrid) built in-process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import tarfile
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_prep.target.norms import randomize_norm_gains

# One thread: in-process forwards on tiny models are dominated by thread start-up and, on a shared 2-core
# machine, by contention (10-100x slower with the default thread count when the other core is busy).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "dflash_prep" / "demo" / "tiny-demo"


def cpu_2proc_config() -> str:
    """A copy of accelerate_configs/cpu_2proc.yaml with a free rendezvous port: the file's fixed port would collide
    when two test runs (or a test run and a user's job) launch 2-process jobs on one machine at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = (REPO / "accelerate_configs" / "cpu_2proc.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("main_process_port:"))
    path = Path(tempfile.mkdtemp(prefix="cpu2proc-")) / "cpu_2proc.yaml"
    path.write_text(f"{text}\nmain_process_port: {port}\n")
    return str(path)


def tiny_llama_config(vocab_size: int = 1024, num_layers: int = 6):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       pad_token_id=0, bos_token_id=0, eos_token_id=0)


def tiny_qwen35_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(DEMO / "model_config.json")


def build(config, seed: int = 0, dtype=torch.float32, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    randomize_norm_gains(model, seed)  # as model.load_model does for random weights: real, non-unit norm gains
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="session")
def llama_config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(tiny_llama_config().to_dict()))
    return path


def demo_overrides(out_dir: Path, **extra) -> list[str]:
    """`--set` overrides that send the demo recipe's output to `out_dir` (plus any extra key=value)."""
    return [f"output.dir={out_dir}"] + [f"{k}={v}" for k, v in extra.items()]


def raw_records(out_dir: Path) -> dict[str, dict[str, bytes]]:
    """sample id -> {member: bytes} over the shards the manifest lists (plain tarfile; asserts no id twice)."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    records: dict[str, dict[str, bytes]] = {}
    for shard in manifest["shards"]:
        with tarfile.open(out_dir / shard["path"]) as tar:
            for info in tar:
                key, member = info.name.split(".", 1)
                records.setdefault(key, {})
                assert member not in records[key], f"{key}.{member} written twice"
                records[key][member] = tar.extractfile(info).read()
    return records


@pytest.fixture
def copy(output, tmp_path) -> Path:
    """A writable copy of the module's `output` fixture (an extraction output), for tests that alter it."""
    dest = tmp_path / "copy"
    shutil.copytree(output, dest)
    return dest


def processes_writing(out: Path) -> list[str]:
    """Pids of the processes whose command line names `output.dir={out}` (a launched script, its DataLoader
    workers): what must be gone once a run has stopped."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if entry.isdigit() and f"output.dir={out}" in cmdline:
            found.append(entry)
    return found


def max_abs_diff_to_alone(decoder, records: dict, layer_ids: list[int], hidden_size: int) -> float:
    """The largest |difference| between the written states (captured layers and the final state after the norm)
    and each sample run alone through `decoder` with `output_hidden_states=True` (after-layer id i is
    hidden_states[i + 1]). `records`: the reader's records (input_ids, tensors)."""
    import numpy as np

    H, worst = hidden_size, 0.0
    for r in records.values():
        with torch.inference_mode():
            ref = decoder(input_ids=torch.from_numpy(r["input_ids"].astype(np.int64))[None], use_cache=False,
                          output_hidden_states=True).hidden_states
        hs = r["tensors"]["hidden_states"]
        for slot, layer in enumerate(layer_ids):
            worst = max(worst, (hs[:, slot * H:(slot + 1) * H] - ref[layer + 1][0]).abs().max().item())
        worst = max(worst, (r["tensors"]["final_hidden_states"] - ref[-1][0]).abs().max().item())
    return worst


def read_stderr_until(proc: subprocess.Popen, marker: str) -> list[str]:
    """`proc`'s stderr lines up to the first that contains `marker` (all of them if none does)."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if marker in line:
            break
    return lines


def interrupt_group_until_exit(proc: subprocess.Popen) -> str:
    """SIGINT to `proc`'s whole group (what a terminal's Ctrl-C does) every 50 ms until it exits; the rest of its
    stderr."""
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(proc.stderr), daemon=True)
    drain.start()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.05)
    proc.wait(timeout=30)
    drain.join(timeout=30)
    return "".join(rest)

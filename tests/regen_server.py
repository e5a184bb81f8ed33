"""Helpers of the regeneration tests.

A real OpenAI-compatible server: the tiny demo model with random weights, saved with `save_pretrained` (and its
tokenizer, the Qwen3 chat template of chat_templates.py so that tool calls render), served by `transformers serve` on
a free loopback port (no part of the HTTP API is mocked); and the process handling of the kill/resume tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from chat_templates import QWEN3
from processes import descendants, kill_tree  # noqa: F401 - re-exported to the regeneration tests

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "dflash_prep" / "demo" / "tiny-demo"
# Stop ids for the random-weight model: its answers then end at varied lengths (finish reason `stop` or `length`),
# as a real model's do.
STOP_IDS = list(range(0, 1024, 7))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(dest: Path, seed: int = 0) -> Path:
    """The demo's config with random weights (seeded), its tokenizer with the Qwen3 template, and a generation
    config whose end-of-sequence ids are STOP_IDS; returns `dest`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(DEMO / "model_config.json")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=STOP_IDS, pad_token_id=0, bos_token_id=0)
    model.save_pretrained(dest)
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tokenizer.chat_template = QWEN3.strip()
    tokenizer.save_pretrained(dest)
    return dest


class Server:
    """`transformers serve MODEL` on 127.0.0.1:port (CPU, float32), started and stopped by the test."""

    def __init__(self, model_dir: Path, port: int | None = None, log_path: Path | None = None):
        self.model_dir, self.port = Path(model_dir), port or free_port()
        self.log_path = log_path or self.model_dir.parent / f"serve-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120.0) -> Server:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        serve = Path(sys.executable).parent / "transformers"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(serve), "serve", str(self.model_dir), "--host", "127.0.0.1", "--port",
                                          str(self.port), "--device", "cpu", "--dtype", "float32"],
                                         stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({self.proc.returncode}): "
                                   f"{self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        else:
            self.stop()
            raise RuntimeError(f"transformers serve did not answer in {timeout}s")
        self.warm_up()
        return self

    def warm_up(self) -> None:
        """One request, so the model is loaded before a test times anything."""
        body = json.dumps({"model": str(self.model_dir), "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 1, "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


# ---------------------------------------------------------------------- processes the kill/resume tests run
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}


def rows_of(out: Path) -> list[dict]:
    import datasets

    return [{k: r[k] for k in ("id", "source_row", "messages")} for r in datasets.load_from_disk(str(out))]


def index_lines(out: Path) -> int:
    return sum(p.read_bytes().count(b"\n") for p in (out / "index").glob("rank-*.jsonl")) \
        if (out / "index").is_dir() else 0


def start_and_wait(cmd: list[str], out: Path, new_commits: int, timeout: float = 240.0) -> subprocess.Popen:
    """Start `cmd` and return once it committed `new_commits` more chunks (or ended)."""
    before = index_lines(out)
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and index_lines(out) < before + new_commits:
        time.sleep(0.02)
    return proc



"""The machinery of a device round (bench/scenarios.py holds the scenarios): a scenario's registry entry and options,
and `Round`: the environment, the steps under one deadline, their logs and outcomes, the stop of a step past its
limit with every process it started."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "dflash_prep" / "demo" / "tiny-demo"
TOKENIZER = DEMO / "tokenizer"
CONFIGS = REPO / "bench" / "configs"
MIN_STEP_SECONDS = 20  # a step with less time left than this is skipped
KILL_GRACE_SECONDS = 10  # after a timeout: SIGTERM, then SIGKILL this much later (the launcher passes the stop on)
FIGURES = r"tok/s|\[bench\].*: (ok|error)|worst|max_rel|PASS|FAIL|OK|verify: |^\[dflash-prep\] done|[Ee]rror"


@dataclass
class Option:
    default: str
    help: str


@dataclass
class Scenario:
    name: str
    gpus: int
    summary: str
    run: Callable
    deadline_seconds: int = 570
    options: dict[str, Option] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, gpus: int, summary: str, deadline_seconds: int = 570, **options: str):
    """Register a scenario; each option is "DEFAULT:what it does" (`--set NAME=VALUE` overrides the default)."""
    def register(fn):
        SCENARIOS[name] = Scenario(name, gpus, summary, fn, deadline_seconds,
                                   {k: Option(*v.split(":", 1)) for k, v in options.items()})
        return fn
    return register


# ------------------------------------------------------------------------------------------------------ round
class Round:
    """One scenario's run: results folder, deadline, options, environment, and its steps (module docstring)."""

    def __init__(self, sc: Scenario, results: Path, deadline_seconds: float, options: dict[str, str], dry: bool,
                 extra_args: list[str]):
        self.sc, self.results, self.dry, self.extra_args = sc, results, dry, extra_args
        self.options = {k: o.default for k, o in sc.options.items()} | options
        self.t0, self.deadline = time.monotonic(), deadline_seconds
        self.failed: list[str] = []
        self._lock = threading.Lock()
        (results / "logs").mkdir(parents=True, exist_ok=True)
        (results / "steps.jsonl").unlink(missing_ok=True)  # this round's steps only
        # the steps' outputs: WORK_DIR (kept, its outputs deleted as their summaries are kept), or a temporary folder
        self.own_work = "WORK_DIR" not in os.environ
        self.work = Path(tempfile.mkdtemp(prefix=f"dflash-bench-{sc.name}-")) if self.own_work else \
            Path(os.environ["WORK_DIR"])
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = self._environment()

    # -- options
    def opt(self, name: str) -> str:
        return self.options[name]

    def flag(self, name: str) -> bool:
        return self.options[name] not in ("", "0", "false", "no")

    # -- environment
    def _environment(self) -> dict:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1"}
        paths = [str(REPO)]
        wheels = Path(os.environ.get("WHEEL_DIR", ".whl"))
        # Not in a CPU dry run: the GPU wheels (flash-linear-attention, liger-kernel with Triton) break a CPU forward.
        if not self.dry and wheels.is_dir() and list(wheels.glob("*.whl")):
            paths.insert(0, self._install_wheels(wheels, Path(tempfile.gettempdir()) / "site"))
        alt = self.options.get("alt_wheels")
        if alt:
            paths.insert(0, self._install_wheels(Path(alt), Path(tempfile.gettempdir()) / "site-alt"))
        env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
        if self.dry:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU run, whatever the machine has
        self._describe(env)
        return env

    def _install_wheels(self, folder: Path, target: Path) -> str:
        wheels = [str(w) for w in sorted(folder.glob("*.whl"))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(target), *wheels], check=True)
        return str(target)

    def _describe(self, env: dict) -> None:
        lines = [f"scenario {self.sc.name}{' (dry run on the CPU)' if self.dry else ''}, options {self.options}",
                 f"work dir {self.work}"]
        if shutil.which("nvidia-smi") and not self.dry:
            lines.append(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used", "--format=csv"],
                                        capture_output=True, text=True).stdout.strip())
        code = ("import importlib.metadata as m\nfor d in ('torch', 'transformers', 'accelerate', 'datasets', "
                "'webdataset', 'flash-linear-attention', 'liger-kernel', 'triton'):\n"
                "    try: print(d, m.version(d))\n    except m.PackageNotFoundError: print(d, '-')")
        lines.append(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)
        (self.results / "env.txt").write_text("\n".join(lines) + "\n")

    # -- time
    def left(self) -> float:
        return self.deadline - (time.monotonic() - self.t0)

    def say(self, text: str) -> None:
        with self._lock:
            print(f"[{self.sc.name} +{time.monotonic() - self.t0:.0f}s] {text}", flush=True)

    # -- steps
    def step(self, name: str, seconds: float, cmd: list[str], gpus: str | None = None, gpu_only: bool = False,
             env: dict | None = None, grep: str = FIGURES) -> int:
        """Run `cmd` as the step `name` (module docstring); -> its exit code (99: skipped)."""
        if gpu_only and self.dry:
            return self._record(name, "skipped (needs CUDA: not part of a CPU dry run)", 99, 0.0)
        limit = min(seconds, self.left() - KILL_GRACE_SECONDS)
        if limit <= MIN_STEP_SECONDS:
            return self._record(name, f"skipped (deadline: {max(self.left(), 0):.0f} s left)", 99, 0.0)
        step_env = {**self.env, **(env or {})}
        if gpus is not None and not self.dry:
            step_env["CUDA_VISIBLE_DEVICES"] = gpus
        self.say(f"{name}: start (timeout {limit:.0f}s): {' '.join(map(str, cmd))[:300]}")
        log_path = self.results / "logs" / f"{name}.log"
        start = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=REPO, env=step_env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else f"failed (exit code {rc})"
            except subprocess.TimeoutExpired:
                _stop_tree(proc)
                rc, status = 124, "timeout"
        self._record(name, status, rc, time.monotonic() - start)
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if re.search(grep, line)]
        for line in lines[-8:]:
            self.say(f"    {line[:240]}")
        return rc

    def _record(self, name: str, status: str, rc: int, seconds: float) -> int:
        with self._lock, open(self.results / "steps.jsonl", "a") as f:
            f.write(json.dumps({"name": name, "status": status.split(" (")[0], "exit_code": rc,
                                "seconds": round(seconds, 1), "detail": status}) + "\n")
        if not status.startswith("ok") and "needs CUDA" not in status:  # a dry run leaves the GPU-only steps out
            self.failed.append(name)
        self.say(f"{name}: {status} in {seconds:.0f}s")
        return rc

    def parallel(self, *sequences: Callable[[], None]) -> None:
        """Run step sequences side by side (e.g. one per GPU); a dry run runs them one after the other."""
        if self.dry:
            for seq in sequences:
                seq()
            return
        threads = [threading.Thread(target=seq) for seq in sequences]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    # -- commands
    def python(self, *args) -> list[str]:
        return [sys.executable, *map(str, args)]

    def extract(self, out: Path, *sets: str) -> list[str]:
        """The extraction in one process (`python -m dflash_prep.commands.extract`), the demo recipe, `sets` on top."""
        return self.python("-m", "dflash_prep.commands.extract", "--set", f"output.dir={out}",
                           "--set", "output.overwrite=true", *(a for kv in sets for a in ("--set", kv)))

    def launch(self, launch_args: list[str], out: Path, *sets: str) -> list[str]:
        """`dflash-prep launch LAUNCH_ARGS -m dflash_prep.commands.extract` with the recipe `sets`."""
        return self.python("-m", "dflash_prep.commands.cli", "launch", *launch_args, "-m",
                           "dflash_prep.commands.extract", "--set", f"output.dir={out}",
                           *(a for kv in sets for a in ("--set", kv)))

    def two_processes(self) -> list[str]:
        """Launcher arguments of one process per GPU of a 2-GPU node (two CPU processes in a dry run)."""
        return (["--config_file", str(REPO / "accelerate_configs" / "cpu_2proc.yaml")] if self.dry else
                ["--multi_gpu", "--num_processes", "2"])

    def verify(self, out: Path, *args: str) -> list[str]:
        return self.python("-m", "dflash_prep.commands.cli", "verify", out, *args)

    def keep(self, out: Path, name: str) -> None:
        """Copy a finished output's summary and manifest to RESULTS_DIR/NAME.*.json, then delete the output."""
        for what in ("summary", "manifest"):
            if (out / f"{what}.json").is_file():
                shutil.copy(out / f"{what}.json", self.results / f"{name}.{what}.json")
        if (out / "logs").is_dir():
            shutil.copytree(out / "logs", self.results / f"{name}.logs", dirs_exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)

    def close(self) -> int:
        if self.own_work:
            shutil.rmtree(self.work, ignore_errors=True)
        self.say(f"done: {'every step ok' if not self.failed else 'not ok: ' + ', '.join(self.failed)}; results in "
                 f"{self.results}")
        return 1 if self.failed else 0


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop_tree(proc: subprocess.Popen) -> None:
    """A step past its time: SIGTERM to it and every process below it (launched ranks run in sessions of their own),
    then SIGKILL to what is left KILL_GRACE_SECONDS later."""
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    time.sleep(1)


def shm_or_tmp(need_gb: int) -> Path:
    """/dev/shm when it has `need_gb` GB free (outputs on RAM: the disk does not set the pace), else the temp dir."""
    try:
        if shutil.disk_usage("/dev/shm").free >= need_gb * 1e9:
            return Path("/dev/shm")
    except OSError:
        pass
    return Path(tempfile.gettempdir())

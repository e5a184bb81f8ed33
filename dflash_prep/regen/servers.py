"""Serving engines the run starts, watches and stops itself (`regenerate.servers`): vLLM, SGLang, `transformers
serve`, or any command template.

Which servers: each node's GPUs (those the process sees: `CUDA_VISIBLE_DEVICES`, else all) are cut into groups of
`gpus_per_server`, one server a group (`num_servers` overrides; without GPUs, one server on the CPU); the launch's
processes of that node share them out, server j to local process j mod (processes per node), so each process
drives its own servers and every node starts its own. Each server gets its group's `CUDA_VISIBLE_DEVICES`, a free
port on `host`, the model (`model.name_or_path`), the served model name, the chat template (`data.chat_template`,
for the presets that take one) and its tensor parallelism (`gpus_per_server`) filled into its command; its output
goes to `OUT/logs/server-<rank>-<j>.log`. The run waits until every server answers `GET /models` (or stops with
the log's last line: exit code 1).

Restarts: a server process that exits, or that the client finds down or broken (every request failing while the
server process lives: regen/openai_engine.py), is stopped and started again on the same port, `max_restarts` times
at most per server; past that it is down, and with no server left the run stops (exit code 1, resumable).

No server outlives the run: each is started in a process group of its own (its workers with it), with
PR_SET_PDEATHSIG (Linux) so its leader gets SIGKILL when the run's process dies, and a watchdog process
(`python -m dflash_prep.regen.watchdog`) that kills its whole group once the run's process, or the
`dflash-prep launch` process it runs under, is gone (a SIGKILL leaves no handler to run). On success, an error,
Ctrl-C or SIGTERM, `stop()` sends SIGTERM to every group, then SIGKILL after `stop_timeout_seconds`, and waits
until the groups are empty: the GPUs are free when it returns (the one-recipe form extracts on them next).

Why our own supervisor: neither accelerate nor the engines start servers per GPU group, restart them, or tie
their lifetime to a launcher; vLLM's and SGLang's own multi-GPU modes (data parallel) run one API server, which
needs no per-GPU process but gives up per-server failure isolation.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dflash_prep.regen.engine import EngineUnavailable
from dflash_prep.regen.watchdog import _alive, _group_alive
from dflash_prep.signals import LAUNCHER_ENV  # the launcher is the parent of a launched rank

log = logging.getLogger("dflash_prep")

PLACEHOLDERS = ("model", "host", "port", "served_model_name", "gpus_per_server", "gpus", "chat_template")
PRESETS = {
    # vllm serve MODEL: https://docs.vllm.ai (CLI `vllm serve`)
    "vllm": ["vllm", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--served-model-name",
             "{served_model_name}", "--tensor-parallel-size", "{gpus_per_server}"],
    # python -m sglang.launch_server: https://docs.sglang.io (server arguments)
    "sglang": ["{python}", "-m", "sglang.launch_server", "--model-path", "{model}", "--host", "{host}", "--port",
               "{port}", "--served-model-name", "{served_model_name}", "--tp-size", "{gpus_per_server}"],
    # transformers serve FORCE_MODEL (transformers[serving]): serves the model under the name it was given
    "transformers": ["{transformers}", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--device",
                     "{device}"],
}
CHAT_TEMPLATE_FLAG = {"vllm": "--chat-template", "sglang": "--chat-template"}
RECENT_RESTART_SECONDS = 10.0  # a failure seen this soon after a restart is the old process's: no new restart


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as `CUDA_VISIBLE_DEVICES` names them (else indices 0..N-1)."""
    try:
        import torch

        count = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA build: no GPUs
        count = 0
    if not count:
        return []
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return listed[:count] if len(listed) >= count else [str(i) for i in range(count)]


def server_groups(gpus: list[str], gpus_per_server: int, num_servers: int | None, local_rank: int,
                  local_world: int) -> list[tuple[int, list[str]]]:
    """This process's servers: (server index on the node, its GPUs). Raises ValueError when the node has too few
    GPUs or fewer servers than processes."""
    if gpus:
        n = num_servers or len(gpus) // gpus_per_server
        if n < 1 or n * gpus_per_server > len(gpus):
            raise ValueError(f"{len(gpus)} GPU(s) visible on this node: too few for {num_servers or 1} server(s) "
                             f"of gpus_per_server = {gpus_per_server}")
        groups = [(j, gpus[j * gpus_per_server:(j + 1) * gpus_per_server]) for j in range(n)]
    else:
        groups = [(j, []) for j in range(num_servers or local_world)]
    mine = [g for g in groups if g[0] % local_world == local_rank]
    if not mine:
        raise ValueError(f"{local_world} processes on this node share {len(groups)} server(s): launch at most "
                         f"{len(groups)} process(es) per node (one process drives several servers)")
    return mine


@dataclass
class _Managed:
    index: int
    gpus: list[str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    watchdog: subprocess.Popen | None = None
    restarts: int = 0
    ready_at: float = 0.0
    restart_why: str | None = None  # a restart asked for by the client
    gone: str | None = None  # why it is not restarted any more
    done: threading.Condition = field(default_factory=threading.Condition)

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self.port}/v1"

    _host: str = "127.0.0.1"


class ManagedServers:
    """This process's servers (the module docstring says which and how). Use as a context manager: `start()` on
    enter (returns once every server answers), `stop()` on exit, whatever ends the block.

    section: the recipe's `regenerate.servers` (regenerate.ServersSection); model: what `{model}` is;
    served_model_name, chat_template (a file or None); logs_dir: OUT/logs; rank: this process's global rank (log
    names); stop: a signals.StopRequest polled while waiting (a stop request ends the wait: LoopStopped is the
    caller's). Raises EngineUnavailable when a server does not come up (exit code 1)."""

    def __init__(self, section, model: str, served_model_name: str, chat_template: str | None, logs_dir: Path,
                 rank: int, local_rank: int, local_world: int, stop=None):
        self.section, self.model, self.served_model_name = section, model, served_model_name
        self.chat_template, self.stop_request = chat_template, stop
        logs_dir = Path(logs_dir)
        logs_dir.mkdir(parents=True, exist_ok=True)
        groups = server_groups(visible_gpus(), section.gpus_per_server, section.num_servers, local_rank, local_world)
        self.pids_path = logs_dir / f"servers-{rank:05d}.json"
        self.servers = [_Managed(j, gpus, free_port(section.host), logs_dir / f"server-{rank:05d}-{j}.log",
                                 _host=section.host) for j, gpus in groups]
        self._watched = [os.getpid()]
        if os.environ.get(LAUNCHER_ENV) and os.getppid() > 1:
            self._watched.append(os.getppid())
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._libc = _libc()

    @property
    def base_urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def __enter__(self) -> ManagedServers:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------ start
    def command(self, server: _Managed) -> list[str]:
        """The server's command line, placeholders filled in."""
        section = self.section
        if section.command is not None:
            template = shlex.split(section.command) if isinstance(section.command, str) else list(section.command)
        else:
            template = list(PRESETS[section.preset])
            if self.chat_template and section.preset in CHAT_TEMPLATE_FLAG:
                template += [CHAT_TEMPLATE_FLAG[section.preset], "{chat_template}"]
        values = {"model": self.model, "host": section.host, "port": str(server.port),
                  "served_model_name": self.served_model_name, "gpus_per_server": str(max(1, len(server.gpus))),
                  "gpus": ",".join(server.gpus), "chat_template": self.chat_template or "",
                  "python": sys.executable, "transformers": str(Path(sys.executable).parent / "transformers"),
                  "device": "cuda" if server.gpus else "cpu"}
        return [part.format(**values) for part in template] + list(section.extra_args)

    def start(self) -> None:
        for server in self.servers:
            self._launch(server)
        for server in self.servers:
            self._wait_ready(server)
        log.info("regenerate: %d server(s) up: %s", len(self.servers),
                 ", ".join(f"{s.base_url} (GPUs {','.join(s.gpus) or 'none'})" for s in self.servers))
        self._thread = threading.Thread(target=self._supervise, daemon=True, name="dflash-prep-servers")
        self._thread.start()

    def _launch(self, server: _Managed) -> None:
        env = {**os.environ, **{k: str(v) for k, v in self.section.env.items()},
               "CUDA_VISIBLE_DEVICES": ",".join(server.gpus)}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)  # the launch's own rendezvous is not the server's (vLLM reads these)
        cmd = self.command(server)
        libc = self._libc
        with open(server.log_path, "ab") as out:
            out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start {shlex.join(cmd)} "
                      f"(CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})\n".encode())
            out.flush()
            try:
                server.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, start_new_session=True,
                                               preexec_fn=(lambda: libc.prctl(1, signal.SIGKILL)) if libc else None)
            except OSError as e:
                raise EngineUnavailable(f"regenerate.servers: cannot start {cmd[0]!r}: {e}") from None
        self._write_pids()
        server.watchdog = subprocess.Popen(
            [sys.executable, "-m", "dflash_prep.regen.watchdog", str(server.proc.pid),
             *map(str, self._watched)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)

    def _write_pids(self) -> None:
        """OUT/logs/servers-<rank>.json: this process's servers now (pid = process group, port, GPUs, log)."""
        from dflash_prep.io import atomic_write_json

        atomic_write_json(self.pids_path, {"run_pid": os.getpid(), "servers": [
            {"index": s.index, "pid": s.proc.pid if s.proc else None, "base_url": s.base_url, "gpus": s.gpus,
             "restarts": s.restarts, "log": str(s.log_path)} for s in self.servers]})

    def _wait_ready(self, server: _Managed) -> None:
        """Until the server answers `GET /models`; EngineUnavailable when it exits or the wait passes
        `startup_timeout_seconds`."""
        deadline = time.monotonic() + self.section.startup_timeout_seconds
        url = f"{server.base_url}/models"
        while True:
            if self.stop_request is not None and self.stop_request.requested:
                return
            code = server.proc.poll()
            if code is not None:
                raise EngineUnavailable(f"server {server.index} ({shlex.join(self.command(server))[:200]}) exited "
                                        f"with code {code} before it answered: {_last_line(server.log_path)} "
                                        f"(its log: {server.log_path})")
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        server.ready_at = time.monotonic()
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"server {server.index} did not answer GET {url} within "
                                        f"{self.section.startup_timeout_seconds:.0f}s (its log: {server.log_path})")
            time.sleep(0.5)

    # ------------------------------------------------------------------------------------------ restarts
    def on_server_down(self, base_url: str, why: str) -> bool:
        """The client found `base_url` down or broken (any thread): wait for its restart. True once it answers
        again, False when its restarts are spent (or the run is ending)."""
        server = next((s for s in self.servers if s.base_url == base_url), None)
        if server is None:
            return False
        with server.done:
            if server.gone is not None or self._closing.is_set():
                return False
            if time.monotonic() - server.ready_at < RECENT_RESTART_SECONDS and server.restart_why is None:
                return True  # a failure of the process just replaced
            if server.restart_why is None:
                server.restart_why = why
            server.done.wait_for(lambda: server.restart_why is None or server.gone is not None
                                 or self._closing.is_set())
            return server.gone is None and not self._closing.is_set()

    def _supervise(self) -> None:
        """The one thread that restarts servers (PR_SET_PDEATHSIG ties a child to the thread that forked it)."""
        while not self._closing.wait(0.5):
            for server in self.servers:
                if server.gone is not None:
                    continue
                code = server.proc.poll()
                why = server.restart_why or (f"its process exited with code {code}" if code is not None else None)
                if why is not None:
                    self._restart(server, why)

    def _restart(self, server: _Managed, why: str) -> None:
        alive = all(_alive(pid) for pid in self._watched)
        if server.restarts >= self.section.max_restarts or not alive:
            reason = (f"restarted {server.restarts} time(s) already (regenerate.servers.max_restarts); its log: "
                      f"{server.log_path}" if alive else "the run is ending")
            log.error("regenerate: server %d (%s) is down: %s; %s", server.index, server.base_url, why, reason)
            with server.done:
                server.gone = f"{why}; {reason}"
                server.done.notify_all()
            return
        server.restarts += 1
        log.warning("regenerate: server %d (%s): %s; restarting it (%d of %d)", server.index, server.base_url, why,
                    server.restarts, self.section.max_restarts)
        self._kill(server)
        try:
            self._launch(server)
            self._wait_ready(server)
        except EngineUnavailable as e:
            log.warning("regenerate: %s", e)
            self._restart(server, str(e))
            return
        log.info("regenerate: server %d (%s) is back", server.index, server.base_url)
        with server.done:
            server.restart_why = None
            server.done.notify_all()

    # ------------------------------------------------------------------------------------------ stop
    def stop(self) -> None:
        """Stop every server this process started (SIGTERM, then SIGKILL after `stop_timeout_seconds`) and wait
        until their process groups are empty. Safe to call twice."""
        self._closing.set()
        for server in self.servers:
            with server.done:
                server.done.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.section.stop_timeout_seconds + 30)
        for server in self.servers:
            self._kill(server)

    def _kill(self, server: _Managed) -> None:
        proc = server.proc
        if proc is None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.section.stop_timeout_seconds
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()
            time.sleep(0.1)
        if _group_alive(proc.pid):
            _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        while _group_alive(proc.pid):
            time.sleep(0.05)
        if server.watchdog is not None:
            server.watchdog.kill()
            server.watchdog.wait()
        server.proc = server.watchdog = None


def _libc():
    """libc, loaded before any fork (a child only calls prctl), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " ".join(lines[-1].split())[:300] if lines else "(no output)"

"""docs/SERVERS.md's offline examples run as written: the demo's model served by `dflash-prep demo-server`, a
regeneration against it, and the one-recipe form with a server the run starts and stops itself.

Run in a fresh folder with the package's commands on PATH; port 8000 becomes a free port (the machine may run
other servers), a line ending in `&` runs in the background (until its server answers), and every process is
checked gone at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from regen_server import ENV, REPO, free_port

pytestmark = pytest.mark.slow


def bash_blocks(path: Path) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)


def commands(block: str) -> list[str]:
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the demo server exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("the demo server did not answer")


def test_the_demo_server_flow_runs_as_written(tmp_path):
    """In the folder where a user ran the README's quick start and docs/ON_POLICY.md's in-process demo first, so
    that each example's output folders are checked not to be another's (a job's folder refuses another job)."""
    blocks = [b for b in bash_blocks(REPO / "docs" / "SERVERS.md") if "demo-server" in b]
    assert len(blocks) == 2
    in_process = [line for b in bash_blocks(REPO / "docs" / "ON_POLICY.md") for line in commands(b)
                  if line.startswith("dflash-prep regenerate --set data.max_samples")]
    assert len(in_process) == 1
    blocks = ["dflash-prep launch -m dflash_prep.commands.extract\n" + in_process[0] + "\n", *blocks]
    port = free_port()
    env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{ENV['PATH']}"}
    background = []
    try:
        for block in blocks:
            for line in commands(block):
                line = line.replace("8000", str(port))
                if line.endswith("&"):
                    proc = subprocess.Popen(["bash", "-c", line[:-1]], cwd=tmp_path, env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True)
                    background.append(proc)
                    wait_healthy(port, proc)
                    continue
                done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=900)
                assert done.returncode == 0, f"{line}\n{done.stderr[-3000:]}"
    finally:
        for proc in background:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    served = json.loads((tmp_path / "out" / "tiny-demo-from-server" / "summary.json").read_text())
    assert served["num_rows"] == 20 and served["num_answered"] >= 15
    managed = json.loads((tmp_path / "out" / "tiny-demo-served" / "summary.json").read_text())
    assert managed["num_answered"] == served["num_answered"]
    manifest = json.loads((tmp_path / "out" / "tiny-demo-served-states" / "manifest.json").read_text())
    assert manifest["num_samples"] > 0  # extracted from the regenerated rows (one sample a row, or a turn)
    assert json.loads((tmp_path / "out" / "tiny-demo" / "manifest.json").read_text())["num_samples"] == 700
    assert json.loads((tmp_path / "out" / "tiny-demo-regenerated" / "summary.json").read_text())["num_rows"] == 20
    servers = json.loads((tmp_path / "out" / "tiny-demo-served" / "logs" / "servers-00000.json").read_text())
    for record in servers["servers"]:  # the server the run started is gone
        try:  # gone (ENOENT, or ESRCH when it goes while read), or a zombie
            state = Path(f"/proc/{record['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        assert state in ("gone", "Z"), state


def test_the_demo_server_without_the_serving_extra_is_one_line_and_saves_nothing(tmp_path, monkeypatch, capsys):
    """A missing server dependency (a module `transformers serve` imports) is refused before the model is saved: one
    line naming it and the extra, exit code 2, no folder written (the server's own check came after the save, as a
    traceback)."""
    from dflash_prep.commands.demo_server import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import of it fails, as where it is not installed
    dest = tmp_path / "model"
    assert main(["--dir", str(dest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "uvicorn" in err[0] and "serving" in err[0] and "Traceback" not in err[0]
    assert not dest.exists()

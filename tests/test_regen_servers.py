"""Servers the run starts itself (`regenerate.servers`), and no row lost to a failing server.

Every server here is a real `transformers serve` of the tiny demo model on loopback (regen_server.py), started by
the run (managed) or by the test (the servers users run). The expected rows come from an uninterrupted run against
a server the test starts itself; whether a process is left is checked by pid (/proc), after success, an error, a
SIGTERM and a SIGKILL of the launcher. A failing server is a real one: its chat template raises, so every request is
answered HTTP 500 while `GET /models` still answers (what a server whose engine died does).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from regen_server import ENV, REPO, Server, free_port, index_lines, rows_of, save_tiny_model

from dflash_prep.commands.regenerate import main as regenerate_main
from dflash_prep.regen.output import read_committed

NUM_ROWS = 12
ROWS = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]
         + ([{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More?"},
             {"role": "assistant", "content": "fine"}] if i % 3 == 0 else [])} for i in range(NUM_ROWS)]
BROKEN_TEMPLATE = "{{ raise_exception('this chat template is broken') }}"
TRANSFORMERS = str(Path(sys.executable).parent / "transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("regen-servers") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen-servers-data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def base_args(model_dir: Path, data: Path, out: Path, **sets) -> dict:
    return {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(model_dir),
            "data.path": str(data), "output.dir": str(out.parent / f"{out.name}-states"),
            "regenerate.output_dir": str(out), "regenerate.engine": "openai", "regenerate.max_tokens": 4,
            "regenerate.turns": "all", "regenerate.rows_per_shard": 2, "regenerate.max_concurrency": 1,
            "regenerate.max_retries": 1, "regenerate.retry_backoff_seconds": 0.1, **sets}


def managed(model_dir: Path, data: Path, out: Path, **sets) -> list[str]:
    keys = base_args(model_dir, data, out, **{"regenerate.servers.preset": "transformers",
                                              "regenerate.servers.extra_args": "[--dtype, float32]",
                                              "regenerate.servers.stop_timeout_seconds": 10,
                                              "regenerate.servers.startup_timeout_seconds": 300, **sets})
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def unmanaged(model_dir: Path, data: Path, out: Path, base_url: str, **sets) -> list[str]:
    keys = base_args(model_dir, data, out, **{"regenerate.base_urls": f"[{base_url}]", **sets})
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def regenerate_cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_prep.commands.regenerate", *argv]


def launch_cmd(argv: list[str], processes: int = 1) -> list[str]:
    multi = ["--multi_gpu", "--main_process_port", str(free_port())] if processes > 1 else []
    return [sys.executable, "-m", "dflash_prep.commands.cli", "launch", *multi, "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m",
            "dflash_prep.commands.regenerate", *argv]


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for_commits(proc: subprocess.Popen, out: Path, n: int, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and index_lines(out) < n:
        time.sleep(0.05)
    assert index_lines(out) >= n, f"no {n} commits: {proc.poll()}"


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def server_records(out: Path) -> list[dict]:
    return [s for p in sorted((out / "logs").glob("servers-*.json")) for s in json.loads(p.read_text())["servers"]]


def run_pids(out: Path) -> list[int]:
    return [json.loads(p.read_text())["run_pid"] for p in sorted((out / "logs").glob("servers-*.json"))]


def assert_gone(pids: list[int], timeout: float = 90.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "processes left behind"


def watchdog_pids() -> list[int]:
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"dflash_prep.regen.watchdog" in cmdline.read_bytes() and running(int(cmdline.parent.name)):
                out.append(int(cmdline.parent.name))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def reference(model_dir, data, tmp_path_factory) -> list[dict]:
    """An uninterrupted run against a server the test runs (the rows every other run must give)."""
    server = Server(model_dir, log_path=tmp_path_factory.mktemp("regen-servers-ref") / "serve.log").start()
    try:
        out = tmp_path_factory.mktemp("regen-servers-reference") / "out"
        assert regenerate_main(unmanaged(model_dir, data, out, server.base_url)) == 0
    finally:
        server.stop()
    rows = rows_of(out)
    assert [r["source_row"] for r in rows] == list(range(NUM_ROWS))
    return rows


def exactly_once(out: Path, reference: list[dict]) -> dict:
    positions = [p for r in read_committed(out).values() for p in r.rows]
    assert sorted(positions) == list(range(NUM_ROWS))  # each row once, none lost
    assert sorted(rows_of(out), key=lambda r: r["source_row"]) == reference
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_answered"] == NUM_ROWS and summary["num_skipped"] == 0
    return summary


# ---------------------------------------------------------------------------------------------- managed servers
@pytest.mark.slow
def test_a_managed_server_answers_as_one_you_run_and_none_is_left(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    proc = start(regenerate_cmd(managed(model_dir, data, out)))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert rows_of(out) == reference
    [record] = server_records(out)
    assert "/chat/completions" in Path(record["log"]).read_text()  # its log under OUT/logs
    assert_gone([record["pid"]])
    assert not watchdog_pids()


@pytest.mark.slow
def test_a_killed_server_is_restarted_and_the_run_completes(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    proc = start(regenerate_cmd(managed(model_dir, data, out, **{"regenerate.max_retries": 3,
                                                                 "regenerate.retry_backoff_seconds": 1.0})))
    wait_for_commits(proc, out, 1)
    [first] = server_records(out)
    os.killpg(first["pid"], signal.SIGKILL)  # the server and every process of its group
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    [second] = server_records(out)
    assert second["restarts"] == 1 and second["pid"] != first["pid"]
    assert second["base_url"] == first["base_url"]  # the same port: the client's URL stays
    assert Path(second["log"]).read_text().count("=== ") == 2  # two starts, one log
    exactly_once(out, reference)
    assert_gone([first["pid"], second["pid"]])


@pytest.mark.slow
def test_sigterm_and_sigkill_of_the_launcher_leave_no_server(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = managed(model_dir, data, out)
    proc = start(launch_cmd(argv))
    wait_for_commits(proc, out, 1)
    pids = [s["pid"] for s in server_records(out)] + run_pids(out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "stopped on SIGTERM" in err, err[-3000:]
    assert_gone(pids)

    proc = start(launch_cmd(argv))  # resumes; then its launcher dies (SIGKILL: no handler runs)
    wait_for_commits(proc, out, index_lines(out) + 1)
    pids = [s["pid"] for s in server_records(out)] + run_pids(out)
    proc.kill()
    proc.wait(timeout=30)
    assert_gone(pids, timeout=180)  # the servers (the watchdog) and the orphaned rank
    assert not watchdog_pids()
    assert regenerate_main(argv) == 0  # the resume, in this process, with a server of its own
    exactly_once(out, reference)
    assert_gone([s["pid"] for s in server_records(out)])


@pytest.mark.slow
def test_a_server_that_cannot_start_or_an_error_after_it_started_leaves_none(model_dir, data, tmp_path, capsys):
    out = tmp_path / "out"
    argv = managed(model_dir, data, out, **{"regenerate.servers.preset": "null", "regenerate.servers.command":
                                            "[sh, -c, 'echo cannot load the weights on port $0 >&2; exit 3', "
                                            "'{port}']"})
    proc = start(regenerate_cmd(argv))
    _, err = proc.communicate(timeout=300)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, err[-3000:]
    assert "exited with code 3" in errors[0] and "cannot load the weights" in errors[0]
    assert "Traceback" not in err

    out = tmp_path / "out2"  # the servers answer, then the run refuses (a served name they do not serve)
    proc = start(regenerate_cmd(managed(model_dir, data, out, **{"regenerate.served_model_name": "not-this-one"})))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "not-this-one" in err, err[-3000:]
    assert_gone([s["pid"] for s in server_records(out)])
    assert not watchdog_pids()


@pytest.mark.slow
def test_two_processes_start_a_server_each(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    proc = start(launch_cmd(managed(model_dir, data, out), processes=2))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    records = server_records(out)
    assert len(records) == 2 and len({r["base_url"] for r in records}) == 2
    for record in records:  # each process drove its own server
        assert "/chat/completions" in Path(record["log"]).read_text()
    assert {r.rank for r in read_committed(out).values()} == {0, 1}
    assert rows_of(out) == reference
    assert_gone([r["pid"] for r in records] + run_pids(out))


# ---------------------------------------------------------------------------------------------- failing servers
def _set_template(model: Path, template: str | None) -> None:
    """The model folder's chat template (chat_template.jinja: what `transformers serve` renders with) made `template`,
    or the saved good one again (None)."""
    path, good = model / "chat_template.jinja", model / "good_template.jinja"
    if not good.exists():
        shutil.copy(path, good)
    path.write_text(template if template is not None else good.read_text())


@pytest.mark.slow
def test_a_server_failing_every_request_loses_no_row(model_dir, data, reference, tmp_path):
    """Killed mid-run, resumed against a server whose every request fails (HTTP 500, GET /models answering):
    it stops (exit 1) with no row skipped; resumed against the server healthy again: every row answered once."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    port = free_port()
    out = tmp_path / "out"
    server = Server(model, port=port, log_path=tmp_path / "serve.log").start()
    argv = unmanaged(model, data, out, server.base_url)
    try:
        proc = start(regenerate_cmd(argv))
        wait_for_commits(proc, out, 1)
        proc.kill()
        proc.wait(timeout=30)
        server.stop()
        before = {k: r for k, r in read_committed(out).items()}
        _set_template(model, BROKEN_TEMPLATE)
        server = Server(model, port=port, log_path=tmp_path / "serve.log")
        server.warm_up = lambda: None  # every request fails now
        server.start()
        proc = start(regenerate_cmd(argv))
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 1 and "broken, not the rows" in err, err[-3000:]
        committed = read_committed(out)
        assert not [s for r in committed.values() for s in r.skipped]  # no row committed as skipped
        assert sum(len(r.rows) for r in committed.values()) >= sum(len(r.rows) for r in before.values())
        server.stop()
        _set_template(model, None)
        server = Server(model, port=port, log_path=tmp_path / "serve.log").start()
        assert regenerate_main(argv) == 0
    finally:
        server.stop()
    exactly_once(out, reference)


@pytest.mark.slow
def test_a_managed_server_failing_every_request_is_restarted_and_no_row_is_lost(model_dir, data, reference,
                                                                                 tmp_path):
    """The first start serves a template that fails every request, the restart a healthy one: one run, every row
    answered once (the rejections of the failing phase were held, never committed)."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    shutil.copy(model / "chat_template.jinja", tmp_path / "good.jinja")
    (tmp_path / "broken.jinja").write_text(BROKEN_TEMPLATE)
    marker, template = tmp_path / "started-once", model / "chat_template.jinja"
    script = (f"if [ -e {marker} ]; then cp {tmp_path / 'good.jinja'} {template}; "
              f"else touch {marker}; cp {tmp_path / 'broken.jinja'} {template}; fi; "
              f"exec {TRANSFORMERS} serve {model} --host $0 --port $1 --device cpu --dtype float32")
    out = tmp_path / "out"
    argv = managed(model, data, out, **{"regenerate.servers.preset": "null", "regenerate.servers.extra_args": "[]",
                                        "regenerate.servers.command": f"[sh, -c, '{script}', '{{host}}', "
                                                                      f"'{{port}}']"})
    proc = start(regenerate_cmd(argv))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "broken, not the rows" in err and "restarting it" in err
    [record] = server_records(out)
    assert record["restarts"] == 1
    exactly_once(out, reference)
    assert_gone([record["pid"]])


@pytest.mark.slow
def test_rows_an_older_version_skipped_for_a_server_error_are_asked_again(model_dir, data, reference, tmp_path):
    """An output written before rejections were confirmed: a part holding a row skipped with HTTP 500 is redone."""
    server = Server(model_dir, log_path=tmp_path / "serve.log").start()
    out = tmp_path / "out"
    argv = unmanaged(model_dir, data, out, server.base_url)
    try:
        assert regenerate_main(argv) == 0
        index = out / "index" / "rank-00000.jsonl"
        lines = [json.loads(line) for line in index.read_text().splitlines()]
        old = lines[0]
        lost = old["rows"].pop(0)
        old["num_rows"] -= 1
        old["skipped"] = [{"source_row": lost, "source_id": f"r{lost}", "reason": "rejected_by_engine",
                           "detail": "HTTP 500: Internal Server Error (2 attempts)"}]
        for line in lines:  # as the version before parts and confirmed rejections wrote them
            line.pop("part", None)
            line.pop("rejections_confirmed", None)
        index.write_text("".join(json.dumps(line) + "\n" for line in lines))
        assert regenerate_main(argv) == 0
    finally:
        server.stop()
    exactly_once(out, reference)


# ---------------------------------------------------------------------------------------------- commits by time
@pytest.mark.slow
def test_commits_by_time_keep_the_answers_a_kill_would_lose(model_dir, tmp_path):
    """One chunk of every row, committed in parts every half second: a SIGKILL keeps the parts, and the resume
    asks exactly the rows no part lists (the rows equal an uninterrupted run's that committed the chunk whole)."""
    rows = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"Count to {i}."}]} for i in range(60)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    server = Server(model_dir, log_path=tmp_path / "serve.log").start()
    out, whole = tmp_path / "out", tmp_path / "whole"
    sets = {"regenerate.rows_per_shard": 1000, "regenerate.max_tokens": 8}
    argv = unmanaged(model_dir, data, out, server.base_url, **sets, **{"regenerate.commit_seconds": 0.5})
    try:
        assert regenerate_main(unmanaged(model_dir, data, whole, server.base_url, **sets)) == 0
        assert len(read_committed(whole)) == 1  # the default: one minute, longer than this run
        proc = start(regenerate_cmd(argv))
        wait_for_commits(proc, out, 2)
        proc.kill()
        proc.wait(timeout=30)
        committed = read_committed(out)
        assert len(committed) >= 2 and {chunk for chunk, _ in committed} == {0}  # parts of the one chunk
        positions = [p for r in committed.values() for p in r.rows]
        assert 0 < len(positions) < len(rows) and len(positions) == len(set(positions)), "make the run longer"
        assert (out / "data" / "shard-000000-001.arrow").is_file()
        assert regenerate_main(argv) == 0
    finally:
        server.stop()
    positions = [p for r in read_committed(out).values() for p in r.rows]
    assert sorted(positions) == list(range(len(rows)))
    assert sorted(rows_of(out), key=lambda r: r["source_row"]) == rows_of(whole)
    assert json.loads((out / "summary.json").read_text())["num_requests"] == len(rows)  # none counted twice


# ---------------------------------------------------------------------------------------------- which servers
def test_servers_are_cut_per_gpu_group_and_shared_out_over_a_nodes_processes():
    from dflash_prep.regen.servers import server_groups

    gpus = [str(i) for i in range(8)]
    assert server_groups(gpus, 2, None, 0, 1) == [(0, ["0", "1"]), (1, ["2", "3"]), (2, ["4", "5"]),
                                                  (3, ["6", "7"])]
    assert server_groups(gpus, 2, None, 1, 2) == [(1, ["2", "3"]), (3, ["6", "7"])]
    assert server_groups(gpus, 4, 1, 0, 1) == [(0, ["0", "1", "2", "3"])]
    assert server_groups([], 1, None, 1, 2) == [(1, [])]  # no GPUs: a CPU server per process
    with pytest.raises(ValueError, match="at most 4 process"):
        server_groups(gpus, 2, None, 5, 8)
    with pytest.raises(ValueError, match="too few"):
        server_groups(gpus[:3], 4, None, 0, 1)


def test_the_presets_fill_in_the_engines_own_flags(tmp_path):
    """The command lines the presets give, written out by hand from the engines' CLI references."""
    from dflash_prep.recipe.schema import ServersSection
    from dflash_prep.regen.servers import ManagedServers, _Managed

    def command(preset, gpus, template="/t/chat.jinja", **kw):
        servers = ManagedServers.__new__(ManagedServers)  # the command alone: no process started
        servers.section = ServersSection(preset=preset, **kw)
        servers.model, servers.served_model_name, servers.chat_template = "/m/Qwen3-8B", "qwen3", template
        return servers.command(_Managed(0, gpus, 8123, tmp_path / "log"))

    assert command("vllm", ["4", "5"], extra_args=["--max-model-len", "8192"]) == [
        "vllm", "serve", "/m/Qwen3-8B", "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "qwen3",
        "--tensor-parallel-size", "2", "--chat-template", "/t/chat.jinja", "--max-model-len", "8192"]
    assert command("sglang", ["0"], template=None) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/m/Qwen3-8B", "--host", "127.0.0.1", "--port",
        "8123", "--served-model-name", "qwen3", "--tp-size", "1"]
    assert command("transformers", [], template=None) == [
        TRANSFORMERS, "serve", "/m/Qwen3-8B", "--host", "127.0.0.1", "--port", "8123", "--device", "cpu"]
    assert command(None, ["1", "2"], command="my-server --gpus {gpus} --tp {gpus_per_server} -p {port}") == [
        "my-server", "--gpus", "1,2", "--tp", "2", "-p", "8123"]


@pytest.mark.parametrize("sets,message", [
    ({"regenerate.servers.preset": "vllm", "regenerate.base_urls": "[http://127.0.0.1:8000/v1]"}, "not both"),
    ({"regenerate.servers.command": "[my-server, '{port}']", "regenerate.servers.preset": "vllm"}, "exactly one"),
    ({"regenerate.servers.command": "[my-server, '{port}', '{gpu}']"}, "unknown placeholder"),
    ({"regenerate.servers.command": "[my-server]"}, "{port}"),
    ({"regenerate.servers.preset": "vllm", "regenerate.engine": "transformers"}, "engine: openai"),
])
def test_a_bad_servers_section_is_one_line_naming_the_key(sets, message):
    from dflash_prep.recipe.schema import RecipeError, load_recipe

    overrides = {"regenerate.engine": "openai", **sets}
    with pytest.raises(RecipeError, match="regenerate") as e:
        load_recipe(None, [f"{k}={v}" for k, v in overrides.items()])
    assert message in str(e.value) and "\n" not in str(e.value)

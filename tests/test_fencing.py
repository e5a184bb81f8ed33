"""Fencing, not only leases: a run that lost the output (frozen past its lease while another run took over) commits
nothing more; a resume that finds one sample in records of two runs keeps one record; leases are judged by the
folder's clock (skewed hosts), by the flock and run id on this host (a pid alive again is not the dead run), and a
lease file that does not read is named as damaged, with the time it will be taken over.

Real processes throughout: other hosts are processes under tests/other_host.py (their own hostname, a flock no other
host sees, optionally a clock that runs ahead or behind); a frozen run is SIGSTOPped by its own fault hook at a
commit point (faults.py `stop_at_commit`) and woken with SIGCONT."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from conftest import REPO, demo_overrides, raw_records

from dflash_prep.commands.extract import EXIT_BAD_RECIPE, EXIT_STOPPED, main
from dflash_prep.commands.inspect import check_output
from dflash_prep.store.locks import (
    LeaseLostError,
    OutputBusyError,
    OutputFence,
    lock_run,
    read_lease,
    running_holders,
)
from dflash_prep.store.manifest import read_committed, shard_store
from dflash_prep.store.records import ShardRecord

OTHER_HOST = REPO / "tests" / "other_host.py"
SETTINGS = {"data.max_samples": 24, "batching.num_workers": 0, "output.max_shard_bytes": "100KB"}


def argv(out: Path, **extra) -> list[str]:
    return [a for kv in demo_overrides(out, **{**SETTINGS, **extra}) for a in ("--set", kv)]


def on_other_host(host: str, *args: str, clock_offset: float | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO), **popen.pop("env", {})}
    offset = ["--clock-offset", str(clock_offset)] if clock_offset is not None else []
    return subprocess.Popen([sys.executable, str(OTHER_HOST), host, *offset, *args], cwd=REPO, env=env, **popen)


def hold_run_lease(host: str, out: Path, lease_seconds: float, clock_offset: float | None = None) -> subprocess.Popen:
    """A process of `host` holding the run lease of `out` (renewing it) until killed."""
    code = (f"from dflash_prep.store.locks import lock_run; lock = lock_run({str(out)!r}, lease_seconds={lease_seconds});"
            f" print('held', flush=True); import time; time.sleep(600)")
    proc = on_other_host(host, "-c", code, clock_offset=clock_offset, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: state T in /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


# -------------------------------------------------------------------------------------------- damaged lease files
GARBAGE = [b"\x00\xff\xfe not json", b"[1, 2, 3]", b'{"host": 3, "pid": "x"}',
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": "soon", "lease_seconds": 300}',
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": 1.0, "lease_seconds": -5}',
           # the right types, values no clock can hold (Python's json reads NaN and Infinity): a traceback before
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": NaN, "lease_seconds": 300}',
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": 1e300, "lease_seconds": 300}',
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": 1.0, "lease_seconds": Infinity}',
           b'{"host": "h", "pid": 1, "run_id": "r", "heartbeat_at": 1.0, "lease_seconds": 1e308}']


@pytest.mark.parametrize("content", GARBAGE, ids=["bytes", "list", "types", "heartbeat", "lease", "nan-time",
                                                  "far-time", "infinite-lease", "huge-lease"])
def test_a_lease_file_that_does_not_parse_is_named_damaged_with_the_time_it_is_taken_over(tmp_path, content):
    out = tmp_path / "out"
    (out / "locks").mkdir(parents=True)
    path = out / "locks" / "run.lease-000000"
    path.write_bytes(content)
    record = read_lease(path)
    assert record.damaged and path.name in record.damaged
    with pytest.raises(OutputBusyError) as e:
        lock_run(out, lease_seconds=30)
    text = str(e.value)
    expected = time.strftime("%Y-%m-%d %H:%M", time.localtime(path.stat().st_mtime + 30))
    assert "damaged" in text and "taken over 30 s after it was last written" in text and expected in text, text
    assert "pid" not in text.split("damaged")[0], text  # no live holder described
    assert list(running_holders(out).values()) == [record.describe()]  # inspect's reader: no traceback
    old = time.time() - 31
    os.utime(path, (old, old))  # written 31 s ago: past the 30 s lease
    lock = lock_run(out, lease_seconds=30)
    assert lock.lease.generation == 1 and lock.lease.took_over.damaged
    lock.release()


def test_the_commands_answer_a_damaged_lease_in_one_line(tmp_path, capsys):
    out = tmp_path / "out"
    (out / "locks").mkdir(parents=True)
    (out / "locks" / "run.lease-000000").write_bytes(b'{"host": "h", "pid": "seven"}')
    assert main(argv(out, **{"output.lease_seconds": 60})) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "damaged" in errors[0] and "pid is 'seven'" in errors[0], err
    assert "Traceback" not in err
    from dflash_prep.commands.inspect import main as inspect_main

    inspect_main([str(out)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ValueError" not in err, err


# -------------------------------------------------------------------------------------------- this host's leases
def test_a_lease_of_this_host_is_judged_by_its_flock_and_run_id_not_its_pid(tmp_path):
    """A lease naming this host whose run's flock is free is a dead run's, even when its pid is alive again (this
    very process: a restarted container's new run can get the dead run's pid; or another live process): taken over
    at once. A live run of this host (its flock held) still refuses."""
    out = tmp_path / "out"
    (out / "locks").mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (os.getpid(), sleeper.pid):
            for p in (out / "locks").glob("run.lease-*"):
                p.unlink()
            record = {"host": socket.gethostname(), "pid": pid, "run_id": "deadbeef", "generation": 4,
                      "lease_seconds": 300.0, "started_at": time.time(), "heartbeat_at": time.time(),
                      "released_at": None}
            (out / "locks" / "run.lease-000004").write_text(json.dumps(record))
            lock = lock_run(out, lease_seconds=300)
            assert lock.lease.generation == 5 and lock.lease.took_over["run_id"] == "deadbeef"
            lock.release()
    finally:
        sleeper.kill()
    code = (f"from dflash_prep.store.locks import lock_run; lock = lock_run({str(out)!r}, lease_seconds=300); "
            f"print('held', flush=True); import time; time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusyError, match=f"pid {holder.pid}"):
            lock_run(out, lease_seconds=300)
    finally:
        holder.kill()
        holder.wait()
    lock_run(out, lease_seconds=300).release()  # its process is gone: at once


# -------------------------------------------------------------------------------------------- skewed clocks
def test_a_dead_host_whose_clock_was_ahead_is_named_as_skew_and_taken_over_after_its_lease(tmp_path):
    out = tmp_path / "out"
    holder = hold_run_lease("gpu-node-5", out, lease_seconds=3, clock_offset=3600)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    died = time.time()
    with pytest.raises(OutputBusyError) as e:
        lock_run(out, lease_seconds=3)
    text = str(e.value)
    assert f"pid {holder.pid} on gpu-node-5" in text and "clock skew" in text and "ahead of this host's" in text
    assert not re.search(r"-\d+ s ago", text), text  # never a negative age
    theirs = time.strftime("%Y-%m-%d %H:%M", time.localtime(died + 3600))
    ours = time.strftime("%Y-%m-%d %H:%M", time.localtime(died))
    assert theirs in text and ours in text, text  # both clocks printed
    time.sleep(max(0.0, died + 3.5 - time.time()))
    lock = lock_run(out, lease_seconds=3)  # 3 s after its last heartbeat by the folder's clock, not in an hour
    assert lock.lease.took_over["host"] == "gpu-node-5"
    lock.release()


def test_a_live_host_whose_clock_is_behind_is_never_taken_over(tmp_path):
    """Its heartbeats look 1000 s old by their own times; the folder's clock sees them renewed: live."""
    out = tmp_path / "out"
    holder = hold_run_lease("gpu-node-6", out, lease_seconds=3, clock_offset=-1000)
    try:
        time.sleep(4)  # longer than its lease: only its renewals keep it
        with pytest.raises(OutputBusyError) as e:
            lock_run(out, lease_seconds=3)
        assert "clock skew" in str(e.value) and "behind this host's" in str(e.value), str(e.value)
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


# -------------------------------------------------------------------------------------------- the fence
FROZEN_COMMIT = """
import sys, time
from pathlib import Path
from dflash_prep.store.locks import lock_run, OutputFence, LeaseLostError
from dflash_prep.store.manifest import shard_store
from dflash_prep.store.records import ShardRecord
out = Path(sys.argv[1])
lock = lock_run(out, "aaaaaaaa", lease_seconds=2)
fence = OutputFence(out, lock.lease.generation, "aaaaaaaa")
final = out / "shards" / "rank-00000" / "shard-000000-aaaaaaaa.tar"
final.parent.mkdir(parents=True)
tmp = final.with_name(final.name + ".tmp")
tmp.write_bytes(b"x" * 1024)
print("ready", flush=True)
sys.stdin.readline()  # SIGSTOPped here, past its lease; woken, it tries to commit
try:
    shard_store(out).appender(0).commit(tmp, final, ShardRecord(str(final.relative_to(out)), 1, 1, 1024, "0" * 64,
                                                               sample_ids=["s0"]), fence)
    print("committed", flush=True)
except LeaseLostError as e:
    print("lost:", e, flush=True)
"""


def test_a_run_frozen_past_its_lease_commits_nothing_after_the_take_over(tmp_path):
    out = tmp_path / "out"
    frozen = on_other_host("node-a", "-c", FROZEN_COMMIT, str(out), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    assert frozen.stdout.readline().strip() == "ready"
    frozen.send_signal(signal.SIGSTOP)
    time.sleep(2.5)  # past its lease: no heartbeat while stopped
    taker = lock_run(out, "bbbbbbbb", lease_seconds=2)  # this host: node-a's flock is not seen here
    fence = OutputFence(out, taker.lease.generation, "bbbbbbbb")
    fence.check()
    frozen.send_signal(signal.SIGCONT)
    frozen.stdin.write("go\n")
    frozen.stdin.flush()
    answer = frozen.stdout.readline()
    assert answer.startswith("lost:") and "no longer holds the output" in answer, answer
    assert frozen.wait(timeout=60) == 0
    assert not (out / "shards" / "rank-00000" / "shard-000000-aaaaaaaa.tar").exists()
    assert not (out / "index" / "rank-00000.jsonl").exists() or (out / "index" / "rank-00000.jsonl").read_bytes() == b""
    with pytest.raises(LeaseLostError):
        OutputFence(out, taker.lease.generation - 1, "aaaaaaaa").check()
    taker.release()


def _record(path: str, samples: list[str], fence: int | None, batch: int) -> ShardRecord:
    return ShardRecord(path, len(samples), 10 * len(samples), 10, "0" * 64, batch_ids=[batch], sample_ids=samples,
                       fence=fence)


def _write(out: Path, rank: int, records: list[ShardRecord]) -> None:
    index = out / "index" / f"rank-{rank:05d}.jsonl"
    index.parent.mkdir(parents=True, exist_ok=True)
    with open(index, "a") as f:
        for r in records:
            (out / r.path).parent.mkdir(parents=True, exist_ok=True)
            (out / r.path).write_bytes(b"y" * r.num_bytes)
            f.write(json.dumps(r.to_json()) + "\n")


def test_one_sample_in_records_of_two_runs_keeps_the_later_runs_record_and_redoes_nothing_else(tmp_path):
    """A frozen run's late line (token 3) and the record of the run that took over (token 5) hold one sample:
    the later run's record is kept, the other dropped with its file; every other record stays. Records of one run
    that share a sample are still a damaged index (nothing says which is right)."""
    out = tmp_path / "out"
    early = _record("shards/rank-00000/shard-000000-aaaaaaaa.tar", ["s0", "s1"], 3, 0)
    late = _record("shards/rank-00000/shard-000001-aaaaaaaa.tar", ["s2", "s3"], 3, 1)
    redone = _record("shards/rank-00001/shard-000000-bbbbbbbb.tar", ["s2", "s3"], 5, 1)
    other = _record("shards/rank-00001/shard-000001-bbbbbbbb.tar", ["s4"], 5, 2)
    _write(out, 0, [early])
    _write(out, 1, [redone, other])
    _write(out, 0, [late])  # landed after the take-over
    assert [r.path for r in read_committed(out)] == [early.path, redone.path, other.path]
    found = shard_store(out).prepare()
    assert [r.path for r in found.committed] == [early.path, redone.path, other.path]
    assert [r.path for r in found.superseded] == [late.path] and not found.damaged
    assert not (out / late.path).exists() and all((out / r.path).exists() for r in (early, redone, other))
    assert late.path not in (out / "index" / "rank-00000.jsonl").read_text()
    again = shard_store(out).prepare()  # nothing more to do
    assert not again.superseded and not again.removed and len(again.committed) == 3
    same_run = _record("shards/rank-00001/shard-000002-bbbbbbbb.tar", ["s4"], 5, 3)
    _write(out, 1, [same_run])
    with pytest.raises(Exception, match="listed in two shards"):
        read_committed(out)


def test_a_damaged_record_of_the_later_run_leaves_the_intact_one_of_the_earlier(tmp_path):
    """The later run's record of a sample whose file is gone is dropped first: the earlier run's intact record
    of it is kept (one intact record), not redone."""
    out = tmp_path / "out"
    first = _record("shards/rank-00000/shard-000000-aaaaaaaa.tar", ["s0"], 1, 0)
    second = _record("shards/rank-00000/shard-000001-bbbbbbbb.tar", ["s0"], 2, 0)
    _write(out, 0, [first, second])
    (out / second.path).unlink()
    found = shard_store(out).prepare()
    assert [r.path for r in found.committed] == [first.path] and list(found.damaged) == [second.path]


# -------------------------------------------------------------------------------------------- whole runs
def _wait_stopped(proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the run ended before its commit point: {proc.stderr.read()[-3000:]}"
        if stopped(proc.pid):
            return
        time.sleep(0.05)
    raise AssertionError("the run never reached its commit point")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["checked", "renamed", "appending", "manifest"])
def test_two_runs_one_frozen_past_its_lease_at_a_commit_point_end_intact_each_sample_once(tmp_path, capsys, point):
    """Run A (host node-a) stops itself at a commit point of shard 1 (or of the manifest) and stays stopped past
    its lease; run B (host node-b) takes the output over and finishes it; A, woken, commits nothing (at
    "appending", past its last check, it lands one late line, whose shard B's records already hold) and ends with
    exit code 1 and one line; a resume then finds the output intact: the 24 samples, each once."""
    out = tmp_path / "out"
    lease = {"output.lease_seconds": 2}
    faults = {"stop_at_commit": {"point": point, "shard": 1}, "forward_delay_seconds": 0.2}
    a = on_other_host("node-a", "extract.py", *argv(out, **lease), env={"DFLASH_PREP_FAULTS": json.dumps(faults)},
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_stopped(a)
    committed_by_a = {r.path for r in read_committed(out)}
    time.sleep(3)  # past A's lease: it renews nothing while stopped
    b = on_other_host("node-b", "extract.py", *argv(out, **lease), stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True)
    assert b.wait(timeout=600) == 0, b.stderr.read()[-3000:]
    manifest_by_b = (out / "manifest.json").read_bytes()
    a.send_signal(signal.SIGCONT)
    assert a.wait(timeout=120) == EXIT_STOPPED
    err = a.stderr.read()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("no longer holds the output" in errors[0] or "took over" in errors[0]), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (out / "manifest.json").read_bytes() == manifest_by_b  # A wrote no manifest over B's
    lines = [json.loads(line) for index in sorted((out / "index").glob("rank-*.jsonl"))
             for line in index.read_text().splitlines()]
    listed_twice = len([s for line in lines for s in line["sample_ids"]]) - len({s for line in lines
                                                                                 for s in line["sample_ids"]})
    if point != "appending":
        assert listed_twice == 0  # a check stood between the freeze and the line: no late line landed
    # at "appending" (past the last check) A's late line usually lands, holding samples B's records hold too
    records = read_committed(out)
    assert {r.path for r in records} >= {p for p in committed_by_a}  # A's commits before the freeze are kept
    ids = [s for r in records for s in r.sample_ids]
    assert len(ids) == len(set(ids)) == 24
    assert main(argv(out, **lease)) == 0  # the resume: finished, nothing to redo
    assert len(raw_records(out)) == 24 and check_output(out) == []
    manifest = json.loads((out / "manifest.json").read_text())
    listed = []
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            listed += sorted({m.name.split(".", 1)[0] for m in tar.getmembers()})
    assert len(listed) == len(set(listed)) == 24

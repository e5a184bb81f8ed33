"""The shard sha256 computed on a thread beside the file writes: every committed shard's recorded digest and size
are those of its file bytes (any member sizes, fp8 and bf16, rolled shards, several lanes), no hashing thread
outlives its shard, and a write or hashing error stops the run cleanly instead of committing a wrong digest."""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
import tarfile
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO

from dflash_prep.faults import Faults
from dflash_prep.plan.batches import SampleInfo
from dflash_prep.store import writer as writer_mod
from dflash_prep.store.manifest import read_committed
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, ShardWriter, encode_batch, lanes
from dflash_prep.target.fp8 import packed_width, store_block


def _pending(batch_id: int, lengths: list[int], width: int, fp8: bool = False, k: int = 2) -> PendingBatch:
    """A batch of samples of the given token counts; states seeded by the batch id (bf16, or packed fp8 rows)."""
    infos = [SampleInfo(f"b{batch_id:04d}-s{j}", batch_id * 100 + j, None,
                        np.arange(n, dtype=np.int32) + batch_id, np.ones(n, np.uint8)) for j, n in enumerate(lengths)]
    N = sum(lengths)
    gen = torch.Generator().manual_seed(batch_id)
    if fp8:
        hs = torch.zeros(N, packed_width(k, width), dtype=torch.uint8)
        for slot in range(k):
            store_block(hs, slot, k, torch.randn(N, width, generator=gen))
        return PendingBatch(batch_id, infos, hs, None, None, list(range(k)))
    states = torch.randn(N, k * width, generator=gen).to(torch.bfloat16)
    return PendingBatch(batch_id, infos, states, None, None, list(range(k)))


_LEFT_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_left_before():
    """Hashing threads alive before the test (left by another one): not charged to this test."""
    _LEFT_BEFORE.clear()
    _LEFT_BEFORE.update(t for t in threading.enumerate() if t.name.startswith("shard-sha256"))


def _hash_threads() -> list[threading.Thread]:
    """The hashing threads this test left alive, after giving finishing ones a moment to go."""
    deadline = time.time() + 2
    while True:
        alive = [t for t in threading.enumerate() if t.name.startswith("shard-sha256") and t not in _LEFT_BEFORE]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.02)


def _assert_committed_match_disk(out: Path) -> list:
    """Every index record's sha256/num_bytes are those of its file (hashlib over the bytes on disk), every file
    under shards/ is a committed shard (no .tmp left), and each shard is a readable tar of its samples."""
    committed = read_committed(out)
    for record in committed:
        data = (out / record.path).read_bytes()
        assert record.num_bytes == len(data), record.path
        assert record.sha256 == hashlib.sha256(data).hexdigest(), record.path
        with tarfile.open(out / record.path) as tar:
            assert len(tar.getnames()) == 4 * record.num_samples
    on_disk = sorted(str(p.relative_to(out)) for p in (out / "shards").rglob("*") if p.is_file())
    assert on_disk == sorted(r.path for r in committed)
    return committed


CASES = {
    # name: (batches as lists of sample lengths, hidden width, max_shard_bytes, lanes)
    "many_tiny_samples": ([[1] * 40 for _ in range(12)], 2, 60_000, 1),
    "huge_members": ([[3000], [2500, 1], [4000]], 512, 1 << 40, 1),  # ~6-8 MB safetensors members
    "rolled_mid_run_many_lanes": ([[7, 300, 2], [1], [900], [5] * 30, [64, 64]] * 3, 64, 150_000, 3),
    "around_the_batching_threshold": ([[n] for n in (255, 256, 257, 511, 512)] * 2, 64, 100_000, 2),
}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("case", list(CASES))
def test_recorded_digest_and_size_are_the_file_bytes(tmp_path, case, fp8):
    batches, width, max_bytes, num_lanes = CASES[case]
    writer = AsyncShardWriter(lanes(tmp_path, 0, max_bytes, 0, num_lanes), max_pending_batches=2)
    for b, lengths in enumerate(batches):
        writer.submit(_pending(b, lengths, width, fp8))
    writer.close()
    committed = _assert_committed_match_disk(tmp_path)
    assert sorted(b for r in committed for b in r.batch_ids) == list(range(len(batches)))
    assert sum(r.num_bytes for r in committed) == writer.bytes_written
    assert _hash_threads() == []


def test_zero_length_members_and_a_sample_of_no_states(tmp_path):
    """Members of 0 bytes (no padding follows them) and a sample with no tokens at all."""
    w = ShardWriter(tmp_path, 0, max_shard_bytes=1 << 40)
    names = ["hidden_states.safetensors", "input_ids.npy", "loss_mask.npy", "meta.json"]
    samples = [({"__key__": f"z{i}", **{n: b"" for n in names}}, 0) for i in range(50)]
    samples.append(({"__key__": "big", **{n: bytes([i]) * (70_000 + i) for i, n in enumerate(names)}}, 1))
    w.write_batch(0, samples)
    w.write_batch(1, encode_batch(_pending(1, [0, 3, 0], 16)))
    w.close()
    assert len(_assert_committed_match_disk(tmp_path)) == 1
    assert _hash_threads() == []


def test_no_hashing_thread_outlives_its_shard(tmp_path):
    """Commits (rolls and the last one), the close of a shard left empty, aborts after an error and after a
    fault injected mid-write: afterwards no hashing thread is left."""
    writer = AsyncShardWriter(lanes(tmp_path / "a", 0, 20_000, 0, 2))
    for b in range(20):
        writer.submit(_pending(b, [50, 3], 32))
    writer.close()
    assert len(read_committed(tmp_path / "a")) >= 10 and _hash_threads() == []

    # A batch that fails inside its first sample (after 100 KB went to the hashing thread) leaves an open shard
    # without samples or batches: close() drops it.
    empty = ShardWriter(tmp_path / "b", 0, 1 << 40)
    with pytest.raises(TypeError):
        empty.write_batch(0, [({"__key__": "x", "a.bin": bytes(100_000), "b.bin": 5}, 1)])
    empty.close()
    assert not [p for p in (tmp_path / "b" / "shards").rglob("*") if p.is_file()] and _hash_threads() == []

    faults = Faults(enospc_shard=3)
    writer = AsyncShardWriter(lanes(tmp_path / "c", 0, 20_000, 0, 2, faults=faults))
    with pytest.raises(OSError, match="No space left"):
        for b in range(40):
            writer.submit(_pending(b, [50, 3], 32))
        writer.close()
    writer.abort()
    _assert_committed_match_disk(tmp_path / "c")
    assert _hash_threads() == []


class _FullDisk:
    """Shard files whose writes fail with ENOSPC once `room` bytes are in, all files together (a disk filling up
    mid-shard)."""

    room = 0
    written = 0

    def __init__(self, path):
        self.f = open(path, "wb", buffering=0)

    @staticmethod
    def open(path, mode="r", *args, **kwargs):
        """The writer's `open`: shard files (.tmp) on the filling disk, the index as usual."""
        if str(path).endswith(".tmp"):
            return _FullDisk(path)
        return open(path, mode, *args, **kwargs)

    def write(self, data):
        n = memoryview(data).nbytes
        if _FullDisk.written + n > _FullDisk.room:
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        _FullDisk.written += n
        return self.f.write(data)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()


@pytest.mark.parametrize("num_lanes", [1, 3])
def test_a_disk_filling_up_mid_shard_leaves_only_committed_shards(tmp_path, monkeypatch, num_lanes):
    monkeypatch.setattr(writer_mod, "open", _FullDisk.open, raising=False)
    monkeypatch.setattr(_FullDisk, "room", 1_000_000)  # ~9 shards' worth, the last one cut mid-member
    monkeypatch.setattr(_FullDisk, "written", 0)
    # buffered: the fake disk is the writer's `open` (tests/test_direct_io.py fills a real one with O_DIRECT)
    writer = AsyncShardWriter(lanes(tmp_path, 0, 100_000, 0, num_lanes, write_mode="buffered"))
    raised = []
    try:
        for b in range(60):
            writer.submit(_pending(b, [40, 90], 64))
        writer.close()
    except OSError as e:
        raised.append(e)
    assert len(raised) == 1 and raised[0].errno == errno.ENOSPC  # raised once, by submit or close
    writer.abort()  # what the run does next: drops the open shards
    assert writer.error is raised[0]
    assert len(_assert_committed_match_disk(tmp_path)) >= 5
    lines = (tmp_path / "index" / "rank-00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["path"] for line in lines] == [r.path for r in read_committed(tmp_path)]
    assert _hash_threads() == []


def test_a_failed_last_commit_in_close_drops_every_open_shard(tmp_path, monkeypatch):
    """The disk fails the fsync of the last commits (in `close`, no `abort` after it): the error surfaces once and
    every lane's open shard is dropped, the failing one included (no .tmp, no hashing thread left)."""
    import os

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error (test)")

    writer = AsyncShardWriter(lanes(tmp_path, 0, 1 << 40, 0, 2))
    for b in range(6):
        writer.submit(_pending(b, [300, 20], 64))
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        writer.close()
    monkeypatch.undo()
    assert writer.error is not None and read_committed(tmp_path) == []
    assert not [p for p in (tmp_path / "shards").rglob("*") if p.is_file()]
    assert _hash_threads() == []


class _FailingSha256:
    """A sha256 whose `update` raises on chosen calls (a hashing thread that fails, e.g. out of memory)."""

    fail_on: set[int] = set()
    calls = 0

    def __init__(self):
        self.h = hashlib.sha256()

    def update(self, data):
        _FailingSha256.calls += 1
        if _FailingSha256.calls in _FailingSha256.fail_on:
            raise MemoryError("hashing failed (test)")
        self.h.update(data)

    def hexdigest(self):
        return self.h.hexdigest()


class _Hashlib:
    sha256 = _FailingSha256


@pytest.mark.parametrize("fail_on", [{1}, {2}, set(range(1, 10_000))], ids=["first", "second", "every"])
def test_a_hashing_error_stops_the_run_and_commits_no_wrong_digest(tmp_path, monkeypatch, fail_on):
    """Whichever piece fails to hash (not only the last handed over), the run raises it; nothing is committed
    with a digest that is not its file's, and no thread hangs."""
    monkeypatch.setattr(writer_mod, "hashlib", _Hashlib)
    monkeypatch.setattr(_FailingSha256, "fail_on", fail_on)
    monkeypatch.setattr(_FailingSha256, "calls", 0)
    writer = AsyncShardWriter(lanes(tmp_path, 0, 1 << 40, 0, 1))
    with pytest.raises(MemoryError, match="hashing failed"):
        for b in range(4):
            writer.submit(_pending(b, [300, 200], 128))  # members of 77-154 KB: several hand-overs per batch
        writer.close()
    writer.abort()
    assert read_committed(tmp_path) == []
    _assert_committed_match_disk(tmp_path)
    assert _hash_threads() == []


def test_a_hashing_error_is_not_forgotten_by_a_later_commit(tmp_path, monkeypatch):
    """A caller of the synchronous writer that goes on after a failed batch must not get a shard committed whose
    digest skipped the bytes that failed to hash."""
    monkeypatch.setattr(writer_mod, "hashlib", _Hashlib)
    monkeypatch.setattr(_FailingSha256, "fail_on", {2})
    monkeypatch.setattr(_FailingSha256, "calls", 0)
    w = ShardWriter(tmp_path, 0, max_shard_bytes=1 << 40)
    with pytest.raises(MemoryError):
        w.write_batch(0, encode_batch(_pending(0, [300, 200], 128)))
    with pytest.raises(MemoryError):  # every later use of that shard's digest fails too
        w.close()
    w.abort()
    assert read_committed(tmp_path) == [] and _hash_threads() == []


def test_lane_buffers_released_and_reused_right_after_the_write(tmp_path):
    """The pinned-memory pattern: batches are views of one host pool; the moment a lane lets go of a batch, its
    slot of the pool is handed out again and overwritten. Every digest must still be that of the file."""
    slot_rows, width = 2000, 128
    pool = torch.zeros(4 * slot_rows, 2 * width, dtype=torch.bfloat16)
    free, scribbled = threading.Condition(), []
    free_slots = [0, 1, 2, 3]

    def reuse(slot: int) -> None:
        pool[slot * slot_rows:(slot + 1) * slot_rows].fill_(-3.0)  # the allocator hands the slot out again
        with free:
            scribbled.append(slot)
            free_slots.append(slot)
            free.notify_all()

    writer = AsyncShardWriter(lanes(tmp_path, 0, 600_000, 0, 2), max_pending_batches=1)
    for b in range(12):
        with free:
            assert free.wait_for(lambda: free_slots, timeout=30)
            slot = free_slots.pop(0)
        fresh = _pending(b, [1500, 499, 1], width)
        view = pool[slot * slot_rows:(slot + 1) * slot_rows]
        view.copy_(fresh.hidden_states_NK)
        batch = PendingBatch(b, fresh.samples, view, None, None, fresh.layer_ids)
        weakref.finalize(batch, reuse, slot)
        writer.submit(batch)
        del batch, view
    writer.close()
    assert len(scribbled) == 12
    committed = _assert_committed_match_disk(tmp_path)
    assert sorted(b for r in committed for b in r.batch_ids) == list(range(12))


ABORT_SCRIPT = """
import sys, torch
from dflash_prep.store.writer import AsyncShardWriter, lanes, PendingBatch
from dflash_prep.plan.batches import SampleInfo
import numpy as np
w = AsyncShardWriter(lanes(sys.argv[1], 0, 1 << 40, 0, 2))
for b in range(6):
    n = 20000
    info = SampleInfo(f"s{b}", b, None, np.zeros(n, np.int32), np.ones(n, np.uint8))
    w.submit(PendingBatch(b, [info], torch.ones(n, 256, dtype=torch.bfloat16), None, None, [1]))
if sys.argv[2] == "abort":
    w.abort()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("how", ["abort", "no_cleanup"])
@pytest.mark.slow
def test_a_process_that_stops_mid_write_exits_promptly(tmp_path, how):
    """A process leaving with shards open (aborted, or not cleaned up at all) does not hang at exit on a hashing
    thread (the interpreter joins those threads at exit; a hang would hit the timeout)."""
    proc = subprocess.run([sys.executable, "-c", ABORT_SCRIPT, str(tmp_path), how], cwd=REPO, timeout=60,
                          capture_output=True, text=True)
    assert "exiting" in proc.stdout, proc.stderr[-2000:]
    if how == "abort":
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert not list(tmp_path.rglob("*.tmp")) and read_committed(tmp_path) == []
    # Without cleanup the lanes (daemon threads) may be inside torch when the interpreter ends, which at times
    # aborts the process (std::terminate, as before the hashing thread): only the absence of a hang is asserted.


def test_members_of_wider_items_are_counted_in_bytes(tmp_path):
    """Member buffers that are not 1-D bytes (a float32 array in `Parts` or alone, a 2-D uint8 array): the tar
    header and the recorded shard size must count their bytes, not their items or rows."""
    from dflash_prep.store.writer import Parts

    w = ShardWriter(tmp_path, 0, max_shard_bytes=1 << 40)
    members = {"__key__": "w", "a.safetensors": Parts([b"head", np.arange(30_000, dtype=np.float32)]),
               "b.bin": np.full((300, 500), 7, np.uint8), "c.bin": np.arange(9, dtype=np.int64), "d.json": "{}"}
    w.write_batch(0, [(members, 1)])
    w.close()
    (record,) = _assert_committed_match_disk(tmp_path)
    with tarfile.open(tmp_path / record.path) as tar:
        assert tar.extractfile("w.a.safetensors").read() == b"head" + np.arange(30_000, dtype=np.float32).tobytes()
        assert tar.extractfile("w.c.bin").read() == np.arange(9, dtype=np.int64).tobytes()


# -- end to end: the demo recipe through extract, then `inspect --check` --------------------------------------

E2E = {"data.max_samples": 48, "batching.num_workers": 0, "batching.max_tokens_per_batch": 2048,
       "output.max_shard_bytes": 1}  # every batch commits a shard of its own: the layout is one shard per batch


def _extract(out: Path, **extra) -> int:
    from conftest import demo_overrides

    from dflash_prep.commands.extract import main

    return main([a for kv in demo_overrides(out, **{**E2E, **extra}) for a in ("--set", kv)])


def _digests_by_batch(out: Path) -> dict[tuple[int, ...], str]:
    """batch ids -> sha256 of the shard holding them, hashed here from the bytes on disk."""
    return {tuple(r.batch_ids): hashlib.sha256((out / r.path).read_bytes()).hexdigest()
            for r in _assert_committed_match_disk(out)}


@pytest.fixture(scope="module")
def clean_digests(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    assert _extract(out, **{"output.num_writer_threads": 1}) == 0
    return _digests_by_batch(out)


@pytest.mark.parametrize("threads,dtype", [(1, "bfloat16"), (4, "bfloat16"), (4, "fp8_e4m3")])
@pytest.mark.slow
def test_extraction_passes_inspect_check(tmp_path, capsys, clean_digests, threads, dtype):
    from dflash_prep.commands.inspect import main as inspect_main

    out = tmp_path / "out"
    assert _extract(out, **{"output.num_writer_threads": threads, "output.dtype": dtype}) == 0
    capsys.readouterr()
    assert inspect_main([str(out), "--check", "--no-progress"]) == 0
    assert "check: OK" in capsys.readouterr().out
    digests = _digests_by_batch(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {s["sha256"] for s in manifest["shards"]} == set(digests.values())
    if dtype == "bfloat16":  # the same batches give the same shard bytes whatever the number of lanes
        assert digests == clean_digests
    assert _hash_threads() == []


@pytest.mark.slow
def test_sigterm_mid_run_then_resume_gives_the_uninterrupted_digests(tmp_path, monkeypatch, clean_digests):
    from dflash_prep.commands.extract import EXIT_STOPPED
    from dflash_prep.faults import ENV_VAR

    out = tmp_path / "out"
    monkeypatch.setenv(ENV_VAR, json.dumps({"sigterm_after_batches": 3}))
    assert _extract(out, **{"output.num_writer_threads": 4}) == EXIT_STOPPED
    stopped = _digests_by_batch(out)
    assert 0 < len(stopped) < len(clean_digests) and not list(out.rglob("*.tmp"))
    assert _hash_threads() == []
    monkeypatch.delenv(ENV_VAR)
    assert _extract(out, **{"output.num_writer_threads": 2}) == 0
    assert _digests_by_batch(out) == clean_digests


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_digests(tmp_path, clean_digests):
    """A hard kill (shards open on 3 lanes, hashing threads busy), then a resume in this process: the shard of
    every batch is byte for byte that of the uninterrupted run."""
    import os
    import signal

    from dflash_prep.faults import ENV_VAR

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", ENV_VAR: json.dumps({"forward_delay_seconds": 0.05})}
    cmd = [sys.executable, "extract.py"] + [a for k, v in {**E2E, "output.dir": out,
                                                           "output.num_writer_threads": 3}.items()
                                            for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    index = out / "index" / "rank-00000.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if index.exists() and index.read_bytes().count(b"\n") >= 4:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before the kill: the test proved nothing"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    killed = {tuple(r.batch_ids): r.sha256 for r in read_committed(out)}
    assert 0 < len(killed) < len(clean_digests)
    assert all(clean_digests[b] == d for b, d in killed.items())  # what was committed before the kill is right
    assert _extract(out, **{"output.num_writer_threads": 3}) == 0
    assert _digests_by_batch(out) == clean_digests

"""The shard writer: tar bytes equal to webdataset's own writer, and several writer lanes per rank that keep
every guarantee (each batch once, atomic commits, a layout that does not depend on thread timing)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from dflash_prep.plan.batches import SampleInfo
from dflash_prep.store.manifest import read_committed
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, ShardWriter, _TarStream, lanes


def _members(key: str, sizes: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    names = ["hidden_states.safetensors", "input_ids.npy", "loss_mask.npy", "meta.json"]
    return {"__key__": key, **{n: rng.integers(0, 256, size, dtype=np.uint8).tobytes() for n, size in zip(names, sizes)}}


@pytest.mark.parametrize("sizes", [[0, 1, 511, 512], [513, 1024, 10240, 10241], [100_000, 7, 3, 20_000]])
def test_tar_bytes_equal_webdatasets_tarwriter(sizes):
    samples = [_members(f"s{i:04d}", sizes[i:] + sizes[:i], i) for i in range(3)]
    ours, theirs = io.BytesIO(), io.BytesIO()
    stream = _TarStream(ours)
    ref = wds.TarWriter(theirs, encoder=False, mtime=0)
    for s in samples:
        stream.write_sample(s)
        ref.write(s)
    stream.close()
    ref.close()
    assert ours.getvalue() == theirs.getvalue()
    assert stream.offset == len(ours.getvalue()) and len(ours.getvalue()) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(ours.getvalue())) as tar:  # and plain tarfile reads it back
        got = {m.name: tar.extractfile(m).read() for m in tar}
    assert got == {f"{s['__key__']}.{k}": v for s in samples for k, v in s.items() if k != "__key__"}


def _pending(batch_id: int, n_samples: int, T: int = 5, width: int = 8) -> PendingBatch:
    infos = [SampleInfo(f"b{batch_id:03d}-s{j}", batch_id * 10 + j, None, np.arange(T, dtype=np.int32) + batch_id,
                        np.ones(T, np.uint8)) for j in range(n_samples)]
    states = torch.arange(n_samples * T * width, dtype=torch.float32).reshape(n_samples * T, width) + batch_id
    return PendingBatch(batch_id, infos, states.to(torch.bfloat16), None, None, [1, 3])


def _write(out: Path, num_lanes: int, num_batches: int = 10, max_shard_bytes: int = 1500) -> AsyncShardWriter:
    writer = AsyncShardWriter(lanes(out, 0, max_shard_bytes, first_shard_number=0, num_lanes=num_lanes))
    for b in range(num_batches):
        writer.submit(_pending(b, 1 + b % 3))
    writer.close()
    return writer


def test_lanes_number_shards_by_lane_and_write_every_batch_once(tmp_path):
    writer = _write(tmp_path / "a", num_lanes=3)
    committed = read_committed(tmp_path / "a")
    assert len(committed) == len(writer.committed) and all(r.num_bytes > 0 for r in committed)
    by_lane: dict[int, list[int]] = {}
    for r in committed:
        number = int(Path(r.path).stem.split("-")[1])
        by_lane.setdefault(number % 3, []).append(number)
        assert all(b % 3 == number % 3 for b in r.batch_ids)  # batch i goes to lane i mod 3
    assert sorted(by_lane) == [0, 1, 2] and all(v == sorted(v) for v in by_lane.values())
    assert sorted(b for r in committed for b in r.batch_ids) == list(range(10))
    sample_ids = [s for r in committed for s in r.sample_ids]
    assert len(sample_ids) == len(set(sample_ids)) == sum(1 + b % 3 for b in range(10))
    with tarfile.open(tmp_path / "a" / committed[0].path) as tar:
        assert len(tar.getnames()) == 4 * committed[0].num_samples
    # Same batches, same lanes: the same files, byte for byte (the layout does not depend on timing).
    _write(tmp_path / "b", num_lanes=3)
    files_a = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in (tmp_path / "a" / "shards").rglob("*.tar")}
    files_b = {p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b" / "shards").rglob("*.tar")}
    assert len(files_a) == len(committed) and files_a == files_b


def test_an_error_in_one_lane_stops_all_and_leaves_only_committed_shards(tmp_path):
    class FailOnShard:  # the writer's side of faults.Faults
        def before_batch_write(self):
            pass

        def on_shard_write(self, rank, shard_number, tmp_path):
            if shard_number == 4:
                raise OSError(28, "No space left on device (test)")

        def after_rename(self, shard_number):
            pass

    out = tmp_path / "out"
    writer = AsyncShardWriter([ShardWriter(out, 0, 1500, j, FailOnShard(), shard_number_step=3) for j in range(3)])
    with pytest.raises(OSError, match="No space left"):
        for b in range(30):
            writer.submit(_pending(b, 2))
        writer.close()
    writer.abort()
    committed = read_committed(out)
    on_disk = sorted(p.name for p in (out / "shards" / "rank-00000").iterdir())
    assert on_disk == sorted(Path(r.path).name for r in committed)  # no .tmp, nothing unlisted
    assert "shard-000004.tar" not in on_disk and "shard-000001.tar" in on_disk
    lines = (out / "index" / "rank-00000.jsonl").read_text().splitlines()
    assert [json.loads(line)["path"] for line in lines] == [r.path for r in committed]  # whole lines only


@pytest.mark.parametrize("tensors", [
    {"hidden_states": torch.randn(7, 24).to(torch.bfloat16)},
    {"hidden_states": torch.randn(3, 40).to(torch.float16), "final_hidden_states": torch.randn(3, 8).half()},
    {"hidden_states": torch.randn(5, 16).to(torch.float8_e4m3fn), "hidden_states_scales": torch.rand(5, 2),
     "final_hidden_states": torch.randn(5, 8).to(torch.float8_e4m3fn), "final_hidden_states_scales": torch.rand(5, 1)},
    {"hidden_states": torch.randn(2, 3)},  # a header whose length needs padding
])
def test_safetensors_parts_are_the_librarys_bytes(tensors):
    from safetensors.torch import load, save

    from dflash_prep.store.writer import safetensors_parts

    parts = safetensors_parts(tensors)
    joined = b"".join(bytes(memoryview(p)) for p in parts)
    assert joined == save(tensors) and parts.num_bytes == len(joined)
    assert all(torch.equal(load(joined)[k].view(torch.uint8), v.view(torch.uint8)) for k, v in tensors.items())


def test_states_reach_the_tar_from_the_host_buffer_without_a_joining_copy(tmp_path):
    """The safetensors member's data parts are views of the packed host buffer (no copy before the write)."""
    from dflash_prep.store.writer import encode_batch

    pending = _pending(0, 2)
    (first, _), (second, _) = encode_batch(pending)
    parts = first["hidden_states.safetensors"]
    assert parts[1].ctypes.data == pending.hidden_states_NK.data_ptr()
    assert second["hidden_states.safetensors"][1].ctypes.data == pending.hidden_states_NK[5:].data_ptr()


def test_host_memory_of_pending_batches_is_bounded(tmp_path):
    """With a bound of 1.5 batches, the loop never has more than one batch waiting on the writers (and a batch
    larger than the bound alone still goes through)."""
    import threading
    import time

    one = _pending(0, 2).hidden_states_NK.nbytes
    release = threading.Event()

    class Slow(ShardWriter):
        def write_batch(self, *args, **kwargs):
            release.wait(5)  # the writers are slow until the test says so
            return super().write_batch(*args, **kwargs)

    out = tmp_path / "out"
    lock = threading.Lock()
    writer = AsyncShardWriter([Slow(out, 0, 1500, j, shard_number_step=3, index_lock=lock) for j in range(3)],
                              max_pending_bytes=int(1.5 * one))
    writer.submit(_pending(0, 2))
    t = threading.Thread(target=writer.submit, args=(_pending(1, 2),))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # blocked: a second batch would exceed the bound (3 lanes, queues empty)
    release.set()
    t.join(5)
    assert not t.is_alive()
    writer.submit(_pending(2, 7))  # larger than the bound: goes once nothing else is pending
    writer.close()
    assert writer.peak_pending_bytes == _pending(2, 7).hidden_states_NK.nbytes
    assert sorted(b for r in read_committed(out) for b in r.batch_ids) == [0, 1, 2]


def test_a_producer_waiting_for_memory_sees_a_writer_error(tmp_path):
    import threading

    class Failing(ShardWriter):
        def write_batch(self, *args, **kwargs):
            raise OSError(28, "No space left on device (test)")

    writer = AsyncShardWriter(Failing(tmp_path / "out", 0, 1500), max_pending_bytes=1)
    writer.submit(_pending(0, 2))
    errors = []

    def submit_more():
        try:
            writer.submit(_pending(1, 2))
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=submit_more)
    t.start()
    t.join(5)
    assert not t.is_alive() and errors and "No space left" in str(errors[0])
    writer.abort()


def test_each_committed_shards_sha256_is_that_of_its_file_bytes(tmp_path):
    """The hashing runs on its own thread beside the file writes: what the index records must still be the
    sha256 of the bytes on disk, for small members (batched before hashing) and large ones alike."""
    import hashlib

    writer = AsyncShardWriter(lanes(tmp_path, 0, 200_000, first_shard_number=0, num_lanes=2))
    for b in range(9):  # 1 to 3 samples of 5-1,200 tokens: members from a few bytes to ~150 KB
        writer.submit(_pending(b, 1 + b % 3, T=5 + 150 * b, width=64))
    writer.close()
    committed = read_committed(tmp_path)
    assert len(committed) >= 3
    for record in committed:
        data = (tmp_path / record.path).read_bytes()
        assert record.num_bytes == len(data)
        assert record.sha256 == hashlib.sha256(data).hexdigest()


def test_a_batch_is_fully_hashed_before_its_buffers_are_released(tmp_path):
    """write_batch returns only after the hashing thread has read the batch's bytes: the writer's caller then
    drops (and the pinned allocator reuses) the host buffer. Overwrite the buffer right after: the digest must
    still be that of the file."""
    import hashlib

    w = ShardWriter(tmp_path, 0, max_shard_bytes=1 << 40)
    pending = _pending(0, 3, T=4000, width=64)
    from dflash_prep.store.writer import encode_batch

    w.write_batch(0, encode_batch(pending))
    pending.hidden_states_NK.fill_(7.0)  # what a reused buffer would hold by the time a late hash read it
    w.close()
    record = read_committed(tmp_path)[0]
    data = (tmp_path / record.path).read_bytes()
    assert record.sha256 == hashlib.sha256(data).hexdigest()

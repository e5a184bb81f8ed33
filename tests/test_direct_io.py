"""O_DIRECT shard writes (`output.write_mode`): the same bytes as buffered writes, the same atomic commits, and the
buffered fallback where a filesystem refuses O_DIRECT (at open: ramfs; at a write: a length the device cannot
take), said once in the log. Expected bytes come from the buffered writer and from hashlib over the files."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_prep.plan.batches import SampleInfo
from dflash_prep.store import writer as writer_mod
from dflash_prep.store.manifest import read_committed
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, _DirectFile, lanes, open_shard_file


def _pending(batch_id: int, lengths: list[int], width: int = 96) -> PendingBatch:
    infos = [SampleInfo(f"b{batch_id:04d}-s{j}", batch_id * 10 + j, None, np.arange(T, dtype=np.int32) + batch_id,
                        np.ones(T, np.uint8)) for j, T in enumerate(lengths)]
    g = torch.Generator().manual_seed(batch_id)
    states = torch.randn(sum(lengths), width, generator=g).to(torch.bfloat16)
    return PendingBatch(batch_id, infos, states, None, None, [1, 3])


def _write(out: Path, mode: str, num_lanes: int = 3, num_batches: int = 24, max_shard_bytes: int = 300_000):
    writer = AsyncShardWriter(lanes(out, 0, max_shard_bytes, 0, num_lanes, write_mode=mode))
    for b in range(num_batches):
        writer.submit(_pending(b, [7 + 131 * (b % 5), 300 + b]))
    writer.close()
    return writer


def _shards(out: Path) -> dict[str, bytes]:
    """Committed shards by name, each checked against its index record (hashlib, size, a readable tar), and no
    other file under shards/ (no .tmp)."""
    committed = read_committed(out)
    got = {}
    for record in committed:
        data = (out / record.path).read_bytes()
        assert (record.num_bytes, record.sha256) == (len(data), hashlib.sha256(data).hexdigest()), record.path
        with tarfile.open(out / record.path) as tar:
            assert len(tar.getnames()) == 4 * record.num_samples
        got[Path(record.path).name] = data
    on_disk = sorted(p.name for p in (out / "shards").rglob("*") if p.is_file())
    assert on_disk == sorted(got)
    return got


def _direct_taken(folder: Path) -> bool:
    try:
        fd = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    (folder / "probe").unlink()
    return True


def test_direct_shards_are_the_buffered_bytes(tmp_path):
    assert _direct_taken(tmp_path), f"the test needs a filesystem that takes O_DIRECT at {tmp_path}"
    f = open_shard_file(tmp_path / "x.tmp", "auto")
    assert isinstance(f, _DirectFile)  # auto is O_DIRECT where the filesystem takes it
    f.close()
    _write(tmp_path / "b", "buffered")
    _write(tmp_path / "d", "direct")
    buffered, direct = _shards(tmp_path / "b"), _shards(tmp_path / "d")
    assert len(direct) >= 6 and direct == buffered  # tails not a multiple of 4 KiB: truncated, never padded


def test_direct_file_writes_across_buffers_and_flushes_midway(tmp_path):
    """Pieces smaller and larger than the buffer, a flush (padded tail, truncated) in the middle, writes after it."""
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5, 512, 3 * 65536 + 17, 3, 200_000, 1000)]
    f = _DirectFile(tmp_path / "f.tmp", buffer_bytes=65536)
    for i, piece in enumerate(pieces):
        f.write(piece if i % 2 else piece.tobytes())
        if i == 2:
            f.flush()
            assert os.path.getsize(tmp_path / "f.tmp") == sum(p.size for p in pieces[:3])
    f.flush()
    os.fsync(f.fileno())
    f.close()
    assert (tmp_path / "f.tmp").read_bytes() == b"".join(p.tobytes() for p in pieces)


def test_a_write_the_device_refuses_goes_on_buffered_said_once(tmp_path, caplog):
    """A buffer of 4 KiB + 100 bytes: its writes are not block multiples, which O_DIRECT on a block device refuses
    (EINVAL); the file goes on buffered, with the same bytes, and the log says it once for every file."""
    assert _direct_taken(tmp_path)
    writer_mod._direct_refusals_said.clear()
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 50_000, dtype=np.uint8)
    with caplog.at_level(logging.WARNING, logger="dflash_prep"):
        for name in ("a.tmp", "b.tmp"):
            f = _DirectFile(tmp_path / name, buffer_bytes=4096 + 100)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            f.close()
            assert (tmp_path / name).read_bytes() == data.tobytes()
    said = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(said) == 1 and "a write" in said[0].getMessage()


def _mount(kind: str, folder: Path, *options: str) -> None:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", kind, *options, kind, str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a {kind} here (needs root): {done.stderr.strip()}")


def _umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], check=True)


def test_a_filesystem_that_refuses_o_direct_gets_buffered_shards_said_once(tmp_path, caplog):
    """ramfs refuses O_DIRECT at open (EINVAL), as tmpfs did before Linux 6.6: auto writes buffered there, same
    bytes as a buffered run elsewhere, and says so once however many shards."""
    folder = tmp_path / "ramfs"
    _mount("ramfs", folder)
    try:
        assert not _direct_taken(folder)
        writer_mod._direct_refusals_said.clear()
        with caplog.at_level(logging.WARNING, logger="dflash_prep"):
            _write(folder / "out", "auto")
        said = [r.getMessage() for r in caplog.records if "O_DIRECT" in r.getMessage()]
        assert len(said) == 1 and "ramfs" in said[0], said
        _write(tmp_path / "ref", "buffered")
        got = _shards(folder / "out")
        assert len(got) >= 6 and got == _shards(tmp_path / "ref")
    finally:
        _umount(folder)


def test_a_disk_filling_up_under_o_direct_leaves_only_committed_shards(tmp_path):
    """A real ENOSPC (a 3 MiB tmpfs, which takes O_DIRECT since Linux 6.6) mid-shard: raised once, the open shards
    dropped, every committed shard whole and listed."""
    folder = tmp_path / "small"
    _mount("tmpfs", folder, "-o", "size=3m")
    try:
        if not _direct_taken(folder):
            pytest.skip("this kernel's tmpfs refuses O_DIRECT (before Linux 6.6)")
        writer = AsyncShardWriter(lanes(folder, 0, 250_000, 0, 2, write_mode="direct"))
        raised = []
        try:
            for b in range(80):
                writer.submit(_pending(b, [200, 350]))
            writer.close()
        except OSError as e:
            raised.append(e)
        assert len(raised) == 1 and raised[0].errno == errno.ENOSPC
        writer.abort()
        assert len(_shards(folder)) >= 3
    finally:
        _umount(folder)


def test_the_gil_switch_interval_is_the_recipes_while_the_lanes_write_and_pythons_after(tmp_path, monkeypatch):
    """`output.switch_interval_seconds`: every batch is written under the recipe's interval (read inside the lane
    threads), the process's own interval is back once the run ends; null leaves Python's; out of range: refused."""
    import sys
    import threading

    from conftest import demo_overrides

    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import RecipeError, load_recipe
    from dflash_prep.store import writer as writer_module

    seen: list[float] = []
    original = writer_module.ShardWriter.write_batch

    def write_batch(self, *args, **kwargs):
        if threading.current_thread().name.startswith("shard-writer"):  # a lane (not plan's tar-size probe)
            seen.append(sys.getswitchinterval())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(writer_module.ShardWriter, "write_batch", write_batch)
    before = sys.getswitchinterval()
    run_extraction(load_recipe(None, demo_overrides(tmp_path / "a", **{"data.max_samples": 40,
                                                                       "output.switch_interval_seconds": 0.0007})))
    assert seen and set(seen) == {0.0007}, seen
    assert sys.getswitchinterval() == before
    seen.clear()
    run_extraction(load_recipe(None, demo_overrides(tmp_path / "b", **{"data.max_samples": 40})))
    assert seen and set(seen) == {before}
    for bad in ("0", "2", "nan"):
        with pytest.raises(RecipeError, match="output.switch_interval_seconds"):
            load_recipe(None, demo_overrides(tmp_path / "c", **{"output.switch_interval_seconds": bad}))

"""bench/disk_probe.py: its timeline arithmetic and its two-buffer O_DIRECT variant, which must write the bytes the
writer's own `_DirectFile` writes (else its figures would measure another file)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.disk_probe import _OverlappedDirectFile, _Timeline  # noqa: E402
from dflash_prep.store.writer import _DirectFile  # noqa: E402


def test_the_timeline_counts_overlapping_writes_once_for_busy_time_and_each_for_the_mean_in_flight():
    t = _Timeline()
    t.record("lane-a", 10.0, 11.0, 100)
    t.record("lane-b", 10.5, 11.5, 300)  # overlaps lane-a's first write by 0.5 s
    t.record("lane-a", 12.0, 13.0, 200)
    s = t.summary(10.0, 14.0)
    # busy: [10, 11.5] and [12, 13] = 2.5 s of 4; in flight: 3 s of writes over 4 s
    assert s["disk_busy_fraction"] == pytest.approx(2.5 / 4)
    assert s["mean_writes_in_flight"] == pytest.approx(3.0 / 4)
    assert s["lane_write_fraction"] == pytest.approx({"lane-a": 2.0 / 4, "lane-b": 1.0 / 4})
    assert s["median_write_bytes_per_second"] == pytest.approx(200.0)  # 100, 300, 200 bytes in 1 s each
    assert s["num_writes"] == 3 and s["median_write_bytes"] == 200


@pytest.mark.parametrize("sizes", [[5000, 70000, 3], [65536 * 3], [1, 65535, 65536, 100000, 7]])
def test_the_two_buffer_variant_writes_the_bytes_of_the_writers_direct_file(tmp_path, sizes):
    rng = np.random.default_rng(len(sizes))
    chunks = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    plain = _DirectFile(tmp_path / "plain.tmp", buffer_bytes=65536)  # OSError: the test needs O_DIRECT at tmp_path
    overlapped = _OverlappedDirectFile(tmp_path / "overlapped.tmp", 65536)
    for f in (plain, overlapped):
        for c in chunks:
            f.write(c)
        f.flush()
        f.close()
    expected = b"".join(chunks)
    assert (tmp_path / "overlapped.tmp").read_bytes() == expected
    assert (tmp_path / "plain.tmp").read_bytes() == expected
    assert os.path.getsize(tmp_path / "overlapped.tmp") == len(expected)

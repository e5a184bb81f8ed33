"""Figures for people: each size in the unit it calls for (the values below are worked out by hand)."""

from __future__ import annotations

import pytest

from dflash_prep.units import format_bytes, format_count, format_duration, format_rate


@pytest.mark.parametrize("value,text", [(0, "0 B"), (512, "512 B"), (1_000, "1.00 KB"), (3_212, "3.21 KB"),
                                        (94_970_000, "94.97 MB"), (999_999, "1.00 MB"), (1.4e9, "1.40 GB"),
                                        (2.6e12, "2.60 TB"), (5e18, "5000.00 PB")])
def test_bytes(value, text):
    assert format_bytes(value) == text


def test_rates_and_durations():
    assert format_rate(50e6) == "50.00 MB/s" and format_rate(1.4e9) == "1.40 GB/s"
    assert [format_duration(s) for s in (42, 4000, 18720, 354240)] == ["42.0 s", "66.7 min", "5.2 h", "4.1 days"]


@pytest.mark.parametrize("value,text", [(950, "950"), (252_000, "252K"), (1_500_000, "1.5M"), (8.03e9, "8.03B"),
                                        (26.9e9, "26.9B"), (999_700, "1M"), (12.5, "12.5")])
def test_counts(value, text):
    assert format_count(value) == text


def test_no_command_keeps_a_formatter_of_its_own():
    """One helper: no module of the package prints bytes as a fixed number of GB (a few MB read "0.0 GB") or
    defines its own size formatter (GPU memory, tens of GB, is said in whole GB)."""
    import re
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "dflash_prep"
    found = []
    for path in package.rglob("*.py"):
        text = path.read_text()
        if re.search(r"def _size\(n|/ 1e9:\.[12]f\} GB|/ 1e6:\.\df\} MB", text):
            found.append(path.name)
    assert found == [], found

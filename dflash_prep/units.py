"""Figures for people: bytes, rates, counts and durations in the unit their size calls for (the ground floor:
imports nothing of the package). Every command's console line uses these, so one size reads the same everywhere.

    format_bytes(94_970_000)      -> '94.97 MB'      decimal units (1 KB = 1000 B), as disks and stores count
    format_bytes(3_212)           -> '3.21 KB'
    format_rate(1.4e9)            -> '1.40 GB/s'
    format_count(252_000)         -> '252K'          parameters, tokens: K, M, B with 3 significant digits
    format_count(8.03e9)          -> '8.03B'
    format_duration(4_000)        -> '66.7 min'
"""

from __future__ import annotations

_BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
_COUNT_UNITS = ("", "K", "M", "B", "T")


def format_bytes(num_bytes: float) -> str:
    """`num_bytes` in B, KB, MB, GB, TB or PB (decimal), two decimals above bytes: '0 B', '512 B', '94.97 MB'."""
    n = float(num_bytes)
    for unit in _BYTE_UNITS:
        if abs(n) < 999.995 or unit == _BYTE_UNITS[-1]:
            return f"{int(round(n))} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_rate(bytes_per_second: float) -> str:
    """A write or read rate: `format_bytes` per second, e.g. '1.40 GB/s'."""
    return f"{format_bytes(bytes_per_second)}/s"


def format_count(count: float) -> str:
    """A count (parameters, tokens) with K, M, B or T and 3 significant digits: '950', '252K', '1.5M', '8.03B'."""
    n = float(count)
    for unit in _COUNT_UNITS:
        if abs(n) < 999.5 or unit == _COUNT_UNITS[-1]:
            if unit == "":
                return f"{n:.0f}" if n == int(n) else f"{n:.3g}"
            return f"{n:.3g}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """'42.0 s', '66.7 min', '5.2 h', '4.1 days'."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"

"""The one sample list every mode reads (a mode that stops early ran a prefix of it), and its parquet of
pre-tokenized rows for dflash-prep."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Samples:
    """The one sample list every mode reads (a mode that stops early ran a prefix of it)."""

    ids: list[str]  # "{i:010d}": dflash-prep's sample_id of row i of the data file the benchmark writes
    tokens: list[np.ndarray]  # int64 [T]
    lengths: np.ndarray  # int64 [n]
    params: dict

    def prefix_by_tokens(self, max_tokens: int) -> int:
        """Largest n such that the first n samples hold <= max_tokens real tokens (at least 1)."""
        return max(1, int(np.searchsorted(np.cumsum(self.lengths), max_tokens, side="right")))


def make_samples(n: int, mu: float, sigma: float, min_len: int, max_len: int, vocab: int, seed: int) -> Samples:
    """Lengths ~ round(lognormal(mu, sigma)) clipped to [min_len, max_len]; token ids uniform in [1, vocab)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), min_len, max_len).astype(np.int64)
    tokens = [rng.integers(1, vocab, size=int(L), dtype=np.int64) for L in lengths]
    params = {"distribution": "lognormal", "mu": mu, "sigma": sigma, "clip": [min_len, max_len], "seed": seed,
              "token_ids": f"uniform in [1, {vocab})", "num_samples": n,
              "num_tokens": int(lengths.sum()), "mean": float(lengths.mean()),
              "median": float(np.median(lengths)), "p90": float(np.percentile(lengths, 90)),
              "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()), "min": int(lengths.min()),
              "expected_mean_unclipped": math.exp(mu + sigma**2 / 2)}
    return Samples([f"{i:010d}" for i in range(n)], tokens, lengths, params)


def write_pretokenized(path: Path, samples: Samples, n: int) -> None:
    """Rows `id`, `input_ids`, `loss_mask` (all ones) as parquet: dflash-prep's pre-tokenized input."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [t.astype(np.int32) for t in samples.tokens[:n]]
    table = pa.table({
        "id": pa.array(samples.ids[:n], pa.string()),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array([np.ones(len(t), np.int8) for t in ids], pa.list_(pa.int8())),
    })
    pq.write_table(table, path)

"""Shard names carry the run id, so two runs writing into one folder (a lock that failed) can never overwrite each
other's shards; outputs with the names of earlier versions (`shard-NNNNNN.tar`) still resume, check, read, export
and verify, the new shards numbered after theirs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from conftest import demo_overrides, raw_records

from dflash_prep.commands.extract import main
from dflash_prep.commands.inspect import check_output
from dflash_prep.commands.verify.entry import main as verify_main
from dflash_prep.consume.export import export
from dflash_prep.consume.reader import ShardDataset
from dflash_prep.plan.batches import SampleInfo
from dflash_prep.store.manifest import read_committed
from dflash_prep.store.writer import AsyncShardWriter, PendingBatch, lanes

NEW_NAME = re.compile(r"^shard-(\d{6})-([0-9a-f]{8})\.tar$")
OLD_NAME = re.compile(r"^shard-(\d{6})\.tar$")


def _pending(batch_id: int, prefix: str) -> PendingBatch:
    T, width = 4, 8
    info = SampleInfo(f"{prefix}{batch_id:03d}", batch_id, None, np.arange(T, dtype=np.int32),
                      np.ones(T, np.uint8))
    states = torch.full((T, width), float(batch_id), dtype=torch.bfloat16)
    return PendingBatch(batch_id, [info], states, None, None, [1, 3])


def test_two_runs_writing_one_rank_folder_at_once_never_share_a_shard_file(tmp_path):
    """Two writers of rank 0 that both start at shard number 0 (what two runs resuming the same output do when no
    lock stops the second): every shard of each is committed under a name of its own."""
    writers = {run_id: AsyncShardWriter(lanes(tmp_path, 0, 1, first_shard_number=0, num_lanes=2, run_id=run_id))
               for run_id in ("0a0a0a0a", "0b0b0b0b")}
    for b in range(4):
        for run_id, writer in writers.items():
            writer.submit(_pending(b, run_id[:2]))
    for writer in writers.values():
        writer.close()
    committed = read_committed(tmp_path)
    names = sorted(Path(r.path).name for r in committed)
    assert len(committed) == 8 and len(set(names)) == 8
    assert sorted(p.name for p in (tmp_path / "shards" / "rank-00000").iterdir()) == names
    assert {NEW_NAME.match(n).group(2) for n in names} == {"0a0a0a0a", "0b0b0b0b"}
    for r in committed:  # each file holds what its own writer wrote
        assert r.sample_ids[0][:2] == NEW_NAME.match(Path(r.path).name).group(2)[:2]


SETTINGS = {"data.max_samples": 24, "batching.num_workers": 0, "output.max_shard_bytes": "1MB"}


def argv(out: Path) -> list[str]:
    return [a for kv in demo_overrides(out, **SETTINGS) for a in ("--set", kv)]


def _to_old_names(out: Path, keep: int) -> list[str]:
    """Rewrite a finished output as an earlier version left it unfinished: shards named `shard-NNNNNN.tar`, the
    first `keep` index records committed, the others' files gone, no manifest. -> the kept paths."""
    kept = []
    for index in sorted((out / "index").glob("rank-*.jsonl")):
        lines = []
        for line in index.read_text().splitlines():
            record = json.loads(line)
            path = out / record["path"]
            if len(kept) < keep:
                old = path.with_name(NEW_NAME.sub(r"shard-\1.tar", path.name))
                path.rename(old)
                record["path"] = str(old.relative_to(out))
                kept.append(record["path"])
                lines.append(json.dumps(record) + "\n")
            else:
                path.unlink()
        index.write_text("".join(lines))
    for name in ("manifest.json", "summary.json"):
        (out / name).unlink()
    for done in (out / "index").glob("*.done.json"):
        done.unlink()
    return kept


def test_an_output_with_the_names_of_an_earlier_version_resumes_checks_reads_and_exports(tmp_path):
    reference = tmp_path / "reference"
    assert main(argv(reference)) == 0
    expected = raw_records(reference)
    out = tmp_path / "out"
    assert main(argv(out)) == 0
    names = [Path(s["path"]).name for s in json.loads((out / "manifest.json").read_text())["shards"]]
    assert len(names) >= 4 and all(NEW_NAME.match(n) for n in names), names
    kept = _to_old_names(out, keep=2)
    assert main(argv(out)) == 0  # the resume: the missing batches redone beside the old-named shards
    paths = [s["path"] for s in json.loads((out / "manifest.json").read_text())["shards"]]
    old = [p for p in paths if OLD_NAME.match(Path(p).name)]
    new = [p for p in paths if NEW_NAME.match(Path(p).name)]
    assert sorted(old) == sorted(kept) and new and len(old) + len(new) == len(paths)
    max_old = max(int(OLD_NAME.match(Path(p).name).group(1)) for p in old)
    assert min(int(NEW_NAME.match(Path(p).name).group(1)) for p in new) > max_old  # numbered after the old ones
    assert raw_records(out) == expected  # the same samples, byte for byte
    assert check_output(out) == []  # `inspect --check`
    assert sorted(s["sample_id"] for s in ShardDataset(out)) == sorted(expected)
    report = export(out, "specforge", tmp_path / "specforge", progress=False)
    assert report.num_samples == len(expected)
    assert verify_main([str(out), "--num-samples", "4", "--no-noise-floor"]) == 0  # hashes, then 4 samples rerun

"""Tests for dflash_prep.consume.vocab: supervised-token frequencies stored with an output, and the d2t / t2d draft
vocabulary in the layouts speculators and SpecForge load.

Expected values are derived by hand (small tables) or by a different route (the shards' own input_ids and
loss_mask members read back with numpy), never by the counting code under test.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import raw_records
from safetensors.numpy import load_file

from dflash_prep.commands.cli import main as cli_main
from dflash_prep.consume.vocab import TOKEN_FREQ_NAME, count_supervised_tokens, draft_vocab

NUM_ROWS = 40


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    out = tmp_path_factory.mktemp("vocab") / "out"
    run_extraction(load_recipe(None, [f"output.dir={out}", f"data.max_samples={NUM_ROWS}", "data.max_length=256",
                                      "batching.max_tokens_per_batch=1024", "batching.num_workers=2"]))
    return out


def supervised_counts_from_shards(out: Path) -> Counter:
    """The supervised-token counts read back from the committed shards' members (an independent route)."""
    counts: Counter = Counter()
    for members in raw_records(out).values():
        ids = np.load(io.BytesIO(members["input_ids.npy"]))
        mask = np.load(io.BytesIO(members["loss_mask.npy"])).astype(bool)
        counts.update(int(t) for t in ids[mask])
    return counts


def test_stored_frequencies_equal_the_supervised_tokens_of_the_written_samples(output):
    manifest = json.loads((output / "manifest.json").read_text())
    stored = load_file(str(output / TOKEN_FREQ_NAME))["token_freq"]
    expected = supervised_counts_from_shards(output)
    assert stored.dtype == np.int64 and stored.shape == (manifest["token_freq"]["vocab_size"],)
    assert {int(t): int(stored[t]) for t in np.flatnonzero(stored)} == dict(expected)
    assert manifest["token_freq"]["num_supervised_tokens"] == sum(expected.values())
    assert manifest["token_freq"]["num_samples"] == manifest["num_samples"]


def test_counting_covers_only_the_listed_samples_and_only_loss_mask_ones():
    from datasets import Dataset

    rows = Dataset.from_dict({"sample_id": ["a", "b", "c"],
                              "input_ids": [[1, 2, 3, 3], [3, 4, 4, 9], [7, 7, 7, 7]],
                              "loss_mask": [[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]]})
    # a: 2, 3, 3 supervised; b: 3, 4, 9; c left out.
    expected = np.zeros(10, dtype=np.int64)
    expected[[2, 3, 4, 9]] = [1, 3, 1, 1]
    assert count_supervised_tokens(rows, 10, {"a", "b"}).tolist() == expected.tolist()
    expected[7] = 4
    assert count_supervised_tokens(rows, 10).tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        count_supervised_tokens(rows, 8, {"b"})


def test_draft_vocabulary_keeps_the_most_frequent_ids_with_offsets():
    counts = np.array([0, 5, 5, 1, 0, 9, 0, 0, 2, 0])
    # N=3: 5 (9), then 1 and 2 (5 each) -> sorted [1, 2, 5]; d2t = selected - arange = [1, 1, 3].
    d2t, t2d = draft_vocab(counts, 3)
    assert d2t.dtype == np.int64 and d2t.tolist() == [1, 1, 3]
    assert t2d.dtype == np.bool_ and np.flatnonzero(t2d).tolist() == [1, 2, 5]
    # N=6: the 5 ids that occur, then the smallest id that does not (0) -> [0, 1, 2, 3, 5, 8].
    d2t, t2d = draft_vocab(counts, 6)
    assert d2t.tolist() == [0, 0, 0, 0, 1, 3] and np.flatnonzero(t2d).tolist() == [0, 1, 2, 3, 5, 8]
    # a tie at the cut goes to the smaller id: N=2 takes 5 and 1, not 2.
    assert np.flatnonzero(draft_vocab(counts, 2)[1]).tolist() == [1, 5]
    with pytest.raises(ValueError, match="1 to 10"):
        draft_vocab(counts, 11)


def test_vocab_command_writes_what_speculators_and_specforge_load(output, tmp_path, capsys):
    size = 64
    assert cli_main(["vocab", str(output), "--size", str(size), "--dest", str(tmp_path / "v")]) == 0
    assert "covering" in capsys.readouterr().out
    vocab_size = json.loads((output / "manifest.json").read_text())["token_freq"]["vocab_size"]
    expected = supervised_counts_from_shards(output)
    top = sorted(expected, key=lambda t: (-expected[t], t))[:size]
    if len(top) < size:  # padding: the smallest ids that never occur
        top += [t for t in range(vocab_size) if t not in expected][:size - len(top)]
    top = sorted(top)

    # speculators (scripts/train.py): np.load + torch.from_numpy; draft index i -> target i + d2t[i].
    d2t = torch.from_numpy(np.load(tmp_path / "v" / "speculators" / "d2t.npy"))
    t2d = torch.from_numpy(np.load(tmp_path / "v" / "speculators" / "t2d.npy"))
    assert d2t.dtype == torch.int64 and d2t.shape == (size,)
    assert t2d.dtype == torch.bool and t2d.shape == (vocab_size,)
    assert (torch.arange(size) + d2t).tolist() == top == torch.nonzero(t2d).flatten().tolist()
    freq = torch.load(tmp_path / "v" / "speculators" / "token_freq.pt", weights_only=True)
    assert freq == dict(expected)

    # SpecForge (draft model load_vocab_mapping): torch.load, then copy_ into the d2t / t2d buffers.
    mapping = torch.load(tmp_path / "v" / "specforge" / "vocab_mapping.pt", weights_only=True)
    d2t_buffer, t2d_buffer = torch.zeros(size, dtype=torch.int64), torch.zeros(vocab_size, dtype=torch.bool)
    d2t_buffer.copy_(mapping["d2t"])
    t2d_buffer.copy_(mapping["t2d"])
    assert torch.equal(d2t_buffer, d2t) and torch.equal(t2d_buffer, t2d)


def test_vocab_command_refuses_a_bad_size_or_a_missing_file_with_exit_2(output, tmp_path, capsys):
    assert cli_main(["vocab", str(output), "--size", "0", "--dest", str(tmp_path / "v")]) == 2
    assert cli_main(["vocab", str(tmp_path), "--size", "8"]) == 2
    err = capsys.readouterr().err
    assert "--size 0" in err and "manifest.json not found" in err and "Traceback" not in err


def test_vocab_refuses_an_output_whose_manifest_is_damaged(output, tmp_path, capsys):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    (copy / "manifest.json").write_bytes((copy / "manifest.json").read_bytes()[:100])
    assert cli_main(["vocab", str(copy), "--size", "8", "--dest", str(tmp_path / "v")]) == 2
    assert "manifest.json is damaged" in capsys.readouterr().err and not (tmp_path / "v").exists()

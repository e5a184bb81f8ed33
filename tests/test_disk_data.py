"""A `save_to_disk` folder as `data.path`: its tokenization cache is keyed on the bytes of the files
`load_from_disk` reads and lives in the project's cache, never in the folder (a hand-edited folder gives its new
rows, and nothing is written into it); a damaged or incomplete folder, and an unfinished regeneration output, are
refused with one line and exit code 2 before any output is claimed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO, raw_records

from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main

NUM_ROWS = 16
SETTINGS = ["--set", "batching.num_workers=0", "--set", "batching.max_tokens_per_batch=4096",
            "--set", "output.max_shard_bytes=100KB", "--set", "output.num_writer_threads=1"]


def argv(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--set", f"output.dir={out}", "--set", f"data.path={data}", *SETTINGS, *extra]


def demo_rows() -> list[dict]:
    lines = (DEMO / "data" / "conversations.jsonl").read_text().splitlines()[:NUM_ROWS]
    return [json.loads(line) for line in lines]


@pytest.fixture
def folder(tmp_path) -> Path:
    """The first NUM_ROWS demo conversations saved with `Dataset.save_to_disk`."""
    import datasets

    path = tmp_path / "rows"
    datasets.Dataset.from_list(demo_rows()).save_to_disk(str(path))
    return path


def files_of(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def decoded(out: Path, sample_id: str) -> str:
    import io

    from transformers import AutoTokenizer

    ids = np.load(io.BytesIO(raw_records(out)[sample_id]["input_ids.npy"]))
    return AutoTokenizer.from_pretrained(DEMO / "tokenizer").decode(ids.tolist())


def first_text(rows: list[dict], i: int) -> tuple[str, str]:
    """(a phrase of row i's first assistant turn, the same phrase with one word changed, same length)."""
    turns = rows[i].get("messages") or rows[i].get("conversations")
    text = next(t.get("content") or t.get("value") for t in turns if t.get("role", t.get("from")) in ("assistant", "gpt"))
    word = next(w for w in text.split() if len(w) >= 5 and w.isalpha())
    return word, "Z" * len(word)


def replace_in_rows(rows: list[dict], i: int, old: str, new: str) -> list[dict]:
    rows = json.loads(json.dumps(rows))
    rows[i] = json.loads(json.dumps(rows[i]).replace(old, new))
    return rows


@pytest.mark.slow
def test_a_hand_edited_folder_gives_its_new_rows_and_nothing_is_written_into_it(tmp_path, folder):
    """The edit replaces the folder's Arrow file with the edited rows' and keeps `state.json` (its fingerprint): what
    a hand edit, a tool writing the Arrow file itself, or a copy of another save over it leave."""
    import datasets

    before = files_of(folder)
    assert main(argv(tmp_path / "first", folder)) == 0
    assert files_of(folder) == before, "the extraction wrote into the data folder"
    rows = demo_rows()
    old, new = first_text(rows, 5)
    assert old in decoded(tmp_path / "first", "0000000005")
    edited = tmp_path / "edited"
    datasets.Dataset.from_list(replace_in_rows(rows, 5, old, new)).save_to_disk(str(edited))
    (arrow,) = [name for name in before if name.endswith(".arrow")]
    shutil.copyfile(edited / arrow, folder / arrow)  # state.json (and its fingerprint) stays as it was
    assert main(argv(tmp_path / "second", folder)) == 0
    text = decoded(tmp_path / "second", "0000000005")
    assert new in text and old not in text
    assert set(files_of(folder)) == set(before), "the extraction wrote into the data folder"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_folder_missing_a_listed_arrow_file_is_refused_before_the_output_is_claimed(tmp_path, folder, capsys):
    (arrow,) = folder.glob("*.arrow")
    arrow.unlink()
    assert main(argv(tmp_path / "out", folder)) == EXIT_BAD_RECIPE
    line = one_error_line(capsys)
    assert "damaged or incomplete" in line and arrow.name in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "no_data_files"])
def test_a_damaged_state_json_is_refused_before_the_output_is_claimed(tmp_path, folder, capsys, damage):
    state = folder / "state.json"
    if damage == "truncated":
        state.write_bytes(state.read_bytes()[:25])
    else:
        state.write_text(json.dumps({**json.loads(state.read_text()), "_data_files": []}))
    assert main(argv(tmp_path / "out", folder)) == EXIT_BAD_RECIPE
    line = one_error_line(capsys)
    assert "damaged or incomplete" in line and "state.json" in line
    assert not (tmp_path / "out").exists()


def test_a_damaged_arrow_file_is_refused_before_the_output_is_claimed(tmp_path, folder, capsys):
    (arrow,) = folder.glob("*.arrow")
    arrow.write_bytes(b"not an arrow stream" * 10)
    assert main(argv(tmp_path / "out", folder)) == EXIT_BAD_RECIPE
    assert arrow.name in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["auto", "disk"])
def test_an_unfinished_regeneration_folder_is_named_as_such(tmp_path, capsys, fmt):
    """What a regeneration leaves before its end (regen/output.py's layout): its run_state.json, committed shards
    under data/, index lines, no state.json yet."""
    import datasets

    unfinished = tmp_path / "regenerated"
    datasets.Dataset.from_list(demo_rows()[:4]).save_to_disk(str(tmp_path / "chunk"))
    (unfinished / "data").mkdir(parents=True)
    shutil.copyfile(next((tmp_path / "chunk").glob("*.arrow")), unfinished / "data" / "shard-000000.arrow")
    (unfinished / "index").mkdir()
    (unfinished / "index" / "rank-00000.jsonl").write_text(json.dumps({"shard": "data/shard-000000.arrow"}) + "\n")
    (unfinished / "run_state.json").write_text(json.dumps({"format": "dflash-prep regenerated rows", "identity": {},
                                                           "rows_per_shard": 4, "runs": []}))
    assert main(argv(tmp_path / "out", unfinished, "--set", f"data.format={fmt}")) == EXIT_BAD_RECIPE
    line = one_error_line(capsys)
    assert "unfinished regeneration output" in line and "regenerate" in line
    assert "format" not in line.replace("regeneration output", "")  # no hint toward data.format
    assert not (tmp_path / "out").exists()

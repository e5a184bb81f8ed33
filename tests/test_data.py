"""Data: every accepted layout and file format, the assistant-only mask, truncation/skip, counted skips."""

from __future__ import annotations

import json

import datasets
import pytest

from conftest import DEMO
from dflash_prep.data import (SKIP_NO_SUPERVISED_PAIR, SKIP_OUT_OF_VOCAB, SKIP_TOO_LONG, load_rows,
                              tokenize_dataset)
from dflash_prep.recipe import DataSection, RecipeError


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO / "tokenizer")


CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4, which is an even number."}]


def test_messages_and_sharegpt_give_the_same_tokens_and_an_assistant_only_mask(tmp_path, tokenizer):
    share = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
             for m in CONV]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": CONV}) + "\n")
    path2 = tmp_path / "rows2.jsonl"
    path2.write_text(json.dumps({"id": "b", "conversations": share}) + "\n")
    a = tokenize_dataset(load_rows(DataSection(path=str(path))), tokenizer, DataSection(path=str(path)), 1024).kept[0]
    b = tokenize_dataset(load_rows(DataSection(path=str(path2))), tokenizer, DataSection(path=str(path2)), 1024).kept[0]
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]
    assert a["source_id"] == "a" and a["sample_id"] == "0000000000"
    supervised = tokenizer.decode([t for t, m in zip(a["input_ids"], a["loss_mask"]) if m])
    assert supervised == "2 + 2 = 4, which is an even number.<|im_end|>"


def test_pretokenized_rows_parquet_and_save_to_disk(tmp_path, tokenizer):
    rows = {"input_ids": [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1, 2000]],
            "loss_mask": [[0, 1, 1, 0], [1, 0], [1, 1, 1], [1, 1]]}
    ds = datasets.Dataset.from_dict(rows)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for section in (DataSection(path=str(tmp_path / "rows.parquet")), DataSection(path=str(tmp_path / "saved"))):
        out = tokenize_dataset(load_rows(section), tokenizer, section, vocab_size=1024)
        assert [r["input_ids"] for r in out.kept] == [[5, 6, 7, 8], [11, 12, 13]]
        assert out.skipped_counts == {SKIP_NO_SUPERVISED_PAIR: 1, SKIP_OUT_OF_VOCAB: 1}
        assert [r["sample_id"] for r in out.skipped_rows] == ["0000000001", "0000000003"]


def test_max_length_truncates_or_skips_and_max_samples(tmp_path, tokenizer):
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(1, 21)), list(range(1, 6)), [1, 2, 3]]})
    ds.to_json(str(tmp_path / "rows.jsonl"))
    trunc = DataSection(path=str(tmp_path / "rows.jsonl"), max_length=8)
    out = tokenize_dataset(load_rows(trunc), tokenizer, trunc, 1024)
    assert [len(r["input_ids"]) for r in out.kept] == [8, 5, 3] and out.skipped_counts == {}
    skip = DataSection(path=str(tmp_path / "rows.jsonl"), max_length=8, overlong="skip", max_samples=2)
    out = tokenize_dataset(load_rows(skip), tokenizer, skip, 1024)
    assert out.num_rows == 2 and [r["source_row"] for r in out.kept] == [1]
    assert out.skipped_counts == {SKIP_TOO_LONG: 1}


def test_bad_paths_and_templates_fail_naming_the_key(tmp_path, tokenizer):
    with pytest.raises(RecipeError, match="`data.path`"):
        load_rows(DataSection(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(RecipeError, match="`data.path`"):
        load_rows(DataSection(path=str(tmp_path / "notes.txt")))
    tokenizer_without_template = tokenizer.__class__.from_pretrained(DEMO / "tokenizer")
    tokenizer_without_template.chat_template = None
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n")
    with pytest.raises(RecipeError, match="no chat template"):
        tokenize_dataset(load_rows(DataSection(path=str(path))), tokenizer_without_template,
                         DataSection(path=str(path)), 1024)

"""Data: every accepted layout and file format, the assistant-only mask, truncation/skip, counted skips."""

from __future__ import annotations

import json

import datasets
import pytest
from conftest import DEMO

from dflash_prep.data.rows import SKIP_NO_SUPERVISED_PAIR, SKIP_OUT_OF_VOCAB, SKIP_TOO_LONG, load_rows, tokenize_dataset
from dflash_prep.recipe.schema import DataSection, RecipeError


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


# ------------------------------------------------------------------------------- bad input: only the bad row
def _outcomes(path, tokenizer) -> tuple[list[str], dict[str, str]]:
    section = DataSection(path=str(path))
    out = tokenize_dataset(load_rows(section), tokenizer, section, 1024)
    return list(out.kept["source_id"]), {r["source_id"]: r["reason"] for r in out.skipped_rows}


def test_a_line_that_is_not_utf8_is_skipped_never_repaired(tmp_path, tokenizer):
    good = json.dumps({"id": "good", "messages": CONV}).encode()
    bad = json.dumps({"id": "bad", "messages": CONV}).encode().replace(b"Be brief.", b"Be \xff brief.")
    path = tmp_path / "rows.jsonl"
    path.write_bytes(good + b"\n" + bad + b"\n" + good.replace(b'"good"', b'"good2"') + b"\n")
    kept, skipped = _outcomes(path, tokenizer)
    assert kept == ["good", "good2"] and skipped == {None: "invalid_utf8"}  # the bad line's id is unreadable too


def test_a_lone_surrogate_in_a_row_skips_that_row_only(tmp_path, tokenizer):
    lines = [json.dumps({"id": "good", "messages": CONV}), '{"id": "x\\udc00", "messages": ' + json.dumps(CONV) + "}",
             json.dumps({"id": "pair \ud83d\ude00", "messages": CONV})]  # a valid surrogate pair is an emoji
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    kept, skipped = _outcomes(path, tokenizer)
    assert kept == ["good", "pair 😀"] and list(skipped.values()) == ["invalid_utf8"]


def test_one_bad_token_id_or_mask_value_skips_only_its_row(tmp_path, tokenizer):
    good = [{"id": f"g{i}", "input_ids": [5, 6, 7 + i % 100], "loss_mask": [0, 1, 1]} for i in range(300)]
    bad = [{"id": "float", "input_ids": [5, 5.5, 7]}, {"id": "huge", "input_ids": [5, 2**64, 7]},
           {"id": "half", "input_ids": [5, 6, 7], "loss_mask": [0, 0.5, 1]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good[:150] + bad + good[150:]))
    kept, skipped = _outcomes(path, tokenizer)
    assert kept == [r["id"] for r in good]
    assert skipped == {"float": "bad_input_ids", "huge": "token_id_out_of_vocab", "half": "bad_loss_mask"}


def test_a_template_with_a_jinja_syntax_error_is_one_line_naming_the_key_and_line():
    from dflash_prep.data.rows import check_chat_template

    template = "{% for m in messages %}\n{{ m.content }\n{% endfor %}"
    with pytest.raises(RecipeError, match=r"`data\.chat_template`: the chat template is not valid Jinja \(line 2"):
        check_chat_template(None, template)


@pytest.mark.parametrize("rows,says", [
    ([{"input_ids": [1, 2, 3.5], "loss_mask": [0, 1, 1]}, {"input_ids": [4, 5], "loss_mask": [1, 1]}],
     "token ids or masks typed as floats"),
    ([{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
       "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
      {"tools": [], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y"}]}],
     "tool schemas typed as a table column"),
])
def test_a_file_read_line_by_line_says_what_one_table_would_have_lost(tmp_path, caplog, rows, says):
    """The note names the loss this file has, not every loss a file could have (chat rows have no token ids)."""
    import json
    import logging

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="dflash_prep"):
        assert len(load_rows(DataSection(path=str(path)))) == 2
    notes = [r.getMessage() for r in caplog.records if "reading it line by line" in r.getMessage()]
    assert len(notes) == 1 and says in notes[0], notes
    assert ("floats" in notes[0]) == ("floats" in says)

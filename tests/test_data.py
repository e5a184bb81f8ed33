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


# ------------------------------------------------------------------------------- data.path lists, details, kinds
def test_data_path_as_a_list_of_files_reads_them_in_order_and_refuses_a_file_named_twice(tmp_path, tokenizer):
    from dflash_prep.recipe.schema import load_recipe

    for name, ids in (("a.jsonl", [[5, 6, 7]]), ("b.jsonl", [[8, 9], [10, 11]])):
        (tmp_path / name).write_text("".join(json.dumps({"input_ids": i}) + "\n" for i in ids))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: {config: cfg.json, tokenizer: tok}\ndata:\n  path: [b.jsonl, a.jsonl]\n")
    section = load_recipe(recipe).data
    assert section.path == [str(tmp_path / "b.jsonl"), str(tmp_path / "a.jsonl")]  # relative to the recipe
    out = tokenize_dataset(load_rows(section), tokenizer, section, 1024)
    assert [r["input_ids"] for r in out.kept] == [[8, 9], [10, 11], [5, 6, 7]]
    twice = DataSection(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "*.jsonl")])
    with pytest.raises(RecipeError, match=r"a\.jsonl is named twice \(its rows would repeat\)"):
        load_rows(twice)
    with pytest.raises(RecipeError, match="`data.path`"):
        load_recipe(recipe, ["data.path=[]"])


def test_every_skipped_row_carries_its_detail(tmp_path, tokenizer):
    lines = [{"id": "ok", "messages": CONV}, {"id": "glaive", "system": "SYSTEM: hi", "chat": "USER: hi"},
             {"id": "role", "messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
             {"id": "oov", "input_ids": [1, 5000]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "not json\n")
    section = DataSection(path=str(path))
    out = tokenize_dataset(load_rows(section), tokenizer, section, 1024)
    details = {r["source_id"]: (r["reason"], r["detail"]) for r in out.skipped_rows}
    assert details == {
        "glaive": ("no_messages_conversations_or_input_ids",
                   "no `messages`, `conversations` or `input_ids` column (the row has: chat, id, system); convert such "
                   "rows first (docs/FORMAT.md, \"Rows without a conversation column\")"),
        "role": ("unknown_role", "turn 0 has role 'narrator' (known: system, developer, user, human, assistant, gpt, "
                 "model, tool, function, ipython, observation, function_call)"),
        "oov": ("token_id_out_of_vocab", "token id 5000 at position 1 is outside 0..1023"),
        None: ("invalid_json", "the line is not JSON (Expecting value: line 1 column 1 (char 0))")}


def _kind_rows(tmp_path, rows_: list[dict]):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return path


REASONING = {"messages": [{"role": "user", "content": "Why?"},
                          {"role": "assistant", "content": "Because it is so.", "reasoning_content": "Think first."}]}
TOOL_CALL = {"messages": [{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                          {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny today."}]}


def test_a_whole_kind_of_row_lost_is_a_warning_with_counts_or_a_stop_with_data_strict(tmp_path, tokenizer, caplog):
    """The demo template renders neither reasoning nor tool calls (a null content fails in it): the rows with
    reasoning are kept without it, those with tool calls skipped; under max_skipped_fraction either way."""
    import logging

    from dflash_prep.data.rows import NothingToExtractError, check_data_verdict

    path = _kind_rows(tmp_path, [{"messages": CONV}] * 6 + [REASONING] * 2 + [TOOL_CALL])
    section = DataSection(path=str(path))
    data = tokenize_dataset(load_rows(section), tokenizer, section, 1024)
    assert data.kinds == {"tool_calls": {"rows": 1, "kept_rendered": 0, "kept_without": 0,
                                         "skipped": {"chat_template_error": 1}},
                          "reasoning": {"rows": 2, "kept_rendered": 0, "kept_without": 2, "skipped": {}}}
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.rows"):
        assert check_data_verdict(data, section) == "9 rows: 8 kept, 1 skipped"
    (warning,) = [m for m in caplog.messages if "every row with" in m]
    assert warning == (
        "data: every row with tool calls is lost: of 1 such rows, 1 skipped (chat_template_error 1) and 0 kept with "
        "a rendering without their tool calls (the chat template drops them); every row with reasoning is lost: of 2 "
        "such rows, 0 skipped and 2 kept with a rendering without their reasoning (the chat template drops them); "
        "set data.strict: true to stop instead")
    with pytest.raises(NothingToExtractError, match=r"^every row with tool calls is lost: .* \(data\.strict: true\)"):
        check_data_verdict(data, DataSection(path=str(path), strict=True))


def test_a_kind_rendered_in_some_row_is_not_lost(tmp_path, tokenizer, caplog):
    import logging

    import chat_templates as T

    from dflash_prep.data.rows import check_data_verdict

    path = _kind_rows(tmp_path, [REASONING, TOOL_CALL, {"messages": CONV}])
    section = DataSection(path=str(path), chat_template=T.QWEN3, strict=True)
    data = tokenize_dataset(load_rows(section), tokenizer, section, 1024)
    assert data.kinds["reasoning"]["kept_rendered"] == 1 and data.kinds["tool_calls"]["kept_rendered"] == 1
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.rows"):
        check_data_verdict(data, section)
    assert not [m for m in caplog.messages if "every row with" in m]


@pytest.mark.parametrize("layout", ["jsonl_tools_column", "parquet_messages_as_json_text"])
def test_a_second_tokenization_reads_the_map_from_the_cache(tmp_path, tokenizer, monkeypatch, layout):
    """Rows a JSON table would distort (a `tools` column of structs: read line by line) and parquet rows holding
    `messages` as JSON text: the second `tokenize_dataset` (a second plan, a resume) calls the tokenize function on
    no row and writes no cache file: the map is read back from the datasets cache."""
    import datasets

    from dflash_prep.data import rows as D

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    records = [{"id": str(i), "tools": tools, "messages": CONV} for i in range(300)]
    if layout == "jsonl_tools_column":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path = tmp_path / "rows.parquet"
        datasets.Dataset.from_list([{k: v if k == "id" else json.dumps(v) for k, v in r.items()}
                                    for r in records]).to_parquet(str(path))
    calls = []
    original = D.Tokenizer.__call__
    monkeypatch.setattr(D.Tokenizer, "__call__", lambda self, batch, indices: calls.append(len(indices))
                        or original(self, batch, indices))
    section = DataSection(path=str(path))
    outcomes, cache_files = [], []
    for _ in range(2):
        rows_ = load_rows(section)
        if layout == "jsonl_tools_column":
            assert rows_.column_names == [D.RAW_JSON_COLUMN]  # the line-by-line path
        calls.clear()
        data = tokenize_dataset(rows_, tokenizer, section, 1024)
        outcomes.append((sum(calls), len(data.kept), data.kept["loss_mask"][0]))
        cache_files.append(sorted(p.name for p in (tmp_path / "cache").rglob("*.arrow")))
    assert outcomes[0][:2] == (300, 300) and outcomes[1][:2] == (0, 300) and outcomes[0][2] == outcomes[1][2]
    assert cache_files[0] == cache_files[1] and any(n.startswith("cache-") for n in cache_files[0])


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


def test_an_unfinished_regeneration_folder_is_refused_as_what_it_is(tmp_path, capsys):
    """A `dflash-prep regenerate` output whose run has not written its dataset files yet, given as `data.path`: one
    line saying what it is and how to finish it (exit code 2 from `plan`, before any output folder is made)."""
    from dflash_prep.commands.plan import main as plan_main
    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.regen import output as regen_output

    folder = tmp_path / "regenerated"
    folder.mkdir()
    regen_output.record_run(folder, {"engine_kind": "openai"}, 2, load_recipe(None).to_yaml())  # the run's state
    (folder / "shards").mkdir()
    (folder / "shards" / "chunk-000000.arrow").write_bytes(b"\0" * 8)  # a committed chunk, no dataset files yet
    out = tmp_path / "states"
    assert plan_main(["--set", f"data.path={folder}", "--set", f"output.dir={out}"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert "an unfinished regeneration output" in line and "formats" not in line, line
    assert not out.exists()

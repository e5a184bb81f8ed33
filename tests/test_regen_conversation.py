"""The regeneration's rules without a server: which turns are asked for, tool calls, finish reasons, seeds, the
sampling parameters from generation_config.json, the recipe section, and the output folder's commits and repair.

The answers here are written by the test (they stand for what an engine returns); what is checked is what the
rules make of them."""

from __future__ import annotations

import json

import pytest

from dflash_prep.data.rows import load_rows
from dflash_prep.recipe.schema import DataSection, RecipeError, load_recipe
from dflash_prep.regen import output
from dflash_prep.regen.conversation import (
    OTHER_CALLS_ENDED,
    OTHER_CALLS_LAST,
    SAME_CALLS,
    SKIP_LENGTH,
    SKIP_NO_PROMPT,
    SKIP_PRETOKENIZED,
    SKIP_REJECTED,
    Conversation,
    RegenSettings,
    generated_positions,
    request_seed,
)
from dflash_prep.regen.engine import Answer
from dflash_prep.regen.sampling import read_generation_defaults, resolve_sampling


def settings(turns="all", on_length="keep", sampling=None) -> RegenSettings:
    return RegenSettings(turns=turns, sampling=sampling or {}, max_tokens=16, chat_template_kwargs={},
                         on_length=on_length, seed=7)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
TOOL_ROW = {"id": "w", "tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
    {"role": "assistant", "content": "18 C."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome."}]}


def test_which_turns_are_generated():
    u, a, s, t = ({"role": r, "content": "x"} for r in ("user", "assistant", "system", "tool"))
    assert generated_positions([s, u, a, u, a], "all") == [2, 4]
    assert generated_positions([s, u, a, u, a], "last") == [4]
    assert generated_positions([u], "last") == [1]  # a prompt alone: its answer is appended
    assert generated_positions([u, a, u], "all") == [1, 3]
    assert generated_positions([a, u, a], "all") == [2]  # the opening greeting has no prompt: kept
    assert generated_positions([u, a, t], "last") == [3]
    assert generated_positions([s, a], "all") == []


def test_rows_that_cannot_be_regenerated_are_skipped_with_a_reason():
    st = settings()
    assert Conversation.of_row({"input_ids": [1, 2, 3]}, 0, st) == SKIP_PRETOKENIZED
    assert Conversation.of_row({"messages": [{"role": "system", "content": "s"}]}, 0, st) == SKIP_NO_PROMPT
    assert Conversation.of_row({"messages": "nope"}, 0, st) == "malformed_conversation"
    assert Conversation.of_row({"messages": [{"role": "narrator", "content": "x"}]}, 0, st) == "unknown_role"


def test_sharegpt_prompt_only_row_asks_for_one_answer_with_its_seed():
    conv = Conversation.of_row({"id": 5, "conversations": [{"from": "human", "value": "Hi"}]}, 3, settings())
    request = conv.next_request()
    assert request.messages == [{"role": "user", "content": "Hi"}]
    assert request.seed == request_seed(7, 3, 1) and request.max_tokens == 16 and request.sampling == {}
    conv.accept(Answer(content="Hello!", finish_reason="stop", prompt_tokens=4, completion_tokens=3))
    assert conv.done and conv.next_request() is None
    row = conv.result({"engine": "e"})
    assert row["id"] == "5" and row["source_row"] == 3
    assert [(m["role"], m["content"]) for m in row["messages"]] == [("user", "Hi"), ("assistant", "Hello!")]
    assert row["regen"]["turns"] == [{"message_index": 1, "finish_reason": "stop", "prompt_tokens": 4,
                                      "completion_tokens": 3, "seed": request_seed(7, 3, 1),
                                      "prompt_token_ids": None, "completion_token_ids": None}]


def test_seeds_are_stable_and_differ_by_row_turn_and_recipe_seed():
    seeds = {request_seed(s, p, i) for s in (0, 1) for p in range(50) for i in range(4)}
    assert len(seeds) == 400 and all(0 <= x < 2 ** 31 for x in seeds)
    assert request_seed(0, 1, 2) == request_seed(0, 1, 2)


def test_all_turns_go_on_from_the_generated_ones():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]}
    conv = Conversation.of_row(row, 0, settings("all"))
    assert conv.next_request().messages == [{"role": "user", "content": "a"}]
    conv.accept(Answer(content="new A"))
    assert conv.next_request().messages == [{"role": "user", "content": "a"},
                                            {"role": "assistant", "content": "new A"},
                                            {"role": "user", "content": "b"}]
    conv.accept(Answer(content="new B"))
    assert [m["content"] for m in conv.result({})["messages"]] == ["a", "new A", "b", "new B"]
    last = Conversation.of_row(row, 0, settings("last"))
    assert [m["content"] for m in last.next_request().messages] == ["a", "A", "b"]  # earlier turns kept


def test_same_tool_calls_go_on_with_the_data_results_pointing_at_the_new_call_ids():
    conv = Conversation.of_row(TOOL_ROW, 0, settings("all"))
    same = [{"id": "new-1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\":  \"Paris\"}"}}]  # same JSON value
    conv.accept(Answer(content=None, tool_calls=same, finish_reason="tool_calls"))
    request = conv.next_request()
    assert request.tools == [WEATHER]
    assert request.messages[-1] == {"role": "tool", "tool_call_id": "new-1", "content": "18C"}
    conv.accept(Answer(content="It is 18 C."))
    conv.accept(Answer(content="Bye."))
    assert conv.done and conv.tool_calls == {SAME_CALLS: 1} and conv.ended_early is None
    row = conv.result({})
    assert json.loads(row["tools"]) == [WEATHER]
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]


@pytest.mark.parametrize("calls, content", [
    ([{"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}], None),
    (None, "I cannot look that up."),  # text where the data called a tool
])
def test_other_tool_calls_end_the_conversation_there(calls, content):
    conv = Conversation.of_row(TOOL_ROW, 0, settings("all"))
    conv.accept(Answer(content=content, tool_calls=calls))
    assert conv.done and conv.ended_early == OTHER_CALLS_ENDED and conv.tool_calls == {OTHER_CALLS_ENDED: 1}
    assert [m["role"] for m in conv.result({})["messages"]] == ["user", "assistant"]


def test_a_tool_call_where_the_data_answered_in_text_ends_it_and_the_last_turn_is_only_counted():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]}
    call = [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    conv = Conversation.of_row(row, 0, settings("all"))
    conv.accept(Answer(content=None, tool_calls=call))
    assert conv.done and conv.ended_early == OTHER_CALLS_ENDED
    last = Conversation.of_row(row, 0, settings("last"))
    last.accept(Answer(content=None, tool_calls=call))
    assert last.done and last.ended_early is None and last.tool_calls == {OTHER_CALLS_LAST: 1}


def test_a_turn_of_reasoning_only_gets_empty_text_and_the_extraction_keeps_it():
    from dflash_prep.data.chat import row_to_chat

    conv = Conversation.of_row({"messages": [{"role": "user", "content": "q"}]}, 0, settings("last"))
    conv.accept(Answer(content=None, reasoning_content="thinking...", finish_reason="length"))
    row = conv.result({})
    assert row["messages"][1]["content"] == "" and row["messages"][1]["reasoning_content"] == "thinking..."
    messages, _ = row_to_chat(row)
    assert messages[1]["reasoning_content"] == "thinking..."


def test_length_keep_drop_and_rejections():
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "b"}, {"role": "assistant", "content": "B"}]}
    keep = Conversation.of_row(row, 0, settings("all", "keep"))
    keep.accept(Answer(content="cut", finish_reason="length"))
    assert not keep.done  # the conversation goes on
    drop = Conversation.of_row(row, 0, settings("all", "drop"))
    drop.accept(Answer(content="cut", finish_reason="length"))
    assert drop.done and drop.skip_reason == SKIP_LENGTH
    rejected = Conversation.of_row(row, 0, settings("all"))
    rejected.accept(Answer(rejected="HTTP 400: too long"))
    assert rejected.done and rejected.skip_reason == SKIP_REJECTED and rejected.skip_detail == "HTTP 400: too long"


def test_sampling_comes_from_generation_config_and_the_recipe_overrides_it(tmp_path):
    from transformers import GenerationConfig

    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.95, top_k=20).save_pretrained(tmp_path / "m")
    defaults, where = read_generation_defaults(str(tmp_path / "m"))
    assert defaults["temperature"] == 0.6 and defaults["top_p"] == 0.95 and defaults["top_k"] == 20
    assert resolve_sampling(defaults, {}) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert resolve_sampling(defaults, {"temperature": 1.0, "min_p": 0.05}) == {
        "temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05}
    assert resolve_sampling(defaults, {"temperature": 0}) == {}  # greedy
    GenerationConfig(max_new_tokens=5).save_pretrained(tmp_path / "greedy")
    assert read_generation_defaults(str(tmp_path / "greedy" / "generation_config.json"))[0] == {}
    assert read_generation_defaults(str(tmp_path / "none"))[0] == {}


@pytest.mark.parametrize("override, key", [
    ("regenerate.engine=vllm", "regenerate.engine"),
    ("regenerate.engine=openai", "regenerate.base_urls"),
    ("regenerate.sampling={topk: 5}", "regenerate.sampling.topk"),
    ("regenerate.sampling={temperature: hot}", "regenerate.sampling.temperature"),
    ("regenerate.turns=first", "regenerate.turns"),
    ("regenerate.on_length=cut", "regenerate.on_length"),
    ("regenerate.max_tokens=0", "regenerate.max_tokens"),
    ("regenerate.generation_config=/no/such/file.json", "regenerate.generation_config"),
    ("regenerate.unknown=1", "regenerate.unknown"),
])
def test_bad_regenerate_keys_are_one_line_errors_naming_the_key(override, key):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [override])
    assert f"`{key}`" in str(e.value) and "\n" not in str(e.value)


def _out_row(position: int) -> dict:
    return {"id": f"r{position}", "source_row": position, "tools": None,
            "messages": [{"role": "user", "content": f"q{position}"}, {"role": "assistant", "content": "a"}],
            "regen": {"engine": "t", "model": "m", "sampling": "{}", "max_tokens": 4, "turns": [],
                      "ended_early": None}}


COUNTS = {"num_requests": 2, "prompt_tokens": 3, "completion_tokens": 4, "finish_reasons": {"stop": 2},
          "tool_calls": {}, "ended_early": {}}


def test_commits_survive_a_torn_index_and_leftovers_and_the_folder_loads_as_data(tmp_path):
    out = tmp_path / "regen"
    committer = output.ChunkCommitter(out, rank=0)
    committer.commit(0, [_out_row(1), _out_row(0)], [], COUNTS)
    committer.commit(1, [_out_row(2)], [{"source_row": 3, "source_id": None, "reason": "x", "detail": None}], COUNTS)
    # what a kill leaves: a .tmp shard, a renamed shard no index line lists, a torn last index line
    (out / "data" / "shard-000002.arrow.tmp").write_bytes(b"partial")
    (out / "data" / "shard-000003.arrow").write_bytes(b"whole but uncommitted")
    with open(out / "index" / "rank-00000.jsonl", "ab") as f:
        f.write(b'{"chunk": 3, "path": "data/sha')
    committed = output.prepare(out)
    assert sorted(committed) == [(0, 0), (1, 0)]  # (chunk, part)
    assert sorted(p.name for p in (out / "data").iterdir()) == ["shard-000000.arrow", "shard-000001.arrow"]
    assert (out / "index" / "rank-00000.jsonl").read_bytes().endswith(b"}\n")
    # a committed shard gone missing is redone
    (out / "data" / "shard-000001.arrow").unlink()
    assert sorted(output.prepare(out)) == [(0, 0)]
    committer = output.ChunkCommitter(out, rank=1)
    committer.commit(1, [_out_row(2)], [{"source_row": 3, "source_id": None, "reason": "x", "detail": None}], COUNTS)
    records = list(output.read_committed(out).values())
    assert not (out / "state.json").exists()
    output.write_dataset_files(out, records, {"shards": []}, [], {})
    rows = load_rows(DataSection(path=str(out)))
    assert rows["source_row"] == [0, 1, 2] and rows["id"] == ["r0", "r1", "r2"]
    assert rows[0]["messages"][1] == {"role": "assistant", "content": "a", "reasoning_content": None,
                                      "tool_calls": None, "tool_call_id": None, "name": None, "weight": None}


def test_a_committed_shard_altered_in_place_at_the_same_size_is_redone(tmp_path):
    """One byte of an answer changed in a committed Arrow shard (the file keeps its size): the resume's prepare
    reads it back against its record's sha256 (computed here independently, with hashlib, from the bytes the
    commit left), drops that part and its file, and keeps the intact one."""
    import hashlib

    out = tmp_path / "regen"
    committer = output.ChunkCommitter(out, rank=0)
    committer.commit(0, [_out_row(0)], [], COUNTS)
    committer.commit(1, [_out_row(1)], [], COUNTS)
    shard = out / "data" / "shard-000001.arrow"
    data = bytearray(shard.read_bytes())
    at = data.find(b"q1")
    assert at >= 0
    data[at] = ord("Q")
    shard.write_bytes(bytes(data))
    assert hashlib.sha256(shard.read_bytes()).hexdigest() != output.read_committed(out)[(1, 0)].sha256
    assert sorted(output.prepare(out)) == [(0, 0)]
    assert sorted(p.name for p in (out / "data").iterdir()) == ["shard-000000.arrow"]
    assert all(json.loads(line)["chunk"] == 0 for line in (out / "index" / "rank-00000.jsonl").read_text().splitlines())


def test_an_output_of_another_job_is_refused_naming_what_changed(tmp_path):
    out = tmp_path / "regen"
    identity = {"engine_kind": "openai", "sampling": {"temperature": 0.6}, "turns": "last", "engine": None}
    output.open_output(out, identity, overwrite=False)
    output.record_run(out, identity, 10, "")
    with pytest.raises(output.RegenMismatchError) as e:
        output.open_output(out, {**identity, "sampling": {"temperature": 0.7}}, overwrite=False)
    assert "sampling: output has {'temperature': 0.6}, this run has {'temperature': 0.7}" in str(e.value)
    output.open_output(out, {**identity, "sampling": {}}, overwrite=True)  # afresh
    assert not (out / output.STATE_NAME).exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(output.RegenMismatchError, match="not a regeneration output"):
        output.open_output(tmp_path / "mine", identity, overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").exists()


def test_the_command_refuses_a_bad_key_and_an_output_inside_the_data(tmp_path, capsys):
    from dflash_prep.commands.cli import main as cli_main

    assert cli_main(["regenerate", "--set", "regenerate.engine=vllm"]) == 2
    assert "`regenerate.engine`" in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"}]}) + "\n")
    for path in (str(tmp_path / "data"), str(tmp_path / "**" / "*.jsonl")):
        assert cli_main(["regenerate", "--set", f"data.path={path}", "--set", f"output.dir={tmp_path / 'states'}",
                         "--set", f"regenerate.output_dir={tmp_path / 'data' / 'answers'}"]) == 2
        assert "lies inside the data" in capsys.readouterr().err
    assert cli_main(["regenerate", "--set", f"data.path={tmp_path / 'data'}", "--set", f"output.dir={tmp_path / 'x'}",
                     "--set", f"regenerate.output_dir={tmp_path / 'x' / 'answers'}"]) == 2
    assert "overlaps `output.dir`" in capsys.readouterr().err

"""`engine: openai` against a real server: `transformers serve` with the tiny demo model (random weights, saved to a
folder), started once for this module on a free loopback port. Every expected answer comes from a request the
test sends itself with the `openai` client, never from the code under test."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import yaml
from regen_server import Server, free_port, save_tiny_model

from dflash_prep.commands.regenerate import main as regenerate_main
from dflash_prep.data.rows import load_rows
from dflash_prep.recipe.schema import DataSection

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ROWS = [
    {"id": "single", "messages": [{"role": "user", "content": "What is 2 + 2?"},
                                  {"role": "assistant", "content": "4"}]},
    {"id": "multi", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                                 {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And bye"},
                                 {"role": "assistant", "content": "Bye!"}]},
    {"id": "prompt-only", "conversations": [{"from": "human", "value": "Tell me a story about a river."}]},
    {"id": "weather", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 18}"},
        {"role": "assistant", "content": "18 C in Paris."}]},
    {"id": "broken", "messages": "not a list"},
]
# A tool call whose arguments are not JSON: `transformers serve` fails on it (HTTP 500) when it is in the prompt.
BAD_ARGUMENTS = {"id": "bad-arguments", "messages": [
    {"role": "user", "content": "x"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "r"},
    {"role": "user", "content": "and then?"}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("regen-openai") / "model")
    server = Server(model).start()
    yield server
    server.stop()


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def regen_args(server: Server, data: Path, out: Path, **sets) -> list[str]:
    keys = {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(server.model_dir),
            "data.path": str(data), "output.dir": str(out.parent / f"{out.name}-states"),
            "regenerate.output_dir": str(out),
            "regenerate.engine": "openai", "regenerate.base_urls": f"[{server.base_url}]",
            "regenerate.max_tokens": MAX_TOKENS, "regenerate.max_retries": 1, "regenerate.retry_backoff_seconds": 0.05,
            "regenerate.max_concurrency": 2, "regenerate.turns": "last", **sets}
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def direct(server: Server, messages: list[dict], tools=None, **kwargs):
    """The server's answer to a request the test writes itself."""
    client = openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)
    args = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **kwargs}
    return client.chat.completions.create(model=str(server.model_dir), messages=messages,
                                          **({"tools": tools} if tools else {}), **args)


def load(out: Path) -> list[dict]:
    import datasets

    return list(datasets.load_from_disk(str(out)))


def data_messages(row: dict) -> list[dict]:
    if "conversations" in row:
        return [{"role": "user", "content": t["value"]} for t in row["conversations"]]
    return row["messages"]


def check_turns_against_direct_requests(server: Server, out_row: dict) -> None:
    """Each generated turn equals the server's answer to its prompt (the output's messages before it), sent by the
    test: text, finish reason and token counts."""
    tools = json.loads(out_row["tools"]) if out_row["tools"] else None
    messages = [{k: v for k, v in m.items() if v is not None} for m in out_row["messages"]]
    for turn in out_row["regen"]["turns"]:
        i = turn["message_index"]
        expected = direct(server, messages[:i], tools)
        assert messages[i]["content"] == expected.choices[0].message.content, (out_row["id"], i)
        assert turn["finish_reason"] == expected.choices[0].finish_reason
        assert turn["completion_tokens"] == expected.usage.completion_tokens
        assert turn["prompt_tokens"] == expected.usage.prompt_tokens


def test_last_turn_keeps_earlier_turns_and_matches_direct_requests(server, tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "last"
    assert regenerate_main(regen_args(server, data, out, **{"regenerate.turns": "last"})) == 0
    rows = {r["id"]: r for r in load(out)}
    assert list(rows) == ["single", "multi", "prompt-only", "weather"]  # source order; the broken row skipped
    for row in rows.values():
        check_turns_against_direct_requests(server, row)
        assert len(row["regen"]["turns"]) == 1
    multi = rows["multi"]["messages"]
    assert [m["content"] for m in multi[:4]] == ["Be brief.", "Hi there", "Hello", "And bye"]  # kept from the data
    weather = rows["weather"]["messages"]
    assert weather[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
    assert [m["role"] for m in weather] == ["user", "assistant", "tool", "assistant"]
    assert len(rows["prompt-only"]["messages"]) == 2  # the answer appended
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_rows"] == 5 and summary["num_answered"] == 4
    assert summary["skipped"] == {"malformed_conversation": 1} and summary["num_requests"] == 4
    assert sum(summary["finish_reasons"].values()) == 4
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skipped == [{"sample_id": "0000000004", "source_row": 4, "source_id": "broken",
                        "reason": "malformed_conversation",
                        "detail": "`messages` is a string that is not JSON (Expecting value: line 1 column 1 (char 0))"}]
    err = capsys.readouterr().err
    assert "done: 5 rows, 4 answered, 1 skipped" in err
    # transformers serve refuses the token-id fields (HTTP 422): the answers are text, and the summary says so
    assert summary["token_ids"] == {"source": "none"} and "the servers return no token ids (HTTP 422" in err
    assert all(t["completion_token_ids"] is None for r in rows.values() for t in r["regen"]["turns"])
    # the folder is data for an extraction as it is; its generated turns come from their text
    assert list(load_rows(DataSection(path=str(out)))["id"]) == ["single", "multi", "prompt-only", "weather"]
    from transformers import AutoTokenizer

    from dflash_prep.data.rows import tokenize_dataset

    section = DataSection(path=str(out))
    tokenized = tokenize_dataset(load_rows(section), AutoTokenizer.from_pretrained(server.model_dir), section, 1024)
    assert tokenized.samples["generated_turns"]["from_text"] == 4
    assert tokenized.samples["generated_turns"]["from_ids"] == 0
    # `plan` counts the prompts' tokens as the server did (the same template, rendered by the tokenizer)
    from dflash_prep.commands.plan import plan_regeneration
    from dflash_prep.recipe.schema import load_recipe

    argv = regen_args(server, data, out, **{"regenerate.turns": "last"})
    estimate = plan_regeneration(load_recipe(None, argv[1::2]), generated_tokens_per_second=2.0)
    assert estimate["prompt_tokens"] == summary["prompt_tokens"] and estimate["num_requests"] == 4
    assert estimate["skipped"] == {"malformed_conversation": 1}
    assert estimate["generated_tokens_at_most"] == 4 * MAX_TOKENS and estimate["seconds_at_most"] == 2 * MAX_TOKENS


def test_all_turns_are_generated_from_the_generated_ones(server, tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", ROWS[:4])
    out = tmp_path / "all"
    assert regenerate_main(regen_args(server, data, out, **{"regenerate.turns": "all"})) == 0
    rows = {r["id"]: r for r in load(out)}
    for row in rows.values():
        check_turns_against_direct_requests(server, row)
    multi = rows["multi"]
    assert [t["message_index"] for t in multi["regen"]["turns"]] == [2, 4]
    assert [m["content"] for m in multi["messages"] if m["role"] != "assistant"] == ["Be brief.", "Hi there", "And bye"]
    # the random model writes text where the data called the tool: the data's tool result answers nothing, so the
    # conversation ends after the generated turn
    weather = rows["weather"]
    assert weather["regen"]["ended_early"] == "other_calls_ended" and len(weather["messages"]) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tool_calls"] == {"other_calls_ended": 1} and summary["num_requests"] == 5


def sampled(**extra) -> dict:
    return {"regenerate.sampling": "{temperature: 1.0, top_k: 50}", "regenerate.extra_sampling": "generation_config",
            "regenerate.max_concurrency": 1, **extra}  # transformers serve seeds its process: one request at a time


def test_the_seed_makes_a_rerun_identical_and_a_changed_job_is_refused(server, tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", [ROWS[0], ROWS[2]])
    first, second, other = tmp_path / "first", tmp_path / "second", tmp_path / "other-seed"
    assert regenerate_main(regen_args(server, data, first, **sampled())) == 0
    assert regenerate_main(regen_args(server, data, second, **sampled())) == 0
    assert regenerate_main(regen_args(server, data, other, **sampled(**{"regenerate.seed": 1}))) == 0
    a, b, c = load(first), load(second), load(other)
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["messages"] for r in a] != [r["messages"] for r in c]
    # the stored seed and sampling reproduce the text in a request of the test's own
    row = a[0]
    turn = row["regen"]["turns"][0]
    assert json.loads(row["regen"]["sampling"]) == {"temperature": 1.0, "top_k": 50}
    again = direct(server, row["messages"][:1], seed=turn["seed"], temperature=1.0,
                   extra_body={"generation_config": json.dumps({"do_sample": True, "temperature": 1.0, "top_k": 50})})
    assert row["messages"][1]["content"] == again.choices[0].message.content
    greedy = direct(server, row["messages"][:1])
    assert greedy.choices[0].message.content != row["messages"][1]["content"]  # it did sample
    # a changed sampling parameter, turns or max_tokens: refused, naming it, before any request
    capsys.readouterr()
    for key, value, named in [("regenerate.sampling", "{temperature: 0.9, top_k: 50}", "sampling"),
                              ("regenerate.turns", "all", "turns"), ("regenerate.max_tokens", 3, "max_tokens")]:
        assert regenerate_main(regen_args(server, data, first, **sampled(**{key: value}))) == 2
        (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert f"{named}: output has" in error
    assert regenerate_main(regen_args(server, data, first, **sampled(**{"regenerate.seed": 3}))) == 2
    # the same job again: finished, left as it is
    before = (first / "manifest.json").read_bytes()
    assert regenerate_main(regen_args(server, data, first, **sampled())) == 0
    assert (first / "manifest.json").read_bytes() == before
    # overwrite starts afresh
    assert regenerate_main(regen_args(server, data, first, **sampled(**{"regenerate.seed": 1,
                                                                        "regenerate.overwrite": "true"}))) == 0
    assert [r["messages"] for r in load(first)] == [r["messages"] for r in c]


def test_rows_the_server_rejects_are_counted_skips_with_its_reason(server, tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", [ROWS[0], BAD_ARGUMENTS])
    out = tmp_path / "rejected"
    assert regenerate_main(regen_args(server, data, out, **{"regenerate.turns": "last"})) == 0
    assert [r["id"] for r in load(out)] == ["single"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == {"rejected_by_engine": 1}
    (skipped,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    # transformers serve answers a tool call's arguments that are not JSON with HTTP 500 (5.24) or 400 (5.25)
    assert skipped["source_id"] == "bad-arguments" and skipped["detail"].startswith(("HTTP 500", "HTTP 400"))
    # a 4xx: transformers serve refuses a field it does not know (top_k sent as a plain extra field) for every row:
    # exit code 2, the reason with an example; the one-recipe form says the same and extracts nothing
    out = tmp_path / "422"
    argv = regen_args(server, data, out, **{"regenerate.sampling": "{temperature: 1.0, top_k: 5}",
                                            "regenerate.extra_sampling": "extra_body"})
    assert regenerate_main(argv) == 2
    err = capsys.readouterr().err
    assert "the regeneration answered no row of 2 - rejected_by_engine: 2 (e.g. row 0000000000" in err
    assert "HTTP 422" in err and "top_k" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_answered"] == 0 and summary["skipped"] == {"rejected_by_engine": 2}
    assert all(d.startswith("HTTP 422") and "top_k" in d for d in summary["rejected_examples"])
    from dflash_prep.commands.extract import main as extract_main

    assert extract_main(argv) == 2 and "the regeneration answered no row of 2" in capsys.readouterr().err
    assert not (tmp_path / "422-states" / "manifest.json").exists()


def test_a_server_rendering_chats_with_another_template_is_warned_about(server, tmp_path, capsys):
    """The server renders with its tokenizer's Qwen3 template; the recipe's data.chat_template is Qwen3.6's (its
    generation prompt opens <think>): the prompt token counts of the probe differ, and the run says so."""
    import chat_templates as T

    template = tmp_path / "qwen36.jinja"
    template.write_text(T.QWEN36)
    data = write_rows(tmp_path / "rows.jsonl", ROWS[:1])
    assert regenerate_main(regen_args(server, data, tmp_path / "other", **{"data.chat_template": str(template)})) == 0
    assert "does not render chats with the recipe's template" in capsys.readouterr().err
    assert regenerate_main(regen_args(server, data, tmp_path / "same")) == 0
    assert "does not render chats" not in capsys.readouterr().err


def test_on_length_keeps_or_drops_the_rows_cut_by_max_tokens(server, tmp_path):
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question number {i}: {w}?"}]}
               for i, w in enumerate(["why", "how", "when", "where", "who", "what", "which", "whose"])]
    data = write_rows(tmp_path / "rows.jsonl", prompts)
    expected = {p["id"]: direct(server, p["messages"], max_tokens=3).choices[0].finish_reason for p in prompts}
    assert set(expected.values()) == {"stop", "length"}  # both kinds, or the test tells nothing
    keep, drop = tmp_path / "keep", tmp_path / "drop"
    assert regenerate_main(regen_args(server, data, keep, **{"regenerate.max_tokens": 3})) == 0
    assert regenerate_main(regen_args(server, data, drop, **{"regenerate.max_tokens": 3,
                                                             "regenerate.on_length": "drop",
                                                             "data.max_skipped_fraction": 1.0})) == 0
    assert {r["id"]: r["regen"]["turns"][0]["finish_reason"] for r in load(keep)} == expected
    assert [r["id"] for r in load(drop)] == [k for k, v in expected.items() if v == "stop"]
    summary = json.loads((drop / "summary.json").read_text())
    assert summary["skipped"] == {"finish_reason_length": sum(v == "length" for v in expected.values())}


def test_one_recipe_regenerates_then_extracts_from_its_output(server, tmp_path, capsys):
    from dflash_prep.commands.extract import main as extract_main

    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"name_or_path": str(server.model_dir), "dtype": "float32"},
        "data": {"path": str(data), "max_length": 512},
        "layers": {"preset": "dflash", "num_layers": 2},
        "batching": {"max_tokens_per_batch": 2048, "num_workers": 0},
        "output": {"dir": str(tmp_path / "states")},
        "regenerate": {"engine": "openai", "base_urls": [server.base_url], "max_tokens": MAX_TOKENS,
                       "turns": "all", "output_dir": str(tmp_path / "answers")}}))
    assert extract_main(["--recipe", str(recipe)]) == 0
    answers = load(tmp_path / "answers")
    manifest = json.loads((tmp_path / "states" / "manifest.json").read_text())
    # Qwen3's template drops the earlier turn of the two-turn row as the target saw it: that row is two samples
    # (data.samples: auto), the others one each
    assert len(answers) == 4 and manifest["samples"]["per_turn_rows"] == 1
    assert manifest["samples"]["per_turn_samples"] == 2 and manifest["num_rows"] == len(answers)  # rows, once
    assert manifest["num_samples"] + manifest["num_skipped"] == manifest["num_sample_candidates"] == 5
    assert manifest["samples"]["generated_turns"]["from_text"] == 5  # transformers serve returns no ids
    from dflash_prep.commands.inspect import main as inspect_main

    capsys.readouterr()
    assert inspect_main([str(tmp_path / "states")]) == 0
    assert "3 row(s) as one sample, 1 per turn (2 samples" in capsys.readouterr().out
    resolved = yaml.safe_load((tmp_path / "states" / "recipe.resolved.yaml").read_text())
    assert resolved["data"]["path"] == str(tmp_path / "answers")
    # the same command again: both finished, nothing redone
    stamp = (tmp_path / "answers" / "manifest.json").stat().st_mtime_ns
    assert extract_main(["--recipe", str(recipe)]) == 0
    assert (tmp_path / "answers" / "manifest.json").stat().st_mtime_ns == stamp


def test_a_server_down_among_several_leaves_its_share_to_the_others(server, tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", ROWS[:3])
    out = tmp_path / "two-servers"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    urls = f"[{dead}, {server.base_url}]"
    assert regenerate_main(regen_args(server, data, out, **{"regenerate.base_urls": urls})) == 0
    assert f"{dead} does not answer GET /models" in capsys.readouterr().err
    assert [r["id"] for r in load(out)] == ["single", "multi", "prompt-only"]
    # none answers: one line, exit code 1 (resumable), nothing committed
    out = tmp_path / "none"
    assert regenerate_main(regen_args(server, data, out, **{"regenerate.base_urls": f"[{dead}]"})) == 1
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "no server answers" in error and not list((out / "index").glob("*.jsonl"))


def test_the_client_drops_idle_connections_before_the_server_closes_them(server):
    """The real server's keep-alive, measured: one request on a raw HTTP/1.1 connection, then the time until the
    server closes it. The engine's client reuses an idle connection only for less than that (a request sent on a
    connection the server is closing fails as a connection error, counted toward the server being down)."""
    import http.client
    import time

    from dflash_prep.regen.openai_engine import KEEPALIVE_EXPIRY_SECONDS, _Server

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/v1/models")
    response = conn.getresponse()
    response.read()
    assert response.status == 200 and response.getheader("connection", "keep-alive").lower() != "close"
    t0 = time.monotonic()
    assert conn.sock.recv(1) == b""  # blocks until the server closes the idle connection
    closed_after = time.monotonic() - t0
    conn.close()
    client = _Server(server.base_url, "EMPTY", 30.0).client
    expiry = client._client._transport._pool._keepalive_expiry  # httpx's pool: the only place the value lives
    assert expiry == KEEPALIVE_EXPIRY_SECONDS and expiry < closed_after - 1.0, (expiry, closed_after)

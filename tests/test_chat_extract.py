"""Real chat data in, end to end: every row format through `accelerate launch extract.py` on the flagship recipe with
a Qwen3.6-style template (no `{% generation %}`), never a silent empty run, unreadable data files, the pad id."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import chat_templates as T
import datasets
import numpy as np
import pytest
import webdataset as wds
from conftest import DEMO, REPO, demo_overrides
from test_chat import ROW
from test_extract import ENV

from dflash_prep.commands import extract, plan
from dflash_prep.commands.extract import run_extraction
from dflash_prep.data import chat
from dflash_prep.recipe.schema import load_recipe

LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "extract.py"]
TINY_MODEL = ["model.name_or_path=null", f"model.config={DEMO / 'model_config.json'}", f"model.tokenizer={DEMO / 'tokenizer'}",
              "model.dtype=float32", "layers.ids=[1, 3, 5]", "batching.max_tokens_per_batch=4096",
              "batching.num_workers=1", "data.num_proc=1"]
ROWS = [  # (row, the supervised text of each assistant turn, written by hand from the Qwen3.6-style rendering)
    (ROW, ["<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>"
           "<|im_end|>", "It is 21 °C in Zürich.<|im_end|>", "No data.\n</think>\n\n東京: no data yet.<|im_end|>"]),
    ({"id": "parts", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Part two."}]},
        {"role": "assistant", "content": "Both parts read.", "reasoning": "Two parts."}]},
     ["Two parts.\n</think>\n\nBoth parts read.<|im_end|>"]),
    ({"id": "sharegpt", "conversations": [
        {"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello! How can I help?"},
        {"from": "human", "value": "Nothing."}, {"from": "gpt", "value": "Okay, bye."}]},
     ["Hello! How can I help?<|im_end|>", "Okay, bye.<|im_end|>"]),  # the last: after the prompted empty think
    ({"id": "specforge", "conversations": [
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."}]}, ["You are welcome.<|im_end|>"]),
    ({"id": "pretokenized", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}, None),
]
IMAGE_ROW = {"id": "image", "messages": [
    {"role": "user", "content": [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "assistant", "content": "A cat."}]}


def launch(*overrides: str, recipe: str | None = None) -> subprocess.CompletedProcess:
    argv = LAUNCH + (["--recipe", recipe] if recipe else []) + [a for kv in overrides for a in ("--set", kv)]
    return subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


def supervised_runs(ids: np.ndarray, mask: np.ndarray, tokenizer) -> list[str]:
    runs, current = [], []
    for t, m in zip(list(ids) + [None], list(mask) + [0]):
        if m:
            current.append(int(t))
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.mark.slow
def test_every_row_format_through_the_flagship_recipe_on_a_qwen36_template(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "template.jinja").write_text(T.QWEN36)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r, _ in ROWS) + json.dumps(IMAGE_ROW) + "\n")
    out = tmp_path / "out"
    # one sample per row (Qwen3.6 renders earlier turns without their reasoning: `auto` would cut those rows per
    # turn, tests/test_onpolicy.py); the masks of the whole renderings are what this test reads
    proc = launch(*TINY_MODEL, f"data.path={data}", f"data.chat_template={tmp_path / 'template.jinja'}",
                  f"output.dir={out}", "data.samples=conversation", recipe="recipes/qwen3.6-27b-dflash.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == len(ROWS) and manifest["skipped"] == {"image_or_audio_content": 1}
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    records = {}
    for s in wds.WebDataset([str(out / sh["path"]) for sh in manifest["shards"]], shardshuffle=False,
                            empty_check=False):
        records[json.loads(s["meta.json"])["source_id"]] = (np.load(io.BytesIO(s["input_ids.npy"])),
                                                            np.load(io.BytesIO(s["loss_mask.npy"])))
    for row, expected in ROWS:
        ids, mask = records[row["id"]]
        if expected is None:  # pre-tokenized: stored as given
            assert ids.tolist() == row["input_ids"] and mask.tolist() == row["loss_mask"]
            continue
        assert supervised_runs(ids, mask, tokenizer) == expected, row["id"]
    # the ids are the template's own rendering (enable_thinking: false, from the flagship recipe), tokenized
    messages, tools = chat.row_to_chat(ROW)
    reference = tokenizer.apply_chat_template(messages, tools=tools, chat_template=T.QWEN36, tokenize=True,
                                              return_dict=True, enable_thinking=False)["input_ids"]
    assert records[ROW["id"]][0].tolist() == list(reference)


@pytest.mark.slow
def test_no_kept_row_stops_before_the_model_loads_with_exit_2_and_plan_says_the_same(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "messages": [{"role": "user", "content": "anyone?"}]},
        {"id": "b", "messages": [{"role": "user", "content": "hello?"}]},
        {"id": "c", "messages": []}]))
    out = tmp_path / "out"
    # `dflash-prep launch extract.py`, the README's command (plain `accelerate launch` turns any failure into 1)
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "launch", "extract.py", "--set", f"data.path={data}",
                           "--set", f"output.dir={out}"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("error: no row kept: all 3 skipped - no_assistant_turn: 2 (e.g. row 0000000000, id 'a': "
                              "no assistant turn (roles: user))")
    assert "empty_conversation: 1 (e.g. row 0000000002, id 'c': `messages` is an empty list)" in message
    assert "Traceback" not in proc.stderr
    log = out / "logs" / "rank-00000.log"
    assert not log.exists() or "model loaded" not in log.read_text()
    assert not (out / "shards").exists() and not (out / "manifest.json").exists()
    assert not (out / "run_state.json").exists()  # the output is not claimed: fixing the data and re-running works
    assert plan.main(["--set", f"data.path={data}", "--set", f"output.dir={tmp_path / 'plan'}"]) == 2
    assert capsys.readouterr().err.strip() == message


def test_more_skipped_than_max_skipped_fraction_stops_with_exit_2(tmp_path, capsys):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, {"messages": []}, {"messages": []}]))
    args = ["--set", f"data.path={data}", "--set", f"output.dir={tmp_path / 'out'}"]
    assert extract.main(args) == 2
    assert "2 of 3 rows skipped (67%), more than data.max_skipped_fraction=0.5" in capsys.readouterr().err
    assert plan.main(args + ["--set", "data.max_skipped_fraction=0.7"]) == 0  # allowed: plan goes on
    assert "rows        3: 1 kept, 2 skipped" in capsys.readouterr().out


def _parquet(path, columns: dict) -> str:
    datasets.Dataset.from_dict(columns).to_parquet(str(path))
    return str(path)


@pytest.mark.parametrize("case", ["empty", "blank_lines", "parquet_columns", "parquet_truncated"])
def test_an_unreadable_data_file_stops_with_one_line_naming_it(tmp_path, capsys, case):
    ids = {"input_ids": [[5, 6, 7]]}
    if case == "empty":
        bad = tmp_path / "empty.jsonl"
        bad.write_text("")
    elif case == "blank_lines":
        bad = tmp_path / "blank.jsonl"
        bad.write_text("\n  \n\n")
    elif case == "parquet_columns":
        _parquet(tmp_path / "a.parquet", ids)
        bad = tmp_path / "b.parquet"
        _parquet(bad, {"input_ids": [[5, 6, 7]], "loss_mask": [[0, 1, 1]]})
    else:
        bad = tmp_path / "cut.parquet"
        whole = open(_parquet(bad, ids), "rb").read()
        bad.write_bytes(whole[: len(whole) // 2])
    path = str(bad) if case != "parquet_columns" else str(tmp_path / "*.parquet")
    code = extract.main(["--set", f"data.path={path}", "--set", f"output.dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and bad.name in errors[0] and "Traceback" not in err, err


def test_a_pad_token_past_the_embedding_table_does_not_reach_the_model(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tokenizer.add_special_tokens({"pad_token": "<pad>"})
    assert tokenizer.pad_token_id == 1024  # the demo model's embedding has rows 0..1023
    tokenizer.save_pretrained(tmp_path / "tok")
    common = {"data.max_samples": 24, "batching.num_workers": 0, "batching.max_tokens_per_batch": 4096,
              "output.dtype": "float32"}
    padded = run_extraction(load_recipe(None, demo_overrides(tmp_path / "pad", **common,
                                                             **{"model.tokenizer": str(tmp_path / "tok")})))
    base = run_extraction(load_recipe(None, demo_overrides(tmp_path / "base", **common)))
    assert padded["num_samples_written"] == base["num_samples_written"] == 24
    assert padded["padding_efficiency"] < 1  # batches were padded
    from conftest import raw_records

    a, b = raw_records(tmp_path / "pad"), raw_records(tmp_path / "base")
    assert {k: r["hidden_states.safetensors"] for k, r in a.items()} == \
        {k: r["hidden_states.safetensors"] for k, r in b.items()}


def test_readme_own_data_row_shows_as_the_readme_says(tmp_path, capsys):
    """docs/DATA.md's row, as written, through `plan --show-sample 0` with a Qwen3.6-style template."""
    section = (REPO / "docs" / "DATA.md").read_text()
    blocks = section.split("```")[1::2]  # the fenced blocks, each from its language tag on
    (row_text,) = [b[len("json\n"):] for b in blocks if b.startswith("json\n")]
    (excerpt,) = [b[1:] for b in blocks if b.startswith("\n")]
    data, template = tmp_path / "chat.jsonl", tmp_path / "template.jinja"
    data.write_text(json.dumps(json.loads(row_text)) + "\n")
    template.write_text(T.QWEN36)
    assert plan.main(["--show-sample", "0", "--set", f"data.path={data}", "--set", f"data.chat_template={template}",
                      "--set", "data.chat_template_kwargs={enable_thinking: false}"]) == 0
    out = capsys.readouterr().out
    # Qwen3.6 renders the first turn's reasoning away from the history: one sample per turn (data.samples: auto)
    assert excerpt in out and out.startswith("row 0 (sample 0000000000_t0001, id 'weather-1'): ")
    assert "\n\nrow 0 (sample 0000000000_t0003, id 'weather-1'): " in out


WEATHER_TOOL = {"name": "get_weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
PARIS_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
              "<|im_end|>")
NEW_SHAPES = [  # (row, the supervised text of each assistant turn, by hand from the Qwen3.6-style rendering)
    ({"id": "anthropic", "system": "Be brief.", "tools": [{"name": "get_weather", "description": "Current weather",
                                                          "input_schema": WEATHER_TOOL["parameters"]}],
      "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "Call the tool.", "signature": "c2ln"},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]},
                   {"role": "assistant", "content": [{"type": "text", "text": "18 °C in Paris."}]}]},
     ["Call the tool.\n</think>\n\n" + PARIS_CALL, "18 °C in Paris.<|im_end|>"]),
    ({"id": "openai-legacy", "functions": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "18 °C in Paris."}]},
     [PARIS_CALL, "18 °C in Paris.<|im_end|>"]),
    ({"id": "llama-factory", "system": "Be brief.", "tools": json.dumps([WEATHER_TOOL]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp_c": 18}'}, {"from": "gpt", "value": "18 °C in Paris."}]},
     [PARIS_CALL, "18 °C in Paris.<|im_end|>"]),
    ({"id": "json-text", "messages": json.dumps([{"role": "user", "content": "Hi"},
                                                 {"role": "assistant", "content": "Hello there."}])},
     ["Hello there.<|im_end|>"]),
    ({"id": "weights", "conversations": [{"from": "human", "value": "Q1"},
                                         {"from": "gpt", "value": "Not this one.", "weight": 0},
                                         {"from": "human", "value": "Q2"},
                                         {"from": "gpt", "value": "This one.", "weight": 1}]},
     ["This one.<|im_end|>"]),
    ({"id": "greeting", "messages": [{"role": "assistant", "content": "Hello! Ask me anything."},
                                     {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]},
     ["Hello! Ask me anything.<|im_end|>", "4.<|im_end|>"]),
]
CONVERTED = [  # rows of the documented conversions (docs/FORMAT.md), and their supervised text
    ("glaive", ["<tool_call>\n<function=calculate_bmi>\n<parameter=weight>\n70\n</parameter>\n<parameter=height>\n1.75"
                "\n</parameter>\n</function>\n</tool_call><|im_end|>",
                "Your BMI is 22.86, a normal weight.<|im_end|>"]),
    ("xlam", ["<tool_call>\n<function=live_giveaways_by_type>\n<parameter=type>\nbeta\n</parameter>\n</function>\n"
              "</tool_call>\n\n<tool_call>\n<function=live_giveaways_by_type>\n<parameter=type>\ngame\n</parameter>\n"
              "</function>\n</tool_call><|im_end|>"]),
]
REDACTED = {"id": "redacted", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
    {"type": "redacted_thinking", "data": "eyJ4IjogMX0="}, {"type": "text", "text": "a"}]}]}


def _cache_files(cache) -> dict[str, int]:
    return {str(p.relative_to(cache)): p.stat().st_mtime_ns for p in cache.rglob("*.arrow")}


@pytest.mark.slow
def test_every_new_row_shape_end_to_end_and_a_resume_reads_the_tokenization_from_the_cache(tmp_path):
    """Anthropic blocks, OpenAI legacy calls, LLaMA-Factory calls, `messages` as JSON text, per-turn weights, an
    assistant-first row and the documented glaive / xlam conversions, from `data.path` given as a list of two files,
    through `accelerate launch extract.py` on the flagship recipe with a Qwen3.6-style template; a row with an
    unsupported block is skipped with its detail. The rows hold tool schemas as objects, so the files are read line by
    line: the re-run (a finished output) writes no cache file and changes none, its tokenization read back."""
    from test_format_doc import GLAIVE, XLAM, conversion_functions
    from transformers import AutoTokenizer

    convert = conversion_functions()
    converted = [{"id": "glaive", **convert["glaive_to_row"](GLAIVE)}, {"id": "xlam", **convert["xlam_to_row"](XLAM)}]
    (tmp_path / "template.jinja").write_text(T.QWEN36)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r, _ in NEW_SHAPES[:3]))
    second.write_text("".join(json.dumps(r) + "\n" for r in [r for r, _ in NEW_SHAPES[3:]] + converted + [REDACTED]))
    out, cache = tmp_path / "out", tmp_path / "hf-cache"
    env = {**ENV, "HF_DATASETS_CACHE": str(cache)}
    argv = LAUNCH + ["--recipe", "recipes/qwen3.6-27b-dflash.yaml"] + [a for kv in TINY_MODEL + [
        f"data.path=[{first}, {second}]", f"data.chat_template={tmp_path / 'template.jinja'}", f"output.dir={out}",
        "data.samples=conversation"]  # the whole renderings' masks are what this test reads (as above)
        for a in ("--set", kv)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every row with" not in proc.stderr  # tool calls and reasoning are rendered
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 8 and manifest["skipped"] == {"unsupported_content_block": 1}
    (skipped,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skipped == {"sample_id": "0000000008", "source_row": 8, "source_id": "redacted",
                       "reason": "unsupported_content_block",
                       "detail": "turn 1: content part 0 is a 'redacted_thinking' block, which has no text form "
                                 "(supported: text, thinking, tool_use, tool_result)"}
    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    records = {}
    for s in wds.WebDataset([str(out / sh["path"]) for sh in manifest["shards"]], shardshuffle=False,
                            empty_check=False):
        records[json.loads(s["meta.json"])["source_id"]] = (np.load(io.BytesIO(s["input_ids.npy"])),
                                                            np.load(io.BytesIO(s["loss_mask.npy"])))
    for source_id, expected in [(r["id"], e) for r, e in NEW_SHAPES] + CONVERTED:
        ids, mask = records[source_id]
        assert supervised_runs(ids, mask, tokenizer) == expected, source_id
    files = _cache_files(cache)
    assert any(name.startswith("dflash_prep_json_lines/") and "/cache-" in name for name in files)
    again = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _cache_files(cache) == files  # read back: no cache file written or rewritten


def test_show_sample_gives_a_skipped_rows_detail_and_plan_warns_or_stops_on_a_lost_kind(tmp_path, capsys, caplog):
    """The demo template renders no `reasoning_content`: every row with reasoning is kept without it, a warning
    before any model loads, and exit code 2 with `data.strict: true`."""
    import logging

    think = {"id": "think", "messages": [{"role": "user", "content": "Why?"},
                                         {"role": "assistant", "content": "Because it is so.",
                                          "reasoning_content": "Think first."}]}
    narrator = {"id": "narrator", "messages": [{"role": "narrator", "content": "x"},
                                               {"role": "assistant", "content": "y"}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [think] * 3 + [narrator]))
    args = ["--set", f"data.path={data}", "--set", f"output.dir={tmp_path / 'out'}"]
    with caplog.at_level(logging.WARNING, logger="dflash_prep.data.rows"):
        assert plan.main(["--show-sample", "3"] + args) == 0
    assert capsys.readouterr().out.startswith(
        "row 3 (sample 0000000003, id 'narrator'): skipped, unknown_role (turn 0 has role 'narrator' (known: system, ")
    assert [m for m in caplog.messages if "every row with" in m] == [
        "data: every row with reasoning is lost: of 3 such rows, 0 skipped and 3 kept with a rendering without their "
        "reasoning (the chat template drops them); set data.strict: true to stop instead"]
    assert plan.main(args + ["--set", "data.strict=true"]) == 2
    assert capsys.readouterr().err.startswith("error: every row with reasoning is lost: of 3 such rows")

"""On-policy samples are the target's own tokens (docs/ON_POLICY.md): the generated turns' ids are kept and the
extraction builds the samples from them; `data.samples: per_turn` samples are the served prompt + the generated
ids; the in-process engine renders with `data.chat_template`; an engine rejecting everything ends with exit code 2;
`weight: 0` turns are never regenerated nor supervised.

The model is the tiny demo config with random weights saved with the Qwen3 template (tests/regen_server.py), whose
template drops earlier turns' reasoning and renders a last turn with an empty think block: a rendering of the whole
conversation is not what the target saw. Every expected value comes from transformers directly: the prompt from
`apply_chat_template(..., add_generation_prompt=True, tokenize=True)`, the answer from `generate` run alone on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import chat_templates as T
import pytest
import torch
from regen_server import STOP_IDS, save_tiny_model

from dflash_prep.commands.regenerate import main as regenerate_main
from dflash_prep.data import rows as D
from dflash_prep.recipe.schema import DataSection

MAX_TOKENS = 10
ROWS = [
    {"id": "single", "messages": [{"role": "user", "content": "Tell me about rivers."}]},
    {"id": "multi", "messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
                                 {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}]},
    {"id": "weight0", "messages": [{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "the data's answer", "weight": 0},
                                   {"role": "user", "content": "More?"}, {"role": "assistant", "content": "x"}]},
    {"id": "broken", "messages": "not a list"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("onpolicy") / "model")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir), \
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def sets(model_dir: Path, data: Path, out: Path, **extra) -> list[str]:
    keys = {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(model_dir),
            "model.dtype": "float32", "data.path": str(data), "output.dir": str(out.parent / f"{out.name}-states"),
            "regenerate.output_dir": str(out), "regenerate.engine": "transformers",
            "regenerate.max_tokens": MAX_TOKENS, "regenerate.rows_per_shard": 2,
            "regenerate.max_tokens_per_batch": 512, "batching.num_workers": 0, **extra}
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def rows_of(out: Path) -> list[dict]:
    import datasets

    return list(datasets.load_from_disk(str(out)))


def clean(messages: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if v is not None and k != "weight"} for m in messages]


def prompt_of(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(clean(messages), add_generation_prompt=True, tokenize=True,
                                              return_dict=True, **kwargs)["input_ids"])


def generate_alone(model, prompt: list[int]) -> list[int]:
    """HF generate on one prompt, greedy: the new ids up to and including the first stop id."""
    with torch.inference_mode():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                             max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=STOP_IDS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def tokenized(out: Path, tokenizer, samples: str) -> dict[str, dict]:
    section = DataSection(path=str(out), samples=samples)
    data = D.tokenize_dataset(D.load_rows(section), tokenizer, section, 1024)
    return {r["sample_id"]: r for r in data.kept}, data


@pytest.fixture(scope="module", params=["all", "last"])
def regenerated(request, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"onpolicy-{request.param}")
    data = tmp / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp / "out"
    assert regenerate_main(sets(model_dir, data, out, **{"regenerate.turns": request.param})) == 0
    return request.param, out


def test_the_generated_ids_are_kept_and_equal_generate_alone(regenerated, hf):
    turns, out = regenerated
    tokenizer, model = hf
    rows = {r["id"]: r for r in rows_of(out)}
    assert list(rows) == ["single", "multi", "weight0"]
    for row in rows.values():
        for turn in row["regen"]["turns"]:
            i = turn["message_index"]
            prompt = prompt_of(tokenizer, row["messages"][:i])
            assert turn["prompt_token_ids"] == prompt, (row["id"], i)
            assert turn["completion_token_ids"] == generate_alone(model, prompt), (row["id"], i)
            stopped = turn["completion_token_ids"][-1] in STOP_IDS
            assert turn["finish_reason"] == ("stop" if stopped else "length")
    # weight 0: the data's text, its weight kept, never generated; the turn after it generated in its context
    w0 = rows["weight0"]
    assert w0["messages"][1]["content"] == "the data's answer" and w0["messages"][1]["weight"] == 0
    assert [t["message_index"] for t in w0["regen"]["turns"]] == [3]
    assert [t["message_index"] for t in rows["multi"]["regen"]["turns"]] == ([1, 3] if turns == "all" else [3])
    # the skipped row's line carries the extraction's one-line detail
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skipped == [{"sample_id": "0000000003", "source_row": 3, "source_id": "broken",
                        "reason": "malformed_conversation", "detail": skipped[0]["detail"]}]
    assert "not a list" in skipped[0]["detail"] or "str" in skipped[0]["detail"]
    assert json.loads((out / "summary.json").read_text())["token_ids"] == {"source": "returned"}


def test_per_turn_samples_are_the_served_prompt_and_the_generated_ids(regenerated, hf):
    turns, out = regenerated
    tokenizer, model = hf
    samples, data = tokenized(out, tokenizer, "per_turn")
    expected_ids = []
    for row in rows_of(out):
        for turn in row["regen"]["turns"]:
            i = turn["message_index"]
            prompt = prompt_of(tokenizer, row["messages"][:i])
            generated = generate_alone(model, prompt)
            sample = samples[f"{row['source_row']:010d}_t{i:04d}"]
            assert sample["input_ids"] == prompt + generated, (row["id"], i)
            assert sample["loss_mask"] == [0] * len(prompt) + [1] * len(generated)
            expected_ids.append(sample["sample_id"])
    assert sorted(samples) == sorted(expected_ids)  # the weight-0 turn and the data's turns are no sample
    generated_turns = sum(len(r["regen"]["turns"]) for r in rows_of(out))
    assert data.samples["generated_turns"]["from_ids"] == generated_turns
    assert data.samples["per_turn_samples"] == generated_turns


def test_auto_cuts_the_rows_qwen3_rewrites_and_keeps_the_others_whole_from_the_ids(regenerated, hf):
    turns, out = regenerated
    tokenizer, model = hf
    samples, data = tokenized(out, tokenizer, "auto")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    whole = {"single": 0, "weight0": 2} | ({} if turns == "all" else {"multi": 1})
    for row in rows_of(out):
        if row["id"] not in whole:  # two generated turns: Qwen3 renders the first without its think block
            assert sorted(s for s in samples if s.startswith(f"{row['source_row']:010d}")) == [
                f"{row['source_row']:010d}_t0001", f"{row['source_row']:010d}_t0003"]
            continue
        (turn,) = row["regen"]["turns"]
        i = turn["message_index"]
        prompt = prompt_of(tokenizer, row["messages"][:i])
        generated = generate_alone(model, prompt)
        stopped = generated[-1] in STOP_IDS
        # the stop token it generated replaces the template's <|im_end|>; cut by max_tokens: <|im_end|> is context
        tail = newline if stopped else [im_end, *newline]
        sample = samples[f"{row['source_row']:010d}"]
        assert sample["input_ids"] == prompt + generated + tail, row["id"]
        assert sample["loss_mask"] == [0] * len(prompt) + [1] * len(generated) + [0] * len(tail)
    assert data.samples["per_turn_rows"] == (1 if turns == "all" else 0)
    # Qwen3 renders every last turn with an empty think block the target did not generate: the ids win, counted
    assert data.samples["generated_turns"]["ids_differ"] >= len(whole)


def test_the_weight_0_turn_is_never_supervised_in_the_extraction(regenerated, hf):
    _, out = regenerated
    tokenizer, _ = hf
    samples, _ = tokenized(out, tokenizer, "conversation")
    sample = samples["0000000002"]
    supervised = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
    assert "the data's answer" not in supervised and "the data's answer" in tokenizer.decode(sample["input_ids"])


def test_the_in_process_engine_renders_with_data_chat_template(model_dir, hf, tmp_path, capsys):
    """The recipe's template (here Qwen3.6's: its generation prompt opens <think>) and keyword arguments, not the
    tokenizer's own: the prompts are the ones apply_chat_template gives with that template."""
    tokenizer, model = hf
    template = tmp_path / "qwen36.jinja"
    template.write_text(T.QWEN36)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    out = tmp_path / "out"
    argv = sets(model_dir, data, out, **{"regenerate.turns": "all", "data.chat_template": str(template),
                                         "data.chat_template_kwargs": "{enable_thinking: false}"})
    assert regenerate_main(argv) == 0
    n = 0
    for row in rows_of(out):
        for turn in row["regen"]["turns"]:
            i = turn["message_index"]
            prompt = prompt_of(tokenizer, row["messages"][:i], chat_template=T.QWEN36, enable_thinking=False)
            assert prompt != prompt_of(tokenizer, row["messages"][:i])  # the templates differ
            assert turn["prompt_token_ids"] == prompt and turn["completion_token_ids"] == generate_alone(model, prompt)
            n += 1
    assert n == 3
    import hashlib

    # the regeneration's identity holds the template (by its sha256; the manifest keeps the text): a changed
    # template is another job
    state = json.loads((out / "run_state.json").read_text())
    assert state["identity"]["chat_template"] == {"source": "data.chat_template",
                                                  "sha256": hashlib.sha256(T.QWEN36.encode()).hexdigest()}
    assert json.loads((out / "manifest.json").read_text())["chat_template_text"] == T.QWEN36
    template.write_text(T.QWEN36 + "{#- edited in place #}")
    assert regenerate_main(argv) == 2
    own = argv[:-4] + ["--set", "data.chat_template_kwargs={enable_thinking: false}"]
    assert regenerate_main(own) == 2  # the tokenizer's own template: another job too
    assert "chat_template.source: output has 'data.chat_template', this run has 'tokenizer'" in \
        capsys.readouterr().err


def test_an_engine_rejecting_every_request_ends_with_exit_code_2_and_its_reasons(model_dir, tmp_path, capsys):
    """A token budget no prompt fits: the in-process engine rejects every request. The regeneration, and the
    one-recipe form, end with exit code 2 naming the reason with an example; a re-run says it again."""
    from dflash_prep.commands.extract import main as extract_main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]))
    out = tmp_path / "out"
    argv = sets(model_dir, data, out, **{"regenerate.max_tokens_per_batch": 12})
    assert regenerate_main(argv) == 2
    err = capsys.readouterr().err
    assert "the regeneration answered no row of 3" in err and "rejected_by_engine: 3 (e.g. row 0000000000" in err
    assert "exceeds the token budget" in err
    assert regenerate_main(argv) == 2 and "answered no row" in capsys.readouterr().err
    assert extract_main(argv + ["--set", "regenerate.max_tokens_per_batch=12"]) == 2
    assert "the regeneration answered no row of 3" in capsys.readouterr().err


def test_more_skipped_rows_than_max_skipped_fraction_end_with_exit_code_2(model_dir, tmp_path, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [ROWS[0], ROWS[3], ROWS[3]]))
    out = tmp_path / "out"
    assert regenerate_main(sets(model_dir, data, out, **{"data.max_skipped_fraction": 0.5})) == 2
    err = capsys.readouterr().err
    assert "skipped 2 of 3 rows, more than data.max_skipped_fraction=0.5" in err
    assert "malformed_conversation: 2 (e.g. row 0000000001" in err


# ------------------------------------------------------------------------------------------ rows written by hand
# A regenerated row as `regenerate` writes it, with a tool call and reasoning; the ids are what an engine
# generated: the same text as the template renders, in other tokens (single characters), so that the test tells
# ids from re-tokenized text.
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL_ROW_MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "Use the tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C.", "reasoning_content": "Read it."}]


def qwen3_tokenizer():
    from test_chat import family_tokenizer

    tokenizer = family_tokenizer("qwen3")
    tokenizer.chat_template = T.QWEN3
    return tokenizer


def char_ids(tokenizer, text: str) -> list[int]:
    """`text` as one token per character (markers as their own token): ids no tokenizer call gives for it."""
    out, i = [], 0
    markers = sorted(T.SPECIAL_TOKENS["qwen3"], key=len, reverse=True)
    while i < len(text):
        m = next((m for m in markers if text.startswith(m, i)), None)
        piece = m or text[i]
        out += tokenizer(piece, add_special_tokens=False)["input_ids"]
        i += len(piece)
    return out


def regen_row(tokenizer, finish: list[str], with_prompt_ids: bool = False) -> tuple[dict, dict]:
    """The row, and message index -> the completion ids its `regen` holds."""
    texts = {1: '<think>\nUse the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>', 3: "<think>\nRead it.\n</think>\n\nIt is 18 C."}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = {i: char_ids(tokenizer, texts[i]) + ([im_end] if f != "length" else [])
                  for i, f in zip((1, 3), finish)}
    turns = []
    for i, f in zip((1, 3), finish):
        prompt = char_ids(tokenizer, tokenizer.apply_chat_template(clean(TOOL_ROW_MESSAGES[:i]), tools=None,
                                                                   add_generation_prompt=True, tokenize=False))
        turns.append({"message_index": i, "finish_reason": f, "prompt_tokens": 0, "completion_tokens": 0, "seed": 0,
                      "prompt_token_ids": prompt if with_prompt_ids else None, "completion_token_ids": completion[i]})
    row = {"id": "tool", "messages": TOOL_ROW_MESSAGES, "tools": None,
           "regen": {"engine": "openai", "turns": turns}}
    return row, completion


def builder(tokenizer, mode: str):
    return D.Tokenizer(tokenizer=tokenizer, max_length=4096, overlong="skip", vocab_size=len(tokenizer),
                       samples=mode, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])


@pytest.mark.parametrize("with_prompt_ids", [False, True])
def test_per_turn_samples_hold_the_ids_of_tool_calls_and_reasoning(with_prompt_ids):
    tokenizer = qwen3_tokenizer()
    row, completion = regen_row(tokenizer, ["tool_calls", "length"], with_prompt_ids)
    samples = builder(tokenizer, "auto").process_row_samples(row)
    assert [(s.suffix, s.sample_kind) for s in samples] == [("_t0001", "per_turn"), ("_t0003", "per_turn")]
    for sample, turn in zip(samples, row["regen"]["turns"]):
        i = turn["message_index"]
        prompt = turn["prompt_token_ids"] if with_prompt_ids else prompt_of(tokenizer, TOOL_ROW_MESSAGES[:i])
        assert sample.input_ids == prompt + completion[i]  # the engine's own ids, not a re-tokenization
        assert sample.loss_mask == [0] * len(prompt) + [1] * len(completion[i])
    assert samples[0].counts["turns_from_ids"] == 2 and samples[0].counts["turns_ids_differ"] == 2
    assert samples[0].counts["turns_cut"] == 1


@pytest.mark.parametrize("finish", ["tool_calls", "length"])
def test_a_conversation_sample_takes_the_ids_and_supervises_only_the_stop_token_generated(finish):
    """One generated turn with a tool call and reasoning, kept whole (`conversation`): the served prompt, the
    generated ids, then what the template writes after them. Stopped on <|im_end|>: supervised; cut by
    max_tokens: the template's <|im_end|> is context."""
    tokenizer = qwen3_tokenizer()
    row, completion = regen_row(tokenizer, [finish, "stop"])
    row = {**row, "messages": TOOL_ROW_MESSAGES[:2], "regen": {"turns": row["regen"]["turns"][:1]}}
    (sample,) = builder(tokenizer, "conversation").process_row_samples(row)
    prompt = prompt_of(tokenizer, TOOL_ROW_MESSAGES[:1])
    tail = ([] if finish != "length" else [tokenizer.convert_tokens_to_ids("<|im_end|>")]) \
        + tokenizer("\n", add_special_tokens=False)["input_ids"]
    assert sample.sample_kind == "conversation" and sample.suffix == ""
    assert sample.input_ids == prompt + completion[1] + tail
    assert sample.loss_mask == [0] * len(prompt) + [1] * len(completion[1]) + [0] * len(tail)


def test_a_stop_token_other_than_the_templates_end_of_turn_is_the_one_supervised():
    tokenizer = qwen3_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_start|>")  # stands for <|endoftext|>: a stop id, not <|im_end|>
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
           "regen": {"turns": [{"message_index": 1, "finish_reason": "stop",
                                "completion_token_ids": [*tokenizer("Hello", add_special_tokens=False)["input_ids"],
                                                         eos]}]}}
    fn = D.Tokenizer(tokenizer=tokenizer, max_length=4096, overlong="skip", vocab_size=len(tokenizer),
                     samples="conversation", stop_token_ids=[eos, tokenizer.convert_tokens_to_ids("<|im_end|>")])
    (sample,) = fn.process_row_samples(row)
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert supervised == row["regen"]["turns"][0]["completion_token_ids"]
    prompt = prompt_of(tokenizer, row["messages"][:1])
    assert sample.input_ids == prompt + supervised + tokenizer("\n", add_special_tokens=False)["input_ids"]


def test_the_users_own_multi_turn_rows_become_one_sample_per_turn_on_a_template_that_drops_reasoning(tmp_path):
    """Your own data, Qwen3's template: `auto` cuts the two-turn row with reasoning into its turns, each its served
    prompt + the turn as the template renders it there (its reasoning shown), and keeps a one-turn row whole; the
    summary counts the samples and the tokens they add."""
    tokenizer = qwen3_tokenizer()
    messages = [{"role": "user", "content": "One?"},
                {"role": "assistant", "content": "1", "reasoning_content": "Count once."},
                {"role": "user", "content": "Two?"},
                {"role": "assistant", "content": "2", "reasoning_content": "Count twice."}]
    rows = [{"id": "two", "messages": messages}, {"id": "one", "messages": messages[:2]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = DataSection(path=str(path), chat_template=T.QWEN3)
    data = D.tokenize_dataset(D.load_rows(section), tokenizer, section, len(tokenizer))
    samples = {r["sample_id"]: r for r in data.kept}
    assert sorted(samples) == ["0000000000_t0001", "0000000000_t0003", "0000000001"]
    for i, reasoning, answer in ((1, "Count once.", "1"), (3, "Count twice.", "2")):
        sample = samples[f"0000000000_t{i:04d}"]
        prompt = prompt_of(tokenizer, messages[:i])
        whole = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=True)["input_ids"]
        assert sample["input_ids"] == list(whole) and sample["input_ids"][: len(prompt)] == prompt
        supervised = tokenizer.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
        assert supervised == f"<think>\n{reasoning}\n</think>\n\n{answer}<|im_end|>"
        assert not any(sample["loss_mask"][: len(prompt)])
    one = tokenizer.apply_chat_template(messages[:2], tokenize=True, return_dict=True)["input_ids"]
    assert samples["0000000001"]["input_ids"] == list(one)
    conversation = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert data.samples["per_turn_rows"] == 1 and data.samples["conversation_rows"] == 1
    assert (data.num_rows, data.num_candidates) == (len(rows), 3)  # rows read once; the samples they gave
    assert data.samples["per_turn_extra_tokens"] == (len(samples["0000000000_t0001"]["input_ids"])
                                                     + len(samples["0000000000_t0003"]["input_ids"])
                                                     - len(conversation))
    from dflash_prep.data.samples import samples_line

    extra = data.samples["per_turn_extra_tokens"]
    assert 0 < extra < 1000  # at 1e6 bytes a token the extra states are `extra` megabytes
    assert samples_line(data.samples, 1e6) == (f"1 row(s) as one sample, 1 per turn (2 samples, {extra:+,} tokens, "
                                               f"+{extra:.2f} MB of states)")
    # `conversation`: one sample per row, as before
    section = DataSection(path=str(path), chat_template=T.QWEN3, samples="conversation")
    whole = D.tokenize_dataset(D.load_rows(section), tokenizer, section, len(tokenizer))
    assert sorted(whole.kept["sample_id"]) == ["0000000000", "0000000001"]
    assert whole.kept[0]["input_ids"] == list(conversation)


# ------------------------------------------------------------------------------------------ servers' token ids
def test_the_ids_are_read_where_vllm_and_sglang_put_them():
    """The response shapes of vLLM's and SGLang's OpenAI protocol definitions (vLLM: `prompt_token_ids` on the
    response, `token_ids` on the choice; SGLang: both on the choice, and `matched_stop` naming a stop token the ids
    may leave out), read by the `openai` client's own types; and a response without them (transformers serve)."""
    from openai.types.chat import ChatCompletion

    from dflash_prep.regen.openai_engine import answer_of

    def response(choice_extra: dict, response_extra: dict, finish: str = "stop") -> ChatCompletion:
        return ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m", **response_extra,
            "choices": [{"index": 0, "finish_reason": finish, **choice_extra,
                         "message": {"role": "assistant", "content": "Hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})

    vllm = answer_of(response({"token_ids": [7, 8]}, {"prompt_token_ids": [1, 2, 3]}))
    assert vllm.prompt_token_ids == [1, 2, 3] and vllm.completion_token_ids == [7, 8]
    sglang = answer_of(response({"token_ids": [7], "prompt_token_ids": [1, 2, 3], "matched_stop": 8}, {}))
    assert sglang.prompt_token_ids == [1, 2, 3] and sglang.completion_token_ids == [7, 8]
    cut = answer_of(response({"token_ids": [7, 9], "matched_stop": None}, {}, finish="length"))
    assert cut.completion_token_ids == [7, 9] and cut.prompt_token_ids is None
    plain = answer_of(response({}, {}))
    assert plain.completion_token_ids is None and plain.prompt_token_ids is None and plain.content == "Hi"


def test_a_turn_without_ids_cut_by_max_tokens_leaves_the_templates_end_of_turn_unsupervised():
    """A server that returns no ids: the turn is its text as the template renders it; cut by max_tokens, the
    <|im_end|> after it is context, stopped, supervised."""
    tokenizer = qwen3_tokenizer()
    for finish, end in (("length", ""), ("stop", "<|im_end|>")):
        row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
               "regen": {"turns": [{"message_index": 1, "finish_reason": finish, "completion_token_ids": None}]}}
        (sample,) = builder(tokenizer, "conversation").process_row_samples(row)
        supervised = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
        assert supervised == "<think>\n\n</think>\n\nHello there" + end
        assert sample.counts["turns_from_text"] == 1

"""The assistant loss mask for any chat template: one test per model family's public format (tests/chat_templates.py).

Each expected mask is written by hand from the family's rendered text, as the exact strings of the runs of
supervised tokens (decoded: a run edge one token off changes the string); the token ids are checked against
`apply_chat_template(tokenize=True)`, a route that does not go through the code under test.
"""

from __future__ import annotations

import json

import chat_templates as T
import pytest
from conftest import DEMO

from dflash_prep.data import chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
SYSTEM = "You are terse. Réponds en une phrase."
# An OpenAI-format row: system prompt, a tool call (content null, arguments a JSON string) and its result,
# reasoning on every assistant turn, 3 assistant turns, unicode.
ROW = {"id": "agent-1", "tools": TOOLS, "messages": [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Weather in Zürich? ☀️"},
    {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 21}"},
    {"role": "assistant", "content": "It is 21 °C in Zürich.", "reasoning_content": "21 degrees."},
    {"role": "user", "content": "And 東京?"},
    {"role": "assistant", "content": "東京: no data yet.", "reasoning_content": "No data."}]}
# A plain chat (for templates without tool roles): system, 3 assistant turns, unicode.
PLAIN = {"messages": [
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Qu'est-ce que 2+2 ?"},
    {"role": "assistant", "content": "4 — facile."}, {"role": "user", "content": "Et 3×3 ?"},
    {"role": "assistant", "content": "9."}, {"role": "user", "content": "Merci 🙏"},
    {"role": "assistant", "content": "De rien ! 😊"}]}


def family_tokenizer(family: str):
    """The demo's byte-level BPE tokenizer (a real fast tokenizer, offline) with the family's markers added as
    special tokens, as the family's own tokenizer holds them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tokenizer.add_tokens(T.SPECIAL_TOKENS[family], special_tokens=True)
    return tokenizer


def supervised_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    runs, current = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(t)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


CASES = {  # family: (template, row, chat_template_kwargs, the supervised text, turn by turn)
    "qwen3": (T.QWEN3, ROW, {}, [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>',
        "It is 21 °C in Zürich.<|im_end|>",
        "<think>\nNo data.\n</think>\n\n東京: no data yet.<|im_end|>"]),
    "qwen36": (T.QWEN36, ROW, {}, [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>",
        "It is 21 °C in Zürich.<|im_end|>",
        "No data.\n</think>\n\n東京: no data yet.<|im_end|>"]),  # the prompt opens <think>\n: not generated
    "llama31": (T.LLAMA31, ROW, {}, [
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>',
        "It is 21 °C in Zürich.<|eot_id|>",
        "東京: no data yet.<|eot_id|>"]),
    "mistral": (T.MISTRAL, ROW, {}, [
        '[THINK]Use the tool.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}</s>',
        "[THINK]21 degrees.[/THINK]It is 21 °C in Zürich.</s>",
        "[THINK]No data.[/THINK]東京: no data yet.</s>"]),
    "gemma": (T.GEMMA, PLAIN, {}, ["4 — facile.<end_of_turn>", "9.<end_of_turn>", "De rien ! 😊<end_of_turn>"]),
    "deepseek": (T.DEEPSEEK, ROW, {}, [
        '</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zürich"}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "</think>It is 21 °C in Zürich.<｜end▁of▁sentence｜>",
        "No data.</think>東京: no data yet.<｜end▁of▁sentence｜>"]),  # the prompt opens <think>
    "gpt_oss": (T.GPT_OSS, ROW, {}, [
        "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>',
        "<|channel|>final<|message|>It is 21 °C in Zürich.<|end|>",
        "<|channel|>analysis<|message|>No data.<|end|><|start|>assistant<|channel|>final<|message|>"
        "東京: no data yet.<|return|>"]),
    "phi": (T.PHI, PLAIN, {}, ["4 — facile.<|end|>", "9.<|end|>", "De rien ! 😊<|end|>"]),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_the_mask_is_exactly_the_assistant_generated_text_for_every_family(family):
    template, row, kwargs, expected = CASES[family]
    tokenizer = family_tokenizer(family)
    renderer = chat.ChatRenderer(tokenizer, template, kwargs)
    messages, tools = chat.row_to_chat(row)
    ids, mask = renderer.tokenize(messages, tools)
    assert supervised_runs(tokenizer, ids, mask) == expected
    reference = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                              return_dict=True, **kwargs)["input_ids"]
    assert ids == list(reference)  # the ids are the template's own rendering, tokenized


def test_qwen3_without_thinking_supervises_the_answers_not_the_prompted_empty_think_block():
    row = json.loads(json.dumps(ROW))
    for m in row["messages"]:
        m.pop("reasoning_content", None)
    tokenizer = family_tokenizer("qwen3")
    ids, mask = chat.ChatRenderer(tokenizer, T.QWEN3, {"enable_thinking": False}).tokenize(*chat.row_to_chat(row))
    rendered = tokenizer.decode(ids)
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n東京: no data yet.<|im_end|>\n")
    assert supervised_runs(tokenizer, ids, mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>',
        "It is 21 °C in Zürich.<|im_end|>", "東京: no data yet.<|im_end|>"]


def test_a_generation_tagged_template_and_its_untagged_copy_give_the_same_masks():
    """The demo template's {% generation %} mask (transformers' own, which agrees with the convention there) equals
    the located spans of the same template with the tags removed, and of the tagged one, on the demo's
    conversations."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    untagged = tokenizer.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    tagged_renderer, plain_renderer = chat.ChatRenderer(tokenizer), chat.ChatRenderer(tokenizer, untagged)
    assert tagged_renderer.generation_tagged and not plain_renderer.generation_tagged
    with open(DEMO / "data" / "conversations.jsonl") as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    for row in rows:
        conversation = chat.row_to_chat(row)
        out = tokenizer.apply_chat_template(conversation[0], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        expected = (list(out["input_ids"]), list(out["assistant_masks"]))
        assert plain_renderer.tokenize(*conversation) == expected == tagged_renderer.tokenize(*conversation)


@pytest.mark.parametrize("row, messages", [
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]),
    ({"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "content": "c", "reasoning": "r"}]},
     [{"role": "user", "content": "a\nb"},
      {"role": "assistant", "content": "c", "reasoning_content": "r", "thinking": "r"}]),
])
def test_every_row_layout_becomes_the_same_messages(row, messages):
    assert chat.row_to_chat(row) == (messages, None)


WEATHER_TOOL = {"name": "get_weather", "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
# The one conversation every shape below holds: a system prompt, a question, a tool call, its result, the answer.
WEATHER = ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": '{"temp_c": 18}'}, {"role": "assistant", "content": "18 °C in Paris."}],
           [{"type": "function", "function": WEATHER_TOOL}])


def _weather(**changes) -> tuple[list[dict], list[dict]]:
    messages = json.loads(json.dumps(WEATHER[0]))
    for index, fields in changes.items():
        messages[int(index[1:])].update(fields)
    return messages, WEATHER[1]


@pytest.mark.parametrize("shape, row, expected", [
    ("openai", {"tools": [{"type": "function", "function": WEATHER_TOOL}], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": '{"temp_c": 18}'}, {"role": "assistant", "content": "18 °C in Paris."}]},
     _weather()),
    ("openai_legacy", {"functions": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "function_call": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "18 °C in Paris."}]},
     _weather(m3={"name": "get_weather"})),
    ("llama_factory", {"system": "Be brief.", "tools": json.dumps([WEATHER_TOOL]), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"temp_c": 18}'}, {"from": "gpt", "value": "18 °C in Paris."}]},
     _weather()),
    ("anthropic", {"system": [{"type": "text", "text": "Be brief."}], "tools": [
        {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_TOOL["parameters"]}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "c2ln"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": '{"temp_c": 18}'}]}]},
            {"role": "assistant", "content": [{"type": "text", "text": "18 °C in Paris."}]}]},
     _weather(m2={"reasoning_content": "Call the tool.", "thinking": "Call the tool."},
              m3={"tool_call_id": "toolu_1"})),
    ("messages_as_json_text", {"tools": json.dumps([{"type": "function", "function": WEATHER_TOOL}]),
                               "messages": json.dumps([
                                   {"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                                       "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                                   {"role": "tool", "content": '{"temp_c": 18}'},
                                   {"role": "assistant", "content": "18 °C in Paris."}])},
     _weather()),
])
def test_every_row_shape_becomes_openai_messages(shape, row, expected):
    messages, tools = chat.row_to_chat(row)
    if shape == "anthropic":  # the tool_use id travels with the call
        expected[0][2]["tool_calls"][0]["id"] = "toolu_1"
    assert (messages, tools) == expected


def test_an_anthropic_user_turn_of_tool_results_and_text_becomes_tool_turns_then_a_user_turn():
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Two calls."}, {"type": "tool_use", "id": "a", "name": "f", "input": {}},
        {"type": "tool_use", "id": "b", "name": "g", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"},
                                     {"type": "tool_result", "tool_use_id": "b", "content": "2"},
                                     {"type": "text", "text": "Go on."}]},
        {"role": "assistant", "content": "Done."}]}
    conv = chat.read_conversation(row)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "tool", "user", "assistant"]
    assert conv.messages[1]["content"] == "Two calls." and conv.arguments_text == {(1, 0): "{}", (1, 1): '{"x": 1}'}
    assert [(m["tool_call_id"], m["content"]) for m in conv.messages[2:4]] == [("a", "1"), ("b", "2")]
    assert conv.messages[4]["content"] == "Go on."


@pytest.mark.parametrize("row, reason, detail", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "a"}]}]},
     chat.UNSUPPORTED_BLOCK, "turn 1: content part 0 is a 'redacted_thinking' block, which has no text form"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
                   {"role": "assistant", "content": "a"}]},
     chat.UNSUPPORTED_BLOCK, "turn 0: a tool_use block in a user turn"),
    ({"system": "SYSTEM: You are a helpful assistant.", "chat": "USER: Hi\n\n\nASSISTANT: Hello <|endoftext|>"},
     chat.NO_CONTENT_FIELD, "no `messages`, `conversations` or `input_ids` column (the row has: chat, system); "
                            'convert such rows first (docs/FORMAT.md, "Rows without a conversation column")'),
    ({"messages": '[{"role": "user"'}, chat.BAD_STRUCTURE, "`messages` is a string that is not JSON"),
    ({"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
     chat.UNKNOWN_ROLE, "turn 0 has role 'narrator'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
     chat.BAD_CONTENT, "turn 1 (assistant): `content` is null and there are no tool calls"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{not json"}]},
     chat.BAD_TOOL_CALLS, "turn 1: a function_call turn whose value is not JSON"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "tools": [{"description": "no name"}]}, chat.BAD_TOOLS, "`tools` entry 0 has neither `function` nor `name`"),
])
def test_a_row_that_cannot_be_a_conversation_names_the_field_at_fault(row, reason, detail):
    with pytest.raises(chat.SkipRow) as e:
        chat.read_conversation(row)
    assert e.value.reason == reason and e.value.detail.startswith(detail), e.value.detail


@pytest.mark.parametrize("row, reason", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "a cat"}]}, chat.MEDIA_CONTENT),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
                   {"role": "assistant", "content": "a cat"}]}, chat.MEDIA_CONTENT),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}, chat.BAD_CONTENT),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     chat.BAD_TOOL_CALLS),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": "{not json"},
     chat.BAD_TOOLS),
])
def test_rows_that_cannot_be_conversations_get_their_own_reason(row, reason):
    with pytest.raises(chat.SkipRow) as e:
        chat.row_to_chat(row)
    assert e.value.args[0] == reason


def test_a_long_agent_conversation_follows_qwen3s_reasoning_rule_turn_by_turn():
    """36 assistant turns (tool calls, tool results, reasoning on each) under Qwen3's template, which keeps a turn's
    reasoning only after the last user query: the expected text of each turn is built from that rule, by hand."""
    tokenizer = family_tokenizer("qwen3")
    messages = [ROW["messages"][0]]
    for k in range(12):
        messages += [{**m, "content": m["content"] + f" ({k})"} if isinstance(m["content"], str) and
                     m["role"] != "tool" else dict(m) for m in ROW["messages"][1:]]
    messages, tools = chat.row_to_chat({"messages": messages, "tools": TOOLS})
    ids, mask = chat.ChatRenderer(tokenizer, T.QWEN3).tokenize(messages, tools)
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    expected = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            text = f"<think>\n{m['reasoning_content']}\n</think>\n\n" if i > last_user else ""
            text += m["content"] or '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
            expected.append(text + "<|im_end|>")
    assert len(expected) == 36 and supervised_runs(tokenizer, ids, mask) == expected


def _qwen3_tagged() -> str:
    """QWEN3 with the assistant header hoisted out of its branches and the rest of the turn, through <|im_end|>, in
    {% generation %}: the same rendering, with transformers marking the generated text itself."""
    branch = T.QWEN3.split('{%- elif message.role == "assistant" %}')[1].split('{%- elif message.role == "tool" %}')[0]
    tagged = (branch.replace("{%- if loop.index0 > ns.last_query_index %}",
                             "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}"
                             "{%- if loop.index0 > ns.last_query_index %}", 1)
              .replace("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'")
              .replace("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}")
              .replace("{{- '<|im_end|>\\n' }}", "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"))
    assert tagged.count("generation %}") == 2 and tagged.count("<|im_start|>") == 1
    return T.QWEN3.replace(branch, tagged)


def _gpt_oss_tagged() -> str:
    """GPT_OSS with `<|start|>assistant` hoisted before the branches and the rest of the turn in {% generation %}."""
    old = T.GPT_OSS.split("{%- elif message.role == 'assistant' %}")[1].split("{%- elif message.role == 'tool' %}")[0]
    new = (old.replace("{%- if message.thinking", "{{- '<|start|>assistant' }}{%- generation %}{%- if message.thinking", 1)
           .replace("'<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>'",
                    "'<|channel|>analysis<|message|>' + message.thinking + '<|end|><|start|>assistant'")
           .replace("'<|start|>assistant<|channel|>commentary", "'<|channel|>commentary")
           .replace("'<|start|>assistant<|channel|>final", "'<|channel|>final")
           .rstrip("\n") + "{%- endgeneration %}\n")
    assert new.count("<|start|>assistant") == 2 and new.count("generation %}") == 2
    return T.GPT_OSS.replace(old, new)


def _random_conversation(rng, max_calls: int) -> list[dict]:
    words = ["ok", "yes", "Zürich", "東京", "done", "\n", "the tool", "21 °C"]  # few: messages repeat
    messages = [{"role": "system", "content": "Be terse."}] if rng.random() < 0.5 else []
    for _turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": rng.choice(words)})
        while True:
            reply = {"role": "assistant", "content": rng.choice(words + [None])}
            if rng.random() < 0.6:
                reply["reasoning_content"] = rng.choice(words)
            if reply["content"] is None or rng.random() < 0.3:
                reply["tool_calls"] = [{"function": {"name": "get_weather", "arguments": {"city": rng.choice(words)}}}
                                       for _ in range(rng.randint(1, max_calls))]
            messages.append(reply)
            if "tool_calls" not in reply:
                break
            messages += [{"role": "tool", "content": rng.choice(words)} for _ in reply["tool_calls"]]
    return messages


@pytest.mark.parametrize("family, tagged_template, max_calls", [("qwen3", _qwen3_tagged, 2),
                                                                ("gpt_oss", _gpt_oss_tagged, 1)])
def test_random_agent_conversations_match_transformers_generation_mask_of_a_tagged_copy(family, tagged_template,
                                                                                        max_calls):
    """200 random conversations (tool calls, tool results, reasoning or not, repeated messages) under templates that
    are not prefix-stable (Qwen3 drops reasoning before the last user query; gpt-oss drops analysis and ends the last
    message with <|return|>): the located spans equal transformers' {% generation %} mask of a tagged copy of the
    template that renders the same text."""
    import random

    tokenizer = family_tokenizer(family)
    template = {"qwen3": T.QWEN3, "gpt_oss": T.GPT_OSS}[family]
    plain, tagged = chat.ChatRenderer(tokenizer, template), tagged_template()
    rng = random.Random(0)
    for _ in range(200):
        messages = _random_conversation(rng, max_calls)
        conversation = chat.row_to_chat({"messages": messages, "tools": TOOLS if rng.random() < 0.5 else None})
        rendered = plain.render(*conversation, False)
        out = tokenizer.apply_chat_template(conversation[0], tools=conversation[1], chat_template=tagged,
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert rendered == tokenizer.decode(out["input_ids"])
        assert plain.tokenize(*conversation) == (list(out["input_ids"]), list(out["assistant_masks"])), rendered


def test_a_template_without_a_generation_prompt_supervises_the_separator_not_the_role_header():
    """A minimal ChatML template with no `add_generation_prompt` branch: the assistant header is still a prompt
    (read off a probe reply), less the separator the template writes after it (the `\n`, which the served model
    generates after that prompt), so the replies, the separator and the end-of-turn marker are supervised."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    tokenizer = family_tokenizer("qwen3")
    ids, mask = chat.ChatRenderer(tokenizer, template).tokenize(*chat.row_to_chat(PLAIN))
    assert supervised_runs(tokenizer, ids, mask) == ["\n4 — facile.<|im_end|>", "\n9.<|im_end|>",
                                                     "\nDe rien ! 😊<|im_end|>"]


def test_tool_calls_that_are_not_a_list_skip_the_row_with_a_detail():
    """Found by the property test: `tool_calls` holding a string crashed the row reader instead of skipping."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": "system"}]}
    with pytest.raises(chat.SkipRow) as e:
        chat.row_to_chat(row)
    assert e.value.reason == "malformed_tool_calls" and "`tool_calls` is" in str(e.value.detail)

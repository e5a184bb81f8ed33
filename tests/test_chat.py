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
    """The demo template's {% generation %} mask (transformers' own) equals the located spans of the same template
    with the tags removed, on the demo's conversations."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    untagged = tokenizer.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    tagged_renderer, plain_renderer = chat.ChatRenderer(tokenizer), chat.ChatRenderer(tokenizer, untagged)
    assert tagged_renderer.generation_tagged and not plain_renderer.generation_tagged
    with open(DEMO / "data" / "conversations.jsonl") as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    for row in rows:
        conversation = chat.row_to_chat(row)
        assert plain_renderer.tokenize(*conversation) == tagged_renderer.tokenize(*conversation)


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
    plain, tagged = chat.ChatRenderer(tokenizer, template), chat.ChatRenderer(tokenizer, tagged_template())
    assert tagged.generation_tagged and not plain.generation_tagged
    rng = random.Random(0)
    for _ in range(200):
        messages = _random_conversation(rng, max_calls)
        conversation = chat.row_to_chat({"messages": messages, "tools": TOOLS if rng.random() < 0.5 else None})
        rendered = plain.render(*conversation, False)
        assert rendered == tagged.render(*conversation, False)
        assert plain.tokenize(*conversation) == tagged.tokenize(*conversation), rendered


def test_a_template_without_a_generation_prompt_supervises_the_separator_not_the_role_header():
    """A minimal ChatML template with no `add_generation_prompt` branch: the assistant header is still a prompt
    (read off a probe reply), less the separator the template writes after it (the `\n`, which the served model
    generates after that prompt), so the replies, the separator and the end-of-turn marker are supervised."""
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    tokenizer = family_tokenizer("qwen3")
    ids, mask = chat.ChatRenderer(tokenizer, template).tokenize(*chat.row_to_chat(PLAIN))
    assert supervised_runs(tokenizer, ids, mask) == ["\n4 — facile.<|im_end|>", "\n9.<|im_end|>",
                                                     "\nDe rien ! 😊<|im_end|>"]

"""docs/FORMAT.md, as written: every worked example of the loss-mask convention is what the extraction gives on that
template and row, and the conversion functions of "Rows without a conversation column" turn rows shaped like the
public datasets into rows the extraction keeps."""

from __future__ import annotations

import json
import re

import chat_templates as T
from conftest import REPO
from test_chat import family_tokenizer

from dflash_prep.data import chat

FORMAT = (REPO / "docs" / "FORMAT.md").read_text()
LOSS_MASK = FORMAT.split("\n## Loss mask\n")[1].split("\n## ")[0]
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4."}]}
TOOL_ROW = {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "content": '{"temp_c": 18}'}, {"role": "assistant", "content": "18 °C."}]}
EXAMPLES = [  # in the order of the document: (tokenizer family, template, row, stop tokens)
    ("qwen3", CHATML, CHAT, ()),
    ("llama31", T.LLAMA31, {"messages": [{"role": "assistant", "content": "Hello! Ask me anything."},
                                         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]},
     ()),
    ("phi", T.PHI35, CHAT, ("<|endoftext|>", *T.STOP_TOKENS["phi"])),
    ("phi", T.PHI3_MINI, CHAT, ()),
    ("llama2", T.LLAMA2, {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure."},
                                       {"role": "user", "content": "2+2?"},
                                       {"role": "assistant", "content": "the answer is 4."}]}, ()),
    ("glm4", T.GLM4, CHAT, ("<|endoftext|>", *T.STOP_TOKENS["glm4"])),
    ("deepseek_v3", T.DEEPSEEK_V3, TOOL_ROW, ()),
    ("qwen3", CHATML, {"messages": [{"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hey hey.", "weight": 0},
                                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}, ()),
]


def marked(family: str, template: str, row: dict, stops: tuple[str, ...]) -> str:
    """The rendering with the supervised runs between [[ and ]] (as `plan --show-sample` prints it)."""
    tokenizer = family_tokenizer(family)
    renderer = chat.ChatRenderer(tokenizer, template, {}, [tokenizer.convert_tokens_to_ids(s) for s in stops])
    out = renderer.tokenize_conversation(chat.read_conversation(row))
    pieces, start = [], 0
    for t in range(1, len(out.input_ids) + 1):
        if t == len(out.input_ids) or out.loss_mask[t] != out.loss_mask[start]:
            text = tokenizer.decode(out.input_ids[start:t])
            pieces.append(f"[[{text}]]" if out.loss_mask[start] else text)
            start = t
    return "".join(pieces)


def test_every_worked_example_of_the_loss_mask_section_is_what_the_extraction_gives():
    blocks = [b for b in re.findall(r"^(`{3,4})\n(.*?)\n\1$", LOSS_MASK, flags=re.S | re.M) if "[[" in b[1]]
    assert len(blocks) == len(EXAMPLES)
    for (_, text), (family, template, row, stops) in zip(blocks, EXAMPLES):
        assert marked(family, template, row, stops).rstrip("\n") == text, text


def conversion_functions() -> dict:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", FORMAT, flags=re.S) if "def glaive_to_row" in b]
    scope: dict = {}
    exec(compile(block, "docs/FORMAT.md", "exec"), scope)
    return scope


# Rows shaped like glaive-function-calling-v2 and xlam-function-calling-60k (their markers, quoting and JSON text).
GLAIVE = {
    "system": 'SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n'
              '{\n    "name": "calculate_bmi",\n    "description": "Calculate the Body Mass Index",\n    "parameters": '
              '{\n        "type": "object",\n        "properties": {\n            "weight": {"type": "number"},\n'
              '            "height": {"type": "number"}\n        },\n        "required": ["weight", "height"]\n'
              '    }\n}\n',
    "chat": "USER: Hi, I need my BMI. I weigh 70 kg and I am 1.75 m tall.\n\n\nASSISTANT: <functioncall> "
            "{\"name\": \"calculate_bmi\", \"arguments\": '{\"weight\": 70, \"height\": 1.75}'} <|endoftext|>\n\n\n"
            "FUNCTION RESPONSE: {\"bmi\": 22.86}\n\n\nASSISTANT: Your BMI is 22.86, a normal weight. <|endoftext|>"
            "\n\n\n"}
XLAM = {"query": "Find live giveaways for beta access and for games.",
        "tools": json.dumps([{"name": "live_giveaways_by_type", "description": "Live giveaways by type",
                              "parameters": {"type": {"description": "beta or game", "type": "str"}}}]),
        "answers": json.dumps([{"name": "live_giveaways_by_type", "arguments": {"type": "beta"}},
                               {"name": "live_giveaways_by_type", "arguments": {"type": "game"}}])}


def test_the_documented_conversions_give_openai_rows():
    scope = conversion_functions()
    glaive, xlam = scope["glaive_to_row"](GLAIVE), scope["xlam_to_row"](XLAM)
    bmi = {"name": "calculate_bmi", "description": "Calculate the Body Mass Index", "parameters": {
        "type": "object", "properties": {"weight": {"type": "number"}, "height": {"type": "number"}},
        "required": ["weight", "height"]}}
    assert chat.row_to_chat(glaive) == ([
        {"role": "system", "content": "You are a helpful assistant with access to the following functions. Use them "
                                      "if required"},
        {"role": "user", "content": "Hi, I need my BMI. I weigh 70 kg and I am 1.75 m tall."},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "calculate_bmi", "arguments": {"weight": 70, "height": 1.75}}}]},
        {"role": "tool", "content": '{"bmi": 22.86}'},
        {"role": "assistant", "content": "Your BMI is 22.86, a normal weight."}],
        [{"type": "function", "function": bmi}])
    messages, tools = chat.row_to_chat(xlam)
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"type": "beta"}, {"type": "game"}]
    assert tools == [{"type": "function", "function": json.loads(XLAM["tools"])[0]}]
    assert messages[0] == {"role": "user", "content": XLAM["query"]}

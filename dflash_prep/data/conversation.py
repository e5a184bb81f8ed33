"""Rows in: every accepted row shape -> a `Conversation` of OpenAI messages, or a `SkipRow` naming what is wrong.

Shapes (docs/FORMAT.md, "Rows", lists them with their fields): OpenAI `messages` (content a string, a list of text
parts, or null beside `tool_calls`; `tool` messages; `reasoning_content` / `reasoning` / `thinking` on assistant
turns; the legacy `function_call` and `function` role; a `tools` or legacy `functions` column), ShareGPT
`conversations` with `from`/`value` (LLaMA-Factory's `function_call` / `observation` turns too), `conversations` with
`role`/`content`, Anthropic content blocks (`text`, `thinking`, `tool_use`, `tool_result`; a `system` column),
`messages` stored as a JSON string, and a per-turn `weight` (0 or 1). A row that cannot be a conversation is a
`SkipRow(reason, detail)`: a stable reason string and one line naming the turn and the field at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
                "gpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool", "ipython": "tool",
                "observation": "tool", "function_call": "assistant"}

# Skip reasons of conversation rows, rendering's included (rows.py re-exports them as SKIP_*; stable strings:
# they appear in summaries).
NO_CONTENT_FIELD = "no_messages_conversations_or_input_ids"
BAD_STRUCTURE = "malformed_conversation"
EMPTY = "empty_conversation"
UNKNOWN_ROLE = "unknown_role"
BAD_CONTENT = "non_string_content"
MEDIA_CONTENT = "image_or_audio_content"
UNSUPPORTED_BLOCK = "unsupported_content_block"
BAD_TOOL_CALLS = "malformed_tool_calls"
BAD_TOOLS = "malformed_tools"
BAD_WEIGHT = "unsupported_turn_weight"
NO_ASSISTANT = "no_assistant_turn"
TEMPLATE_ERROR = "chat_template_error"
SPAN_NOT_FOUND = "assistant_span_not_found"

MEDIA_PART_TYPES = {"image", "image_url", "input_image", "audio", "input_audio", "audio_url", "video", "video_url",
                    "file", "input_file", "document"}
TEXT_PART_TYPES = {"text", "input_text", "output_text"}
CONVERSION_DOC = 'docs/FORMAT.md, "Rows without a conversation column"'


class SkipRow(Exception):
    """A row that cannot become a sample: `reason` (args[0], a stable string) and `detail` (args[1], one line
    naming the turn and field, or the template's error)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)

    @property
    def reason(self) -> str:
        return self.args[0]

    @property
    def detail(self) -> str:
        return self.args[1]


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def one_line(text: Any, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


@dataclass
class Conversation:
    """A row as OpenAI messages. `weights[i]`: message i's per-turn `weight` (0 or 1; None when the row has none);
    `arguments_text[(i, j)]`: the arguments of tool call j of message i as JSON text, as the data holds them (an
    object given as one is serialized with `json.dumps(..., ensure_ascii=False)`)."""

    messages: list[dict]
    tools: list[dict] | None = None
    weights: list[int | None] = field(default_factory=list)
    arguments_text: dict[tuple[int, int], str] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ rows in
def _parts_of(content: list, t: int, role: str) -> dict:
    """A list of content parts or blocks (OpenAI parts, Anthropic blocks) of turn t (-1: the `system` column) ->
    {text: [..], thinking: [..], calls: [..], results: [(tool_use_id, text)]}. Raises SkipRow."""
    where = f"turn {t}" if t >= 0 else "the `system` column"
    parts: dict = {"text": [], "thinking": [], "calls": [], "results": []}
    for k, part in enumerate(content):
        if isinstance(part, str):
            parts["text"].append(part)
            continue
        if not isinstance(part, dict):
            raise SkipRow(BAD_CONTENT, f"{where}: content part {k} is {type_name(part)}, not an object or text")
        kind = part.get("type")
        if kind in MEDIA_PART_TYPES or (kind is None and any(part.get(m) is not None for m in MEDIA_PART_TYPES)):
            raise SkipRow(MEDIA_CONTENT, f"{where}: content part {k} is {kind or 'media'}")
        allowed = {"assistant": ("thinking", "tool_use"), "user": ("tool_result",)}.get(role, ())
        if kind in ("thinking", "tool_use", "tool_result") and kind not in allowed:
            raise SkipRow(UNSUPPORTED_BLOCK, f"{where}: a {kind} block in a {role} turn")
        if kind == "thinking" and isinstance(part.get("thinking"), str):
            parts["thinking"].append(part["thinking"])
        elif kind == "tool_use":
            parts["calls"].append(part)
        elif kind == "tool_result":
            text = part.get("content", "")
            text = "\n".join(_parts_of(text, t, "tool")["text"]) if isinstance(text, list) else text
            if not isinstance(text, str) or not isinstance(part.get("tool_use_id"), str):
                raise SkipRow(BAD_CONTENT, f"{where}: tool_result block {k} without a tool_use_id or text content")
            parts["results"].append((part["tool_use_id"], text))
        elif (kind in TEXT_PART_TYPES or kind is None) and isinstance(part.get("text"), str):
            parts["text"].append(part["text"])
        elif kind is None or kind in TEXT_PART_TYPES or kind == "thinking":
            raise SkipRow(BAD_CONTENT, f"{where}: content part {k} ({kind or 'untyped'}) has no text")
        else:
            raise SkipRow(UNSUPPORTED_BLOCK, f"{where}: content part {k} is a {one_line(kind, 40)!r} block, which "
                                             f"has no text form (supported: text, thinking, tool_use, tool_result)")
    return parts


def _tool_calls_of(calls: Any, t: int) -> tuple[list[dict], list[str]]:
    """OpenAI `tool_calls`, legacy `function_call`, LLaMA-Factory calls, Anthropic `tool_use` -> ([{type, function:
    {name, arguments}, (id)}], [arguments as JSON text]); arguments given as a JSON string that holds an object are
    passed as that object (as vLLM does before rendering). Raises SkipRow."""
    if not isinstance(calls, list) or not calls:
        raise SkipRow(BAD_TOOL_CALLS, f"turn {t}: tool calls are {type_name(calls)}, not a non-empty list")
    out, texts = [], []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else call
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SkipRow(BAD_TOOL_CALLS, f"turn {t}: tool call {j} has no function name")
        args = next((fn[k] for k in ("arguments", "parameters", "input") if k in fn), None)
        args = {} if args is None else args
        if isinstance(args, str):
            text = args
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif isinstance(args, dict):
            text = json.dumps(args, ensure_ascii=False)
        else:
            raise SkipRow(BAD_TOOL_CALLS, f"turn {t}: tool call {j} ({fn['name']}) has arguments of type "
                                          f"{type_name(args)}, not an object or a JSON string")
        item = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
        texts.append(text)
    return out, texts


def _calls_in_text(value: Any, t: int) -> list:
    """LLaMA-Factory's `function_call` turn: its value is a call, or a list of calls, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise SkipRow(BAD_TOOL_CALLS, f"turn {t}: a function_call turn whose value is not JSON ({e})") from None
    return [value] if isinstance(value, dict) else value


def _weight_of(turn: dict, t: int, role: str) -> int | None:
    """A turn's `weight` (axolotl, LLaMA-Factory): 0 = not trained, 1 = trained; None when absent."""
    weight = turn.get("weight")
    if weight is None:
        return None
    if isinstance(weight, bool) or (isinstance(weight, (int, float)) and weight in (0, 1)):
        weight = int(weight)
    else:
        raise SkipRow(BAD_WEIGHT, f"turn {t} has weight {one_line(repr(weight), 40)}: a turn is trained (1) or not (0)")
    if weight == 1 and role != "assistant":
        raise SkipRow(BAD_WEIGHT, f"turn {t} ({role}) has weight 1: only assistant turns are supervised")
    return weight


def _turn_fields(turn: Any, t: int) -> tuple[str, str, str]:
    """-> (role, the row's own role name, content key). Raises SkipRow."""
    if not isinstance(turn, dict):
        raise SkipRow(BAD_STRUCTURE, f"turn {t} is {type_name(turn)}, not an object")
    if turn.get("role") is not None or ("role" in turn and "from" not in turn):
        role_raw, content_key = turn.get("role"), "content"
    elif "from" in turn:
        role_raw, content_key = turn.get("from"), "value"
    else:
        raise SkipRow(BAD_STRUCTURE, f"turn {t} has neither `role` nor `from` (keys: {one_line(sorted(turn), 80)})")
    role = ROLE_ALIASES.get(role_raw) if isinstance(role_raw, str) else None
    if role is None:
        raise SkipRow(UNKNOWN_ROLE, f"turn {t} has role {one_line(role_raw, 40)!r} (known: {', '.join(ROLE_ALIASES)})")
    return role, role_raw, content_key


def _turn_messages(turn: Any, t: int) -> list[tuple[dict, list[str]]]:
    """One turn of any accepted layout -> [(message, arguments texts of its tool calls)]: one message, or, for a
    user turn of Anthropic `tool_result` blocks, a `tool` message per result (then the user's text, if any).
    Raises SkipRow."""
    role, role_raw, content_key = _turn_fields(turn, t)
    content = turn.get(content_key)
    calls = turn.get("tool_calls") or None
    if calls is not None and not isinstance(calls, list):
        raise SkipRow(BAD_TOOL_CALLS, f"turn {t} ({role_raw}): `tool_calls` is {type_name(calls)}, not a list")
    if role_raw == "function_call":
        calls, content = _calls_in_text(content, t), None
    elif role == "assistant" and calls is None and turn.get("function_call") is not None:
        calls = [turn["function_call"]]  # OpenAI's legacy single call
    if content_key not in turn and not (role == "assistant" and calls):
        raise SkipRow(BAD_STRUCTURE, f"turn {t} ({role_raw}) has no `{content_key}`")
    parts = {"text": [], "thinking": [], "calls": [], "results": []}
    what_none = "holds no text part" if isinstance(content, list) else "is null"  # said when nothing is left
    if isinstance(content, list):
        parts = _parts_of(content, t, role)
        content = "\n".join(parts["text"]) if parts["text"] else None  # joined as vLLM joins text parts
    elif content is not None and not isinstance(content, str):
        raise SkipRow(BAD_CONTENT, f"turn {t} ({role_raw}): `{content_key}` is {type_name(content)}, not text")
    out = [({"role": "tool", "tool_call_id": i, "content": text}, []) for i, text in parts["results"]]
    if out and content is None:
        return out
    message: dict = {"role": role, "content": content}
    texts: list[str] = []
    calls = (calls or []) + parts["calls"]
    if role == "assistant" and calls:
        message["tool_calls"], texts = _tool_calls_of(calls, t)
    elif content is None:
        raise SkipRow(BAD_CONTENT, f"turn {t} ({role_raw}): `{content_key}` {what_none}"
                                   + (" and there are no tool calls" if role == "assistant" else ""))
    if role == "assistant":
        reasoning = next((turn[k] for k in ("reasoning_content", "reasoning", "thinking")
                          if isinstance(turn.get(k), str)), None)
        reasoning = "\n".join(parts["thinking"]) if parts["thinking"] else reasoning
        if reasoning is not None:  # Qwen3/DeepSeek templates read `reasoning_content`, gpt-oss `thinking`
            message["reasoning_content"] = message["thinking"] = reasoning
    for key in ("name", "tool_call_id"):
        if isinstance(turn.get(key), str):
            message[key] = turn[key]
    return out + [(message, texts)]


def _tools_of(row: dict) -> list[dict] | None:
    """The row's `tools` (or legacy `functions`) column: a list or a JSON string; bare function schemas
    ({name, description, parameters} or Anthropic's {name, description, input_schema}) are wrapped as OpenAI tools."""
    key = "tools" if row.get("tools") is not None else "functions"
    tools = row.get(key)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as e:
            raise SkipRow(BAD_TOOLS, f"`{key}` is a string that is not JSON ({e})") from None
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(x, dict) for x in tools):
        raise SkipRow(BAD_TOOLS, f"`{key}` is {type_name(tools)}, not a list of objects")
    out = []
    for k, tool in enumerate(tools):
        if isinstance(tool.get("function"), dict):
            out.append(tool)
        elif isinstance(tool.get("name"), str):
            fn = {n: v for n, v in tool.items() if n not in ("type", "input_schema")}
            if "input_schema" in tool:
                fn["parameters"] = tool["input_schema"]
            out.append({"type": "function", "function": fn})
        else:
            raise SkipRow(BAD_TOOLS, f"`{key}` entry {k} has neither `function` nor `name`")
    return out


def _turns_of(row: dict) -> tuple[str, list]:
    """-> (column, turns) of `messages` or `conversations` (a list, or a JSON string holding one). Raises SkipRow."""
    key = "messages" if row.get("messages") is not None else "conversations"
    raw = row.get(key)
    if raw is None:
        columns = ", ".join(sorted(str(c) for c in row)[:8]) or "none"
        raise SkipRow(NO_CONTENT_FIELD, f"no `messages`, `conversations` or `input_ids` column (the row has: "
                                        f"{columns}); convert such rows first ({CONVERSION_DOC})")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise SkipRow(BAD_STRUCTURE, f"`{key}` is a string that is not JSON ({e})") from None
    if not isinstance(raw, list):
        raise SkipRow(BAD_STRUCTURE, f"`{key}` is {type_name(raw)}, not a list of turns")
    if not raw:
        raise SkipRow(EMPTY, f"`{key}` is an empty list")
    return key, raw


def _system_of(row: dict) -> str | None:
    """A `system` column (LLaMA-Factory, Anthropic requests): a string or a list of text blocks."""
    system = row.get("system")
    if isinstance(system, list):
        system = "\n".join(_parts_of(system, -1, "system")["text"])
    return system if isinstance(system, str) and system.strip() else None


def read_conversation(row: dict) -> Conversation:
    """A row (dict) -> Conversation. Raises SkipRow(reason, detail) for a row that cannot be one: no
    messages/conversations, malformed turns, unknown roles, non-text or media content, unsupported blocks, bad tool
    calls, tools or weights, no assistant turn."""
    _, raw = _turns_of(row)
    conv = Conversation(messages=[])
    system = _system_of(row)
    roles = [x.get("role", x.get("from")) for x in raw if isinstance(x, dict)]
    if system is not None and "system" not in [ROLE_ALIASES.get(r) for r in roles if isinstance(r, str)]:
        conv.messages.append({"role": "system", "content": system})
        conv.weights.append(None)
    for t, turn in enumerate(raw):
        produced = _turn_messages(turn, t)
        weight = _weight_of(turn, t, produced[-1][0]["role"])
        for message, texts in produced:
            i = len(conv.messages)
            conv.arguments_text.update({(i, j): text for j, text in enumerate(texts)})
            conv.messages.append(message)
            conv.weights.append(weight if message["role"] == "assistant" else None)
    if not any(m["role"] == "assistant" for m in conv.messages):
        raise SkipRow(NO_ASSISTANT, "no assistant turn (roles: "
                                    + one_line(", ".join(m["role"] for m in conv.messages), 80) + ")")
    conv.tools = _tools_of(row)
    return conv


def row_to_chat(row: dict) -> tuple[list[dict], list[dict] | None]:
    """A row (dict) -> (messages, tools) for `apply_chat_template` and OpenAI-compatible servers (tool-call
    arguments as objects where the data holds one). Raises SkipRow (see `read_conversation`)."""
    conv = read_conversation(row)
    return conv.messages, conv.tools


def conversation_of(messages: list[dict], tools: list[dict] | None = None) -> Conversation:
    """Messages already in OpenAI form (row_to_chat's) -> Conversation (no weights)."""
    texts = {}
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or []):
            args = call["function"]["arguments"]
            texts[(i, j)] = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Conversation(list(messages), tools, [None] * len(messages), texts)


def prompt_conversation(messages: list[dict], tools: list[dict] | None = None) -> Conversation:
    """The messages before an assistant turn to generate (OpenAI form, a request's), read exactly as a row holding
    them and that turn is read (`read_conversation`), so a prompt renders as the extraction renders the row. Raises
    SkipRow."""
    row = {"messages": [*messages, {"role": "assistant", "content": ""}], "tools": tools}
    conv = read_conversation(row)
    n = len(conv.messages) - 1
    return Conversation(conv.messages[:n], conv.tools, conv.weights[:n],
                        {k: v for k, v in conv.arguments_text.items() if k[0] < n})

"""Chat rows -> the template's own rendering, its token ids, and the assistant loss mask, for any chat template.

Rows: OpenAI `messages` (content a string, a list of text parts, or null beside `tool_calls`; `tool` messages;
`reasoning_content` / `reasoning` on assistant turns; an optional `tools` column), ShareGPT `conversations` with
`from`/`value`, and `conversations` with `role`/`content` (SpecForge's and speculators' own rows).

The token ids are exactly the tokenization of the template's rendering of the whole conversation (what
`apply_chat_template(messages, tools=tools, **chat_template_kwargs)` gives), never of a re-assembled or
"training" variant: the drafter is conditioned on what the served target sees.

The mask (docs/FORMAT.md states the convention): 1 on every token the assistant generates: its text, its reasoning
and its tool calls as the template renders them, and its end-of-turn marker; 0 on role headers, the generation
prompt, and system / user / tool text. A template with a `{% generation %}` block marks the generated text itself
(transformers' `return_assistant_tokens_mask`). Any other template: each assistant message's generated span is
located in the one full rendering, with no knowledge of the model family:

- start: the rendering of the messages before it (`R_i`) is located in the full rendering (at its end when the
  template is prefix-stable; else aligned, see `locate_end`), then the generation prompt (`G_i` minus `R_i`) is
  skipped as far as the full rendering repeats it (Qwen3 with `enable_thinking: false` prompts with an empty
  `<think></think>` block that earlier turns do not render: `prompt_length_present`);
- end: where the rendering of the messages up to and including it (`R_{i+1}`) ends in the full rendering (the
  whole text for the last message; see `_turn_end` for templates that render a last message differently), less
  trailing whitespace (the `\\n` a template writes after `<|im_end|>` or `<end_of_turn>` is the template's, not
  the model's);
- a token is supervised when its characters overlap a span (the rule transformers uses for `{% generation %}`).

Templates that are not prefix-stable (Qwen3 drops earlier turns' reasoning once a later user turn exists; gpt-oss
drops earlier analysis) render an earlier message differently in `R_i` than in the full conversation; `locate_end`
then takes the place in the full rendering that ends like `R_i` and differs from it by the least text (the
dropped or added blocks). A span that cannot be located, or spans out of order, skip the row
(`assistant_span_not_found`) rather than guess.
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

ROLE_ALIASES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
                "gpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool", "ipython": "tool",
                "observation": "tool"}

# Skip reasons of this stage (data.py re-exports them as SKIP_*; stable strings, they appear in summaries).
NO_CONTENT_FIELD = "no_messages_conversations_or_input_ids"
BAD_STRUCTURE = "malformed_conversation"
EMPTY = "empty_conversation"
UNKNOWN_ROLE = "unknown_role"
BAD_CONTENT = "non_string_content"
MEDIA_CONTENT = "image_or_audio_content"
BAD_TOOL_CALLS = "malformed_tool_calls"
BAD_TOOLS = "malformed_tools"
NO_ASSISTANT = "no_assistant_turn"
TEMPLATE_ERROR = "chat_template_error"
SPAN_NOT_FOUND = "assistant_span_not_found"

MEDIA_PART_TYPES = {"image", "image_url", "input_image", "audio", "input_audio", "audio_url", "video", "video_url",
                    "file", "input_file"}
TEXT_PART_TYPES = {"text", "input_text", "output_text"}
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
_PIECES = re.compile(r"\w+|\s+|[^\w\s]")
_PROBE = "Zq7probe"  # content of the probe assistant message (ChatRenderer._turn_end)


class SkipRow(Exception):
    """A row that cannot become a sample; `args[0]` is its skip reason."""


# ------------------------------------------------------------------------------------------------ rows in
def _text_of(content: Any) -> str | None:
    """A message's content as the string the template receives; None for null. Text parts are joined with "\\n"
    (what vLLM sends a string-content template). Raises SkipRow."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise SkipRow(BAD_CONTENT)
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PART_TYPES or (isinstance(part, dict) and kind is None
                                        and any(k in part and part[k] is not None for k in MEDIA_PART_TYPES)):
            raise SkipRow(MEDIA_CONTENT)
        text = part.get("text") if isinstance(part, dict) else None
        if (kind not in TEXT_PART_TYPES and kind is not None) or not isinstance(text, str):
            raise SkipRow(BAD_CONTENT)
        texts.append(text)
    return "\n".join(texts)


def _tool_calls_of(calls: Any) -> list[dict]:
    """OpenAI `tool_calls` -> [{type, function: {name, arguments}}, (id)]; arguments given as a JSON string that
    holds an object are passed as that object (as vLLM does before rendering). Raises SkipRow."""
    if not isinstance(calls, list) or not calls:
        raise SkipRow(BAD_TOOL_CALLS)
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        fn = fn if isinstance(fn, dict) else call
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise SkipRow(BAD_TOOL_CALLS)
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        if args is None:
            args = {}
        if not isinstance(args, (dict, str)):
            raise SkipRow(BAD_TOOL_CALLS)
        item = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


def _message_of(turn: Any) -> dict:
    """One turn of any accepted layout -> a message dict for the template. Raises SkipRow."""
    if not isinstance(turn, dict):
        raise SkipRow(BAD_STRUCTURE)
    if turn.get("role") is not None or ("role" in turn and "from" not in turn):
        role_raw, content_key = turn.get("role"), "content"
    elif turn.get("from") is not None or "from" in turn:
        role_raw, content_key = turn.get("from"), "value"
    else:
        raise SkipRow(BAD_STRUCTURE)
    role = ROLE_ALIASES.get(role_raw) if isinstance(role_raw, str) else None
    if role is None:
        raise SkipRow(UNKNOWN_ROLE)
    calls = turn.get("tool_calls")
    if content_key not in turn and not (role == "assistant" and calls):
        raise SkipRow(BAD_STRUCTURE)
    content = _text_of(turn.get(content_key))
    message: dict = {"role": role, "content": content}
    if role == "assistant" and calls:
        message["tool_calls"] = _tool_calls_of(calls)
    elif content is None:
        raise SkipRow(BAD_CONTENT)
    if role == "assistant":
        reasoning = next((turn[k] for k in ("reasoning_content", "reasoning", "thinking")
                          if isinstance(turn.get(k), str)), None)
        if reasoning is not None:  # Qwen3/DeepSeek templates read `reasoning_content`, gpt-oss `thinking`
            message["reasoning_content"] = message["thinking"] = reasoning
    for key in ("name", "tool_call_id"):
        if isinstance(turn.get(key), str):
            message[key] = turn[key]
    return message


def row_to_chat(row: dict) -> tuple[list[dict], list[dict] | None]:
    """A row (dict) -> (messages, tools) for `apply_chat_template`. Raises SkipRow(reason) for a row that cannot
    be one: no messages/conversations, malformed turns, unknown roles, non-text or media content, bad tool calls or
    tools, no assistant turn."""
    raw = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    if raw is None:
        raise SkipRow(NO_CONTENT_FIELD)
    if not isinstance(raw, list):
        raise SkipRow(BAD_STRUCTURE)
    if not raw:
        raise SkipRow(EMPTY)
    messages = [_message_of(turn) for turn in raw]
    if not any(m["role"] == "assistant" for m in messages):
        raise SkipRow(NO_ASSISTANT)
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            raise SkipRow(BAD_TOOLS) from None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise SkipRow(BAD_TOOLS)
    return messages, tools or None


# ------------------------------------------------------------------------------------------------ rendering
def has_generation_block(template: str) -> bool:
    """True when the template marks assistant text with `{% generation %}` (a mere mention of the word, as in
    `add_generation_prompt`, does not count)."""
    return bool(_GENERATION_BLOCK.search(template or ""))


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


def _unaligned_chars(a: str, b: str) -> int:
    """Characters of a and b outside their alignment: common prefix and suffix, then difflib on the pieces (words,
    spaces, punctuation) of what lies between."""
    head = _common_prefix_length(a, b)
    a, b = a[head:], b[head:]
    tail = _common_prefix_length(a[::-1], b[::-1])
    a, b = a[: len(a) - tail], b[: len(b) - tail]
    if not a or not b:
        return len(a) + len(b)
    pa, pb = _PIECES.findall(a), _PIECES.findall(b)
    blocks = difflib.SequenceMatcher(None, pa, pb, autojunk=False).get_matching_blocks()
    return len(a) + len(b) - 2 * sum(len("".join(pa[m.a: m.a + m.size])) for m in blocks)


def locate_end(part: str, full: str, context: int = 256, key_chars: int = 8) -> int | None:
    """Where the end of `part` (a rendering of the first messages of a conversation) falls in `full` (the
    rendering of the whole conversation), in characters; None when it cannot be located.

    `len(part)` when `full` starts with `part`. Otherwise the texts agree up to a first difference p (blocks one
    rendering keeps and the other drops, such as earlier turns' reasoning) and `part` ends the way `full` does at
    its end e: each e where `full` (from `context` characters before p) repeats the last `key_chars` of `part`
    (fewer when no such run occurs), ending past p, is a candidate, and the one taken has `full[p:e]` differ least
    from `part[p:]`: the fewest characters outside their difflib alignment (on words, spaces and punctuation), so
    dropped or added blocks count once, an earlier end leaves out the rest of `part`, and a later repetition of the
    same text brings in all the text in between; the nearest to `len(part)` on a tie. Candidates are tried by
    their length difference, a lower bound of their cost, so the search stops early."""
    if full.startswith(part):
        return len(part)
    p = _common_prefix_length(part, full)
    start = max(0, p - context)
    window = full[start: p + 2 * (len(part) - p) + context]
    key = part[max(start, len(part) - key_chars):]
    first = max(0, p - start - len(key) + 1)
    while key and window.find(key, first) < 0:
        key, first = key[1:], first + 1
    ends, at = [], window.find(key, first) if key else -1
    while at >= 0:
        ends.append(start + at + len(key))
        at = window.find(key, at + 1)
    if len(ends) <= 1:
        return ends[0] if ends else None
    best, best_cost = None, None
    for end in sorted(ends, key=lambda e: (abs(e - len(part)), e)):
        if best_cost is not None and abs(end - len(part)) >= best_cost:
            break
        cost = _unaligned_chars(part[p:], full[p:end])
        if best_cost is None or cost < best_cost:
            best, best_cost = end, cost
    return best


def prompt_length_present(prompt: str, text: str, markers: tuple[str, ...] = ()) -> int:
    """How much of a generation prompt `text` (the full rendering from a message boundary on) repeats: all of it,
    or, when `text` departs from it (an earlier turn rendered without the prompt's `<think>` opener), the part up
    to the last whitespace or whole marker (added token) both share, so a shared first character of a word
    (`<t` of `<think>` and `<tool_call>`) is not taken for part of the prompt."""
    n = _common_prefix_length(prompt, text)
    if n == len(prompt):
        return n
    cut = max((i + 1 for i in range(n) if prompt[i].isspace()), default=0)
    for marker in markers:
        j = prompt.find(marker)
        while 0 <= j and j + len(marker) <= n:
            cut = max(cut, j + len(marker))
            j = prompt.find(marker, j + 1)
    return cut


class ChatRenderer:
    """Renders conversations with one template and gives (input_ids, loss_mask); see the module docstring.

    `tokenizer`: a transformers fast tokenizer (offsets are needed); `chat_template`: a Jinja string replacing the
    tokenizer's own, or None; `template_kwargs`: `data.chat_template_kwargs`."""

    def __init__(self, tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        self.template = template
        self.kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "add_generation_prompt"}
        self.generation_tagged = has_generation_block(template or "")
        # the tokenizer's added tokens that the template writes (Llama-3 has 256, its template uses 4)
        self.markers = tuple(sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                                     if t.content.strip() and t.content in (template or "")}))

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    def assistant_spans(self, messages: list[dict], tools: list[dict] | None, full: str) -> list[tuple[int, int]]:
        """Character spans [start, end) of the assistant messages' generated text in `full`. Raises SkipRow."""
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], tools, False) if i else ""
            prompt = self._generation_prompt(messages[:i], tools, before)
            boundary = locate_end(before, full) if i else 0
            if boundary is None:
                raise SkipRow(SPAN_NOT_FOUND)
            start = boundary + prompt_length_present(prompt, full[boundary:], self.markers)
            last = i == len(messages) - 1
            end = len(full) if last else self._turn_end(messages[: i + 1], tools, full, prompt)
            if end is None:
                raise SkipRow(SPAN_NOT_FOUND)
            if end < start or (spans and start < spans[-1][1]):
                raise SkipRow(SPAN_NOT_FOUND)
            while end > start and full[end - 1].isspace():
                end -= 1
            if end > start:  # an empty reply a template renders as nothing supervises nothing
                spans.append((start, end))
        return spans

    def _generation_prompt(self, head: list[dict], tools: list[dict] | None, before: str) -> str:
        """What the template writes before an assistant reply after `head` (rendered as `before`): its generation
        prompt (`add_generation_prompt=True`), e.g. `<|im_start|>assistant\n`. A template without that branch
        renders nothing there; the assistant's header is then read off a probe reply rendered after `head` (the
        text between `before` and the probe), so the role header is never taken for generated text."""
        prompted = self.render(head, tools, True)
        cut = len(before) if prompted.startswith(before) else _common_prefix_length(before, prompted)
        if prompted[cut:]:
            return prompted[cut:]
        try:
            probed = self.render(head + [{"role": "assistant", "content": _PROBE}], tools, False)
        except Exception:  # noqa: BLE001 - a template may refuse such a probe; then no header is known
            return ""
        at = probed.find(_PROBE, len(before))
        return probed[len(before):at] if probed.startswith(before) and at >= 0 else ""

    def _turn_end(self, head: list[dict], tools: list[dict] | None, full: str, prompt: str) -> int | None:
        """Where the rendering of `head` (the messages up to an assistant message that is not the last) ends in
        `full`. A template may render a conversation's last message differently (gpt-oss ends it with <|return|>
        instead of <|end|>, Qwen3 adds an empty think block): then `head` is rendered followed by a probe assistant
        message, which makes the message render as it does mid-conversation, and is cut where the probe's header
        (`prompt` up to its first line break) begins."""
        after = self.render(head, tools, False)
        if full.startswith(after):
            return len(after)
        try:
            probed = self.render(head + [{"role": "assistant", "content": _PROBE}], tools, False)
        except Exception:  # noqa: BLE001 - e.g. a template that refuses two assistant turns in a row
            probed = ""
        at = probed.rfind(_PROBE)
        if at >= 0:
            header = prompt[: prompt.find("\n") + 1] if "\n" in prompt else prompt
            cut = probed.rfind(header, 0, at) if header else at
            end = locate_end(probed[:cut], full) if cut > 0 else None
            if end is not None:
                return end
        return locate_end(after, full)

    def tokenize(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        """-> (input_ids, loss_mask), each [T] ints, the ids exactly `apply_chat_template`'s. Raises SkipRow."""
        try:
            if self.generation_tagged:
                out = self.tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=self.template, tokenize=True, return_dict=True,
                    return_assistant_tokens_mask=True, **self.kwargs)
                return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
            full = self.render(messages, tools, False)
            spans = self.assistant_spans(messages, tools, full)
        except SkipRow:
            raise
        except Exception as e:  # noqa: BLE001 - a template may reject a role order, a missing field...
            raise SkipRow(TEMPLATE_ERROR) from e
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), mask_from_spans(enc["offset_mapping"], spans)


def mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters [s, e) overlap a span (spans sorted, disjoint), else 0."""
    mask, k = [0] * len(offsets), 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0] and e > s:
            mask[t] = 1
    return mask


def load_chat_template(value: str | None) -> str | None:
    """`data.chat_template`: an inline Jinja string (holds `{%` or `{{`) or a file path -> the template text."""
    if value is None or "{%" in value or "{{" in value:
        return value
    with open(value, encoding="utf-8") as f:
        return f.read()

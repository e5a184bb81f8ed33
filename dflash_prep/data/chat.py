"""Chat rows -> the template's own rendering, its token ids, and the assistant loss mask, for any chat template.

Rows come in as a `Conversation` of OpenAI messages (conversation.py: every accepted shape, per-turn weights, the
tool-call arguments as the data holds them).

The token ids are exactly the tokenization of the template's rendering of the whole conversation (what
`apply_chat_template(messages, tools=tools, **chat_template_kwargs)` gives), never of a re-assembled or
"training" variant: the drafter is conditioned on what the served target sees. Tool calls are rendered the one way
the template accepts, the same for every row (`ChatRenderer.tool_call_form`): arguments as an object (what vLLM
passes), else as the JSON text the data holds; a null content as missing, else as "".

The mask (docs/FORMAT.md states the convention): 1 on every token the assistant generates after the served prompt:
its text, its reasoning and its tool calls as the template renders them, and its end-of-turn marker; 0 on role
headers, the generation prompt, and system / user / tool text. Each assistant message's generated span is located
in the one full rendering, with no knowledge of the model family (a `{% generation %}` block is only compared with
it: a disagreement is logged once):

- start: the rendering of the messages before it (`R_i`, less an end-of-text the template appends only when no
  generation prompt is asked for) is located in the full rendering (at its end when the template is
  prefix-stable; else aligned, see `locate_end`), then the generation prompt (`G_i` minus `R_i`) is skipped as far
  as the full rendering repeats it (`prompt_length_present`). A template without a generation prompt: the
  assistant's header read off a probe reply stands for it, less its trailing whitespace (a separator the served
  model generates after the prompt). A first turn with nothing before it, or a prefix the template refuses to
  render: the header is found in a probe rendering (`_start_without_prefix`);
- end: where the rendering of the messages up to and including it (`R_{i+1}`) ends in the full rendering (the
  whole text, less that end-of-text, for the last message; see `_turn_end`), less trailing whitespace (the `\\n` a
  template writes after `<|im_end|>` or `<end_of_turn>` is the template's, not the model's). A turn that does not
  end with one of the model's stop tokens (`generation_config.json`), followed by one (GLM-style templates, where
  the next role's token ends a turn), has that token supervised too: it is what the model generates to stop;
- a token is supervised when its characters overlap a span (the rule transformers uses for `{% generation %}`);
- an assistant turn with `weight: 0` is located but not supervised.

A span that cannot be located, or spans out of order, skip the row (`assistant_span_not_found`) rather than guess.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import re
from dataclasses import dataclass

from dflash_prep.data.conversation import (
    BAD_CONTENT,
    BAD_STRUCTURE,
    BAD_TOOL_CALLS,
    BAD_TOOLS,
    BAD_WEIGHT,
    EMPTY,
    MEDIA_CONTENT,
    NO_ASSISTANT,
    NO_CONTENT_FIELD,
    ROLE_ALIASES,
    SPAN_NOT_FOUND,
    TEMPLATE_ERROR,
    UNKNOWN_ROLE,
    UNSUPPORTED_BLOCK,
    Conversation,
    SkipRow,
    conversation_of,
    one_line,
    read_conversation,
    row_to_chat,
)

# Rows in (conversation.py) are re-exported: other stages call chat.row_to_chat, and the skip reasons live beside it.
__all__ = [
    "BAD_CONTENT", "BAD_STRUCTURE", "BAD_TOOL_CALLS", "BAD_TOOLS", "BAD_WEIGHT", "EMPTY", "MEDIA_CONTENT",
    "NO_ASSISTANT", "NO_CONTENT_FIELD", "ROLE_ALIASES", "SPAN_NOT_FOUND", "TEMPLATE_ERROR", "UNKNOWN_ROLE",
    "UNSUPPORTED_BLOCK", "Conversation", "SkipRow", "conversation_of", "read_conversation", "row_to_chat",
    "ChatRenderer", "Rendered", "has_generation_block", "load_chat_template", "locate_end", "mask_from_spans",
    "prompt_length_present"
]

log = logging.getLogger(__name__)

_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")
_PIECES = re.compile(r"\w+|\s+|[^\w\s]")
_PROBE = "Zq7probe"  # content of the probe messages (ChatRenderer._turn_end, _start_without_prefix)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "zq7probe_fn", "description": "probe", "parameters": {
    "type": "object", "properties": {"zq7key": {"type": "string"}}}}}]
_LOGGED_ONCE: set[str] = set()  # (what, template digest) already logged by this process


# ------------------------------------------------------------------------------------------------ text search
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


def _log_once(key: str, message: str, *args) -> None:
    if key not in _LOGGED_ONCE:
        _LOGGED_ONCE.add(key)
        log.warning(message, *args)


# ------------------------------------------------------------------------------------------------ rendering
@dataclass
class Rendered:
    """A tokenized conversation: `input_ids` and `loss_mask` ([T] ints), and whether the rendering kept what the row
    holds: some assistant turn's reasoning (`renders_reasoning`), some tool call's function name inside an
    assistant turn (`renders_tool_calls`)."""

    input_ids: list[int]
    loss_mask: list[int]
    renders_reasoning: bool = False
    renders_tool_calls: bool = False


@dataclass
class RenderedSpans:
    """A conversation as this template renders it whole: the messages in the template's form, the text, the
    assistant spans ([(message index, start, end)] in characters), the token ids and their character offsets."""

    messages: list[dict]
    full: str
    spans: list[tuple[int, int, int]]
    input_ids: list[int]
    offsets: list[tuple[int, int]]


class ChatRenderer:
    """Renders conversations with one template and gives token ids and loss masks; see the module docstring.

    `tokenizer`: a transformers fast tokenizer (offsets are needed); `chat_template`: a Jinja string replacing the
    tokenizer's own, or None; `template_kwargs`: `data.chat_template_kwargs`; `stop_token_ids`: the ids the model
    stops on (`generation_config.json`'s `eos_token_id`, rows.stop_token_ids_of), for templates with no end-of-turn
    token; `missing_stop_source`: the generation_config.json looked for and not found (a template with no end-of-turn
    token then warns once: no turn end is supervised)."""

    def __init__(self, tokenizer, chat_template: str | None = None, template_kwargs: dict | None = None,
                 stop_token_ids: list[int] | None = None, missing_stop_source: str | None = None):
        self.tokenizer = tokenizer
        self.missing_stop_source = missing_stop_source  # the generation_config.json looked for and not found
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        self.template = template
        self.digest = hashlib.sha256((template or "").encode()).hexdigest()[:16]
        self.kwargs = {k: v for k, v in (template_kwargs or {}).items() if k != "add_generation_prompt"}
        self.generation_tagged = has_generation_block(template or "")
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        # the tokenizer's added tokens that the template writes (Llama-3 has 256, its template uses 4), and its
        # special tokens (an eos_token the template writes through a variable)
        self.markers = tuple(sorted({t.content for t in added if t.content.strip() and (
            t.content in (template or "") or t.special)}, key=lambda m: (-len(m), m)))
        stops = {tokenizer.convert_ids_to_tokens(int(i)) for i in (stop_token_ids or [])}
        self.stop_texts = tuple(sorted(s for s in stops if isinstance(s, str) and s in self.markers))
        self.tool_call_form = self._tool_call_form()
        self.hint_rows_left = 64  # rows compared with the {% generation %} blocks (a template's wrapping is systematic)

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.kwargs)

    # ---------------------------------------------------------------------------------------- tool calls
    def _tool_call_form(self) -> tuple[str, str | None]:
        """(arguments as "object" or "string", null content as None or "") that this template renders: the first
        of (object, None), (string, None), (object, ""), (string, "") whose probe rendering holds the argument
        value and no Python dict (`{'key': ...}`: a template that concatenates or prints the arguments as text).
        Decided once per template, so every row is rendered the same way."""
        for null_content in (None, ""):
            for form in ("object", "string"):
                args = {"zq7key": "zq7value"} if form == "object" else '{"zq7key": "zq7value"}'
                call = {"id": "Zq7probe1", "type": "function", "function": {"name": "zq7probe_fn", "arguments": args}}
                probe = [{"role": "user", "content": _PROBE}, {"role": "assistant", "content": null_content,
                                                                 "tool_calls": [call]}]
                try:
                    text = self.render(probe, _PROBE_TOOLS, False)
                except Exception:  # noqa: BLE001 - the template refuses this form: try the next
                    continue
                if "zq7value" in text and "{'zq7key'" not in text:
                    return form, null_content
        return "object", None  # no form renders: rows with tool calls fail alike, with the template's error

    def template_messages(self, conv: Conversation) -> list[dict]:
        """The messages as this template takes them (`tool_call_form`)."""
        form, null_content = self.tool_call_form
        if form == "object" and null_content is None:
            return conv.messages
        out = []
        for i, m in enumerate(conv.messages):
            if m.get("tool_calls"):
                m = {**m, "content": null_content if m.get("content") is None else m["content"]}
                if form == "string":
                    m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": conv.arguments_text[(i, j)]}}
                                       for j, c in enumerate(m["tool_calls"])]
            out.append(m)
        return out

    # ---------------------------------------------------------------------------------------- spans
    def _token_safe(self, text: str, n: int) -> int:
        """`n`, moved back to the start of any marker of `text` that straddles it."""
        moved = True
        while moved:
            moved = False
            for m in self.markers:
                j = text.find(m, max(0, n - len(m) + 1), n - 1 + len(m))
                if 0 <= j < n:
                    n, moved = j, True
        return n

    def _is_closing(self, text: str) -> bool:
        """True for text made of markers and whitespace only, holding a marker (an end-of-text token)."""
        rest = text
        for m in self.markers:
            rest = rest.replace(m, "")
        return bool(text.strip()) and not rest.strip()

    def _header_key(self, prompt: str) -> str:
        """What opens an assistant header: the marker a generation prompt starts with, else its first line."""
        marker = next((m for m in self.markers if prompt.startswith(m)), None)
        if marker is not None:
            return marker
        return prompt[: prompt.find("\n") + 1] if "\n" in prompt else prompt

    def _probe_header(self, head: list[dict], tools: list[dict] | None, before: str) -> str:
        """The text a template without a generation prompt writes between `head` (rendered as `before`) and an
        assistant reply's content, read off a probe reply; "" when none is found."""
        try:
            probed = self.render(head + [{"role": "assistant", "content": _PROBE}], tools, False)
        except Exception:  # noqa: BLE001 - a template may refuse such a probe; then no header is known
            return ""
        at = probed.find(_PROBE, len(before))
        return probed[len(before):at] if probed.startswith(before) and at >= 0 else ""

    def _prompt_after(self, head: list[dict], tools: list[dict] | None) -> tuple[str, str, str]:
        """(R, G, C) after the messages `head`: their rendering without a generation prompt, less C; the
        generation prompt G the template writes after them; C, an end-of-text the template writes only when no
        generation prompt is asked for (Phi-3.5 and Phi-4-mini append eos_token), else "". A template with no
        generation prompt: G is the assistant's header read off a probe reply, less its trailing whitespace (a
        separator the served model generates after the prompt). Raises what the template raises."""
        before = self.render(head, tools, False)
        prompted = self.render(head, tools, True)
        closing = ""
        if prompted.startswith(before):
            cut = len(before)
        else:
            cut = _common_prefix_length(before, prompted)
            safe = self._token_safe(before, cut)
            if self._is_closing(before[safe:]):
                cut, closing, before = safe, before[safe:], before[:safe]
        prompt = prompted[cut:]
        if not prompt:
            prompt = self._probe_header(head, tools, before).rstrip()
        return before, prompt, closing

    def _turn_start(self, messages: list[dict], i: int, tools: list[dict] | None,
                    full: str) -> tuple[int, str, str]:
        """(start of assistant message i's generated text in `full`, its generation prompt, the template's
        end-of-text C of `_prompt_after`). Raises SkipRow."""
        if i > 0:
            try:
                before, prompt, closing = self._prompt_after(messages[:i], tools)
            except Exception:  # noqa: BLE001 - a template may refuse the cut conversation (no user turn yet)
                return self._start_without_prefix(messages, i, tools, full)
            boundary = locate_end(before, full)
            if boundary is None:
                raise SkipRow(SPAN_NOT_FOUND, f"message {i} (assistant): the rendering of the messages before it "
                                              f"is not found in the rendering of the whole conversation")
            return boundary + prompt_length_present(prompt, full[boundary:], self.markers), prompt, closing
        return self._start_without_prefix(messages, i, tools, full)

    def _start_without_prefix(self, messages: list[dict], i: int, tools: list[dict] | None,
                              full: str) -> tuple[int, str, str]:
        """`_turn_start` for an assistant message whose preceding messages cannot be rendered alone (none: the row
        opens with the assistant; or the template refuses them). A probe reply in its place gives the text before
        its content (`opening`: the template's preamble and the header); the header begins at the last place
        `opening` has the opening marker (or line) of the generation prompt the template writes after a user turn,
        and that prompt is skipped from there as for any turn. A template with no such prompt: the generated text
        starts at the end of `opening`, less its trailing whitespace (a separator, generated)."""
        probe = {"role": "assistant", "content": _PROBE}
        opening = None
        for conv in (messages[:i] + [probe], messages[:i] + [probe] + messages[i + 1:]):
            try:
                text = self.render(conv, tools, False)
            except Exception:  # noqa: BLE001 - the next form may render
                continue
            if _PROBE in text:
                opening = text[: text.find(_PROBE)]
                break
        try:
            _, prompt, closing = self._prompt_after(messages[:i] + [{"role": "user", "content": _PROBE}], tools)
        except Exception:  # noqa: BLE001 - no prompt known: the header is what precedes the content
            prompt, closing = "", ""
        key = self._header_key(prompt)
        at = opening.rfind(key) if opening is not None and key else -1
        at = at if at >= 0 or opening is None else len(opening.rstrip())  # a separator is generated
        if opening is None or not full.startswith(opening[:at]):
            raise SkipRow(SPAN_NOT_FOUND, f"message {i} (assistant): the template renders neither the messages "
                                          f"before it nor a probe reply in its place like the whole conversation")
        return at + prompt_length_present(prompt, full[at:], self.markers), prompt, closing

    def _turn_end(self, messages: list[dict], i: int, tools: list[dict] | None, full: str, prompt: str,
                  closing: str) -> int | None:
        """Where the rendering of the messages up to assistant message i (not the last) ends in `full`, less the
        template's end-of-text `closing`. A template may render a conversation's last message differently (gpt-oss
        ends it with <|return|> instead of <|end|>, Qwen3 adds an empty think block): then the messages are rendered
        followed by a probe assistant message, which makes message i render as it does mid-conversation, and are cut
        where the probe's header (`_header_key` of `prompt`) begins."""
        head = messages[: i + 1]
        try:
            after = self.render(head, tools, False)
        except Exception:  # noqa: BLE001 - a template may refuse the cut conversation; the probe may render
            after = None
        if after is not None and closing and after.endswith(closing):
            after = after[: -len(closing)]
        if after is not None and full.startswith(after):
            return len(after)
        try:
            probed = self.render(head + [{"role": "assistant", "content": _PROBE}], tools, False)
        except Exception:  # noqa: BLE001 - e.g. a template that refuses two assistant turns in a row
            probed = ""
        at = probed.rfind(_PROBE)
        if at >= 0:
            header = self._header_key(prompt)
            cut = probed.rfind(header, 0, at) if header else at
            end = locate_end(probed[:cut], full) if cut > 0 else None
            if end is not None:
                return end
        if after is not None:
            return locate_end(after, full)
        return self._end_before_user_probe(head, tools, full)

    def _end_before_user_probe(self, head: list[dict], tools: list[dict] | None, full: str) -> int | None:
        """The end of `head`'s last message in `full` for a template that renders `head` neither alone nor before
        a probe reply (Qwen3.5/3.6 refuse a conversation with no user turn: an assistant-first row): `head` is
        rendered before a probe user turn and cut where that turn's header begins (its last marker, or its last
        line, as a probe user turn rendered alone shows it)."""
        user = {"role": "user", "content": _PROBE}
        try:
            with_user, alone = self.render(head + [user], tools, False), self.render([user], tools, False)
        except Exception:  # noqa: BLE001 - nothing renders: the span is not found
            return None
        if _PROBE not in alone or _PROBE not in with_user:
            return None
        header = alone[: alone.find(_PROBE)]
        starts = [header.rfind(m) for m in self.markers if m in header]
        key = header[max(starts):] if starts else header[header.rstrip("\n").rfind("\n") + 1:]
        at = with_user.rfind(_PROBE)
        cut = with_user.rfind(key, 0, at) if key else at
        return locate_end(with_user[:cut], full) if cut > 0 else None

    def _stop_after(self, full: str, start: int, end: int) -> tuple[int, int] | None:
        """The span of a stop token (`stop_texts`) that follows a turn [start, end) not ending with one, past
        whitespace: what a model whose template has no end-of-turn token generates to end its turn (GLM-style: the
        next role's token)."""
        if not self.stop_texts or any(full.endswith(s, start, end) for s in self.stop_texts):
            return None
        j = end
        while j < len(full) and full[j].isspace():
            j += 1
        stop = next((s for s in self.stop_texts if full.startswith(s, j)), None)
        return (j, j + len(stop)) if stop else None

    def assistant_spans(self, messages: list[dict], tools: list[dict] | None,
                        full: str) -> list[tuple[int, int, int]]:
        """[(message index, start, end)]: character spans of the assistant messages' generated text in `full`, in
        order (a turn may have a second span: its stop token, `_stop_after`). Raises SkipRow."""
        spans: list[tuple[int, int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, prompt, closing = self._turn_start(messages, i, tools, full)
            if i == len(messages) - 1:
                end = len(full) - len(closing) if closing and full.endswith(closing) else len(full)
            else:
                end = self._turn_end(messages, i, tools, full, prompt, closing)
            if end is None or end < start or (spans and start < spans[-1][2]):
                raise SkipRow(SPAN_NOT_FOUND, f"message {i} (assistant): the end of its text is not found in the "
                                              f"rendering of the whole conversation" if end is None else
                                              f"message {i} (assistant): its located text overlaps another turn's")
            while end > start and full[end - 1].isspace():
                end -= 1
            if end > start:  # an empty reply a template renders as nothing supervises nothing
                spans.append((i, start, end))
                stop = self._stop_after(full, start, end)
                if stop is not None:
                    spans.append((i, *stop))
        return spans

    # ---------------------------------------------------------------------------------------- tokens
    def rendered_spans(self, conv: Conversation) -> RenderedSpans:
        """The conversation rendered whole, tokenized, and its assistant spans located (`assistant_spans`). Raises
        SkipRow (`chat_template_error` with the template's own error as the detail)."""
        messages = self.template_messages(conv)
        try:
            full = self.render(messages, conv.tools, False)
            spans = self.assistant_spans(messages, conv.tools, full)
        except SkipRow:
            raise
        except Exception as e:  # noqa: BLE001 - a template may reject a role order, a missing field...
            raise SkipRow(TEMPLATE_ERROR, f"{type(e).__name__}: {one_line(e, 240)}") from e
        if self.missing_stop_source and spans and not any(
                full.endswith(m, 0, e) for _, _, e in spans for m in self.markers):
            _log_once("no-end-of-turn:" + self.digest, "data: the chat template writes no end-of-turn token after "
                      "assistant turns and no stop ids were found (no %s): no turn end is supervised, so the "
                      "drafter never sees the model stop; put the model's generation_config.json there (logged "
                      "once)", self.missing_stop_source)
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        return RenderedSpans(messages, full, spans, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]])

    def tokenize_conversation(self, conv: Conversation, supervised: set[int] | None = None) -> Rendered:
        """-> Rendered: the ids exactly `apply_chat_template`'s, the mask of the convention with `weight: 0` turns
        left out (and, with `supervised`, every assistant message whose index it does not hold). Raises SkipRow
        (`chat_template_error` with the template's own error as the detail)."""
        r = self.rendered_spans(conv)
        if self.generation_tagged:
            self._compare_with_generation_blocks(r.messages, conv.tools, r.input_ids, r.offsets, r.spans)
        weights = conv.weights or [None] * len(r.messages)
        mask = mask_from_spans(r.offsets, [(s, e) for i, s, e in r.spans if weights[i] != 0
                                           and (supervised is None or i in supervised)])
        return Rendered(r.input_ids, mask, *self._kinds_rendered(r.messages, r.full, r.spans))

    def served_prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The token ids of the prompt served for an assistant turn after `messages` (this template's form of them,
        `template_messages`): rendered with the generation prompt, tokenized without special tokens added on top.
        What the in-process engine runs, and the context of a `per_turn` sample. Raises what the template raises."""
        text = self.render(messages, tools, True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prefix_stable(self, messages: list[dict], tools: list[dict] | None, full: str, turns: list[int]) -> bool:
        """Whether the whole rendering `full` shows each assistant turn of `turns` in the context the target had
        when it wrote it: the rendering of the messages before turn i with the generation prompt, and that of the
        messages up to turn i (less an end-of-text the template writes only without a generation prompt), are both
        where `full` starts. False for a template that drops earlier turns' reasoning (Qwen3), or renders a last
        turn unlike a mid-conversation one (an empty think block, gpt-oss's <|return|>). Raises what the template
        raises."""
        for i in turns:
            before, prompt, closing = self._prompt_after(messages[:i], tools) if i else ("", "", "")
            if not full.startswith(before + prompt):
                return False
            if i < len(messages) - 1:
                upto = self.render(messages[: i + 1], tools, False)
                if closing and upto.endswith(closing):
                    upto = upto[: -len(closing)]
                if not full.startswith(upto):
                    return False
        return True

    def tokenize(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], list[int]]:
        """OpenAI messages (row_to_chat's) -> (input_ids, loss_mask), each [T] ints. Raises SkipRow."""
        rendered = self.tokenize_conversation(conversation_of(messages, tools))
        return rendered.input_ids, rendered.loss_mask

    @staticmethod
    def _kinds_rendered(messages: list[dict], full: str, spans: list[tuple[int, int, int]]) -> tuple[bool, bool]:
        """(some turn's reasoning is in its rendered turn: its first line's first 40 characters; some tool call's
        function name is)."""
        region: dict[int, tuple[int, int]] = {}
        for i, s, e in spans:
            a, b = region.get(i, (s, e))
            region[i] = (min(a, s), max(b, e))
        reasoning = tool_calls = False
        for i, (s, e) in region.items():
            text, message = full[s:e], messages[i]
            lines = (message.get("reasoning_content") or "").strip().splitlines()
            reasoning = reasoning or bool(lines and lines[0].strip()[:40] in text)
            tool_calls = tool_calls or any(c["function"]["name"] in text for c in message.get("tool_calls") or [])
        return reasoning, tool_calls

    def _compare_with_generation_blocks(self, messages: list[dict], tools: list[dict] | None, ids: list[int],
                                        offsets: list, spans: list[tuple[int, int, int]]) -> None:
        """A template's `{% generation %}` blocks are a hint only: the mask they give (transformers'
        `return_assistant_tokens_mask`) is compared with the convention's on the renderer's first 64 rows (a block
        that wraps a header or a newline does so on every turn), and the first disagreement is logged (once per
        template and process), naming the tokens it would supervise or leave out."""
        key = "generation:" + self.digest
        if key in _LOGGED_ONCE or self.hint_rows_left <= 0:
            return
        self.hint_rows_left -= 1
        try:
            out = self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                     tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True, **self.kwargs)
        except Exception:  # noqa: BLE001 - the hint is optional
            return
        hint, mask = list(out["assistant_masks"]), mask_from_spans(offsets, [(s, e) for _, s, e in spans])
        if list(out["input_ids"]) != ids or hint == mask:
            return
        extra = [self.tokenizer.decode([ids[t]]) for t in range(len(ids)) if hint[t] and not mask[t]]
        missing = [self.tokenizer.decode([ids[t]]) for t in range(len(ids)) if mask[t] and not hint[t]]
        _log_once(key, "data: the chat template's {%% generation %%} blocks disagree with the loss-mask convention "
                  "(docs/FORMAT.md) on a row: they supervise %d tokens it leaves out %s and leave out %d it "
                  "supervises %s; the mask follows the convention (logged once)", len(extra), extra[:6],
                  len(missing), missing[:6])

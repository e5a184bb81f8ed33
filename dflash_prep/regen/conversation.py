"""The conversation rules: which turns the target writes, what it is asked, and what a row becomes.

A row is read as the extraction reads it (data/chat.py: OpenAI `messages`, ShareGPT or role/content
`conversations`, a `tools` column) and normalized to OpenAI messages. Every non-assistant turn (system, user, tool)
is kept as it is. The target is asked for assistant turns, one `Request` per turn, each with the conversation as it
stands before that turn:

- `turns: last`: the final assistant turn is replaced by the target's; earlier assistant turns are kept from the
  data. A conversation ending in a user or tool turn (a prompt-only row) gets its answer appended.
- `turns: all`: every assistant turn is the target's, turn k generated from the target's own turns before it
  (multi-turn on-policy), and a conversation ending in a user or tool turn gets its answer appended.
- An assistant turn with no user or tool turn before it (an opening greeting) has no prompt: it is kept.
- An assistant turn with `weight: 0` is never regenerated: it stays the data's text, keeps its weight in the output
  (the extraction never supervises it), and the turns after it are asked with it in their context. Data messages
  after the last generated turn (a final `weight: 0` turn) are kept as they are.

Token ids: each generated turn's provenance keeps the engine's `completion_token_ids` (the stop token included
when it stopped on one) and `prompt_token_ids` where the engine gives them (None otherwise); the extraction builds
the turn from them (data/samples.py).

Tool calls (`turns: all`): the data's tool results answer the data's calls. A generated turn whose calls are the
data turn's (same number, names and arguments, compared as parsed JSON, in order) goes on: the data's tool results
follow, their `tool_call_id` pointing at the generated calls' ids. A generated turn whose calls differ (other
calls, calls where the data answered in text, or text where the data called a tool) ends the conversation right
after it: nothing in the data answers it. Each outcome is counted (`tool_calls`: `same_calls_continued`,
`other_calls_ended`, and `other_calls_last_turn` where the turn was the last one anyway).

Seeds: a request's seed is a hash of `regenerate.seed`, the row's position in the data and the turn's message index
(`request_seed`): stable across runs, processes and resumes, different for every turn.

Finish reason `length` (a turn cut by `max_tokens`): `on_length: keep` keeps the turn as generated and goes on;
`drop` drops the row (skip reason `finish_reason_length`). An engine's refusal (`Answer.rejected`) skips the row
(`rejected_by_engine`, the engine's reason kept with it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from dflash_prep.data import chat
from dflash_prep.regen.engine import FINISH_LENGTH, Answer, Request

SKIP_PRETOKENIZED = "pretokenized_row"  # input_ids rows hold no conversation to regenerate
SKIP_NO_PROMPT = "no_prompt"  # no assistant turn has a user or tool turn before it
SKIP_REJECTED = "rejected_by_engine"
SKIP_LENGTH = "finish_reason_length"

SAME_CALLS, OTHER_CALLS_ENDED, OTHER_CALLS_LAST = "same_calls_continued", "other_calls_ended", "other_calls_last_turn"

MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "weight")


class RowSkip(str):
    """A skip reason (the string) with its one-line `detail`, as the extraction's skips have."""

    def __new__(cls, reason: str, detail: str | None = None):
        obj = super().__new__(cls, reason)
        obj.detail = detail
        return obj


@dataclass(frozen=True)
class RegenSettings:
    """What every request of a run shares (from the recipe's `regenerate` section, sampling resolved)."""

    turns: str  # "last" | "all"
    sampling: dict  # sampling.resolve_sampling: {} greedy
    max_tokens: int
    chat_template_kwargs: dict
    on_length: str  # "keep" | "drop"
    seed: int


def request_seed(seed: int, position: int, message_index: int) -> int:
    """A seed in [0, 2**31) from the recipe's seed, the row's position and the turn (31 bits: every server takes it)."""
    digest = hashlib.sha256(f"dflash-prep:regenerate:{seed}:{position}:{message_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFFFFFF


def _openai_message(message: dict) -> dict:
    """A normalized message (chat.row_to_chat) in the OpenAI form: tool-call arguments as JSON strings, the
    reasoning as `reasoning_content` only (chat.py adds `thinking` for gpt-oss templates)."""
    out = {"role": message["role"], "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            args = call["function"]["arguments"]
            item = {"type": "function", "function": {"name": call["function"]["name"], "arguments":
                                                     args if isinstance(args, str) else json.dumps(args)}}
            if call.get("id") is not None:
                item["id"] = call["id"]
            calls.append(item)
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name", "weight"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def normalize_row(row: dict) -> tuple[list[dict], list[dict] | None]:
    """A row -> (OpenAI messages, tools); an assistant message with a per-turn weight keeps it (`weight`). Raises
    chat.SkipRow(reason, detail) for a row that holds no usable conversation; a row with no assistant turn at all
    (prompts only) is accepted."""
    if row.get("input_ids") is not None and row.get("messages") is None and row.get("conversations") is None:
        raise chat.SkipRow(SKIP_PRETOKENIZED, "the row holds input_ids, no conversation to regenerate")
    drop_last = False
    try:
        conv = chat.read_conversation(row)
    except chat.SkipRow as e:
        if e.args[0] != chat.NO_ASSISTANT:
            raise
        # Prompts only: normalize them with a placeholder answer in the row's own layout, then drop it.
        key = "messages" if row.get("messages") is not None else "conversations"
        turns = row[key]
        placeholder = {"from": "gpt", "value": ""} if "from" in turns[0] else {"role": "assistant", "content": ""}
        conv, drop_last = chat.read_conversation({**row, key: [*turns, placeholder]}), True
    weights = conv.weights or [None] * len(conv.messages)
    messages = [_openai_message({**m, "weight": w} if w is not None else m)
                for m, w in zip(conv.messages, weights)]
    return (messages[:-1] if drop_last else messages), conv.tools


def generated_positions(messages: list[dict], turns: str) -> list[int]:
    """Message indexes the target writes (`len(messages)` = an answer appended after the last turn); an
    assistant turn with `weight: 0` is never one."""
    has_prompt, positions = False, []
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and has_prompt and message.get("weight") != 0:
            positions.append(i)
        has_prompt = has_prompt or message["role"] in ("user", "tool")
    if messages and messages[-1]["role"] != "assistant" and has_prompt:
        positions.append(len(messages))
    if turns == "last":
        positions = positions[-1:]
    return positions


def _arguments(call: dict):
    args = call.get("function", {}).get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args.strip()
    return args


def same_calls(data_calls: list[dict] | None, generated_calls: list[dict] | None) -> bool:
    """Whether a generated turn calls what the data turn called: same number of calls, and each the same name and
    arguments (parsed JSON compared as values), in order. Two turns without calls are the same."""
    data_calls, generated_calls = data_calls or [], generated_calls or []
    return len(data_calls) == len(generated_calls) and all(
        a.get("function", {}).get("name") == b.get("function", {}).get("name") and _arguments(a) == _arguments(b)
        for a, b in zip(data_calls, generated_calls))


@dataclass
class Conversation:
    """One row being regenerated: `next_request()` -> the next turn to ask for (None when done), `accept(answer)`,
    then `result()` (the output row) or `skip_reason` (and `skip_detail`)."""

    position: int  # the row's position in the data (its sample id in the extraction: `{position:010d}`)
    source_id: str | None
    data: list[dict]  # the data's messages, OpenAI form
    tools: list[dict] | None
    targets: list[int]
    settings: RegenSettings
    messages: list[dict] = field(default_factory=list)  # the conversation so far
    next_target: int = 0
    turns: list[dict] = field(default_factory=list)  # per generated turn: index, finish reason, tokens, seed
    tool_calls: dict = field(default_factory=dict)  # outcome -> count
    ended_early: str | None = None
    skip_reason: str | None = None
    skip_detail: str | None = None
    done: bool = False

    @classmethod
    def of_row(cls, row: dict, position: int, settings: RegenSettings, id_column: str | None = None):
        """-> Conversation, or the skip reason (RowSkip, a str with its `detail`) of a row that cannot be
        regenerated."""
        try:
            data, tools = normalize_row(row)
        except chat.SkipRow as e:
            return RowSkip(e.reason, e.detail or None)
        targets = generated_positions(data, settings.turns)
        if not targets:
            return RowSkip(SKIP_NO_PROMPT, "no assistant turn to write has a user or tool turn before it (roles: "
                           + ", ".join(m["role"] for m in data)[:80] + ")")
        source_id = row.get(id_column or "id")
        if isinstance(source_id, (dict, list)):
            source_id = json.dumps(source_id, sort_keys=True)
        conv = cls(position=position, source_id=None if source_id is None else str(source_id), data=data,
                   tools=tools, targets=targets, settings=settings)
        conv.messages = [dict(m) for m in data[: targets[0]]]
        return conv

    def next_request(self) -> Request | None:
        if self.done:
            return None
        index = self.targets[self.next_target]
        s = self.settings
        messages = [{k: v for k, v in m.items() if k != "weight"} for m in self.messages]  # ours, not the API's
        return Request(messages=messages, tools=self.tools, sampling=dict(s.sampling),
                       seed=request_seed(s.seed, self.position, index), max_tokens=s.max_tokens,
                       chat_template_kwargs=dict(s.chat_template_kwargs))

    def accept(self, answer: Answer) -> None:
        """The answer to `next_request()`: the turn is added and the conversation moves on, ends, or is skipped."""
        index = self.targets[self.next_target]
        if answer.rejected is not None:
            self._skip(SKIP_REJECTED, answer.rejected)
            return
        self.turns.append({"message_index": len(self.messages), "finish_reason": answer.finish_reason,
                           "prompt_tokens": int(answer.prompt_tokens),
                           "completion_tokens": int(answer.completion_tokens),
                           "seed": request_seed(self.settings.seed, self.position, index),
                           "prompt_token_ids": _ids(answer.prompt_token_ids),
                           "completion_token_ids": _ids(answer.completion_token_ids)})
        if answer.finish_reason == FINISH_LENGTH and self.settings.on_length == "drop":
            self._skip(SKIP_LENGTH, f"turn {len(self.messages)} reached max_tokens={self.settings.max_tokens}")
            return
        # no text and no call (a turn that is all reasoning, cut by max_tokens): "" - a null content without tool
        # calls is no valid assistant message for the extraction (non_string_content)
        turn = {"role": "assistant", "content": answer.content if answer.content is not None or answer.tool_calls
                else ""}
        if answer.reasoning_content is not None:
            turn["reasoning_content"] = answer.reasoning_content
        if answer.tool_calls:
            turn["tool_calls"] = [dict(c) for c in answer.tool_calls]
        self.messages.append(turn)
        self.next_target += 1
        last = self.next_target == len(self.targets)
        original = self.data[index] if index < len(self.data) else None
        if original is not None and (original.get("tool_calls") or answer.tool_calls):
            if same_calls(original.get("tool_calls"), answer.tool_calls):
                self._count(SAME_CALLS)
            else:
                self._count(OTHER_CALLS_LAST if last else OTHER_CALLS_ENDED)
                if not last:
                    self.ended_early = OTHER_CALLS_ENDED
                    self.done = True
                    return
        ids = _call_id_map(original, answer)
        upto = len(self.data) if last else self.targets[self.next_target]
        for message in self.data[index + 1: upto]:  # the turns in between (after the last: weight-0 ones)
            message = dict(message)
            if message.get("tool_call_id") in ids:
                message["tool_call_id"] = ids[message["tool_call_id"]]
            self.messages.append(message)
        if last:
            self.done = True

    def _count(self, outcome: str) -> None:
        self.tool_calls[outcome] = self.tool_calls.get(outcome, 0) + 1

    def _skip(self, reason: str, detail: str) -> None:
        self.skip_reason, self.skip_detail, self.done = reason, detail, True

    def result(self, provenance: dict) -> dict:
        """The output row: OpenAI messages (every key of MESSAGE_KEYS, null where absent), `tools` as a JSON string
        (tool schemas differ in keys: one table column of structs would fill the missing ones with null), the row's
        own id and position, and `regen`: `provenance` (engine, model, sampling; the same for every row) with this
        row's generated turns (message index, finish reason, prompt / completion tokens, seed)."""
        return {
            "id": self.source_id,
            "source_row": self.position,
            "messages": [{k: m.get(k) for k in MESSAGE_KEYS} for m in self.messages],
            "tools": None if self.tools is None else json.dumps(self.tools),
            "regen": {**provenance, "turns": self.turns, "ended_early": self.ended_early},
        }


def _ids(ids) -> list[int] | None:
    return None if ids is None else [int(t) for t in ids]


def _call_id_map(original: dict | None, answer: Answer) -> dict:
    """data call id -> generated call id, position by position (the calls are the same ones)."""
    if original is None or not original.get("tool_calls") or not answer.tool_calls:
        return {}
    return {a["id"]: b["id"] for a, b in zip(original["tool_calls"], answer.tool_calls)
            if a.get("id") is not None and b.get("id") is not None}

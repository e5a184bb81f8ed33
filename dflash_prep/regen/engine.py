"""What every regeneration engine speaks: a `Request` (one assistant turn to generate) in, an `Answer` out.

The conversation rules (regen/conversation.py) turn a row into requests, one turn at a time; an engine answers a list
of requests in any order it likes (concurrent HTTP calls, length-grouped batches) and returns the answers in the
order of the requests. Engines never see rows, ids or the output folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

FINISH_STOP, FINISH_LENGTH, FINISH_TOOL_CALLS = "stop", "length", "tool_calls"


@dataclass(frozen=True)
class Request:
    """One assistant turn to generate.

    messages: OpenAI chat messages before the turn (roles system/user/assistant/tool; assistant turns may hold
        `reasoning_content` and `tool_calls` with JSON-string `arguments`, as the OpenAI API has them).
    tools: the OpenAI `tools` list of the row, or None.
    sampling: sampling parameters by their OpenAI / vLLM names (`temperature`, `top_p`, `top_k`, `min_p`,
        `repetition_penalty`, ...); an empty dict is greedy decoding.
    seed: the per-request seed (derived from the row and the recipe: conversation.request_seed).
    max_tokens: new tokens at most.
    chat_template_kwargs: passed to the server (`chat_template_kwargs`) or to `apply_chat_template`.
    """

    messages: list[dict]
    tools: list[dict] | None
    sampling: dict
    seed: int
    max_tokens: int
    chat_template_kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """The generated turn, or why there is none.

    content: the assistant's text (None when it only called tools).
    reasoning_content: the reasoning the server's (or the template's) parser split off, else None.
    tool_calls: OpenAI tool calls (`[{"id", "type": "function", "function": {"name", "arguments": str}}]`) or None.
    finish_reason: `stop`, `length`, `tool_calls` (as the server says it).
    prompt_tokens / completion_tokens: token counts of the prompt and the generated turn.
    prompt_token_ids: the served prompt's token ids, where the engine has them (the in-process engine always; a
        server that returns them: vLLM, SGLang), else None.
    completion_token_ids: the ids the engine generated, the stop token included when it stopped on one, where the
        engine has them, else None (the text is then all there is: `transformers serve`).
    rejected: None for an answer; else the reason the engine refused this one request (a 4xx, a prompt longer than
        the context): a counted skip of the row, never the end of the run.
    """

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    finish_reason: str = FINISH_STOP
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejected: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None


class EngineUnavailable(RuntimeError):
    """The engine cannot answer at all (a server down past its retries): the run stops, resumable (exit code 1)."""


class Engine(Protocol):
    """An engine: `identity()` says what would change the text (compared on resume), `answer()` does the work."""

    def identity(self) -> dict:
        """JSON-able facts that decide the generated text: model identity, engine name, served model name."""

    def answer(self, requests: list[Request]) -> list[Answer]:
        """One answer per request, in the requests' order. Raises EngineUnavailable when the engine is gone."""

    def close(self) -> None:
        """Release servers' connections, threads, or the model."""

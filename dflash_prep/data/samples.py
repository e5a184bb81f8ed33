"""One conversation row -> its samples: the whole conversation, or one sample per supervised assistant turn, built
from the target's own token ids where the row holds them (docs/ON_POLICY.md).

`data.samples`:
- `conversation`: one sample per row, the template's rendering of the whole conversation (chat.py's mask);
- `per_turn`: one sample per supervised assistant turn i: the served prompt of that turn (the rendering of the
  messages before it with the generation prompt), then the turn; only that turn supervised. Its sample id is the
  row's with `_t` and the message index (`0000000012_t0003`);
- `auto` (default): `per_turn` for a row whose whole rendering does not show some supervised turn in the context the
  target had (`ChatRenderer.prefix_stable`: Qwen3's template drops earlier turns' reasoning), or whose generated ids
  for a turn before the last differ from the template's rendering of its text; `conversation` otherwise.

Regenerated rows (`dflash-prep regenerate`'s output, a `regen` column): only the generated turns are supervised
(turns kept from the data, `weight: 0` ones included, are context), and a generated turn that carries its
`completion_token_ids` is built from them, not from its re-tokenized text:
- `per_turn`: the engine's `prompt_token_ids` (else the served prompt rendered here) + the completion ids, all of the
  completion supervised;
- `conversation`: the turn's tokens in the whole rendering are replaced by the completion ids (the ids win; a turn
  whose ids differ from the rendering is counted). A turn that stopped on a stop token supervises that token,
  whichever it was (it replaces the template's end-of-turn marker); a turn cut by `max_tokens` has no end-of-turn
  supervised: the marker the template writes after it stays, as context.
A generated turn without ids (a server that returns none) is rendered from its text, as any turn; cut by
`max_tokens`, the end-of-turn marker the template writes after it is context there too.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from dflash_prep.data.chat import ChatRenderer, RenderedSpans, mask_from_spans
from dflash_prep.data.conversation import Conversation
from dflash_prep.units import format_bytes

SAMPLES_MODES = ("conversation", "per_turn", "auto")
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class GeneratedTurn:
    """A turn the target generated (a regenerated row's `regen.turns` entry)."""

    message_index: int
    finish_reason: str
    completion_ids: list[int] | None
    prompt_ids: list[int] | None


@dataclass
class Sample:
    """One sample of a row: `suffix` ("" for the whole conversation, `_tNNNN` for one turn), ids and mask ([T])."""

    suffix: str
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class RowSamples:
    """What a row became: its samples, the mode decided for it, and its generated turns counted: built from ids,
    from text (no ids), whose ids differ from the template's rendering of their text, cut by `max_tokens`;
    `conversation_tokens`: the whole conversation's tokens (what one sample would hold)."""

    samples: list[Sample]
    mode: str
    renders_reasoning: bool = False
    renders_tool_calls: bool = False
    turns_from_ids: int = 0
    turns_from_text: int = 0
    turns_ids_differ: int = 0
    turns_cut: int = 0
    conversation_tokens: int = 0
    differing: set = field(default_factory=set)


def generated_turns(row: dict) -> dict[int, GeneratedTurn] | None:
    """message index -> GeneratedTurn of a regenerated row (its `regen` column), None for any other row."""
    regen = row.get("regen")
    if not isinstance(regen, dict) or not isinstance(regen.get("turns"), list):
        return None
    out = {}
    for turn in regen["turns"]:
        if not isinstance(turn, dict) or not isinstance(turn.get("message_index"), int):
            continue
        ids, prompt = turn.get("completion_token_ids"), turn.get("prompt_token_ids")
        out[turn["message_index"]] = GeneratedTurn(turn["message_index"], str(turn.get("finish_reason") or ""),
                                                   None if ids is None else [int(t) for t in ids],
                                                   None if prompt is None else [int(t) for t in prompt])
    return out


def _token_range(offsets: list[tuple[int, int]], starts: list[int], ends: list[int], s: int, e: int):
    """[a, b): the tokens whose characters overlap [s, e)."""
    return bisect_right(ends, s), bisect_left(starts, e)


class SampleBuilder:
    """Builds a row's samples with one renderer (module docstring). `stop_token_ids`: the ids the model stops on."""

    def __init__(self, renderer: ChatRenderer, mode: str, stop_token_ids: list[int]):
        self.renderer, self.mode = renderer, mode
        tokenizer = renderer.tokenizer
        self.stop_ids = set(int(i) for i in stop_token_ids)
        marker_ids = tokenizer.convert_tokens_to_ids(list(renderer.markers)) if renderer.markers else []
        self.marker_ids = {int(i) for i in marker_ids if isinstance(i, int) and i != tokenizer.unk_token_id}

    def build(self, conv: Conversation, generated: dict[int, GeneratedTurn] | None) -> RowSamples:
        """-> RowSamples. Raises SkipRow (chat.py's reasons)."""
        r = self.renderer.rendered_spans(conv)
        weights = conv.weights or [None] * len(r.messages)
        assistant = [i for i, m in enumerate(r.messages) if m["role"] == "assistant" and weights[i] != 0]
        if generated is not None:
            generated = {i: g for i, g in generated.items() if i in assistant}
            supervised = sorted(generated)
        else:
            supervised = assistant
        if self.renderer.generation_tagged:  # a hint only, compared and logged (chat.py)
            self.renderer._compare_with_generation_blocks(r.messages, conv.tools, r.input_ids, r.offsets, r.spans)
        wanted = set(supervised)
        mask = mask_from_spans(r.offsets, [(s, e) for i, s, e in r.spans if i in wanted])
        ids, mask, info = self._splice(r, mask, generated or {})
        mode = self.mode
        if mode == "auto":
            mode = "conversation" if self._conversation_holds(r, conv, supervised, info) else "per_turn"
        reasoning, tool_calls = self.renderer._kinds_rendered(r.messages, r.full, r.spans)
        out = RowSamples([], mode, reasoning, tool_calls, conversation_tokens=len(ids), **{
            k: v for k, v in info.items() if k != "differing"}, differing=info["differing"])
        if mode == "conversation":
            out.samples = [Sample("", ids, mask)]
        else:
            out.samples = [self._turn_sample(conv, r, i, (generated or {}).get(i)) for i in supervised]
        return out

    def _conversation_holds(self, r: RenderedSpans, conv: Conversation, supervised: list[int], info: dict) -> bool:
        """`auto`: the whole rendering shows every supervised turn in its served context, and no generated turn
        but the last differs from the rendering of its text."""
        if any(i != max(supervised, default=-1) for i in info["differing"]):
            return False
        try:
            return self.renderer.prefix_stable(r.messages, conv.tools, r.full, supervised)
        except Exception:  # noqa: BLE001 - a template that refuses a cut conversation: one sample, as before
            return True

    def _turn_sample(self, conv: Conversation, r: RenderedSpans, i: int, g: GeneratedTurn | None) -> Sample:
        """The `per_turn` sample of assistant message i: its served prompt + the turn, only the turn supervised."""
        suffix = f"_t{i:04d}"
        if g is not None and g.completion_ids is not None:
            prompt = g.prompt_ids if g.prompt_ids is not None else \
                self.renderer.served_prompt_ids(r.messages[:i], conv.tools)
            return Sample(suffix, list(prompt) + list(g.completion_ids),
                          [0] * len(prompt) + [1] * len(g.completion_ids))
        head = Conversation(conv.messages[: i + 1], conv.tools, list(conv.weights[: i + 1]) if conv.weights else [],
                            {k: v for k, v in conv.arguments_text.items() if k[0] <= i})
        rendered = self.renderer.tokenize_conversation(head, supervised={i})
        return Sample(suffix, rendered.input_ids, rendered.loss_mask)

    def _splice(self, r: RenderedSpans, mask: list[int], generated: dict[int, GeneratedTurn]):
        """The whole rendering with each generated turn's tokens replaced by its completion ids (module docstring)
        -> (ids, mask, counts)."""
        info = {"turns_from_ids": 0, "turns_from_text": 0, "turns_ids_differ": 0, "turns_cut": 0, "differing": set()}
        starts = [s for s, _ in r.offsets]
        ends = [e if e > s else s + 1 for s, e in r.offsets]  # a zero-width token never straddles a span start
        spans: dict[int, list[tuple[int, int]]] = {}
        for i, s, e in r.spans:
            spans.setdefault(i, []).append((s, e))
        mask = list(mask)
        pieces = []
        for i in sorted(generated):
            g = generated[i]
            info["turns_cut"] += g.finish_reason == FINISH_LENGTH
            if g.completion_ids is None or i not in spans:
                info["turns_from_text"] += 1
                if g.finish_reason == FINISH_LENGTH and i in spans:  # no end-of-turn was generated: context
                    for s, e in spans[i]:
                        a, b = _token_range(r.offsets, starts, ends, s, e)
                        if b > a and r.input_ids[b - 1] in self.marker_ids:
                            mask[b - 1] = 0
                continue
            info["turns_from_ids"] += 1
            (s, e), *rest = spans[i]
            a, b = _token_range(r.offsets, starts, ends, s, e)
            after = [_token_range(r.offsets, starts, ends, s2, e2) for s2, e2 in rest]  # a stop token after it
            old, new, new_mask = r.input_ids[a:b], *self._turn_tokens(r.input_ids, a, b, after, g, mask)
            if new != old:
                info["turns_ids_differ"] += 1
                info["differing"].add(i)
            pieces.append((a, b, new, new_mask))
        ids = list(r.input_ids)
        for a, b, new, new_mask in reversed(pieces):
            ids[a:b], mask[a:b] = new, new_mask
        return ids, mask, info

    def _turn_tokens(self, ids: list[int], a: int, b: int, after: list[tuple[int, int]], g: GeneratedTurn,
                     mask: list[int]) -> tuple[list[int], list[int]]:
        """The tokens (and mask) that replace ids[a:b], a generated turn's rendering; `after`: token ranges of a
        stop token the template writes after the turn (chat.py `_stop_after`), whose mask is set here."""
        completion, old = g.completion_ids, ids[a:b]
        closing = bool(old) and old[-1] in self.marker_ids  # the template's end-of-turn marker
        cut = g.finish_reason == FINISH_LENGTH
        stopped = not cut and bool(completion) and completion[-1] in self.stop_ids
        new = list(completion[:-1] if stopped else completion)
        new_mask = [1] * len(new)
        # GLM-style: no end-of-turn marker, the template writes the stop token (the next role's) after the turn
        stop_follows = stopped and not closing and bool(after) and ids[after[0][0]:after[0][1]] == [completion[-1]]
        if stopped and not stop_follows:
            new.append(completion[-1])  # the stop token it generated, whichever: supervised
            new_mask.append(1)
            for c, d in after:  # a stop token the template writes after it is context
                mask[c:d] = [0] * (d - c)
        elif not stopped and closing:
            new.append(old[-1])  # cut: the template's marker is context; a stop the server left out: the marker
            new_mask.append(0 if cut else 1)
        if cut:
            for c, d in after:
                mask[c:d] = [0] * (d - c)
        return new, new_mask


def samples_line(summary: dict, bytes_per_token: float | None = None) -> str | None:
    """One line of a `rows.samples_summary` for `plan` and `inspect`: rows kept whole, rows cut per turn (their
    samples, the tokens and, given the bytes of states per token, the bytes they add), and the generated turns by
    source (ids, text), with those whose ids differ from the template's rendering and those cut by max_tokens.
    None when there is nothing to say (no conversation row)."""
    if not summary:
        return None
    line = f"{summary['conversation_rows']:,} row(s) as one sample, {summary['per_turn_rows']:,} per turn"
    if summary["per_turn_rows"]:
        extra = summary["per_turn_extra_tokens"]
        line += f" ({summary['per_turn_samples']:,} samples, {extra:+,} tokens"
        extra_bytes = extra * bytes_per_token if bytes_per_token else None
        line += (f", {'-' if extra_bytes < 0 else '+'}{format_bytes(abs(extra_bytes))} of states)"
                 if extra_bytes is not None else ")")
    turns = summary.get("generated_turns") or {}
    if any(turns.values()):
        line += (f"; generated turns: {turns['from_ids']:,} from the engine's ids ({turns['ids_differ']:,} of them "
                 f"would re-tokenize otherwise, as generated text often does: the ids the target generated are "
                 f"kept), {turns['from_text']:,} from text, {turns['cut']:,} cut by max_tokens")
    return line

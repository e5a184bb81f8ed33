"""Batched generation over a static cache, one decode step replayed as a CUDA graph: the in-process engine's fast path.

Why our own loop and not HF `generate`: `generate` with a batch of 64 on an 8B target spends 28-30 ms per decode step
on the host (Python, kernel launches: the GPU waits), 2,130-2,255 generated tok/s on an H200; the same forward with
a static cache replayed as one CUDA graph takes 10.4 ms a step at batch 64 and 18.7 ms at batch 256 (issue figures,
bench/regen_bench.py measures ours). transformers gives the pieces (its `StaticCache`, also for the Qwen3.5 hybrid's
Gated DeltaNet states; its mask creation, which on a static cache with one query token runs without a host sync;
its logits processors); the loop that ties them is this module. `generate(cache_implementation="static")` and
`torch.compile(mode="reduce-overhead")` were not chosen: the first still runs the step on the host, the second
compiles every model shape for minutes, past a benchmark's budget on a 64-layer target.

The loop, on a left-padded batch `input_ids [B, W]` with its `attention_mask [B, W]` (0 = padding):

- **Cache.** A transformers `StaticCache` of `W + new_tokens` positions; every row's prompt ends at position W - 1 of
  the cache and its generated tokens follow, so one shared cache position serves the whole batch.
- **Positions and mask** as `generate` derives them: position ids `cumsum(mask) - 1` (padding 0), then one more per
  step; the 2D mask covers the cache's whole length (padding 0, everything after the prompt 1: the causal mask hides
  what is not written yet). Attention never sees padding and the Gated DeltaNet layers zero padded positions before
  their convolution and recurrence (transformers' `create_recurrent_attention_mask`), so a row's tokens are the ones
  its prompt gets alone (tests: greedy equals `generate` on each prompt alone, token for token, in float32).
- **Prefill, packed** where every token mixer is full attention or a Gated DeltaNet layer that keeps its states in
  the cache (transformers >= 5.24; `packed_prefill_blocker`): the rows' prompts without their padding, back to back
  in packed rows of about `prefill_tokens` tokens (whole prompts), through the model as extraction runs packed rows
  (positions from 0 per prompt, torch's varlen FlashAttention and fla's varlen kernels within each:
  target/packing.py); each layer's keys and values, or each prompt's conv and recurrent states, are written into
  the static cache where the padded layout has them (`_PackedPrefillCache`). No padding is computed and no mask is
  built. Measured reason (H200): the 8B shape's prefill 17k prompt tok/s padded, 42k packed; the 27B hybrid's 5.7 s
  padded, 2.8 s packed.
- **Prefill, padded** otherwise (sliding-window attention, whose static cache rolls; a Gated DeltaNet layer of an
  earlier transformers; `prefill="padded"`), chunked by columns: forwards of about `prefill_tokens` tokens fill the
  cache in order (activation memory is bounded by it, not by the batch); a forward runs only the rows that hold a real
  token in its columns (a prefix of a batch sorted longest first), so left padding costs little prefill compute, and
  attends over the cache's filled prefix only (keys, values and mask cut at its last column: `_row_views`); columns
  are 64 x a power of two and rows 16 x a power of two (or the batch), a bounded set of shapes reused by every later
  batch, and a forward widens only while `prefill_fill` of what it computes is real (`_prefill_span`).
- **Attention**: where the model's attention is `sdpa`, regen/attention.py's function runs: the padded prefill with
  keys and values never repeated per query head (its docstring has the measurement), and the decode steps on
  transformers' `sdpa` in row spans (`plan_decode_spans`: consecutive rows cut where their first real columns
  differ, each span attending from its own first column on, so the left padding of shorter rows is not read), with
  `key_limit_graphs` > 1 each step's keys ending at a limit that grows with the steps (`_key_limit`: the cache's
  columns no step has written yet are not read); a model on another implementation keeps it. On CUDA the decode
  steps of an attention-only model run on flex attention instead by default (`decode_kernel` auto:
  `resolve_decode_kernel`): compiled
  PyTorch flex-decoding over each row's own key blocks only (regen/attention.py's FlexDecodeMask), the batch's key
  columns rounded up to a few per octave (`flex_key_columns`, by the engine) so a job compiles few shapes.
- **Decode step**: the model's forward on one token a row over static buffers (token, position, mask, cache), then,
  outside the step, the logits (float32, as `generate` takes them) through the batch's logits processors (the
  engine's: repetition penalty, warpers, the per-row seeded draw, which reads the step from the sequence length as it
  does under `generate`) and the argmax. On CUDA with `cuda_graphs`, the first step runs eagerly on a side stream
  (kernels chosen and autotuned for its shapes), is captured there as a `torch.cuda.CUDAGraph` and replayed for
  every later step of the same key limit (a new limit: a new eager step and capture, at most `key_limit_graphs` a
  batch); a capture that fails (an operation that syncs with the host) is logged once and the engine
  decodes eagerly. On the CPU the same loop runs with the step called directly: the code the tests check is the
  code the GPU runs, less the capture.
- **Stop**: per row at a stop id or after its own new-token limit; a finished row is masked, not removed (its later
  tokens are the padding id, as `generate` fills them; rows never read each other, so the others' answers do not
  change); the loop ends when every row has finished (checked every `check_every` steps: a check syncs with the GPU,
  and tells `on_rows_done`, when set, how many more rows have finished: a progress bar moves within a batch).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from dataclasses import dataclass

import torch

from dflash_prep.regen.attention import (DEFAULT_SPAN_COST_KEYS, FLEX_MAX_SHAPES, STATIC_ATTENTION, FlexDecodeMask,
                                         admit_flex_shape,
                                         decode_key_limit, decode_spans, flex_decode, plan_decode_spans,
                                         release_prefill_masks)
from dflash_prep.target.backoff import is_oom
from dflash_prep.target.packing import PACKED_ATTENTION

log = logging.getLogger("dflash_prep")

PREFILL_MODES = ("auto", "packed", "padded")
# the decode steps' attention kernel where the model's attention is `sdpa` (regen/attention.py)
DECODE_KERNELS = ("auto", "sdpa", "flex")
# the default, `auto`: flex on CUDA (compiled: 9,484 generated tok/s warm at 15.3 ms a step on the 8B benchmark, one
# H200, against 7,582 at 22.3 ms on sdpa in row spans, same run; float32 slice exact), except for a hybrid with Gated
# DeltaNet layers (the 27B: 1,083 on flex against 1,085 on sdpa, same run, so no reason yet) and off CUDA (the CPU's
# flex is PyTorch's unfused reference implementation, which reads every column): sdpa there
DECODE_KERNEL = "auto"
# key limits (CUDA graphs) of one batch's decode steps by default: 1, the cache's end (8 measured slower)
KEY_LIMIT_GRAPHS = 1


@dataclass
class DecodeStats:
    """What the decoder ran, summed over calls: prefill and decode wall seconds (synced), steps, the path."""

    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    graph_captures: int = 0
    graph_failures: int = 0
    flex_failures: int = 0  # batches whose decode on flex attention failed and ran again on sdpa
    flex_shape_overflows: int = 0  # batches decoded on sdpa: a new shape past attention.FLEX_MAX_SHAPES
    prefill_forwards: int = 0
    prompt_tokens_prefilled: int = 0  # real prompt tokens
    prefill_computed_tokens: int = 0  # tokens the prefill forwards computed (padding included)
    decode_spans: int = 0  # row spans the decode steps attended in (regen/attention.py), summed over batches


class StaticCacheDecoder:
    """Batched greedy / processed generation on `model` over a static cache (the module docstring says how).

    model: a transformers causal LM (`forward(input_ids, attention_mask, position_ids, cache, use_cache,
        logits_to_keep)`), in eval mode, on its device. pad_token_id: what finished rows emit.
    prefill_tokens: tokens per prefill forward at most (at least `column_multiple` columns of the rows it needs).
    column_multiple / row_multiple: prefill forwards hold multiples of these columns / rows (few distinct shapes).
    cuda_graphs: capture the decode step on CUDA (ignored on other devices).
    check_every: decode steps between checks that every row has finished.
    prefill: `packed` (whole prompts back to back, no padding: every token mixer full attention), `padded`
        (column chunks of the left-padded batch), `auto` (packed where it applies; `prefill_reason` says why not).
    span_cost_keys: the price of one more row span in the decode steps' attention, in cache positions read
        (regen/attention.py's `plan_decode_spans`; default DEFAULT_SPAN_COST_KEYS, measured on one H200: the 8B
        benchmark's 256 x 256 from 6,077 to 7,657 generated tok/s warm, the engine's batch cut pricing the spans
        too), or None: no spans, every row reads the cache from column 0.
    key_limit_graphs: the decode steps' attention reads the keys only up to a limit that grows with the steps,
        in at most this many blocks (one CUDA graph each: `_key_limit`); 1 (the default): every step reads to the
        cache's end. Measured on one H200 (the 8B benchmark, 256 x 256): 8 limits 7,449 generated tok/s warm and
        6,094 cold against 7,626 and 7,533 with 1 (each new limit's eager step and capture cost more than the
        unwritten columns saved); long answers, where those columns are most of a row's cache, are not measured.
    decode_kernel: `sdpa` (transformers' function, in row spans as `span_cost_keys` says), `flex` (PyTorch's flex
        attention, compiled on CUDA: each row reads only the key blocks from its own first real column to the
        step's, one CUDA graph for every step; `span_cost_keys` and `key_limit_graphs` then do not apply:
        regen/attention.py's FlexDecodeMask; a batch of a new shape past attention.FLEX_MAX_SHAPES runs on sdpa) or
        `auto` (the default: `resolve_decode_kernel`). Either way only where the model's attention is `sdpa`.
    Raises ValueError for sizes < 1, an unknown `prefill` or `decode_kernel`, or `packed` for a model it does not
    apply to.
    """

    def __init__(self, model, pad_token_id: int, *, prefill_tokens: int = 32768, cuda_graphs: bool = True,
                 check_every: int = 8, column_multiple: int = 64, row_multiple: int = 16, prefill_fill: float = 0.75,
                 prefill: str = "auto", span_cost_keys: int | None = DEFAULT_SPAN_COST_KEYS,
                 key_limit_graphs: int = KEY_LIMIT_GRAPHS, decode_kernel: str = DECODE_KERNEL):
        if min(prefill_tokens, check_every, column_multiple, row_multiple, key_limit_graphs) < 1:
            raise ValueError(f"prefill_tokens={prefill_tokens}, check_every={check_every}, column_multiple="
                             f"{column_multiple}, row_multiple={row_multiple} and key_limit_graphs={key_limit_graphs} "
                             "must be >= 1")
        self.device = next(model.parameters()).device
        decode_kernel = resolve_decode_kernel(decode_kernel, self.device.type, _has_gated_deltanet(model))
        self.prefill_reason = _prefill_blocker(model, prefill)
        self.packed_prefill = self.prefill_reason is None
        # fla's Triton kernels autotune per new row length (~8 s each on the 27B hybrid): a hybrid's packed rows are
        # padded to a few fixed lengths; attention-only models run their exact lengths (torch's kernels, measured)
        self.pad_packed_rows = self.packed_prefill and _has_gated_deltanet(model)
        if self.packed_prefill:  # Gated DeltaNet modules without fla's varlen kernels: once per prompt
            from dflash_prep.target.packing import register_packed_attention, run_linear_attention_per_segment

            register_packed_attention()
            run_linear_attention_per_segment(model, self.device.type)
        self.attention = decode_attention(model)
        self.model, self.pad_token_id = model, int(pad_token_id)
        self.cache_keyword = cache_keyword(model)
        self.prefill_tokens, self.check_every = prefill_tokens, check_every
        self.span_cost_keys = span_cost_keys
        self.key_limit_graphs = key_limit_graphs
        self.decode_kernel = decode_kernel
        self.on_rows_done = None  # callable(n) or None: n more rows of the batch being decoded have finished
        self.column_multiple, self.row_multiple = column_multiple, row_multiple
        self.prefill_fill = prefill_fill
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.stats = DecodeStats()

    @property
    def path(self) -> str:
        """The decode path in words (for the log and the benchmark)."""
        steps = "static cache + CUDA graph" if self.cuda_graphs else "static cache, eager steps"
        prefill = "packed prefill" if self.packed_prefill else f"padded prefill ({self.prefill_reason})"
        if self.flex:
            return f"{steps}, flex attention from each row's first key, {prefill}"
        ours = self.attention == STATIC_ATTENTION
        spans = ", attention in row spans" if ours and self.span_cost_keys is not None else ""
        limits = ", keys read to each step's limit" if ours and self.key_limit_graphs > 1 else ""
        return f"{steps}{spans}{limits}, {prefill}"

    @property
    def flex(self) -> bool:
        """Whether the decode steps run on flex attention (`decode_kernel` flex, the model's attention ours)."""
        return self.decode_kernel == "flex" and self.attention == STATIC_ATTENTION

    @property
    def prefill_copies_keys(self) -> bool:
        """Whether a prefill forward copies keys and values per query head (the padded prefill on an attention
        implementation other than ours, e.g. transformers' eager): what the batch sizing holds memory for."""
        return not self.packed_prefill and self.attention != STATIC_ATTENTION

    @property
    def span_cost_keys_in_use(self) -> int | None:
        """The price of a row span the decode steps attend in (`span_cost_keys`), None where they attend without
        spans (unset, or the model on an attention implementation other than ours): what the batch cut prices."""
        if self.flex:
            return 0  # every row reads from its own first block: spans at no price, as many as there are columns
        return self.span_cost_keys if self.attention == STATIC_ATTENTION else None

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int, stop_ids: list[int],
                 processors=None, row_new_tokens: list[int] | None = None) -> torch.Tensor:
        """-> the new ids [B, n] (long, on the model's device, n <= new_tokens: fewer when every row stopped), a
        row's ids after its stop id or its own limit being `pad_token_id`, as `generate` returns them.

        input_ids / attention_mask: [B, W] long, left padded. new_tokens: steps at most. stop_ids: end-of-sequence
        ids (may be empty). processors: a transformers `LogitsProcessorList` called as under `generate`
        (`(sequences [B, W + step], scores [B, V] float32)`), or None. row_new_tokens: per-row limits (<= new_tokens),
        default new_tokens for all. Raises what the model raises (an out-of-memory error included). With
        `decode_kernel` flex, a batch whose decode fails otherwise (flex attention's compile or kernel: a shape or
        head size it cannot take) is logged once and run again from its prefill on sdpa, which this decoder keeps
        from then on (`stats.flex_failures`). ValueError where a row of `attention_mask` is not left padding
        then its prompt to the last column (zeros, then at least one one): the positions, the row spans and the flex
        mask read each row's prompt as one run of columns ending at W - 1."""
        if not _is_left_padded(attention_mask):
            raise ValueError("attention_mask: every row must be left padded, its prompt running to the last "
                             "column (zeros, then ones, at least one)")
        if self.flex and not admit_flex_shape(input_ids.shape[0], input_ids.shape[1] + new_tokens, self._flex_kind):
            if not self.stats.flex_shape_overflows:
                log.warning("regeneration: %d batch shapes compiled for flex attention (the cap); batches of a new "
                            "shape decode on sdpa in row spans", FLEX_MAX_SHAPES)
            self.stats.flex_shape_overflows += 1  # a new shape past the compiled ones' cap: this batch on sdpa
            return self._generate(input_ids, attention_mask, new_tokens, stop_ids, processors, row_new_tokens, False)
        if self.flex:
            try:
                return self._generate(input_ids, attention_mask, new_tokens, stop_ids, processors, row_new_tokens,
                                      True)
            except Exception as e:  # noqa: BLE001 - flex attention's failure: the batch again on sdpa, said once
                if is_oom(e):
                    raise  # the engine halves the batch
                self.stats.flex_failures += 1
                self.decode_kernel = "sdpa"
                log.warning("regeneration: the decode steps on flex attention failed (%s: %s); decoding on sdpa in "
                            "row spans from now on", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return self._generate(input_ids, attention_mask, new_tokens, stop_ids, processors, row_new_tokens, False)

    @property
    def _flex_kind(self) -> str:
        """What besides rows and key columns the compiled flex call is specialized on: dtype and head sizes."""
        text = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") \
            else self.model.config
        heads = (getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None),
                 getattr(text, "head_dim", None), getattr(text, "hidden_size", None))
        return f"{self.model.dtype}:{heads}"

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int, stop_ids: list[int],
                  processors, row_new_tokens: list[int] | None, flex: bool) -> torch.Tensor:
        """`generate` on the decoder's current settings, the decode steps on flex attention or not (`flex`)."""
        from transformers import StaticCache

        batch, width = input_ids.shape
        device = self.device
        sequences = torch.full((batch, width + new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        sequences[:, :width] = input_ids.to(device)
        mask = torch.ones((batch, width + new_tokens), dtype=torch.long, device=device)
        mask[:, :width] = attention_mask.to(device)
        positions = (mask[:, :width].cumsum(-1) - 1).masked_fill_(mask[:, :width] == 0, 0)
        limits = torch.tensor(row_new_tokens or [new_tokens] * batch, dtype=torch.long, device=device)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        cache = StaticCache(config=self.model.config, max_cache_len=width + new_tokens)

        t = _now(device)
        packed = self.packed_prefill and _packable_cache(cache)
        with _attention_implementation(self.model, PACKED_ATTENTION if packed else self.attention):
            if packed:
                logits = self._prefill_packed(sequences[:, :width], mask[:, :width], cache)
            else:
                logits = self._prefill(sequences[:, :width], mask, positions, cache)
                release_prefill_masks()
        t_decode = _now(device)
        self.stats.prefill_seconds += t_decode - t
        spans = None if flex else self._spans(mask, width, new_tokens)
        flex = FlexDecodeMask(_first_real_columns(mask, width), width + new_tokens, width - 1) if flex else None
        with _attention_implementation(self.model, self.attention), decode_spans(spans, width + new_tokens), \
                flex_decode(flex):
            done = self._decode(sequences, mask, positions, cache, logits, width, new_tokens, limits, stops,
                                processors, spans is not None and self.key_limit_graphs > 1, flex)
        self.stats.decode_seconds += _now(device) - t_decode
        self.stats.decode_steps += max(done - 1, 0)
        del cache
        return sequences[:, width:width + done]

    def _spans(self, mask: torch.Tensor, width: int, new_tokens: int) -> list[tuple[int, int, int]] | None:
        """The decode steps' row spans (regen/attention.py: each attends from its own first real column; without
        `span_cost_keys` but with key limits, one span of every row from column 0, which ends at the steps' key
        limit), or None: every row reads the whole cache on transformers' `sdpa`, or our attention function does
        not run (the model on another implementation)."""
        if self.attention != STATIC_ATTENTION:
            return None
        if self.span_cost_keys is None:
            return [(0, mask.shape[0], 0)] if self.key_limit_graphs > 1 else None
        first_real = _first_real_columns(mask, width).tolist()
        spans = plan_decode_spans(first_real, width + new_tokens, span_cost_keys=self.span_cost_keys)
        self.stats.decode_spans += len(spans)
        return spans

    def _decode(self, sequences, mask, positions, cache, logits, width: int, new_tokens: int, limits, stops,
                processors, key_limits: bool, flex: FlexDecodeMask | None = None) -> int:
        """The decode loop from the prefill's last logits, writing `sequences` -> the steps done. key_limits: the
        steps read the keys up to their own limit (`_key_limit`), one CUDA graph per limit. flex: the steps' flex
        attention mask, advanced one column before each step (outside the CUDA graph, in place)."""
        batch, device = sequences.shape[0], sequences.device
        self._reported = 0
        step_input = {"token": torch.empty((batch, 1), dtype=torch.long, device=device),
                      "position": positions[:, -1:].clone()}
        unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        step_fn, graph, key_limit = None, None, None
        done = 0
        for step in range(new_tokens):
            if step > 0:  # the previous token goes in: one forward of one token a row
                step_input["position"].add_(1)
                if flex is not None:
                    flex.advance()
                if key_limits and (wanted := self._key_limit(step, width, new_tokens)) != key_limit:
                    key_limit = wanted
                    decode_key_limit(key_limit)
                    step_fn, graph = None, None  # a step reading further: captured anew
                if step_fn is None:
                    if self.cuda_graphs:
                        logits, step_fn, graph = self._first_step_and_capture(step_input, mask, cache)
                    else:
                        logits = self._forward(step_input, mask, cache)
                        step_fn = lambda: self._forward(step_input, mask, cache)  # noqa: E731
                else:
                    logits = step_fn()
            scores = logits.float()
            if processors:
                scores = processors(sequences[:, :width + step], scores)
            token = scores.argmax(dim=-1)
            token = torch.where(unfinished, token, torch.full_like(token, self.pad_token_id))
            sequences[:, width + step] = token
            step_input["token"].copy_(token[:, None])
            unfinished &= ~torch.isin(token, stops) & (limits > step + 1)
            done = step + 1
            if done % self.check_every == 0:  # one sync: how many rows still run
                running = int(unfinished.sum())
                self._rows_done(batch - running)
                if not running:
                    break
        self._rows_done(batch)
        del graph, step_fn
        return done

    def _key_limit(self, step: int, width: int, new_tokens: int) -> int:
        """The key column a decode step's attention ends at (exclusive): step `step` (>= 1) attends the positions
        before width + step; the limit rounds that up to a block of columns (a multiple of `column_multiple`), so a
        batch's steps use at most `key_limit_graphs` limits (one CUDA graph each; 1: the cache's end for every
        step), never past the cache's end. Why: the steps otherwise read every not-yet-written column of the cache
        (masked): on the 8B benchmark (256 new tokens, a row's cache about 620 positions from its span's column
        on), ~128 of them a row a step on average (not enough there to pay for the captures: the constructor's
        docstring)."""
        block = max(self.column_multiple, -(-new_tokens // (self.key_limit_graphs * self.column_multiple))
                    * self.column_multiple)
        return min(width + new_tokens, width + -(-step // block) * block)

    def _rows_done(self, finished: int) -> None:
        """Report to `on_rows_done` the rows finished since the last report (`finished`: all finished so far)."""
        if self.on_rows_done is not None and finished > self._reported:
            self.on_rows_done(finished - self._reported)
        self._reported = max(self._reported, finished)

    def _forward(self, step_input: dict, mask: torch.Tensor, cache) -> torch.Tensor:
        """One decode forward on the step's static buffers -> logits [B, V] (the model's dtype)."""
        out = self.model(input_ids=step_input["token"], attention_mask=mask, position_ids=step_input["position"],
                         use_cache=True, logits_to_keep=1, **{self.cache_keyword: cache})
        return out.logits[:, -1, :]

    def _prefill_packed(self, input_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """Each row's prompt tokens (no padding) back to back in packed rows of about `prefill_tokens` tokens (whole
        prompts; one longer prompt alone), through the model as extraction runs packed rows (target/packing.py:
        positions from 0 per prompt, varlen attention and Gated DeltaNet kernels within each); every layer's
        keys and values, or conv and recurrent states, written into the static cache where a padded prefill has
        them (row r's n tokens at columns W - n .. W - 1: `_PackedPrefillCache`) -> the last prompt token's logits
        of each row [B, V]. A hybrid's packed row is padded, as extraction pads them, to the smallest of a few
        fixed lengths (planner.packed_row_lengths of `prefill_tokens`, and `column_multiple` x powers of two below
        them) with a tail segment of its own (never written to the cache): fla's kernels meet a handful of shapes,
        not one per forward (first-seen shapes cost Triton autotuning). The cache's length counters are then W, as
        after a padded prefill: the decode steps go on from there."""
        from dflash_prep.plan.planner import packed_row_lengths

        batch, width = input_ids.shape
        lengths = mask.sum(-1).tolist()
        # extraction's row lengths (1/8 .. 1 of the budget), and below them powers of two: a small batch is not
        # padded to an eighth of the budget
        large = packed_row_lengths(self.prefill_tokens, self.column_multiple)
        row_lengths = sorted({*large, *(self.column_multiple << k for k in range(32)
                                        if self.column_multiple << k < large[0])})
        logits, start = None, 0
        while start < batch:
            end, tokens = start + 1, lengths[start]
            while end < batch and tokens + lengths[end] <= self.prefill_tokens:
                tokens, end = tokens + lengths[end], end + 1
            padded = tokens if not self.pad_packed_rows else next(
                (n for n in row_lengths if n >= tokens), -(-tokens // self.column_multiple) * self.column_multiple)
            out = self._packed_forward(input_ids, cache, start, lengths[start:end], padded)
            if logits is None:
                logits = out.new_empty((batch, out.shape[-1]))
            logits[start:end] = out
            self.stats.prefill_forwards += 1
            self.stats.prompt_tokens_prefilled += tokens
            self.stats.prefill_computed_tokens += padded
            start = end
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length"):  # attention layers; a Gated DeltaNet layer counts no positions
                layer.cumulative_length.fill_(width)
        return logits

    def _packed_forward(self, input_ids: torch.Tensor, cache, first_row: int, lengths: list[int],
                        padded: int) -> torch.Tensor:
        """One packed row: the prompts of rows first_row .. (their `lengths` tokens, right-aligned in `input_ids`
        [B, W]) then a tail of padding to `padded` tokens -> their last tokens' logits [len(lengths), V]."""
        from dflash_prep.target.packing import flash_kwargs

        width, tokens = input_ids.shape[1], sum(lengths)
        n = torch.tensor(lengths, dtype=torch.long)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
        torch.cumsum(n, 0, out=cu[1:])
        rows = torch.repeat_interleave(torch.arange(first_row, first_row + len(lengths)), n)
        within = torch.arange(tokens) - torch.repeat_interleave(cu[:-1], n)  # 0.. within each prompt
        columns = within + (width - n).repeat_interleave(n)
        tail = padded - tokens
        bounds = torch.cat([cu, cu[-1:] + tail]) if tail else cu  # the tail is a segment of its own
        positions = torch.cat([within, torch.arange(tail)])
        rows, columns, positions, bounds = (x.to(self.device) for x in (rows, columns, positions, bounds))
        ids = torch.cat([input_ids[rows, columns], input_ids.new_full((tail,), self.pad_token_id)])
        packed_cache = _PackedPrefillCache(cache, rows, columns, input_ids.shape[0], first_row, lengths,
                                           tail_tokens=tail)
        out = self.model(input_ids=ids[None], position_ids=positions[None], attention_mask=None,
                         use_cache=True, logits_to_keep=bounds[1:len(lengths) + 1] - 1,
                         **{self.cache_keyword: packed_cache},
                         **flash_kwargs(bounds.to(torch.int32), max(max(lengths), tail)))
        return out.logits[0]

    def _prefill(self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The prompt columns through the model in order, in forwards of `prefill_tokens` tokens at most -> the last
        column's logits [B, V].

        Padding is not computed where it can be skipped: rows sorted longest first (as the engine cuts batches) have
        their first real column in ascending order, so the rows a run of columns needs are a prefix of the batch,
        and the forward runs on that prefix over views of the cache's first rows (the other rows hold only padding
        there: their attention never reads it, their Gated DeltaNet states stay the zeros that masked padding
        leaves). The first forward holds the whole batch (it allocates the cache at its full size); rows in another
        order run whole. The 2D mask given to a forward ends at its last column: the Gated DeltaNet
        layers read the padding of the forward's own columns from its last columns."""
        batch, width = input_ids.shape
        first_real = _first_real_columns(mask, width).tolist()
        prefix_ok = all(a <= b for a, b in zip(first_real, first_real[1:]))
        logits, start = None, 0
        while start < width:
            end, rows = self._prefill_span(first_real, start, width, prefix_ok)
            with _row_views(cache, rows if rows < batch else None, end if start > 0 else None):
                out = self.model(input_ids=input_ids[:rows, start:end], attention_mask=mask[:rows, :end],
                                 position_ids=positions[:rows, start:end], use_cache=True, logits_to_keep=1,
                                 **{self.cache_keyword: cache})
            self.stats.prefill_forwards += 1
            self.stats.prefill_computed_tokens += rows * (end - start)
            logits, start = out.logits[:, -1, :], end
        self.stats.prompt_tokens_prefilled += int(mask[:, :width].sum())
        return logits  # the last forward held every row: every prompt ends at column width - 1

    def _prefill_span(self, first_real: list[int], start: int, width: int, prefix_ok: bool) -> tuple[int, int]:
        """(end column, rows) of the prefill forward from column `start`, from a small fixed set of shapes (each
        new one costs a Triton compile / autotune in flash-linear-attention's and liger's kernels, ~8 s on the
        27B hybrid; the set is bounded, so later batches meet only shapes already seen):

        - the first forward (it allocates the cache: every row) holds `width % column_multiple` columns, or one
          multiple: it is mostly padding;
        - then columns are `column_multiple` x a power of two, the largest whose rows x columns <= prefill_tokens;
        - rows: the prefix of rows with a real token before `end`, rounded up to `row_multiple` x a power of two
          (capped at the batch; all rows when the batch is not sorted longest first)."""
        batch, step = len(first_real), self.column_multiple

        def rows_for(end: int) -> int:
            if start == 0 or not prefix_ok:
                return batch
            needed = max(1, sum(f < end for f in first_real))  # 1: columns of padding only (a wider input)
            rows = self.row_multiple
            while rows < needed:
                rows *= 2
            return min(batch, rows)

        def fill(end: int) -> float:  # real tokens / tokens computed by the forward [start, end)
            rows = rows_for(end)
            return sum(end - max(f, start) for f in first_real[:rows] if f < end) / (rows * (end - start))

        if start == 0:
            return (width % step or min(step, width)), batch
        columns = min(step, width - start)
        while (start + 2 * columns <= width and rows_for(start + 2 * columns) * 2 * columns <= self.prefill_tokens
               and (not prefix_ok or fill(start + 2 * columns) >= self.prefill_fill)):
            columns *= 2
        return start + columns, rows_for(start + columns)

    def _first_step_and_capture(self, step_input: dict, mask: torch.Tensor, cache):
        """(logits of this step, replay function -> logits, graph): the step run eagerly on a side stream (the
        warm-up CUDA graphs need: kernels chosen, autotuned, their workspaces allocated on that stream; it is a real
        step, its logits used), then captured as a CUDA graph on the same stream (capturing runs nothing: the cache
        stays one step ahead). A capture that fails gives an eager step function and graph None (logged once; later
        batches decode eagerly)."""
        with torch.cuda.device(self.device):  # a process whose current device is another GPU captures on this one
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                logits = self._forward(step_input, mask, cache)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            logits.record_stream(torch.cuda.current_stream(self.device))  # read on the default stream next
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            return (logits, *self._capture(graph, stream, step_input, mask, cache))

    def _capture(self, graph, stream, step_input: dict, mask: torch.Tensor, cache):
        """(replay function -> logits, graph), or (an eager step function, None) when the capture fails."""
        try:
            # thread_local: the engine runs in a worker thread; another thread's CUDA calls must not void the capture
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                static_logits = self._forward(step_input, mask, cache)
        except Exception as e:  # noqa: BLE001 - a host sync in some model's forward: decode eagerly, said once
            if is_oom(e):
                raise  # the engine halves the batch
            self.stats.graph_failures += 1
            self.cuda_graphs = False
            log.warning("regeneration: the decode step could not be captured as a CUDA graph (%s: %s); decoding "
                        "with eager steps", type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return (lambda: self._forward(step_input, mask, cache)), None
        self.stats.graph_captures += 1

        def replay() -> torch.Tensor:
            graph.replay()
            return static_logits

        return replay, graph


CACHE_CALLS = ("get_conv_state(", "get_recurrent_state(", "update_conv_state(", "update_recurrent_state(")


def resolve_decode_kernel(decode_kernel: str, device_type: str, gated_deltanet: bool = False) -> str:
    """The decode kernel `decode_kernel` names on a `device_type` device for a model with Gated DeltaNet layers or
    not: `auto` is `flex` on CUDA for a model without them, else `sdpa` (DECODE_KERNEL says why; flex acts only on
    the attention layers whose keys are the whole cache, so other hybrids stay exact, their speed unmeasured);
    `sdpa` and `flex` are themselves. ValueError for another name."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel={decode_kernel!r}: one of {', '.join(DECODE_KERNELS)}")
    if decode_kernel == "auto":
        return "flex" if device_type == "cuda" and not gated_deltanet else "sdpa"
    return decode_kernel


def packed_prefill_blocker(model) -> str | None:
    """Why the packed prefill does not apply to `model` (a few words), or None. It applies when every token mixer is
    one packed rows keep exact (target/mixers.py): attention without a sliding window (a static cache's window
    layer rolls its keys: the padded layout is what it holds), or a Gated DeltaNet layer that reads and writes its
    states through transformers' cache calls (`CACHE_CALLS`, found in its forward's source: what
    `_PackedPrefillCache` answers per prompt; transformers >= 5.24). The hybrid's packed prefill is exact on the CPU
    (tests) and, on one H200, passed the benchmark's check (the 27B hybrid in float32: greedy tokens equal to
    `generate` alone, teacher-forced logits within 1.8e-3 of a plain forward, as `generate`'s own batches) and ran
    faster (64 prompts x 128 new tokens: 1,091 generated tok/s warm against 777 padded, cold 350 against 80):
    bench/results/regen-20261203-hybrid-check/."""
    from dflash_prep.target.mixers import ATTENTION, GATED_DELTANET, token_mixers

    mixers = token_mixers(model)
    if not mixers:
        return "no token mixers found"
    for mixer in mixers:
        if mixer.why_not:
            return f"{mixer.class_name}: {mixer.why_not}"
        if mixer.kind == GATED_DELTANET:
            source = _forward_source(type(model.get_submodule(mixer.path)))
            if source is None:
                return f"{mixer.class_name}: its forward's source cannot be read"
            missing = [c[:-1] for c in CACHE_CALLS if c not in source]
            if missing:
                return f"{mixer.class_name} does not use the cache calls {', '.join(missing)}"
            unanswered = sorted({m for m in re.findall(r"\bcache\.(\w+)\(", source)
                                 if not callable(getattr(_PackedPrefillCache, m, None))})
            if unanswered:  # a newer transformers asks the cache something the packed prefill cannot answer
                return f"{mixer.class_name} calls cache.{', cache.'.join(unanswered)}, which the packed prefill " \
                       f"does not answer"
        elif mixer.kind != ATTENTION:
            return f"{mixer.class_name} is neither attention nor a Gated DeltaNet"
        elif "sliding_window" in mixer.features:
            return f"{mixer.class_name} has a sliding window"
    return None


def _forward_source(cls) -> str | None:
    """The source of `cls.forward` and of the functions of its module that it calls (one level: transformers 5.25
    moved the Gated DeltaNet's conv-state calls into `causal_conv1d_forward`), or None where it cannot be read."""
    import sys

    from dflash_prep.target.kernels import plain_function

    modeling = sys.modules.get(cls.__module__)
    forward = inspect.unwrap(cls.forward)
    try:
        parts = [inspect.getsource(forward)]
        for name in forward.__code__.co_names:
            helper = plain_function(vars(modeling).get(name)) if modeling is not None else None
            if helper is not None and helper.__module__ == cls.__module__:
                parts.append(inspect.getsource(helper))
    except (OSError, TypeError):
        return None
    return "\n".join(parts)


def _prefill_blocker(model, prefill: str) -> str | None:
    """Why the decoder on `model` prefills padded (None: packed) for the `prefill` mode asked; ValueError for an
    unknown mode, or `packed` where it does not apply."""
    if prefill not in PREFILL_MODES:
        raise ValueError(f"prefill={prefill!r}: one of {', '.join(PREFILL_MODES)}")
    if prefill == "padded":
        return "asked for"
    reason = packed_prefill_blocker(model)
    if prefill == "packed" and reason is not None:
        raise ValueError(f"packed prefill does not apply to this model: {reason}")
    return reason


def cache_keyword(model) -> str:
    """The keyword the model's forward takes its cache by: `cache` (transformers >= 5.24) or `past_key_values`
    (earlier 5.x, where an unknown `cache` keyword would reach the attention functions). A forward that names
    neither (a wrapper's `*args, **kwargs`, a compiled module) follows the installed transformers' own decoders."""
    for forward in (model.forward, None):
        parameters = inspect.signature(forward or _installed_decoder_forward()).parameters
        if "cache" in parameters:
            return "cache"
        if "past_key_values" in parameters:
            return "past_key_values"
    return "cache"


def _installed_decoder_forward():
    """The forward of a decoder of the installed transformers (Llama's), whose signature names the cache keyword."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return LlamaForCausalLM.forward


def _has_gated_deltanet(model) -> bool:
    from dflash_prep.target.mixers import GATED_DELTANET, token_mixers

    return any(m.kind == GATED_DELTANET for m in token_mixers(model))


def decode_attention(model) -> str:
    """The attention implementation the decoder runs the model with: ours (regen/attention.py) where the model's
    is `sdpa`, else the model's own."""
    from dflash_prep.regen.attention import register
    from dflash_prep.target.layers import find_decoder

    current = find_decoder(model).config._attn_implementation
    return register() if current in ("sdpa", STATIC_ATTENTION) else current


@contextlib.contextmanager
def _attention_implementation(model, name: str):
    """The model on attention implementation `name` (registered: the decoder registers its own at construction)
    while the block runs (transformers' set_attn_implementation), then back on the one it had."""
    from dflash_prep.target.layers import find_decoder

    before = find_decoder(model).config._attn_implementation
    if name != before:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if find_decoder(model).config._attn_implementation != before:
            model.set_attn_implementation(before)


def _packable_cache(cache) -> bool:
    """Every layer of the static cache one the packed prefill writes into: full attention's StaticLayer or the
    Gated DeltaNet's LinearAttentionLayer (exact types: a sliding or combined layer is not)."""
    from transformers.cache_utils import LinearAttentionLayer, StaticLayer

    return all(type(layer) in (StaticLayer, LinearAttentionLayer) for layer in cache.layers)


class _PackedPrefillCache:
    """What a packed prefill forward gets as its cache (the prompts of batch rows `first_row` .. in one packed row,
    `lengths` tokens each), answering per prompt what transformers' static cache answers for a padded batch:

    - attention layers: keys and values [1, Hkv, T, D] (after RoPE) written into the static cache at
      (rows[t], columns[t]) for prompt token t of the packed row (the tail is not written), and handed back
      unchanged, so the layer attends within the packed row (varlen attention) as extraction does;
    - Gated DeltaNet layers: no previous state (None); the conv input [1, C, T] handed back unchanged (the conv runs
      per prompt: fla's kernel on `cu_seqlens`, or the module once per prompt: target/packing.py) and each prompt's
      last `conv_kernel_size` inputs (zeros before a shorter prompt's start, as the padded layout's masked padding
      gives) written as its row's conv state; the final recurrent states [S, H, Dk, Dv] (one per prompt: fla's chunk
      kernel on `cu_seqlens`) written to the prompts' rows. A module run once per prompt calls with one prompt's
      [1, C, n] / [1, H, Dk, Dv]: the prompts are then met in order, counted per layer.

    Each static layer is allocated at the batch's size first (it sizes itself from the first states it sees)."""

    is_compileable = False

    def __init__(self, cache, rows: torch.Tensor, columns: torch.Tensor, batch: int, first_row: int,
                 lengths: list[int], tail_tokens: int = 0):
        self.cache, self.rows, self.columns, self.batch = cache, rows, columns, batch
        self.first_row, self.lengths, self.tokens = first_row, lengths, sum(lengths) + tail_tokens
        self.segments = len(lengths) + (1 if tail_tokens else 0)  # the tail: a segment never written
        self.met: dict[tuple, int] = {}  # (layer, "conv" | "recurrent") -> prompts met one at a time

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.cache.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states.new_empty((self.batch, key_states.shape[1], 1, key_states.shape[3])),
                                      value_states.new_empty((self.batch, value_states.shape[1], 1,
                                                              value_states.shape[3])))
        real = self.rows.shape[0]  # the prompts' tokens come first, the tail after them
        layer.keys[self.rows, :, self.columns] = key_states[0, :, :real].transpose(0, 1)
        layer.values[self.rows, :, self.columns] = value_states[0, :, :real].transpose(0, 1)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return None

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0  # transformers >= 5.25: no intermediate recurrent states (those serve a rollback; a prefill keeps none)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        return None  # transformers >= 5.25 calls it only on a cached conv state, and this cache answers None for it

    def _prompts(self, layer_idx: int, kind: str, whole: bool) -> tuple[int, int]:
        """(first, end) prompt indices a call covers: all of them, or the next one met alone (past the last prompt:
        the tail, an empty range)."""
        if whole:
            return 0, len(self.lengths)
        k = self.met.get((layer_idx, kind), 0)
        self.met[(layer_idx, kind)] = k + 1
        return min(k, len(self.lengths)), min(k + 1, len(self.lengths))

    def update_conv_state(self, conv_input: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> torch.Tensor:
        layer = self.cache.layers[layer_idx]
        width = conv_kernel_size or conv_input.shape[-1]
        a, b = self._prompts(layer_idx, "conv", conv_input.shape[-1] == self.tokens and self.segments > 1)
        if a == b:
            return conv_input
        n = torch.tensor(self.lengths[a:b], device=conv_input.device)
        ends = torch.cumsum(n, 0)  # in the call's own coordinates: 0 .. its tokens
        taken = ends[:, None] - width + torch.arange(width, device=conv_input.device)[None]  # [prompts, K]
        seen = taken >= (ends - n)[:, None]
        states = conv_input[0][:, taken.clamp(min=0)].permute(1, 0, 2) * seen[:, None, :]  # [prompts, C, K]
        if not layer.is_conv_states_initialized[state_idx]:
            layer.lazy_initialization(conv_states=conv_input.new_zeros((self.batch, conv_input.shape[1], width)),
                                      state_idx=state_idx, conv_kernel_size=width)
        layer.conv_states[state_idx][self.first_row + a:self.first_row + b] = states
        layer.has_previous_state[state_idx] = True
        return conv_input

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        layer = self.cache.layers[layer_idx]
        a, b = self._prompts(layer_idx, "recurrent", recurrent_states.shape[0] == self.segments and self.segments > 1)
        if a == b:
            return recurrent_states
        if not layer.is_recurrent_states_initialized[state_idx]:
            layer.lazy_initialization(recurrent_states=recurrent_states.new_zeros(
                (self.batch, *recurrent_states.shape[1:])), state_idx=state_idx)
        layer.recurrent_states[state_idx][self.first_row + a:self.first_row + b] = recurrent_states[:b - a]
        return recurrent_states


@contextlib.contextmanager
def _row_views(cache, rows: int | None, columns: int | None = None):
    """The cache's tensors (keys and values of attention layers, conv and recurrent states of linear-attention
    layers: transformers 5's cache layers) replaced by views of their first `rows` rows while the block runs, so a
    forward on those rows writes into the whole cache's storage; None: nothing replaced.

    columns: the (full) attention layers' keys and values also cut to their first `columns` positions (their
    `max_cache_len` too, which sizes the mask): a prefill forward ending there attends over the filled prefix only,
    not the cache's whole length (what is after it is not written yet; the causal mask would hide it), and
    transformers' SDPA path, which repeats keys and values per query head when a mask is given, copies only that
    prefix. Only on layers already allocated (a static layer allocates its full length on its first update)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    saved = []
    for layer in cache.layers:
        # a sliding window layer rolls its keys by its length: never cut
        cut = (columns if isinstance(layer, StaticLayer) and not isinstance(layer, StaticSlidingWindowLayer)
               and isinstance(getattr(layer, "keys", None), torch.Tensor) else None)
        if cut is not None:
            saved.append((layer.__dict__, "max_cache_len", layer.max_cache_len))
            layer.max_cache_len = cut
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and (rows is not None or cut is not None):
                saved.append((layer.__dict__, name, tensor))
                setattr(layer, name, tensor[:rows, :, :cut])
        if rows is None:
            continue
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            for index, tensor in (states.items() if isinstance(states, dict) else ()):
                if isinstance(tensor, torch.Tensor):
                    saved.append((states, index, tensor))
                    states[index] = tensor[:rows]
    try:
        yield
    finally:
        for holder, key, value in reversed(saved):
            holder[key] = value


def _is_left_padded(mask: torch.Tensor) -> bool:
    """Every row of the 2D mask [B, W] is zeros then ones, the last column one."""
    m = mask.to(torch.long)
    return bool((((m == 0) | (m == 1)).all() & (m[:, 1:] >= m[:, :-1]).all() & (m[:, -1] == 1).all()).item())


def _first_real_columns(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[B] long: each left-padded row's first real column (its prompt's first token) from the 2D mask [B, >= W]."""
    return width - mask[:, :width].sum(-1)


def _now(device: torch.device) -> float:
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()

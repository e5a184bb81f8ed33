"""How the static decoder's batches are sized and cut: from device memory and a decode cost model, not a token budget
alone.

Why: a decode step reads the weights once whatever the batch, plus every row's static cache over its whole padded
width (attention reads the masked padding too), so the cheapest way through a list of prompts sorted longest first
is neither one batch per memory-full of padded tokens (the longest prompt sets every row's width) nor one batch per
length (each batch re-reads the weights every step). Per decode step, in bytes read:

    cost(batch) = weights_bytes + rows x (padded prompt + new tokens) x kv_bytes_per_token

and every batch runs the same `new_tokens` steps, so the cut that minimizes the sum over batches of that cost
minimizes decode time under this model (compute per row is the same whatever the cut; the Gated DeltaNet state of a
row is read once a step in any batch).

When the decode steps attend in row spans (regen/attention.py, `span_cost_keys` set), a row no longer reads the left
padding before its span's first column, so padding stops being what a merged batch pays; the read term becomes

    sum over rows of (keys - the row's own first column, rounded down to the spans' column multiple)
    + span_cost_keys x min(distinct such columns, the planner's span limit)

an estimate of what `plan_decode_spans` plans for that batch (the planner merges neighbouring columns where a span
costs more than the padding it saves, and must merge beyond its span limit), cheap enough for the dynamic programming
below. A cut blind to the spans pays for padding they do not read: on the 8B benchmark's 256 prompts it is 43 rows
over 2,880 positions and 213 over 960, two batches of 256 steps each, where one batch (memory allowing) runs 256
steps reading the weights once a step.

`cut_batches` finds the cheapest cut exactly by dynamic programming over the sorted list
(cut points anywhere, O(n x max_batch_size)), under the limits: rows <= max_batch_size, rows x padded tokens <= the
token budget and, on CUDA, the bytes a batch holds at its end (cache, states, the prefill's transient copies) <= the
memory free after the weights (`memory_limit_bytes`).

Sizes per model (`ModelSizes.of`): KV bytes per token = full-attention layers x key/value heads x head dim x 2 (keys
and values) x dtype bytes; Gated DeltaNet bytes per row = its layers x (value heads x key dim x value dim (float32)
+ conv channels x conv kernel x dtype bytes). Tested against arithmetic in tests/test_regen_batch_sizing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_FRACTION = 0.85  # of the memory free after the weights: allocator fragmentation, logits, processors


@dataclass(frozen=True)
class ModelSizes:
    """weights_bytes: all parameters (and quantized layers' weight buffers). kv_bytes_per_token: one token of
    every full-attention layer's keys and values. state_bytes_per_row: one row's linear-attention (Gated DeltaNet)
    conv and recurrent states.
    repeat_bytes_per_token: a prefill forward's keys and values repeated per query head (transformers' SDPA with a
    mask, or eager), one attention layer at a time, per token of the attended prefix and row; 0 where the decoder's
    prefill copies none (packed, or on regen/attention.py's function: `StaticCacheDecoder.prefill_copies_keys`)."""

    weights_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_row: int
    repeat_bytes_per_token: int

    @classmethod
    def of(cls, model, config) -> ModelSizes:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        dtype_bytes = next(model.parameters()).element_size()
        # and the buffers of quantized layers: an FP8 checkpoint's linear layers hold their weights and scales as
        # buffers (fp8_weights.BlockFP8Linear: `weights_in_buffers`)
        quantized = [b for m in model.modules() if hasattr(m, "weights_in_buffers") for b in m.buffers(recurse=False)]
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *quantized))
        layers = int(text.num_hidden_layers)
        types = list(getattr(text, "layer_types", None) or [])[:layers]
        if not types and getattr(text, "full_attention_interval", None):
            interval = int(text.full_attention_interval)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        attention = sum(t != "linear_attention" for t in types) if types else layers
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        linear = layers - attention
        state = 0
        if linear:
            k_heads, v_heads = int(text.linear_num_key_heads), int(text.linear_num_value_heads)
            k_dim, v_dim = int(text.linear_key_head_dim), int(text.linear_value_head_dim)
            conv = (2 * k_heads * k_dim + v_heads * v_dim) * int(text.linear_conv_kernel_dim) * dtype_bytes
            state = linear * (v_heads * k_dim * v_dim * 4 + conv)
        return cls(weights_bytes=weights, kv_bytes_per_token=attention * kv_heads * head_dim * 2 * dtype_bytes,
                   state_bytes_per_row=state, repeat_bytes_per_token=heads * head_dim * 2 * dtype_bytes)

    def batch_bytes(self, rows: int, width: int, new_tokens: int) -> int:
        """What a batch of `rows` rows, prompts padded to `width`, holds at most: its static cache and states, and
        the transient per-head copy of keys and values of its widest prefill forward (one layer)."""
        return rows * ((width + new_tokens) * self.kv_bytes_per_token + self.state_bytes_per_row
                       + width * self.repeat_bytes_per_token)

    def weights_tokens(self) -> float:
        """The weights' read per step in tokens of cache (the cost model's price of one more batch)."""
        return self.weights_bytes / self.kv_bytes_per_token if self.kv_bytes_per_token else float("inf")


def cut_batches(lengths: list[int], new_tokens: int, width_of, max_batch_size: int, max_tokens_per_batch: int,
                sizes: ModelSizes | None, memory_limit_bytes: int | None,
                span_cost_keys: int | None = None) -> list[tuple[int, int]]:
    """[(start, end)] index ranges of `lengths` (prompt tokens, sorted longest first) minimizing the sum of
    `cost(batch)` (module docstring) under the limits; width_of(prompt tokens) -> the padded width of a batch whose
    longest prompt has them. span_cost_keys: the decode steps' price of a row span when they attend in spans (the
    read term of the module docstring), None when every row reads the whole cache. Without sizes (no model
    figures): consecutive batches filled to the limits. A prompt alone always makes a batch (the caller rejected
    those over the token budget)."""
    n = len(lengths)
    price = sizes.weights_tokens() if sizes is not None else float("inf")

    def fits(rows: int, width: int) -> bool:
        if rows > max_batch_size or rows * (width + new_tokens) > max_tokens_per_batch:
            return False
        return memory_limit_bytes is None or sizes is None or \
            sizes.batch_bytes(rows, width, new_tokens) <= memory_limit_bytes

    if price == float("inf"):  # one more batch costs more than any padding: fill each batch
        cuts, start = [], 0
        while start < n:
            width, end = width_of(lengths[start]), start + 1
            while end < n and fits(end + 1 - start, width):
                end += 1
            cuts.append((start, end))
            start = end
        return cuts
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest cut of lengths[:j]
    back = [0] * (n + 1)
    for start in range(n):  # forward: a batch starting at `start` takes the width of lengths[start]
        width = width_of(lengths[start])
        read = _ReadCost(width + new_tokens, span_cost_keys)
        for end in range(start + 1, n + 1):
            rows = end - start
            if rows > 1 and not fits(rows, width):
                break
            cost = best[start] + price + read.add_row(width - lengths[end - 1])
            if cost < best[end]:
                best[end], back[end] = cost, start
    cuts, end = [], n
    while end > 0:
        cuts.append((back[end], end))
        end = back[end]
    return cuts[::-1]


class _ReadCost:
    """A batch's cache positions read per decode step as its rows are added (sorted longest first), in the cost
    model's units: the whole cache a row without spans; with spans, each row from its own first column (rounded down
    to the spans' column multiple) plus the spans' price (the module docstring's estimate)."""

    def __init__(self, keys: int, span_cost_keys: int | None):
        from dflash_prep.regen.attention import MAX_DECODE_SPANS, SPAN_COLUMN_MULTIPLE

        self.keys, self.span_cost_keys = keys, span_cost_keys
        self.multiple, self.max_spans = SPAN_COLUMN_MULTIPLE, MAX_DECODE_SPANS
        self.rows_read, self.columns, self.last_column = 0, 0, None

    def add_row(self, first_real: int) -> int:
        """One more row whose first real column is `first_real` -> the batch's read so far."""
        if self.span_cost_keys is None:
            self.rows_read += self.keys
            return self.rows_read
        column = first_real // self.multiple * self.multiple
        self.rows_read += self.keys - column
        if column != self.last_column:
            self.columns, self.last_column = self.columns + 1, column
        return self.rows_read + self.span_cost_keys * min(self.columns, self.max_spans)

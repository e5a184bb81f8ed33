"""The static decoder's attention: one function registered in transformers' AttentionInterface for the decode steps
and the padded prefill forwards of regen/decode.py, where the model's own attention is `sdpa`.

Why our own, for the padded prefill: transformers' `sdpa` path, given a mask (a padded batch), repeats every
key and value per query head (`repeat_kv`: a copy) before SDPA. Measured on an H200 (bench/regen_bench.py's
profile of one warm prefill): 870 of 3,256 device ms on the Llama-3.1-8B shape (128 rows, 55,770 prompt tokens),
505 of 5,033 on the Qwen3.6-27B hybrid (64 rows); with this function the hybrid's copies took 259 of 4,747 ms. It
runs SDPA on the query heads packed per key/value head instead (queries [B, Hkv, G * S, D] against keys
[B, Hkv, L, D]), the mask [B, 1, S, L] repeated G times along the queries (once per forward: every layer gets the
same mask object): the same math, no key or value copied.

Decode steps (one query a row) go to transformers' `sdpa` function, in row spans when the decoder sets them
(`decode_spans`): a left-padded batch's rows begin at different columns, and SDPA reads every key of the cache, the
padding included, so the rows are cut into a few consecutive spans, each attending over the keys from its own first
real column on (views of the cache: nothing copied; the keys before it are masked padding for every row of the span,
so the result is the same; on one H200 the 8B benchmark's 256 x 256 went from 6,077 to 7,657 generated tok/s warm
with them, the batch cut pricing them too), each ending at the steps' key limit when the decoder sets one
(`decode_key_limit`: the cache's columns no step has written yet are not read). Everything else (no mask, softcap,
position bias, sinks, output_attentions) goes to transformers' `sdpa` as it is. Measured for the decode step, and
not kept: two batched GEMMs (scores q k^T in float32, softmax, p v) took 23.7 ms of an eager 8B step (128 rows x
1,792 positions) where SDPA's cuDNN kernel took 14.9, and 9.8 against 4.6 ms on the hybrid (64 rows x 1,664
positions).

Decode steps on flex attention instead (`flex_decode`; the decoder's `decode_kernel="flex"`, and `auto` on CUDA for
a model without Gated DeltaNet layers): PyTorch's
`flex_attention` with a block mask of each row's own key blocks, from its first real column's block to the block of
the column being decoded (FlexDecodeMask), compiled on CUDA into PyTorch's flex-decoding kernel, which splits the
keys across the SMs and reads only the listed blocks: neither a row's left padding nor the columns no step has
written yet are read, with one CUDA graph for every step (the block counts grow in place between replays). Why:
the sdpa decode step above reads the cache at about 2 TB/s on one H200 (cuDNN's kernel, 14.9 ms for 128 rows x
1,792 positions of the 8B shape), under half the memory's bandwidth. Measured on that GPU (the 8B's 256 x 256),
flex compiled with every shape static (`_flex_attention`) ran 15.3 ms a step against 22.3 in row spans, exact on
the float32 slice; compiled with the batch dynamic it had run 54.3 ms (inductor's main flex-attention template:
the decoding kernel needs the batch size static). The 27B hybrid ran level on either.

Shapes: query [B, Hq, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], Hq a multiple of Hkv (the query heads of
key/value head h are h * G .. h * G + G - 1, as transformers' `repeat_kv`); mask bool (True: attend) or additive
float, broadcastable to [B, 1, S, L] (transformers' `sdpa_mask`, which is registered under this name as well).
Returns ([B, S, Hq, Dv], None) like every AttentionInterface function. The tests check it against attention
written out in float64 on the CPU, and the decoder's answers against `generate` alone.
"""

from __future__ import annotations

import contextlib
import threading

import torch

STATIC_ATTENTION = "regen_static"  # no "flash" or "sdpa" in the name: transformers reads such names by substring
SPAN_COLUMN_MULTIPLE = 64  # a span's first key column is a multiple of it (aligned for the kernels)
MAX_DECODE_SPANS = 8  # row spans a decode step attends in at most (one SDPA call a layer each)
DEFAULT_SPAN_COST_KEYS = 8192  # a span's price in cache positions (plan_decode_spans); measured: bench/RESULTS.md


def register() -> str:
    """Register the function and sdpa's mask under STATIC_ATTENTION (idempotent) -> the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(STATIC_ATTENTION, static_attention)
    AttentionMaskInterface.register(STATIC_ATTENTION, sdpa_mask)
    return STATIC_ATTENTION


def static_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs):
    """AttentionInterface function (the module docstring gives shapes and what runs where)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    flex = _DecodeSpans.flex
    if flex is not None and query.shape[2] == 1 and query.shape[0] == flex.rows and key.shape[2] == flex.keys \
            and not _needs_sdpa(module, query, key, value, dropout, kwargs):
        return flex.attend(query, key, value, scaling), None
    spans = _DecodeSpans.spans
    # spans only over a layer whose keys are the whole cache: a sliding-window layer's keys are a rolling buffer of
    # one window, whose columns are not the positions the spans were cut at
    if query.shape[2] == 1 and spans and spans[-1][1] == query.shape[0] and key.shape[2] == _DecodeSpans.keys \
            and attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] == key.shape[2]:
        return _decode_in_spans(module, query, key, value, attention_mask, spans, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs), None
    if query.shape[2] == 1 or attention_mask is None or _needs_sdpa(module, query, key, value, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return _prefill(query, key, value, attention_mask, scale), None


def _needs_sdpa(module, query, key, value, dropout, kwargs) -> bool:
    """What only transformers' `sdpa` function runs as asked: softcap, position bias, sinks, attention weights,
    dropout, query heads not a multiple of the key heads."""
    return bool(kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
                or kwargs.get("s_aux") is not None or kwargs.get("output_attentions") or (dropout and module.training)
                or query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1])


class _DecodeSpansState(threading.local):
    """The row spans of the batch being decoded: [(first row, end row, first key column)], the key columns of the
    cache they were cut for (its positions), set by `decode_spans`, and the column the steps' keys end at
    (exclusive; None: the cache's end), set by `decode_key_limit`; or the batch's flex-attention mask, set by
    `flex_decode` (spans and limit then unused). Per thread: decoders in two threads of one process (each engine
    answers in a worker thread) must not read each other's spans, limit or mask."""

    spans: list[tuple[int, int, int]] | None = None
    keys: int | None = None
    limit: int | None = None
    flex: FlexDecodeMask | None = None  # set by `flex_decode`: the steps on flex attention instead


_DecodeSpans = _DecodeSpansState()


@contextlib.contextmanager
def decode_spans(spans: list[tuple[int, int, int]] | None, keys: int | None = None):
    """Decode steps attend per row span while the block runs (the module docstring), in the layers whose keys are
    `keys` columns (the cache's positions; a sliding-window layer's shorter buffer attends whole); None: whole."""
    before = _DecodeSpans.spans, _DecodeSpans.keys, _DecodeSpans.limit
    _DecodeSpans.spans, _DecodeSpans.keys, _DecodeSpans.limit = spans, keys, None
    try:
        yield
    finally:
        _DecodeSpans.spans, _DecodeSpans.keys, _DecodeSpans.limit = before


def decode_key_limit(limit: int | None) -> None:
    """The decode steps under `decode_spans` read the keys before column `limit` only (None: up to the cache's
    end). The caller guarantees every position the steps attend lies before it: the columns from `limit` on are
    ones no step has written yet, which the causal mask hides anyway (so the result is the same), but which the
    attention kernel would read. Set before each eager step or CUDA-graph capture that should use it (a captured
    step keeps the limit it was captured with)."""
    _DecodeSpans.limit = limit


def _decode_in_spans(module, query, key, value, mask, spans, **kwargs) -> torch.Tensor:
    """[B, Hq, 1, D] ... -> [B, 1, Hq, Dv]: each span's rows against the keys from its first column on, up to the
    steps' key limit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    limit = _DecodeSpans.limit or key.shape[2]
    outs = []
    for first, end, column in spans:
        rows_mask = mask[first:end] if mask.shape[0] > 1 else mask
        out, _ = sdpa_attention_forward(module, query[first:end], key[first:end, :, column:limit],
                                        value[first:end, :, column:limit], rows_mask[..., column:limit], **kwargs)
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


FLEX_BLOCK_COLUMNS = 128  # key columns of a flex-attention block (its kernels' default block size)
# batch shapes (rows, key columns) the compiled flex call is compiled for at most in a process: dynamo's recompile
# limit for it, raised from its default 8 (`_flex_attention`); a batch of another shape past it decodes on sdpa
FLEX_MAX_SHAPES = 64
_flex_attention_compiled = None  # torch.compile(flex_attention), made once a process (a compile per shape)
_flex_shapes: set[tuple[int, int, str]] = set()  # the (rows, key columns) admitted so far (`admit_flex_shape`)


def flex_key_columns(columns: int) -> int:
    """The key columns (the static cache's length) a batch decoded on flex attention is given for `columns` (its
    padded prompt width + new tokens): rounded up to a multiple of FLEX_BLOCK_COLUMNS up to 1,024, then to four
    steps an octave (at most 25% more; 1,280, 1,536, 1,792, 2,048, 2,560, ...). Why: the flex call is compiled per
    shape (`_flex_attention`), so a job's batches should share few key counts (their row counts still vary); the
    extra columns cost cache memory (the batch cut counts them) and no reads (each row's block list ends at the
    step's column)."""
    if columns <= 1024:
        step = FLEX_BLOCK_COLUMNS
    else:
        step = 1 << ((columns - 1).bit_length() - 3)
    return -(-columns // step) * step


def admit_flex_shape(rows: int, keys: int, kind: str = "") -> bool:
    """Whether a batch of `rows` x `keys` key columns of a model `kind` (its dtype and head sizes: what else dynamo
    compiles per) may decode on flex attention in this process: a shape already admitted, or a new one while fewer
    than FLEX_MAX_SHAPES are (then admitted). False past that: the decoder runs that batch on sdpa (a compile per
    shape, and dynamo refuses more than its recompile limit). Row counts are not rounded (the batch cut picks
    them), so a long job of many batch sizes can reach the cap."""
    shape = (int(rows), int(keys), kind)
    if shape in _flex_shapes:
        return True
    if len(_flex_shapes) >= FLEX_MAX_SHAPES:
        return False
    _flex_shapes.add(shape)
    return True


class FlexDecodeMask:
    """The decode steps of a left-padded batch on PyTorch's flex attention: each row reads only the key blocks from
    its own first real column to the column being decoded, through a `BlockMask` whose per-row block counts grow in
    place (`advance`), so one captured CUDA graph serves every step; a block's columns outside that range are masked
    by the mask function (`kv >= first_real[b] and kv <= column`): the same keys transformers' mask lets through.
    On CUDA the call is `torch.compile`d (PyTorch's flex-decoding kernel: the keys split across the GPU's SMs); on
    the CPU it runs eagerly (PyTorch's reference implementation: the tests' path; `compiled=True` compiles there too).

    first_real: [B] long, each row's first real key column (left padding before it), on the batch's device.
    keys: the cache's key columns (the full attention layers' length); column: the last column already written (the
    prompt's last, W - 1), the steps' first call attending one column further (`advance` before each step)."""

    def __init__(self, first_real: torch.Tensor, keys: int, column: int, compiled: bool | None = None):
        from torch.nn.attention.flex_attention import BlockMask

        self.rows, self.keys = int(first_real.shape[0]), int(keys)
        self.compiled = first_real.device.type == "cuda" if compiled is None else compiled
        self.first_real = first_real.to(torch.long)
        self.column = torch.full((1,), column, dtype=torch.long, device=first_real.device)
        self.first_block = self.first_real // FLEX_BLOCK_COLUMNS
        blocks = -(-self.keys // FLEX_BLOCK_COLUMNS)
        offsets = torch.arange(blocks, device=first_real.device)
        indices = (self.first_block[:, None] + offsets[None]).clamp(max=blocks - 1).to(torch.int32)
        self.num_blocks = torch.zeros((self.rows, 1, 1), dtype=torch.int32, device=first_real.device)
        first, last = self.first_real, self.column

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= first[b]) & (kv_idx <= last[0])

        extra = {"compute_q_blocks": False} if "compute_q_blocks" in _parameters(BlockMask.from_kv_blocks) else {}
        self.block_mask = BlockMask.from_kv_blocks(self.num_blocks, indices[:, None, None, :],
                                                   BLOCK_SIZE=FLEX_BLOCK_COLUMNS, mask_mod=mask_mod,
                                                   seq_lengths=(1, self.keys), **extra)

    def advance(self) -> None:
        """The next step attends one column further: its blocks counted anew, in place (device ops, no sync)."""
        self.column.add_(1)
        last_block = torch.div(self.column, FLEX_BLOCK_COLUMNS, rounding_mode="floor")
        self.num_blocks.view(-1).copy_(last_block - self.first_block + 1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """query [B, Hq, 1, D], key / value [B, Hkv, L, D] (L == keys) -> [B, 1, Hq, Dv]."""
        out = _flex_attention(self.compiled)(query, key, value, block_mask=self.block_mask, scale=scaling,
                                            enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous()


def _flex_attention(compiled: bool):
    """PyTorch's flex_attention, compiled (made once) with every shape static, or the eager reference (which warns
    once that it is unfused: said in FlexDecodeMask). Static: inductor's flex-decoding kernel (the keys split across
    SMs) needs the batch and head counts static (its `_use_flex_decoding`), and dynamo makes a dimension dynamic once
    it has seen two sizes of it (the profile of a process that had compiled two batch sizes showed the main
    flex-attention kernel: 54 ms a step against 23 on sdpa, 8B shape, one H200); on the CPU that dynamic recompile
    failed to build. The cost: a compile per batch shape (about 2 s of the 8B's first batch on one H200), and past
    dynamo's recompile limit (8 a function by default; FLEX_MAX_SHAPES around this call) the call fails, so the
    decoder admits no more shapes than that (`admit_flex_shape`) and falls back to sdpa on any other failure
    (logged)."""
    global _flex_attention_compiled
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return _eager_flex_attention
    if _flex_attention_compiled is None:
        _flex_attention_compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    return _flex_attention_static


def _flex_attention_static(*args, **kwargs):
    """The compiled flex call with dynamo's recompile limit raised to FLEX_MAX_SHAPES while it runs (its default, 8
    compiles of one function a process, would stop a job's ninth batch shape; `admit_flex_shape` keeps the decoder
    within the raised one)."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name before 2.7
    with config.patch(**{name: max(FLEX_MAX_SHAPES, getattr(config, name))}):
        return _flex_attention_compiled(*args, **kwargs)


def _eager_flex_attention(*args, **kwargs):
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(*args, **kwargs)


def _parameters(function) -> set[str]:
    import inspect

    return set(inspect.signature(function).parameters)


@contextlib.contextmanager
def flex_decode(mask: FlexDecodeMask | None):
    """Decode steps (one query a row, a full-attention layer of `mask.keys` columns, `mask.rows` rows) on flex
    attention with `mask` while the block runs; None: as without."""
    before = _DecodeSpans.flex
    _DecodeSpans.flex = mask
    try:
        yield
    finally:
        _DecodeSpans.flex = before


def plan_decode_spans(first_real: list[int], keys: int, column_multiple: int = SPAN_COLUMN_MULTIPLE,
                      max_spans: int = MAX_DECODE_SPANS,
                      span_cost_keys: int = DEFAULT_SPAN_COST_KEYS) -> list[tuple[int, int, int]]:
    """The row spans of a batch (rows in their order; row r's first real key column `first_real[r]`) that minimize
    the keys read per decode step, sum over spans of rows x (keys - its first column), plus `span_cost_keys` per
    span (one more small SDPA call a layer: ~10 us of GPU time, about what 8,192 positions of an 8B's cache take
    to read), at most `max_spans`; a span's first column is its rows' smallest, rounded down to `column_multiple`
    (aligned for the kernels). Exact dynamic programming over the cut points between runs of rows with one first
    column (a batch sorted by length has a few dozen), O(runs^2 x max_spans)."""
    if not first_real:
        return []
    runs: list[list[int]] = []  # [first row, end row, start column] of consecutive rows with one start
    for row, f in enumerate(first_real):
        column = (f // column_multiple) * column_multiple
        if runs and runs[-1][2] == column:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1, column])
    n, inf = len(runs), float("inf")
    best = [[inf] * (n + 1) for _ in range(max_spans + 1)]  # best[k][j]: runs[:j] in k spans
    back = [[0] * (n + 1) for _ in range(max_spans + 1)]
    best[0][0] = 0.0
    for k in range(1, max_spans + 1):
        for j in range(1, n + 1):
            column = keys
            for i in range(j - 1, -1, -1):  # the span runs[i:j]
                column = min(column, runs[i][2])
                if best[k - 1][i] == inf:
                    continue
                cost = best[k - 1][i] + (runs[j - 1][1] - runs[i][0]) * (keys - column) + span_cost_keys
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    k = min(range(1, max_spans + 1), key=lambda k: best[k][n])
    spans, j = [], n
    while j > 0:
        i = back[k][j]
        spans.append((runs[i][0], runs[j - 1][1], min(r[2] for r in runs[i:j])))
        j, k = i, k - 1
    return spans[::-1]


class _RepeatedMask:
    """The last mask repeated per query group (one forward's layers all get the same mask object); the source is
    held, so an `is` check cannot match a new tensor at a reused address."""

    source: torch.Tensor | None = None
    groups: int = 0
    repeated: torch.Tensor | None = None

    @classmethod
    def of(cls, mask: torch.Tensor, groups: int) -> torch.Tensor:
        if mask is not cls.source or groups != cls.groups:
            cls.source, cls.groups, cls.repeated = mask, groups, mask.repeat(1, 1, groups, 1)
        return cls.repeated

    @classmethod
    def release(cls) -> None:
        cls.source, cls.groups, cls.repeated = None, 0, None


def release_prefill_masks() -> None:
    """Drop the last repeated prefill mask (a padded prefill's, up to a few hundred MB): called after a prefill."""
    _RepeatedMask.release()


def _prefill(query, key, value, mask, scale: float) -> torch.Tensor:
    """Several queries a row, with a mask -> [B, S, Hq, Dv]."""
    batch, q_heads, length, dim = query.shape
    kv_heads = key.shape[1]
    groups = q_heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * length, dim)  # query index g * S + s
    if mask.shape[2] == 1 or groups == 1:
        packed_mask = mask
    else:
        packed_mask = _RepeatedMask.of(mask, groups)  # [B, 1, S, L] -> [B, 1, G * S, L]
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=packed_mask, scale=scale)
    out = out.view(batch, kv_heads, groups, length, value.shape[-1]).reshape(batch, q_heads, length, -1)
    return out.transpose(1, 2).contiguous()

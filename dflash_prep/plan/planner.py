"""Global, deterministic batch planning for hidden-state capture.

GPU memory scales with ``batch_size * padded_length`` and every distinct
``(batch_size, padded_length)`` shape costs seconds of Triton autotuning, so
this module

* rounds every sample length up to one of a small set of padded lengths
  (:class:`ShapeBuckets`),
* cuts each bucket into batches whose padded-token count never exceeds a
  budget (:func:`plan_batches`); within a bucket every batch has the same
  batch size except possibly the last, so a bucket contributes at most two
  shapes,
* orders batches longest-first, so an out-of-memory error shows up in the
  first minute of a run instead of hours in,
* splits a plan across data-parallel ranks so they finish together by predicted time: the forward's FLOPs and
  the write's bytes of each batch (:class:`BatchCostModel`, :func:`split_across_ranks`).

With ``batching.packing`` a plan is of packed rows instead (:func:`plan_packed_rows`): one row of whole samples
per forward, filled best-fit to the budget and padded to one of a few fixed row lengths.

Everything here is pure Python and deterministic: the same lengths and
settings always give the same plan, on any machine.
"""

from __future__ import annotations

import bisect
import functools
import math
import numbers
import operator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Sequence

from dflash_prep.recipe.schema import RecipeError

if TYPE_CHECKING:
    from dflash_prep.recipe.schema import Recipe

__all__ = [
    "ShapeBuckets",
    "PlannedBatch",
    "plan_batches",
    "plan_stats",
    "split_across_ranks",
    "BatchCost",
    "BatchCostModel",
    "rank_finish_seconds",
]


def _as_int(value: Any, name: str) -> int:
    """``value`` as a Python int (numpy integers accepted); TypeError for floats, bools, etc."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


@functools.lru_cache(maxsize=64)
def _compute_edges(length_multiple: int, growth: float, max_length: int) -> tuple[int, ...]:
    # growth is taken as the number its shortest decimal repr spells (1.1 means
    # exactly 11/10), and the arithmetic is exact, so the edges are what a person
    # computes by hand and do not depend on float rounding (in binary floating
    # point 1360 * 1.1 / 8 is 187.00000000000003, which would ceil to 188).
    exact_growth = Fraction(repr(growth))
    # The last edge is capped at max_length rounded up to the multiple: growing past it would only add padding
    # to the longest samples and raise the budget they need.
    cap = math.ceil(max_length / length_multiple) * length_multiple
    edges = [min(length_multiple, cap)]
    while edges[-1] < max_length:
        prev = edges[-1]
        grown = math.ceil(prev * exact_growth / length_multiple) * length_multiple
        edges.append(min(cap, max(prev + length_multiple, grown)))
    return tuple(edges)


@dataclass(frozen=True)
class ShapeBuckets:
    """Padded lengths allowed on the GPU.

    Edges are multiples of ``length_multiple`` growing geometrically by
    ``growth`` (> 1.0)::

        edges[0]   = length_multiple
        edges[i+1] = max(edges[i] + length_multiple,
                         ceil(edges[i] * growth / length_multiple) * length_multiple)

    up to and including the first edge >= ``max_length``; the last edge is capped at ``max_length``
    rounded up to a multiple of ``length_multiple``.

    Guarantees:

    * edges are strictly increasing multiples of ``length_multiple``;
    * ``edges()[-1] >= max_length`` and every earlier edge is ``< max_length``,
      so every length in ``[1, max_length]`` has an edge. the last edge is at most
      ``max_length`` rounded up to the multiple (64 / 1.25 / 4096 ends at 4096, not 4800);
    * ``growth`` is interpreted as the decimal number its ``repr`` shows and the
      rounding is done in exact rational arithmetic, so results are free of
      float artefacts and identical on every platform.
    """

    length_multiple: int
    growth: float
    max_length: int

    def __post_init__(self) -> None:
        length_multiple = _as_int(self.length_multiple, "length_multiple")
        max_length = _as_int(self.max_length, "max_length")
        if isinstance(self.growth, bool) or not isinstance(self.growth, numbers.Real):
            raise TypeError(f"growth must be a real number, got {self.growth!r}")
        growth = float(self.growth)
        if length_multiple < 1:
            raise ValueError(f"length_multiple must be >= 1, got {length_multiple}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        if not (math.isfinite(growth) and growth > 1.0):
            raise ValueError(f"growth must be a finite number > 1.0, got {self.growth!r}")
        # Normalise (e.g. numpy ints -> int) so equality/hash behave.
        object.__setattr__(self, "length_multiple", length_multiple)
        object.__setattr__(self, "max_length", max_length)
        object.__setattr__(self, "growth", growth)

    def edges(self) -> tuple[int, ...]:
        """All allowed padded lengths, ascending (see the class docstring)."""
        return _compute_edges(self.length_multiple, self.growth, self.max_length)

    def round_up(self, num_tokens: int) -> int:
        """Smallest edge >= ``num_tokens``.

        Raises ValueError if ``num_tokens < 1`` or ``num_tokens > max_length``.
        """
        num_tokens = _as_int(num_tokens, "num_tokens")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if num_tokens > self.max_length:
            raise ValueError(
                f"num_tokens={num_tokens} exceeds buckets max_length={self.max_length}; "
                "truncate or drop the sample before planning, or raise max_length"
            )
        edges = self.edges()
        return edges[bisect.bisect_left(edges, num_tokens)]


@dataclass(frozen=True)
class PlannedBatch:
    """One GPU batch of the plan.

    Attributes:
        batch_id: stable id = position in the global plan returned by
            :func:`plan_batches` (0 is the first, longest batch).
        sample_indices: row indices into the tokenized dataset, ordered by
            (true length desc, index asc).
        padded_length: T after bucket rounding; every sample in the batch has
            true length <= T.
        num_real_tokens: sum of the true lengths of the samples.
        packed: the samples lie back to back in ONE row of `padded_length` tokens (packing.py) instead of one
            right-padded row each; then `padded_length` >= num_real_tokens.
    """

    batch_id: int
    sample_indices: tuple[int, ...]
    padded_length: int
    num_real_tokens: int
    packed: bool = False

    def __post_init__(self) -> None:
        if not self.sample_indices:
            raise ValueError("a PlannedBatch needs at least one sample")
        if self.padded_length < 1:
            raise ValueError(f"padded_length must be >= 1, got {self.padded_length}")
        if not 0 < self.num_real_tokens <= self.num_padded_tokens:
            raise ValueError(
                f"num_real_tokens={self.num_real_tokens} must be in "
                f"[1, batch_size * padded_length = {self.num_padded_tokens}]"
            )

    @property
    def batch_size(self) -> int:
        """Number of samples (rows) in the batch."""
        return len(self.sample_indices)

    @property
    def num_padded_tokens(self) -> int:
        """The tokens the GPU actually processes: ``batch_size * padded_length``, or ``padded_length`` for a
        packed row."""
        return self.padded_length if self.packed else len(self.sample_indices) * self.padded_length

    @property
    def shape(self) -> tuple[int, int]:
        """The forward's input shape (rows, tokens per row): (1, padded_length) for a packed row."""
        return (1, self.padded_length) if self.packed else (len(self.sample_indices), self.padded_length)


def plan_batches(
    lengths: Sequence[int],
    *,
    max_tokens_per_batch: int,
    max_batch_size: int,
    buckets: ShapeBuckets,
) -> list[PlannedBatch]:
    """Cut all samples into padded batches under a padded-token budget.

    ``lengths[i]`` is the true token length of dataset row ``i``.

    Algorithm (deterministic and global over the whole dataset):

    1. round each length up with ``buckets.round_up`` and group samples by
       rounded length;
    2. order each group by (true length desc, index asc);
    3. the group's batch size is
       ``min(max_batch_size, max_tokens_per_batch // padded_length)``;
       cut the group into consecutive chunks of that size (the last chunk may
       be smaller);
    4. order all batches by padded_length desc, ties by the chunk's position
       in its group; ``batch_id`` = index in that order.

    Guarantees:

    * every index ``0 .. len(lengths)-1`` appears in exactly one batch;
    * ``batch.num_padded_tokens <= max_tokens_per_batch`` and
      ``batch.batch_size <= max_batch_size`` for every batch;
    * each bucket yields at most two distinct (batch_size, padded_length)
      shapes, so the plan has at most ``2 * len(buckets.edges())`` shapes;
    * the result depends only on the lengths and the settings (the same input
      always gives an equal plan); ``batch_id == position`` in the list.

    Raises ValueError if a length is < 1 or > ``buckets.max_length``, if
    ``max_tokens_per_batch`` or ``max_batch_size`` is < 1, or if a sample's
    padded length exceeds ``max_tokens_per_batch`` (a batch of one would not
    fit). An empty ``lengths`` gives an empty plan.
    """
    max_tokens_per_batch = _as_int(max_tokens_per_batch, "max_tokens_per_batch")
    max_batch_size = _as_int(max_batch_size, "max_batch_size")
    if max_tokens_per_batch < 1:
        raise ValueError(f"max_tokens_per_batch must be >= 1, got {max_tokens_per_batch}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")

    groups = _group_by_padded_length(lengths, buckets)
    # (padded_length, position of the chunk in its group, indices, real tokens)
    chunks: list[tuple[int, int, tuple[int, ...], int]] = []
    for padded_length in sorted(groups, reverse=True):
        chunks += _cut_group(padded_length, groups[padded_length], max_tokens_per_batch, max_batch_size)

    # Already in (padded_length desc, position asc) order; sort anyway so the
    # ordering is stated in one place and does not rely on the loop above.
    chunks.sort(key=lambda c: (-c[0], c[1]))
    return [
        PlannedBatch(
            batch_id=batch_id,
            sample_indices=indices,
            padded_length=padded_length,
            num_real_tokens=real_tokens,
        )
        for batch_id, (padded_length, _, indices, real_tokens) in enumerate(chunks)
    ]



def _group_by_padded_length(lengths: Sequence[int], buckets: ShapeBuckets) -> dict[int, list[tuple[int, int]]]:
    """padded_length -> [(true_length, index)]; raises ValueError on a length < 1 or > buckets.max_length."""
    edges = buckets.edges()
    groups: dict[int, list[tuple[int, int]]] = {}
    for index, raw_length in enumerate(lengths):
        length = _as_int(raw_length, f"lengths[{index}]")
        if length < 1:
            raise ValueError(f"lengths[{index}]={length} must be >= 1")
        if length > buckets.max_length:
            raise ValueError(
                f"lengths[{index}]={length} exceeds buckets max_length={buckets.max_length}; "
                "truncate or drop the sample before planning, or raise max_length"
            )
        groups.setdefault(edges[bisect.bisect_left(edges, length)], []).append((length, index))
    return groups


def _cut_group(padded_length: int, members: list[tuple[int, int]], max_tokens_per_batch: int,
               max_batch_size: int) -> list[tuple[int, int, tuple[int, ...], int]]:
    """One length group in (true length desc, index asc) order, cut into chunks of the group's batch size:
    [(padded_length, position in the group, indices, real tokens)]."""
    members = sorted(members, key=lambda pair: (-pair[0], pair[1]))
    batch_size = min(max_batch_size, max_tokens_per_batch // padded_length)
    if batch_size < 1:
        true_length, index = members[0]
        raise ValueError(
            f"max_tokens_per_batch={max_tokens_per_batch} is smaller than the padded length "
            f"{padded_length} of sample {index} (true length {true_length}); "
            f"set batching.max_tokens_per_batch >= {padded_length} or lower data.max_length"
        )
    chunks = []
    for start in range(0, len(members), batch_size):
        chunk = members[start:start + batch_size]
        chunks.append((padded_length, start, tuple(index for _, index in chunk), sum(n for n, _ in chunk)))
    return chunks

def plan_stats(batches: Sequence[PlannedBatch]) -> dict[str, Any]:
    """Summary of a plan (or of one rank's share of it), for logging.

    Keys: ``num_batches``, ``num_samples``, ``num_real_tokens``,
    ``num_padded_tokens``, ``padding_efficiency`` (real / padded tokens),
    ``num_shapes`` (distinct forward shapes ``PlannedBatch.shape``, i.e. how many
    autotuning runs to expect), ``batch_size_min``, ``batch_size_max``,
    ``batch_size_mean``, ``padded_length_min``, ``padded_length_max``.

    For an empty list (e.g. a rank that got no batches) the counts are 0 and
    ``padding_efficiency`` and the min/max/mean fields are None.
    """
    batches = list(batches)
    num_real_tokens = sum(b.num_real_tokens for b in batches)
    num_padded_tokens = sum(b.num_padded_tokens for b in batches)
    batch_sizes = [b.batch_size for b in batches]
    padded_lengths = [b.padded_length for b in batches]
    empty = not batches
    return {
        "num_batches": len(batches),
        "num_samples": sum(batch_sizes),
        "num_real_tokens": num_real_tokens,
        "num_padded_tokens": num_padded_tokens,
        "padding_efficiency": None if empty else num_real_tokens / num_padded_tokens,
        "num_shapes": len({b.shape for b in batches}),
        "batch_size_min": None if empty else min(batch_sizes),
        "batch_size_max": None if empty else max(batch_sizes),
        "batch_size_mean": None if empty else sum(batch_sizes) / len(batches),
        "padded_length_min": None if empty else min(padded_lengths),
        "padded_length_max": None if empty else max(padded_lengths),
    }


@dataclass(frozen=True)
class BatchCost:
    """Predicted seconds of one planned batch on one rank: its forward and the writing of its records.

    The two overlap (background writer threads write batch i while the GPU runs batch i+1), so a rank's predicted
    finish is ``max(sum of forward_seconds, sum of write_seconds)`` over its batches (:func:`rank_finish_seconds`),
    and a batch adds at most ``seconds = max(forward_seconds, write_seconds)`` to it."""

    forward_seconds: float
    write_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.forward_seconds, self.write_seconds)


@dataclass(frozen=True)
class BatchCostModel:
    """The numbers a batch's predicted time is computed from (``cost.batch_cost_model`` derives them from the
    target's config and the storage layout).

    forward FLOPs = ``linear_flops_per_token`` x padded tokens (2 x decoder parameters run: every row position,
    padding included, goes through the weights) + ``attention_flops_per_token_pair`` x sum over samples of
    length^2 (causal attention: QK^T and AV, 4 x width FLOPs per token pair, half of the pairs, per quadratic
    layer: ``2 x attention layers run x num_heads x head_dim``); per-sample true lengths, so a batch that packs
    several samples in one row is counted by its samples, not by its row;
    write bytes = ``write_bytes_per_token`` x real tokens + ``write_bytes_per_sample`` x samples (the records'
    bytes; padding is never stored).
    Seconds = FLOPs / ``forward_flops_per_second``, bytes / ``write_bytes_per_second``."""

    linear_flops_per_token: float
    attention_flops_per_token_pair: float
    forward_flops_per_second: float
    write_bytes_per_token: float
    write_bytes_per_sample: float
    write_bytes_per_second: float

    def cost_of(self, batch: PlannedBatch, lengths: Sequence[int]) -> BatchCost:
        """Predicted seconds of `batch`; ``lengths[i]`` = true tokens of dataset row i (the plan's lengths)."""
        sample_lengths = [lengths[i] for i in batch.sample_indices]
        flops = (self.linear_flops_per_token * batch.num_padded_tokens
                 + self.attention_flops_per_token_pair * sum(n * n for n in sample_lengths))
        num_bytes = self.write_bytes_per_token * sum(sample_lengths) + self.write_bytes_per_sample * len(sample_lengths)
        return BatchCost(flops / self.forward_flops_per_second, num_bytes / self.write_bytes_per_second)


def _padded_tokens_cost(batch: PlannedBatch) -> BatchCost:
    """The cost without a model: one unit per padded token, nothing written."""
    return BatchCost(float(batch.num_padded_tokens), 0.0)


def rank_finish_seconds(costs: Sequence[BatchCost]) -> float:
    """A rank's predicted finish for batches of these costs: forwards and writes overlap, the slower sets it."""
    return max(sum(c.forward_seconds for c in costs), sum(c.write_seconds for c in costs), 0.0)


def split_across_ranks(batches: Sequence[PlannedBatch], num_ranks: int,
                       cost: Callable[[PlannedBatch], BatchCost] | None = None) -> list[list[PlannedBatch]]:
    """Split a plan over ``num_ranks`` data-parallel ranks so that they finish together by predicted time.

    ``cost(batch)`` is the batch's predicted :class:`BatchCost` (``functools.partial(model.cost_of,
    lengths=...)`` of a :class:`BatchCostModel`); None counts padded tokens only. A rank's predicted finish is
    ``max(forwards, writes)`` (they overlap: :func:`rank_finish_seconds`). Deterministic greedy
    longest-processing-time: visit the batches by ``cost.seconds`` desc (ties by ``batch_id`` asc) and give each
    to the rank whose predicted finish with it is lowest (ties -> lowest rank). Each rank's list is then ordered
    by ``cost.seconds`` desc (ties by ``batch_id``), its longest padded length moved first: the largest, longest
    batches first (an out-of-memory error shows in the first minute), the smallest last, so the tail after a
    rank's last forward is short.

    Guarantees:

    * returns exactly ``num_ranks`` lists; every input batch appears in exactly
      one of them (nothing repeated or dropped);
    * max - min predicted finish over the ranks <= the largest ``cost.seconds`` of a batch (the rank that
      finishes last took its last batch when its finish with it was the lowest of all ranks);
    * a rank gets an EMPTY list when there are fewer batches than ranks
      (callers must cope with a rank that has nothing to do);
    * same input -> same split, whatever the input order (every rank computes it and must agree: the costs are
      sums and products of Python floats in a fixed order, the same on every machine).

    O(batches x ranks). Raises ValueError if ``num_ranks < 1``.
    """
    num_ranks = _as_int(num_ranks, "num_ranks")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    cost = cost or _padded_tokens_cost
    costs = {b.batch_id: cost(b) for b in batches}
    assigned: list[list[PlannedBatch]] = [[] for _ in range(num_ranks)]
    forward = [0.0] * num_ranks
    write = [0.0] * num_ranks
    for batch in sorted(batches, key=lambda b: (-costs[b.batch_id].seconds, b.batch_id)):
        c = costs[batch.batch_id]
        rank = min(range(num_ranks), key=lambda r: (max(forward[r] + c.forward_seconds, write[r] + c.write_seconds), r))
        assigned[rank].append(batch)
        forward[rank] += c.forward_seconds
        write[rank] += c.write_seconds
    for share in assigned:
        share.sort(key=lambda b: (-costs[b.batch_id].seconds, b.batch_id))
        if share:  # the longest padded length first whatever its cost: the memory peak shows at once
            longest = min(share, key=lambda b: (-b.padded_length, b.batch_id))
            share.remove(longest)
            share.insert(0, longest)
    return assigned


PACKED_ROW_FRACTIONS = (Fraction(1, 8), Fraction(1, 4), Fraction(1, 2), Fraction(3, 4), Fraction(1))


def packed_row_lengths(max_tokens_per_batch: int, length_multiple: int) -> tuple[int, ...]:
    """The fixed lengths a packed row is padded to, ascending: the budget itself and 1/8, 1/4, 1/2, 3/4 of it
    rounded up to `length_multiple` (never above the budget). Almost every row is filled to the budget; the
    fractions serve the last, partly filled rows, so a run has at most 5 shapes (+ one per over-long sample)."""
    lengths = {min(max_tokens_per_batch, math.ceil(max_tokens_per_batch * f / length_multiple) * length_multiple)
               for f in PACKED_ROW_FRACTIONS}
    return tuple(sorted(lengths))


def plan_packed_rows(lengths: Sequence[int], *, max_tokens_per_batch: int,
                     length_multiple: int) -> list[PlannedBatch]:
    """Pack all samples into rows of at most ``max_tokens_per_batch`` real tokens (one row = one forward, B=1).

    Best-fit decreasing, deterministic: samples by (length desc, index asc), each into the open row with the
    least room that still holds it (ties: the older row), else a new row. ``batching.max_batch_size`` does not
    apply: on the benchmark's lognormal lengths (mean ~320) a cap of 256 samples per row left the rows of short
    samples part-empty (padding efficiency 0.951 at a 65,536 budget, 0.9998 without the cap). A sample longer
    than the budget gets a row of its own, its length rounded up to ``length_multiple``. Each row is then padded
    to the smallest of ``packed_row_lengths`` that holds it. Rows
    are ordered by padded length desc, ties by creation order; ``batch_id`` = position; within a row, samples
    in placement order (length desc).

    Guarantees: every index appears in exactly one row; a row's real tokens never exceed the budget (an
    over-long sample alone excepted) and its padded length is <= the budget; the result depends only on the
    inputs. Raises ValueError for a length < 1 or a budget / multiple < 1.
    """
    budget = _as_int(max_tokens_per_batch, "max_tokens_per_batch")
    for name, value in (("max_tokens_per_batch", budget), ("length_multiple", length_multiple)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    order = sorted(range(len(lengths)), key=lambda i: (-_as_int(lengths[i], f"lengths[{i}]"), i))
    rows: list[list[int]] = []  # sample indices per row, in creation order
    used: list[int] = []  # real tokens per row
    room: list[tuple[int, int]] = []  # (free tokens, row) of the open rows, ascending
    for index in order:
        n = int(lengths[index])
        if n < 1:
            raise ValueError(f"lengths[{index}]={n} must be >= 1")
        slot = bisect.bisect_left(room, (n, -1))
        if slot == len(room):  # no open row holds it: a new row
            rows.append([index])
            used.append(n)
            if n < budget:
                bisect.insort(room, (budget - n, len(rows) - 1))
            continue
        free, row = room.pop(slot)
        rows[row].append(index)
        used[row] += n
        if free - n > 0:
            bisect.insort(room, (free - n, row))
    return _packed_batches(rows, used, packed_row_lengths(budget, length_multiple), length_multiple)


def _packed_batches(rows: list[list[int]], used: list[int], row_lengths: tuple[int, ...],
                    length_multiple: int) -> list[PlannedBatch]:
    """Rows -> PlannedBatch list: each padded to the smallest fixed row length holding it (an over-long sample's
    row: its length rounded up to the multiple), ordered by padded length desc, then creation order."""
    padded = []
    for n in used:
        slot = bisect.bisect_left(row_lengths, n)
        padded.append(row_lengths[slot] if slot < len(row_lengths) else -(-n // length_multiple) * length_multiple)
    order = sorted(range(len(rows)), key=lambda r: (-padded[r], r))
    return [PlannedBatch(batch_id=batch_id, sample_indices=tuple(rows[r]), padded_length=padded[r],
                         num_real_tokens=used[r], packed=True) for batch_id, r in enumerate(order)]


PACKED_ROW_TOKENS_AUTO = 32768
"""`batching.max_tokens_per_row: auto`. Measured on an H200 (bench/RESULTS.md, warm passes, same samples): rows of
32,768 tokens ran the Llama-3.1-8B shape at 43,224 real tok/s against 42,042 for padded batches of up to 131,072
tokens, and the Qwen3.6-27B hybrid at 9,645 against 9,275; rows of 131,072 tokens ran the 8B at 37,636 against
41,677 padded. A big row needs big pinned host buffers for its states (a first pinned allocation took 3.4 s for
5.4 GB, bench/results/sync_probe.json) and leaves more to write after the last forward."""


def packed_row_budget(batching) -> int:
    """Tokens per packed row at most: `max_tokens_per_row` (`auto`: PACKED_ROW_TOKENS_AUTO), never above the
    resolved `max_tokens_per_batch` (an int: budget.py resolves `auto` first)."""
    row = PACKED_ROW_TOKENS_AUTO if batching.max_tokens_per_row == "auto" else int(batching.max_tokens_per_row)
    return min(row, _as_int(batching.max_tokens_per_batch, "max_tokens_per_batch"))


def make_plan(lengths: list[int], recipe: Recipe, packed: bool = False) -> list[PlannedBatch]:
    """The global batch plan of `recipe` for the kept samples' `lengths` (what OUT/plan.json freezes; also what
    `dflash-prep plan` reports, so its figures are the run's): packed rows (`packed`, plan_packed_rows) or
    right-padded batches of a few lengths (plan_batches). Raises RecipeError (exit code 2, one line) when the
    recipe's budget cannot hold a sample: the recipe is what must change."""
    b = recipe.batching
    try:
        if packed:
            return plan_packed_rows(lengths, max_tokens_per_batch=packed_row_budget(b),
                                    length_multiple=b.length_multiple)
        buckets = ShapeBuckets(b.length_multiple, b.length_growth, recipe.data.max_length)
        return plan_batches(lengths, max_tokens_per_batch=b.max_tokens_per_batch, max_batch_size=b.max_batch_size,
                            buckets=buckets)
    except ValueError as e:
        raise RecipeError(f"the batch plan: {e}") from None


def plan_settings(recipe: Recipe) -> dict:
    b = recipe.batching
    return {"max_tokens_per_batch": b.max_tokens_per_batch, "max_batch_size": b.max_batch_size,
            "length_multiple": b.length_multiple, "length_growth": b.length_growth,
            "max_length": recipe.data.max_length, "packing": recipe.batching.packing,
            "max_tokens_per_row": b.max_tokens_per_row}

"""Tests for dflash_prep.planner (pure Python; no GPU, no torch)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings, strategies as st

from dflash_prep.planner import (
    PlannedBatch,
    ShapeBuckets,
    plan_batches,
    plan_stats,
    split_across_ranks,
)

FAST = settings(max_examples=120, deadline=None)


# --------------------------------------------------------------------------- buckets

@pytest.mark.parametrize(
    ("length_multiple", "growth", "max_length", "expected"),
    [
        # Worked by hand: 64 -> ceil(80/64)=2 -> 128 -> ceil(2.5)=3 -> 192 -> ceil(3.75)=4 -> 256
        # -> 5 -> 320 -> ceil(6.25)=7 -> 448 -> ceil(8.75)=9 -> 576 -> ceil(11.25)=12 -> 768
        # -> 15 -> 960 -> ceil(18.75)=19 -> 1216 -> ceil(23.75)=24 -> 1536 -> 30 -> 1920
        # -> ceil(37.5)=38 -> 2432 -> ceil(47.5)=48 -> 3072 -> 60 -> 3840 -> 75 -> 4800, capped at 4096 (= max_length rounded up to 64), stop
        (64, 1.25, 4096,
         (64, 128, 192, 256, 320, 448, 576, 768, 960, 1216, 1536, 1920, 2432, 3072, 3840, 4096)),
        # Exactly hitting max_length stops there.
        (64, 1.25, 256, (64, 128, 192, 256)),
        # max_length below the first edge: a single bucket.
        (64, 1.25, 10, (64,)),
        # Doubling.
        (1, 2.0, 10, (1, 2, 4, 8, 10)),  # 16 capped at max_length
        # Tiny growth: the "+ length_multiple" floor dominates.
        (16, 1.01, 100, (16, 32, 48, 64, 80, 96, 112)),
        # growth 1.1: 64*1.1/64=1.1->2, 2.2->3, 3.3->4, 4.4->5, 5.5->6, 6.6->7, 7.7->8, 8.8->9,
        # 9.9->10, 640*1.1/64=11 exactly -> 704, 12.1->13 (832), 14.3->15 (960), 16.5->17 (1088),
        # capped at 1024 (1000 rounded up to 64).
        (64, 1.1, 1000, (64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 832, 960, 1024)),
    ],
)
def test_bucket_edges_hand_computed(length_multiple, growth, max_length, expected):
    assert ShapeBuckets(length_multiple, growth, max_length).edges() == expected


def test_bucket_edges_use_exact_decimal_growth():
    # 1360 * 1.1 / 8 = 187 exactly, but 187.00000000000003 in binary floats,
    # which a naive math.ceil would turn into 188 (edge 1504).
    edges = ShapeBuckets(8, 1.1, 1600).edges()
    i = edges.index(1360)
    assert edges[i + 1] == 1496
    assert 1504 not in edges


@FAST
@given(
    length_multiple=st.integers(1, 128),
    growth=st.floats(1.001, 4.0, allow_nan=False, allow_infinity=False),
    max_length=st.integers(1, 20000),
)
def test_bucket_edges_invariants(length_multiple, growth, max_length):
    edges = ShapeBuckets(length_multiple, growth, max_length).edges()
    assert edges[0] == length_multiple
    assert all(e % length_multiple == 0 for e in edges)
    assert all(b >= a + length_multiple for a, b in zip(edges, edges[1:]))
    # Geometric growth everywhere but the last step, which is capped at max_length rounded up.
    assert all(b >= a * growth - 1e-6 * a for a, b in zip(edges[:-2], edges[1:-1]))
    assert edges[-1] >= max_length
    assert edges[-1] == -(-max_length // length_multiple) * length_multiple
    assert all(e < max_length for e in edges[:-1])


def test_round_up_boundaries():
    b = ShapeBuckets(64, 1.25, 4096)
    assert b.round_up(1) == 64
    assert b.round_up(63) == 64
    assert b.round_up(64) == 64
    assert b.round_up(65) == 128
    assert b.round_up(192) == 192
    assert b.round_up(193) == 256
    assert b.round_up(3840) == 3840
    assert b.round_up(3841) == 4096
    assert b.round_up(4096) == 4096
    with pytest.raises(ValueError, match=r"num_tokens=4097 exceeds buckets max_length=4096"):
        b.round_up(4097)
    with pytest.raises(ValueError, match=r"num_tokens must be >= 1, got 0"):
        b.round_up(0)
    with pytest.raises(ValueError, match=r"got -5"):
        b.round_up(-5)
    with pytest.raises(TypeError):
        b.round_up(10.0)


@FAST
@given(
    length_multiple=st.integers(1, 64),
    growth=st.floats(1.01, 3.0),
    max_length=st.integers(1, 5000),
    data=st.data(),
)
def test_round_up_is_smallest_edge_at_or_above(length_multiple, growth, max_length, data):
    b = ShapeBuckets(length_multiple, growth, max_length)
    n = data.draw(st.integers(1, max_length))
    t = b.round_up(n)
    assert t >= n and t in b.edges()
    assert all(e < n for e in b.edges() if e < t)


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        (dict(length_multiple=0, growth=1.25, max_length=10), ValueError, "length_multiple must be >= 1, got 0"),
        (dict(length_multiple=64, growth=1.0, max_length=10), ValueError, "growth must be a finite number > 1.0, got 1.0"),
        (dict(length_multiple=64, growth=0.5, max_length=10), ValueError, "got 0.5"),
        (dict(length_multiple=64, growth=float("inf"), max_length=10), ValueError, "growth must be a finite"),
        (dict(length_multiple=64, growth=float("nan"), max_length=10), ValueError, "growth must be a finite"),
        (dict(length_multiple=64, growth=1.25, max_length=0), ValueError, "max_length must be >= 1, got 0"),
        (dict(length_multiple=64.0, growth=1.25, max_length=10), TypeError, "length_multiple must be an integer"),
    ],
)
def test_bucket_validation(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern.replace(".", r"\.")):
        ShapeBuckets(**kwargs)


# --------------------------------------------------------------------------- plan_batches

SMALL = ShapeBuckets(64, 1.25, 256)  # edges (64, 128, 192, 256)
EXAMPLE_LENGTHS = [10, 70, 64, 200, 65, 5, 130, 64]


def test_plan_batches_hand_worked_example():
    # Groups: 256:[3]; 192:[6]; 128:[1(70), 4(65)]; 64:[2(64), 7(64), 0(10), 5(5)].
    # Batch sizes with budget 256, cap 3: T=256 -> 1, T=192 -> 1, T=128 -> 2, T=64 -> 3.
    plan = plan_batches(EXAMPLE_LENGTHS, max_tokens_per_batch=256, max_batch_size=3, buckets=SMALL)
    assert plan == [
        PlannedBatch(0, (3,), 256, 200),
        PlannedBatch(1, (6,), 192, 130),
        PlannedBatch(2, (1, 4), 128, 135),
        PlannedBatch(3, (2, 7, 0), 64, 138),
        PlannedBatch(4, (5,), 64, 5),
    ]
    assert [b.batch_size for b in plan] == [1, 1, 2, 3, 1]
    assert [b.num_padded_tokens for b in plan] == [256, 192, 256, 192, 64]


def test_plan_stats_hand_worked_example():
    plan = plan_batches(EXAMPLE_LENGTHS, max_tokens_per_batch=256, max_batch_size=3, buckets=SMALL)
    stats = plan_stats(plan)
    assert stats == {
        "num_batches": 5,
        "num_samples": 8,
        "num_real_tokens": 608,
        "num_padded_tokens": 960,
        "padding_efficiency": pytest.approx(608 / 960),
        "num_shapes": 5,
        "batch_size_min": 1,
        "batch_size_max": 3,
        "batch_size_mean": pytest.approx(1.6),
        "padded_length_min": 64,
        "padded_length_max": 256,
    }


def test_plan_stats_empty():
    stats = plan_stats([])
    assert stats["num_batches"] == 0 and stats["num_samples"] == 0 and stats["num_shapes"] == 0
    assert stats["padding_efficiency"] is None and stats["batch_size_mean"] is None


def test_plan_batches_empty_input():
    assert plan_batches([], max_tokens_per_batch=256, max_batch_size=3, buckets=SMALL) == []


def test_plan_batches_accepts_numpy_lengths():
    np = pytest.importorskip("numpy")
    a = plan_batches(np.array(EXAMPLE_LENGTHS, dtype=np.int64), max_tokens_per_batch=256,
                     max_batch_size=3, buckets=SMALL)
    b = plan_batches(EXAMPLE_LENGTHS, max_tokens_per_batch=256, max_batch_size=3, buckets=SMALL)
    assert a == b
    assert all(type(i) is int for batch in a for i in batch.sample_indices)


@st.composite
def plan_inputs(draw, max_samples=300):
    """Random buckets, lengths, and a budget at least one padded sample large."""
    buckets = ShapeBuckets(
        draw(st.integers(1, 128)),
        draw(st.floats(1.01, 2.5)),
        draw(st.integers(1, 4096)),
    )
    lengths = draw(st.lists(st.integers(1, buckets.max_length), max_size=max_samples))
    longest_padded = buckets.round_up(max(lengths)) if lengths else 1
    max_tokens = draw(st.integers(longest_padded, longest_padded * 40))
    max_batch_size = draw(st.integers(1, 300))
    return lengths, max_tokens, max_batch_size, buckets


@FAST
@given(plan_inputs())
def test_plan_respects_budget_cap_and_covers_every_sample_once(inputs):
    lengths, max_tokens, max_bs, buckets = inputs
    plan = plan_batches(lengths, max_tokens_per_batch=max_tokens, max_batch_size=max_bs, buckets=buckets)

    seen = Counter(i for b in plan for i in b.sample_indices)
    assert seen == Counter(range(len(lengths)))  # every sample exactly once

    for pos, b in enumerate(plan):
        assert b.batch_id == pos
        assert b.num_padded_tokens <= max_tokens
        assert 1 <= b.batch_size <= max_bs
        assert b.padded_length in buckets.edges()
        assert all(lengths[i] <= b.padded_length for i in b.sample_indices)
        assert all(buckets.round_up(lengths[i]) == b.padded_length for i in b.sample_indices)
        assert b.num_real_tokens == sum(lengths[i] for i in b.sample_indices)
        keys = [(-lengths[i], i) for i in b.sample_indices]
        assert keys == sorted(keys)  # (length desc, index asc)

    # Longest first; within a bucket all batches are full-size except the last one.
    assert [b.padded_length for b in plan] == sorted((b.padded_length for b in plan), reverse=True)
    for t in {b.padded_length for b in plan}:
        sizes = [b.batch_size for b in plan if b.padded_length == t]
        full = min(max_bs, max_tokens // t)
        assert all(s == full for s in sizes[:-1]) and 1 <= sizes[-1] <= full
    assert plan_stats(plan)["num_shapes"] <= 2 * len({b.padded_length for b in plan})


@FAST
@given(plan_inputs())
def test_plan_is_deterministic(inputs):
    lengths, max_tokens, max_bs, buckets = inputs
    kw = dict(max_tokens_per_batch=max_tokens, max_batch_size=max_bs, buckets=buckets)
    assert plan_batches(lengths, **kw) == plan_batches(list(lengths), **kw)


@FAST
@given(plan_inputs(), st.randoms(use_true_random=False))
def test_plan_is_invariant_to_input_order(inputs, rnd):
    # Feed the same (index, length) pairs in a different order: the plan is
    # the same, by index. A Sequence API ties index to position, so the order
    # is shuffled by relabelling rows: new row j holds old row perm[j].
    lengths, max_tokens, max_bs, buckets = inputs
    kw = dict(max_tokens_per_batch=max_tokens, max_batch_size=max_bs, buckets=buckets)
    perm = list(range(len(lengths)))
    rnd.shuffle(perm)
    shuffled = [lengths[p] for p in perm]
    plan = plan_batches(lengths, **kw)
    plan_shuffled = plan_batches(shuffled, **kw)

    # Batch shapes and their length profiles never depend on the order.
    def profile(p, ls):
        return [(b.padded_length, tuple(ls[i] for i in b.sample_indices)) for b in p]
    assert profile(plan_shuffled, shuffled) == profile(plan, lengths)

    # Where lengths are distinct, the same original rows land in the same batches.
    if len(set(lengths)) == len(lengths):
        mapped = [tuple(perm[j] for j in b.sample_indices) for b in plan_shuffled]
        assert mapped == [b.sample_indices for b in plan]


def test_plan_tie_break_by_index():
    # Equal lengths are ordered by index asc, whatever their positions.
    plan = plan_batches([50, 60, 50, 60, 50], max_tokens_per_batch=128, max_batch_size=2, buckets=SMALL)
    assert [b.sample_indices for b in plan] == [(1, 3), (0, 2), (4,)]


def test_plan_longest_batch_first():
    lengths = [5, 250, 100, 60, 190, 3]
    plan = plan_batches(lengths, max_tokens_per_batch=512, max_batch_size=8, buckets=SMALL)
    assert [b.padded_length for b in plan] == [256, 192, 128, 64]
    assert plan[0].sample_indices == (1,)


def test_plan_batch_size_cap_binds_before_budget():
    plan = plan_batches([1] * 10, max_tokens_per_batch=10_000, max_batch_size=4, buckets=SMALL)
    assert [b.batch_size for b in plan] == [4, 4, 2]
    assert all(b.padded_length == 64 for b in plan)


def test_plan_error_when_one_sample_exceeds_budget():
    with pytest.raises(ValueError) as info:
        plan_batches([10, 130, 70], max_tokens_per_batch=150, max_batch_size=4, buckets=SMALL)
    msg = str(info.value)
    assert "max_tokens_per_batch=150" in msg
    assert "padded length 192" in msg
    assert "sample 1 (true length 130)" in msg


@pytest.mark.parametrize(
    ("lengths", "kw", "pattern"),
    [
        ([10, 257], {}, r"lengths\[1\]=257 exceeds buckets max_length=256"),
        ([10, 0], {}, r"lengths\[1\]=0 must be >= 1"),
        ([10], {"max_tokens_per_batch": 0}, r"max_tokens_per_batch must be >= 1, got 0"),
        ([10], {"max_batch_size": 0}, r"max_batch_size must be >= 1, got 0"),
    ],
)
def test_plan_validation(lengths, kw, pattern):
    kwargs = dict(max_tokens_per_batch=256, max_batch_size=4, buckets=SMALL)
    kwargs.update(kw)
    with pytest.raises(ValueError, match=pattern):
        plan_batches(lengths, **kwargs)


def test_plan_rejects_float_lengths():
    with pytest.raises(TypeError, match=r"lengths\[0\] must be an integer"):
        plan_batches([10.5], max_tokens_per_batch=256, max_batch_size=4, buckets=SMALL)


# --------------------------------------------------------------------------- split_across_ranks

def _example_plan():
    # padded tokens by batch_id: [256, 192, 256, 192, 64]
    return plan_batches(EXAMPLE_LENGTHS, max_tokens_per_batch=256, max_batch_size=3, buckets=SMALL)


def _ids(split):
    return [[b.batch_id for b in rank] for rank in split]


def test_split_hand_worked():
    plan = _example_plan()
    # Visit order (tokens desc, id asc): 0(256) 2(256) 1(192) 3(192) 4(64).
    assert _ids(split_across_ranks(plan, 1)) == [[0, 1, 2, 3, 4]]
    # r0:0 r1:2 | tie 256/256 -> r0:1 (448) | r1:3 (448) | tie -> r0:4 (512)
    assert _ids(split_across_ranks(plan, 2)) == [[0, 1, 4], [2, 3]]
    # r0:0 r1:2 r2:1 | r2 (192) least -> 3 (384) | tie r0/r1 at 256 -> r0:4
    assert _ids(split_across_ranks(plan, 3)) == [[0, 4], [2], [1, 3]]
    # Fewer batches than ranks: the extra ranks get empty lists.
    assert _ids(split_across_ranks(plan, 7)) == [[0], [2], [1], [3], [4], [], []]


def test_split_empty_plan():
    assert split_across_ranks([], 3) == [[], [], []]


@FAST
@given(plan_inputs(max_samples=200), st.sampled_from([1, 2, 3, 7]))
def test_split_properties(inputs, num_ranks):
    lengths, max_tokens, max_bs, buckets = inputs
    plan = plan_batches(lengths, max_tokens_per_batch=max_tokens, max_batch_size=max_bs, buckets=buckets)
    split = split_across_ranks(plan, num_ranks)

    assert len(split) == num_ranks
    assert Counter(b.batch_id for rank in split for b in rank) == Counter(range(len(plan)))
    assert Counter(i for rank in split for b in rank for i in b.sample_indices) == Counter(range(len(lengths)))
    for rank in split:
        ids = [b.batch_id for b in rank]
        assert ids == sorted(ids)  # each rank still runs its longest batches first
    if plan:
        loads = [sum(b.num_padded_tokens for b in rank) for rank in split]
        assert max(loads) - min(loads) <= max(b.num_padded_tokens for b in plan)
    if len(plan) < num_ranks:
        assert sum(1 for rank in split if not rank) == num_ranks - len(plan)
    assert split_across_ranks(plan, num_ranks) == split  # deterministic
    # Input order does not matter either.
    reordered = list(plan)
    random.Random(0).shuffle(reordered)
    assert split_across_ranks(reordered, num_ranks) == split


@pytest.mark.parametrize("num_ranks", [0, -1])
def test_split_rejects_bad_rank_count(num_ranks):
    with pytest.raises(ValueError, match=f"num_ranks must be >= 1, got {num_ranks}"):
        split_across_ranks(_example_plan(), num_ranks)

"""Tests for dflash_prep.plan.planner (pure Python; no GPU, no torch)."""

from __future__ import annotations

import functools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_prep.plan.planner import (
    BatchCostModel,
    PlannedBatch,
    ShapeBuckets,
    plan_batches,
    plan_stats,
    rank_finish_seconds,
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
    """Without a cost model a batch costs its padded tokens (the former balance)."""
    plan = _example_plan()
    # Visit order (tokens desc, id asc): 0(256) 2(256) 1(192) 3(192) 4(64); a rank runs them in that order, its
    # longest padded length first.
    assert _ids(split_across_ranks(plan, 1)) == [[0, 2, 1, 3, 4]]
    # r0:0 r1:2 | tie 256/256 -> r0:1 (448) | r1:3 (448) | tie -> r0:4 (512)
    assert _ids(split_across_ranks(plan, 2)) == [[0, 1, 4], [2, 3]]
    # r0:0 r1:2 r2:1 | r2 (192) least -> 3 (384) | tie r0/r1 at 256 -> r0:4
    assert _ids(split_across_ranks(plan, 3)) == [[0, 4], [2], [1, 3]]
    # Fewer batches than ranks: the extra ranks get empty lists.
    assert _ids(split_across_ranks(plan, 7)) == [[0], [2], [1], [3], [4], [], []]


# Unit rates: 1 FLOP per padded token, 1 per causal token pair, 1 FLOP/s; 4 bytes per token, 10 per sample, 1 B/s.
UNIT_COSTS = BatchCostModel(linear_flops_per_token=1, attention_flops_per_token_pair=1, forward_flops_per_second=1,
                            write_bytes_per_token=4, write_bytes_per_sample=10, write_bytes_per_second=1)


def test_split_by_predicted_time_hand_worked():
    """Four batches of 8 padded tokens each (a padded-token balance cannot tell them apart) whose forward and write
    times differ. By hand (forward = 8 + sum len^2, write = 4 x tokens + 10 x samples):
    A [8] T=8: 72 / 42; B 8 x [1] T=1: 16 / 112; C [6] T=8: 44 / 34; D 4 x [2] T=2: 24 / 72.
    Visit by max desc: B 112, A 72, D 72, C 44.  B -> r0 (16, 112).  A: r0 max(88, 154) vs r1 max(72, 42) -> r1.
    D: r0 max(40, 184) vs r1 max(96, 114) -> r1 (96, 114).  C: r0 max(60, 146) vs r1 max(140, 148) -> r0.
    r0 = {B, C} runs C first (its longest padded length), r1 = {A, D} (A: 72 = D: 72, lower id first)."""
    lengths = [8] + [1] * 8 + [6] + [2] * 4
    plan = [PlannedBatch(0, (0,), 8, 8), PlannedBatch(1, tuple(range(1, 9)), 1, 8), PlannedBatch(2, (9,), 8, 6),
            PlannedBatch(3, (10, 11, 12, 13), 2, 8)]
    cost = functools.partial(UNIT_COSTS.cost_of, lengths=lengths)
    assert [(cost(b).forward_seconds, cost(b).write_seconds) for b in plan] == [(72, 42), (16, 112), (44, 34),
                                                                                 (24, 72)]
    split = split_across_ranks(plan, 2, cost)
    assert _ids(split) == [[2, 1], [0, 3]]
    assert [rank_finish_seconds([cost(b) for b in share]) for share in split] == [146, 114]
    # by padded tokens all tie: by id, r0 A C, r1 B D (D's longer padded length first)
    assert _ids(split_across_ranks(plan, 2)) == [[0, 2], [3, 1]]


def _heavy_tailed_lengths(n: int, seed: int) -> list[int]:
    """Pareto-tailed chat lengths: most a few hundred tokens, a few thousand-token ones."""
    rng = random.Random(seed)
    return [min(4096, max(1, int(60 * rng.paretovariate(1.3)))) for _ in range(n)]


@pytest.mark.parametrize("num_ranks", [2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_ranks_finish_together_by_predicted_time(num_ranks, seed):
    """Heavy-tailed lengths, an 8B-like cost model: each rank's predicted finish, computed here from the lengths
    (not by the planner), is within the largest batch's predicted time of every other rank's."""
    lengths = _heavy_tailed_lengths(3000, seed)
    plan = plan_batches(lengths, max_tokens_per_batch=16384, max_batch_size=256,
                        buckets=ShapeBuckets(64, 1.125, 4096))
    linear, pair, flops_s = 1.6e10, 2 * 32 * 4096, 4.7e14
    per_token, per_sample, bytes_s = 16400.0, 3000.0, 0.35e9
    model = BatchCostModel(linear, pair, flops_s, per_token, per_sample, bytes_s)

    def forward(b):
        return (linear * len(b.sample_indices) * b.padded_length
                + pair * sum(lengths[i] ** 2 for i in b.sample_indices)) / flops_s

    def write(b):
        return (per_token * sum(lengths[i] for i in b.sample_indices) + per_sample * len(b.sample_indices)) / bytes_s

    split = split_across_ranks(plan, num_ranks, functools.partial(model.cost_of, lengths=lengths))
    assert Counter(b.batch_id for share in split for b in share) == Counter(range(len(plan)))
    finish = [max(sum(map(forward, share)), sum(map(write, share))) for share in split]
    largest = max(max(forward(b), write(b)) for b in plan)
    assert max(finish) - min(finish) <= largest * (1 + 1e-9)
    for share in split:
        assert share[0].padded_length == max(b.padded_length for b in share)  # the memory peak first
        rest = [max(forward(b), write(b)) for b in share[1:]]
        assert all(a >= b * (1 - 1e-9) for a, b in zip(rest, rest[1:]))  # then largest first, smallest last
    assert split_across_ranks(list(reversed(plan)), num_ranks, functools.partial(model.cost_of, lengths=lengths)) \
        == split  # deterministic, whatever the input order


def test_split_empty_plan():
    assert split_across_ranks([], 3) == [[], [], []]
    assert split_across_ranks([], 2, functools.partial(UNIT_COSTS.cost_of, lengths=[])) == [[], []]


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
        if rank:  # each rank still runs its longest batch first, then by padded tokens
            assert rank[0].padded_length == max(b.padded_length for b in rank)
            tokens = [b.num_padded_tokens for b in rank[1:]]
            assert tokens == sorted(tokens, reverse=True)
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

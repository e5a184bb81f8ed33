"""The static decoder's attention function (regen/attention.py: its own path for padded prefill forwards, several
queries a row with a mask; transformers' sdpa for one query a row) against attention written out here: keys and
values repeated per query head (`repeat_interleave`, the grouping transformers' `repeat_kv` defines), scores
scaled, masked, softmax in float64, a fully masked query giving zeros (SDPA's convention). float32 on the CPU."""

from __future__ import annotations

import types

import pytest
import torch

from dflash_prep.regen.attention import STATIC_ATTENTION, register, static_attention


def reference(q, k, v, mask, scale):
    """[B, Hq, S, D] ... -> [B, S, Hq, Dv] in float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    allowed = mask if mask.dtype == torch.bool else torch.isfinite(mask)
    if mask.dtype != torch.bool:
        scores = scores + mask.double().masked_fill(~allowed, 0)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (probs @ v).transpose(1, 2)


def masks(batch, queries, keys, first_real):
    """bool [B, 1, S, L]: row b sees keys from first_real[b] on, causally (the queries are the last S positions)."""
    positions = torch.arange(keys)
    causal = positions[None, :] <= (keys - queries + torch.arange(queries))[:, None]
    real = positions[None, :] >= torch.tensor(first_real)[:, None]
    return (causal[None] & real[:, None])[:, None]


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("queries", [1, 7])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_equals_attention_written_out(q_heads, kv_heads, queries, kind):
    torch.manual_seed(q_heads * 10 + queries)
    batch, keys, dim = 3, 40, 16
    q = torch.randn(batch, q_heads, queries, dim)
    k, v = torch.randn(batch, kv_heads, keys, dim), torch.randn(batch, kv_heads, keys, 12)
    # row 2 sees nothing in its first queries when they sit before its first real key (padding columns); with one
    # query a row it sees nothing at all (a padding column of a padded prefill's 1-column forward)
    mask = masks(batch, queries, keys, [0, 5, keys - 3 if queries > 1 else keys])
    if kind == "additive":  # 0 where seen, -inf elsewhere, and a bias where seen
        mask = torch.where(mask, torch.rand(mask.shape) * 0.5, torch.tensor(float("-inf")))
    module = types.SimpleNamespace(num_key_value_groups=q_heads // kv_heads, training=False, is_causal=True)
    out, weights = static_attention(module, q, k, v, mask, scaling=0.37)
    assert weights is None and out.shape == (batch, queries, q_heads, 12)
    assert torch.allclose(out.double(), reference(q, k, v, mask, 0.37), atol=2e-6)
    assert (out[2, :3 if queries > 1 else 1] == 0).all()  # row 2's queries that see no key


def test_registered_with_the_sdpa_mask():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    assert register() == STATIC_ATTENTION
    assert AttentionInterface()[STATIC_ATTENTION] is static_attention
    assert AttentionMaskInterface()[STATIC_ATTENTION] is sdpa_mask


def test_decode_in_row_spans_equals_attention_written_out():
    """One query a row over a left-padded cache, the rows cut into spans that each attend from their own first
    column (what the static decoder sets): the same as every row over every key, the reference here."""
    from dflash_prep.regen.attention import decode_spans

    torch.manual_seed(3)
    first = [0, 3, 20, 21, 40]
    q, k, v = torch.randn(5, 8, 1, 16), torch.randn(5, 2, 48, 16), torch.randn(5, 2, 48, 16)
    mask = masks(5, 1, 48, first)
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, is_causal=True)
    with decode_spans([(0, 2, 0), (2, 4, 16), (4, 5, 40)], 48):
        out, _ = static_attention(module, q, k, v, mask, scaling=0.3)
    assert torch.allclose(out.double(), reference(q, k, v, mask, 0.3), atol=2e-6)


@pytest.mark.parametrize("spans", [[(0, 5, 0)], [(0, 2, 0), (2, 4, 16), (4, 5, 32)]])
def test_decode_keys_end_at_the_key_limit(spans):
    """A decode step at cache position 35 of 48 (its mask hides the columns from 36 on, as the causal mask does) with
    the key limit at 40: the same as attention written out over the whole cache, and the columns from 40 on are
    never read (NaN there would poison the output: a masked NaN value still multiplies a zero weight)."""
    from dflash_prep.regen.attention import decode_key_limit, decode_spans

    torch.manual_seed(5)
    q, k, v = torch.randn(5, 8, 1, 16), torch.randn(5, 2, 48, 16), torch.randn(5, 2, 48, 16)
    mask = masks(5, 1, 48, [0, 3, 20, 21, 34])
    mask[..., 36:] = False
    expected = reference(q, k, v, mask, 0.3)
    k[:, :, 40:], v[:, :, 40:] = float("nan"), float("nan")
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, is_causal=True)
    with decode_spans(spans, 48):
        decode_key_limit(40)
        out, _ = static_attention(module, q, k, v, mask, scaling=0.3)
        decode_key_limit(None)
        whole, _ = static_attention(module, q, k, v, mask, scaling=0.3)
    assert torch.allclose(out.double(), expected, atol=2e-6)
    assert torch.isnan(whole).any()  # the same step without the limit reads them


def test_a_sliding_window_layer_attends_whole_under_row_spans():
    """The same spans, cut for a cache of 48 positions, while a sliding-window layer of the same model runs: its
    keys are a rolling buffer of one window (24 columns, not positions), with a mask of its own; its rows attend
    over the whole buffer (cutting it at the spans' columns would leave the last row no key at all)."""
    from dflash_prep.regen.attention import decode_spans

    torch.manual_seed(4)
    q, k, v = torch.randn(5, 8, 1, 16), torch.randn(5, 2, 24, 16), torch.randn(5, 2, 24, 16)
    mask = masks(5, 1, 24, [0, 0, 2, 3, 10])
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, is_causal=True)
    with decode_spans([(0, 2, 0), (2, 4, 16), (4, 5, 40)], 48):
        out, _ = static_attention(module, q, k, v, mask, scaling=0.3)
    assert torch.allclose(out.double(), reference(q, k, v, mask, 0.3), atol=2e-6)


def test_decode_spans_follow_the_left_padding():
    """plan_decode_spans: rows whose first real columns differ widely get spans of their own when the keys saved
    pay for a span; a uniform batch stays one span; every span starts at its rows' smallest column, aligned."""
    from dflash_prep.regen.attention import plan_decode_spans

    keys = 4096 + 256
    wide = [0] * 16 + [2000] * 100 + [3900] * 100  # 16 long prompts, then shorter ones
    spans = plan_decode_spans(wide, keys, column_multiple=64, span_cost_keys=8192)
    assert spans == [(0, 16, 0), (16, 116, 1984), (116, 216, 3840)]
    assert plan_decode_spans([128] * 50, keys) == [(0, 50, 128)]
    assert plan_decode_spans([5, 900], 1000, span_cost_keys=10 ** 9) == [(0, 2, 0)]  # a span costs more than any save


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flex_decode_reads_each_rows_keys_from_its_first_block_to_the_step(compiled):
    """Decode steps on flex attention (FlexDecodeMask, what the static decoder sets with decode_kernel=flex) over a
    left-padded cache of 520 columns, rows beginning at columns 0 to 250, the mask advanced from column 259 over
    several steps: each step equals attention written out over the keys from the row's first real column to the
    step's column. Compiled (PyTorch's fused kernel, which reads only the listed key blocks of 128 columns): NaN in
    the blocks a row must not read (before its first real column's block, after the step's) leaves the output
    finite, so the block lists are checked too; eager (the reference implementation the CPU decoder runs) reads every
    column, so there the keys stay finite."""
    from dflash_prep.regen.attention import FlexDecodeMask, flex_decode

    torch.manual_seed(11)
    first, keys = [0, 3, 130, 200, 250], 520
    q, k, v = torch.randn(5, 8, 1, 16), torch.randn(5, 2, keys, 16), torch.randn(5, 2, keys, 16)
    flex = FlexDecodeMask(torch.tensor(first), keys, 259, compiled=compiled)
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, is_causal=True)
    for column in (260, 261, 383, 384, 385, 511, 512, 519):  # 512..519: the last block, 8 of its 128 columns
        while int(flex.column) < column:
            flex.advance()
        mask = masks(5, 1, keys, first)
        mask[..., column + 1:] = False
        expected = reference(q, k, v, mask, 0.3)
        k_read, v_read = k.clone(), v.clone()
        if compiled:  # the blocks outside each row's range: never read
            for row, f in enumerate(first):
                for t in (k_read, v_read):
                    t[row, :, :f // 128 * 128] = float("nan")
                    t[row, :, (column // 128 + 1) * 128:] = float("nan")
        with flex_decode(flex):
            out, _ = static_attention(module, q, k_read, v_read, mask, scaling=0.3)
        assert torch.allclose(out.double(), expected, atol=2e-6), column
        assert flex.num_blocks.view(-1).tolist() == [column // 128 - f // 128 + 1 for f in first]


@pytest.mark.slow
def test_compiled_flex_decode_serves_batches_of_several_shapes_in_one_process():
    """The decoder's batches differ in rows and cache length; the compiled flex call (every shape static, one compile
    each) answers each as attention written out over the row's keys from its first real column to the step's."""
    from dflash_prep.regen.attention import FlexDecodeMask, flex_decode

    torch.manual_seed(12)
    module = types.SimpleNamespace(num_key_value_groups=4, training=False, is_causal=True)
    for rows, keys in ((3, 300), (5, 300), (4, 340), (3, 300)):
        first = torch.randint(0, 200, (rows,)).tolist()
        q, k, v = torch.randn(rows, 8, 1, 16), torch.randn(rows, 2, keys, 16), torch.randn(rows, 2, keys, 16)
        flex = FlexDecodeMask(torch.tensor(first), keys, 259, compiled=True)
        flex.advance()
        mask = masks(rows, 1, keys, first)
        mask[..., 261:] = False
        with flex_decode(flex):
            out, _ = static_attention(module, q, k, v, mask, scaling=0.3)
        assert torch.allclose(out.double(), reference(q, k, v, mask, 0.3), atol=2e-6), (rows, keys)

"""The static-cache decode loop (regen/decode.py), the in-process engine's default path, on the CPU in float32: the
tiny Llama-style model and the tiny Qwen3.5 hybrid (Gated DeltaNet + attention) with random weights.

Expected ids come from HF `generate` run on each prompt alone (no padding, no batch, its own dynamic cache) or from
`generate` on the same padded batch with the same logits processors; never from the loop itself. On the CPU the CUDA
graph capture is off: the loop, its cache, masks, positions and chunked prefill are the code the GPU runs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEMO, tiny_llama_config
from test_regen_hf_engine import (DEMO_EOS, PROMPTS, SAMPLING, alone, llama_config, make_request, prompt_ids,
                                  section, user)

from dflash_prep.regen.decode import StaticCacheDecoder
from dflash_prep.regen.hf_engine import TransformersEngine, _processors

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return llama_config(tmp_path_factory.mktemp("llama") / "config.json")


def engine_for(name: str, llama_path: str, **kwargs) -> TransformersEngine:
    config = llama_path if name == "llama" else str(DEMO / "model_config.json")
    return TransformersEngine(section(config), CPU, 8192, **kwargs)


PAD_IN_PROMPTS = 77  # an ordinary token (a nonzero embedding, unlike the configs' pad id 0): padding that leaks shows


def padded(engine: TransformersEngine, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded [B, W] ids and mask, built here (not by the engine); the padding positions hold an ordinary
    token, so only the mask keeps them out."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_IN_PROMPTS, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("name,order,prefill", [("llama", "longest-first", "padded"), ("llama", "as-given", "padded"),
                                                ("llama", "longest-first", "packed"), ("llama", "as-given", "auto"),
                                                ("demo", "longest-first", "packed"),
                                                pytest.param("demo", "as-given", "auto", marks=pytest.mark.slow),
                                                pytest.param("demo", "longest-first", "padded", marks=pytest.mark.slow),
                                                pytest.param("demo", "as-given", "padded", marks=pytest.mark.slow)])
def test_chunked_prefill_and_per_row_limits_equal_generate_alone(name, order, prefill, llama_path):
    """Five prompts of 3 to ~400 tokens in one batch, each row with its own new-token limit (2 to 12), the decode
    steps' attention in row spans from each span's first real column, their keys up to limits that grow with the
    steps (6 limits of 2 columns here): every row's
    ids equal `generate` on its prompt alone with that limit (up to and including the first end-of-sequence id),
    then padding to the batch's end. Padded prefill: forwards of 10 tokens at most (sorted longest first, as the
    engine cuts batches: forwards of the rows that have begun; in the given order: whole columns); packed prefill
    (`auto` or `packed`): whole prompts back to back, 150 tokens a forward at
    most (the longest alone), on the hybrid with each prompt's Gated DeltaNet conv and recurrent states written to
    its row (the module runs once per prompt here)."""
    engine = engine_for(name, llama_path, decoder="generate")
    prompts = [prompt_ids(engine, m) for m in PROMPTS]
    if order == "longest-first":
        prompts.sort(key=len, reverse=True)
    limits = [12, 2, 7, 12, 5]
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=150 if prefill != "padded" else 10,
                                 column_multiple=1, row_multiple=1, prefill=prefill, span_cost_keys=0,
                                 key_limit_graphs=8)
    # auto: packed on both (attention-only, and the hybrid whose Gated DeltaNet keeps its states in the cache)
    assert decoder.packed_prefill == (prefill != "padded")
    ids, mask = padded(engine, prompts)
    with torch.inference_mode():
        out = decoder.generate(ids, mask, 12, [DEMO_EOS], row_new_tokens=limits).tolist()
    assert decoder.stats.decode_steps > 0 and decoder.stats.graph_captures == 0  # CPU: no capture
    assert decoder.stats.prompt_tokens_prefilled == sum(map(len, prompts))
    assert decoder.stats.decode_spans >= 3  # the decode steps attended in row spans (free here: span cost 0)
    if decoder.packed_prefill:  # several packed forwards, each padded only to a fixed row length
        from dflash_prep.plan.planner import packed_row_lengths

        assert decoder.stats.prefill_forwards >= 3
        assert sum(map(len, prompts)) <= decoder.stats.prefill_computed_tokens <= decoder.stats.prefill_forwards * max(
            max(map(len, prompts)), max(packed_row_lengths(150, 1)))
    for row, (p, limit) in enumerate(zip(prompts, limits)):
        expected = alone(engine, p, new=limit)
        assert out[row][:len(expected)] == expected
        assert set(out[row][len(expected):]) <= {engine.pad_token_id}


@pytest.mark.parametrize("name,prefill", [("llama", "auto"), ("llama", "padded"), ("demo", "packed"),
                                          pytest.param("demo", "padded", marks=pytest.mark.slow)])
def test_flex_decode_equals_generate_alone(name, prefill, llama_path):
    """The decode steps on flex attention (decode_kernel=flex: each row's keys from its own first real column to the
    step's, PyTorch's reference implementation on the CPU): five prompts of 3 to ~400 tokens, longest first, each
    row with its own new-token limit, every row's ids equal `generate` on its prompt alone, then padding; on the
    hybrid its attention layers run flex, its Gated DeltaNet layers as ever. No row spans are planned for it."""
    engine = engine_for(name, llama_path, decoder="generate")
    prompts = sorted((prompt_ids(engine, m) for m in PROMPTS), key=len, reverse=True)
    limits = [12, 2, 7, 12, 5]
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=150 if prefill != "padded" else 40,
                                 column_multiple=1, row_multiple=1, prefill=prefill, decode_kernel="flex")
    assert decoder.flex and "flex attention from each row's first key" in decoder.path
    assert decoder.span_cost_keys_in_use == 0  # the batch cut: each row priced from its own column
    ids, mask = padded(engine, prompts)
    with torch.inference_mode():
        out = decoder.generate(ids, mask, 12, [DEMO_EOS], row_new_tokens=limits).tolist()
    assert decoder.stats.decode_steps > 0 and decoder.stats.decode_spans == 0
    for row, (p, limit) in enumerate(zip(prompts, limits)):
        expected = alone(engine, p, new=limit)
        assert out[row][:len(expected)] == expected
        assert set(out[row][len(expected):]) <= {engine.pad_token_id}


def test_an_unknown_decode_kernel_is_refused(llama_path):
    engine = engine_for("llama", llama_path, decoder="generate")
    with pytest.raises(ValueError, match="decode_kernel='flash': one of auto, sdpa, flex"):
        StaticCacheDecoder(engine.model, engine.pad_token_id, decode_kernel="flash")


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_a_mask_that_is_not_left_padding_is_refused(kernel, llama_path):
    """The decoder reads each row's prompt as one run of columns ending at the last: a right-padded row, a hole
    inside a prompt or an empty prompt is refused before any forward (the same batch left padded runs)."""
    engine = engine_for("llama", llama_path, decoder="generate")
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, decode_kernel=kernel)
    ids = torch.randint(3, 100, (2, 6))
    for bad in ([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], [[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]],
                [[0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]], [[0, 0, 2, 1, 1, 1], [1, 1, 1, 1, 1, 1]]):
        with pytest.raises(ValueError, match="left padded"):
            decoder.generate(ids, torch.tensor(bad), 2, [])
    assert decoder.stats.decode_steps == 0 and decoder.stats.prompt_tokens_prefilled == 0
    with torch.inference_mode():
        out = decoder.generate(ids, torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]), 2, [])
    assert out.shape == (2, 2)


def test_a_stop_id_ends_its_row_only():
    """The tiny Llama with an end-of-sequence id its greedy answers reach at different steps: the batched loop stops
    each row there (padding after it) while the others go on exactly as alone."""
    import tempfile
    from pathlib import Path

    probe = TransformersEngine(section(llama_config(Path(tempfile.mkdtemp()) / "c.json")), CPU, 8192,
                               decoder="generate", ignore_eos=True)
    prompts = [prompt_ids(probe, m) for m in PROMPTS]
    free = [alone(probe, p, new=12, eos=-1) for p in prompts]
    stop_id = free[0][3]  # the 4th greedy token of the first prompt: row 0 stops there at the latest
    decoder = StaticCacheDecoder(probe.model, probe.pad_token_id)
    ids, mask = padded(probe, prompts)
    with torch.inference_mode():
        out = decoder.generate(ids, mask, 12, [stop_id]).tolist()
    stopped = 0
    for row, ids_free in enumerate(free):
        cut = ids_free.index(stop_id) + 1 if stop_id in ids_free else 12
        stopped += cut < 12
        assert out[row][:cut] == ids_free[:cut] and set(out[row][cut:]) <= {probe.pad_token_id}
    assert stopped >= 1 and stopped < len(prompts)  # some rows stopped early, others ran on


@pytest.mark.parametrize("sampling", [SAMPLING, {"temperature": 0.8, "repetition_penalty": 1.3, "min_p": 0.05}],
                         ids=["top_p-top_k", "penalty-min_p"])
def test_sampled_batch_equals_generate_with_the_same_processors(sampling, llama_path):
    """One padded batch, sampling with the per-row seeded draw: the loop's ids equal `generate`'s on the same batch
    with the same logits processors (the random stream and the processors see the same step and sequences)."""
    engine = engine_for("llama", llama_path, decoder="generate")
    prompts = [prompt_ids(engine, m) for m in PROMPTS]
    ids, mask = padded(engine, prompts)
    seeds = [11, 12, 13, 14, 15]
    with torch.inference_mode():
        expected = engine._generate(ids, mask, 16, _processors(sampling, seeds, mask, 16)).tolist()
        decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=64)
        got = decoder.generate(ids, mask, 16, engine.eos_token_ids, _processors(sampling, seeds, mask, 16)).tolist()
    assert [row[:len(e)] for row, e in zip(got, expected)] == expected
    assert all(set(row[len(e):]) <= {engine.pad_token_id} for row, e in zip(got, expected))


@pytest.mark.parametrize("name", ["llama", pytest.param("demo", marks=pytest.mark.slow)])
def test_the_engine_default_is_the_static_loop_and_a_sample_does_not_depend_on_its_batch(name, llama_path):
    """The engine's default decoder is the static loop; a sampled request (seed 7) gives the same text alone and in
    batches of other prompts in either order, and the greedy requests beside it equal generate alone."""
    engine = engine_for(name, llama_path, prefill_tokens=32)
    assert isinstance(engine.decoder, StaticCacheDecoder) and "static cache" in engine.decode_path
    target = make_request(user("Tell me a joke."), seed=7, sampling=SAMPLING, max_tokens=12)
    others = [make_request(m, seed=100 + i, sampling=SAMPLING, max_tokens=12) for i, m in enumerate(PROMPTS[1:4])]
    alone_text = engine.answer([target])[0].content
    batch = engine.answer([others[0], target, others[1], others[2]])
    reversed_batch = engine.answer([others[2], others[1], target, others[0]])
    assert batch[1].content == alone_text == reversed_batch[2].content
    greedy = engine.answer([make_request(m, seed=i) for i, m in enumerate(PROMPTS)])
    for messages, answer in zip(PROMPTS, greedy):
        expected = alone(engine, prompt_ids(engine, messages))
        assert answer.completion_tokens == len(expected)
        assert answer.content == engine.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                         skip_special_tokens=True)


def test_the_decode_path_names_the_family_and_the_gated_deltanet_kernel(llama_path):
    """Said per family: the Llama-style model decodes on the static loop; the hybrid also names its recurrence kernel
    (the torch fallback here: flash-linear-attention is not installed on this machine)."""
    import importlib.util

    assert engine_for("llama", llama_path).decode_path == \
        "llama: static cache, eager steps, attention in row spans, packed prefill"
    hybrid = engine_for("demo", llama_path, decoder="generate").decode_path
    assert hybrid.startswith("qwen3_5_text: HF generate (dynamic cache); Gated DeltaNet decode on ")
    assert ("flash-linear-attention's" in hybrid) == (importlib.util.find_spec("fla") is not None)


def test_prefill_forwards_attend_over_the_filled_prefix_in_a_bounded_set_of_shapes(llama_path):
    """Each prefill forward after the first (which allocates the cache) gets from the static cache only the keys up
    to its own last column (not the cache's whole length), and the forwards' (rows, columns) come from the fixed
    set: rows row_multiple x 2^k or the batch, columns column_multiple x 2^j. Recorded at transformers'
    StaticLayer.update; the answers stay those of `generate` alone (the tests above)."""
    from transformers.cache_utils import StaticLayer

    engine = engine_for("llama", llama_path, decoder="generate")
    prompts = sorted([prompt_ids(engine, m) for m in PROMPTS], key=len, reverse=True)
    ids, mask = padded(engine, prompts)
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=256, column_multiple=16,
                                 row_multiple=2, prefill="padded")
    seen, update = [], StaticLayer.update

    def recording(layer, keys, values, *args, **kwargs):
        out = update(layer, keys, values, *args, **kwargs)
        seen.append((keys.shape[0], keys.shape[2], out[0].shape[2], int(layer.cumulative_length)))
        return out

    StaticLayer.update = recording
    try:
        with torch.inference_mode():
            decoder.generate(ids, mask, 3, [])
    finally:
        StaticLayer.update = update
    width, full = ids.shape[1], ids.shape[1] + 3
    prefill = [s for s in seen if s[1] > 1 or s[3] <= width]
    first_end = prefill[0][3]
    assert all(attended == full for _, _, attended, end in prefill if end == first_end)  # allocates the cache
    later = [s for s in prefill if s[3] > first_end]
    assert later and all(attended == end for _, _, attended, end in later)
    assert all(attended == full for rows, t, attended, _ in seen if t == 1 and rows == len(prompts))  # decode
    allowed_rows = {2 * 2 ** k for k in range(4)} | {len(prompts)}
    allowed_columns = {16 * 2 ** j for j in range(6)} | {width % 16}
    assert {rows for rows, *_ in prefill} <= allowed_rows and {t for _, t, *_ in prefill} <= allowed_columns
    assert len({(rows, t) for rows, t, *_ in prefill}) < len(prefill)  # shapes repeat


def test_a_packed_forward_writes_each_prompt_state_to_its_row():
    """The packed prefill's cache in the layout fla's varlen kernels give it (one call over the whole packed row:
    conv input [1, C, T], final recurrent states [S, ...]), for prompts of 2, 6 and 4 tokens at batch rows 1..3 of
    4, conv kernel 4: row r's conv state is its prompt's last 4 conv inputs, zeros before a shorter prompt (as
    transformers pads a prompt alone), its recurrent state the prompt's own; row 0 (not in this forward) stays
    zero. The expected states are cut here from the packed input, prompt by prompt."""
    from transformers import StaticCache

    from dflash_prep.regen.decode import _PackedPrefillCache

    cache = StaticCache(config=_hybrid_config(), max_cache_len=16)
    linear = next(i for i, layer in enumerate(cache.layers) if hasattr(layer, "conv_states"))
    lengths, channels, kernel = [6, 2, 4], 5, 4  # the short prompt after another: its zeros are not its neighbour
    packed = torch.randn(1, channels, sum(lengths) + 3)  # then a tail of 3 padding tokens, a segment of its own
    states = torch.randn(4, 2, 3, 3)  # the tail's last
    wrapper = _PackedPrefillCache(cache, torch.zeros(12, dtype=torch.long), torch.zeros(12, dtype=torch.long),
                                  batch=4, first_row=1, lengths=lengths, tail_tokens=3)
    assert wrapper.get_conv_state(linear) is None and wrapper.get_recurrent_state(linear) is None
    assert wrapper.update_conv_state(packed, linear, conv_kernel_size=kernel) is packed
    wrapper.update_recurrent_state(states, linear)
    layer, start = cache.layers[linear], 0
    assert (layer.conv_states[0][0] == 0).all() and (layer.recurrent_states[0][0] == 0).all()
    for row, n in enumerate(lengths, start=1):
        alone = torch.nn.functional.pad(packed[0, :, start:start + n], (kernel, 0))[:, -kernel:]
        assert torch.equal(layer.conv_states[0][row], alone)
        assert torch.equal(layer.recurrent_states[0][row], states[row - 1])
        start += n
    assert layer.has_previous_state[0]


def _hybrid_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(DEMO / "model_config.json"))


@pytest.mark.parametrize("name", ["llama", "demo"])
def test_packed_prefill_of_odd_prompts_equals_generate_alone(name, llama_path):
    """Raw prompts of 1, 2 and 3 tokens (shorter than the hybrid's conv kernel of 4) beside one of 260 tokens, a
    prefill budget of 100 tokens (the long prompt alone in a forward over the budget; the short ones packed with
    a padding tail on the hybrid), in a batch and then each alone as a batch of one: every row equals `generate`
    alone, ignoring end-of-sequence."""
    engine = engine_for(name, llama_path, decoder="generate")
    vocab = engine.model.config.vocab_size
    prompts = [[(7 * i + 11) % (vocab - 3) + 3 for i in range(260)], [5, 9, 4], [17, 3], [23]]
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, prefill_tokens=100, prefill="packed")
    expected = [alone(engine, p, new=6, eos=-1) for p in prompts]
    with torch.inference_mode():
        together = decoder.generate(*padded(engine, prompts), 6, []).tolist()
        one_by_one = [decoder.generate(*padded(engine, [p]), 6, []).tolist()[0] for p in prompts]
    assert together == expected and one_by_one == expected
    assert decoder.stats.prefill_forwards == 2 + len(prompts)  # 260 alone, then 3 + 2 + 1 together; then 4 alone
    assert engine.model.config._attn_implementation == "sdpa"  # the model is back on its own attention after


def test_progress_moves_as_rows_finish_within_a_batch(llama_path):
    """One batch whose rows stop at different steps (a stop id the first prompt reaches at its 4th token), checks
    every 2 steps: the engine's on_answered is called several times for that single batch, as rows finish, and
    counts each request once."""
    engine = engine_for("llama", llama_path, ignore_eos=True)
    prompts = [prompt_ids(engine, m) for m in PROMPTS]
    free = [alone(engine, p, new=12, eos=-1) for p in prompts]
    stop_id = free[0][3]
    engine.eos_token_ids = [stop_id]
    engine.decoder.check_every = 2
    calls = []
    answers = engine.answer([make_request(m, seed=i, max_tokens=12) for i, m in enumerate(PROMPTS)],
                            on_answered=calls.append)
    assert engine.num_generate_calls == 1  # one batch
    assert sum(calls) == len(PROMPTS) and len(calls) >= 2, calls
    stopped = [f.index(stop_id) + 1 if stop_id in f else 12 for f in free]
    assert [a.completion_tokens for a in answers] == stopped


def test_rows_redone_after_an_out_of_memory_split_and_rejected_requests_are_counted_once(llama_path):
    """Six prompts of one length and one over the token budget (rejected), checks every step, the first prompt's
    answer ending at its first token (a stop id no other answer holds); a CUDA out-of-memory error on the third
    decode step of the 6-row batch. Reported, as it happens: the rejected request, the first row (finished before the
    error), nothing when the half [0, 3) finishes that row again, its other 2 rows, then the 3 of [3, 6): 7 in all,
    each request once, and the answers those of `generate` alone."""
    engine = engine_for("llama", llama_path, ignore_eos=True)
    questions = [user(f"Question {i}: why is the sky blue?") for i in range(6)]
    assert len({len(prompt_ids(engine, m)) for m in questions}) == 1
    free = [alone(engine, prompt_ids(engine, m), new=12, eos=-1) for m in questions]
    stop_id = free[0][0]
    assert all(stop_id not in f for f in free[1:])
    engine.eos_token_ids, engine.decoder.check_every = [stop_id], 1
    steps = {"decode": 0}

    def out_of_memory(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape == (6, 1):
            steps["decode"] += 1
            if steps["decode"] == 3:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")

    hook = engine.model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    calls = []
    try:
        answers = engine.answer([make_request(m, max_tokens=12) for m in questions]
                                + [make_request(user("word " * 9000), max_tokens=12)], on_answered=calls.append)
    finally:
        hook.remove()
    assert engine.num_ooms == 1 and answers[-1].rejected is not None
    assert calls == [1, 1, 2, 3]
    assert [a.completion_token_ids for a in answers[:6]] == [free[0][:1]] + free[1:]


def test_the_cache_goes_by_the_name_the_models_forward_takes():
    """transformers 5.24 names the forward's cache `cache`; 5.17 names it `past_key_values` and passes an unknown
    `cache=` on to the attention functions (the packed one refused it: every batch failed on such a GPU machine).
    The real model of this install, and a forward of the older signature."""
    import inspect

    from transformers import AutoModelForCausalLM

    from dflash_prep.regen.decode import cache_keyword

    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    installed = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    assert cache_keyword(model) == installed

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, **kwargs):
            return None

    assert cache_keyword(Older()) == "past_key_values"

    class Wrapper(torch.nn.Module):  # a forward that names neither (a wrapper, a compiled module): the install's
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    assert cache_keyword(Wrapper(model)) == installed


@pytest.mark.parametrize("new_tokens,graphs,multiple", [(256, 8, 64), (2048, 8, 64), (12, 8, 1), (100, 1, 64),
                                                        (5, 3, 64)])
def test_the_key_limits_cover_every_step_in_few_blocks(new_tokens, graphs, multiple, llama_path):
    """A step attends the positions before width + step: its limit is at least that, a multiple of the column
    multiple past the width (or the cache's end), never past the cache's end, non-decreasing, and a batch's steps
    use at most `key_limit_graphs` distinct limits (1: the cache's end throughout)."""
    engine = engine_for("llama", llama_path, decoder="generate")
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, column_multiple=multiple,
                                 key_limit_graphs=graphs)
    width = 1000
    limits = [decoder._key_limit(step, width, new_tokens) for step in range(1, new_tokens)]
    assert all(width + step <= limit <= width + new_tokens for step, limit in zip(range(1, new_tokens), limits))
    assert all((limit - width) % multiple == 0 or limit == width + new_tokens for limit in limits)
    assert limits == sorted(limits) and len(set(limits)) <= graphs
    if graphs == 1:
        assert set(limits) <= {width + new_tokens}
    if (new_tokens, graphs, multiple) == (256, 8, 64):  # the 8B benchmark's: blocks of 64 columns
        assert sorted(set(limits)) == [1064, 1128, 1192, 1256]


def test_decoders_in_two_threads_keep_their_own_spans_and_key_limits(llama_path):
    """Two decoders (two copies of the tiny Llama) in two threads on batches of one shape: thread A stops at its 70th
    decode step (past its first key limit, width + 64) while thread B runs its first steps (B's limit is width +
    64), then both go on. Each row of both equals `generate` alone with a stop id no answer reaches (the spans and the
    key limit are each thread's own: read across threads, A's later steps lost the keys past B's limit), and no
    span or limit is left set once both have ended."""
    import copy
    import threading
    import time

    from dflash_prep.regen.attention import _DecodeSpans

    engine = engine_for("llama", llama_path, decoder="generate")
    prompts = [prompt_ids(engine, m) for m in PROMPTS][:4]
    expected = [alone(engine, p, new=129, eos=-1) for p in prompts]
    models = {"a": engine.model, "b": copy.deepcopy(engine.model)}
    b_may_start, steps, out = threading.Event(), {"a": 0}, {}

    def pause_a(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            steps["a"] += 1
            if steps["a"] == 70:
                b_may_start.set()
                time.sleep(0.3)

    def slow_b(module, args, kwargs):
        if kwargs["input_ids"].shape[1] == 1:
            time.sleep(0.02)

    hooks = [models["a"].register_forward_pre_hook(pause_a, with_kwargs=True),
             models["b"].register_forward_pre_hook(slow_b, with_kwargs=True)]

    def decode(name):
        if name == "b":
            b_may_start.wait(60)
        decoder = StaticCacheDecoder(models[name], engine.pad_token_id, key_limit_graphs=8)
        with torch.inference_mode():
            out[name] = decoder.generate(*padded(engine, prompts), 129, []).tolist()

    try:
        threads = [threading.Thread(target=decode, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for h in hooks:
            h.remove()
    assert out["a"] == expected and out["b"] == expected
    assert (_DecodeSpans.spans, _DecodeSpans.keys, _DecodeSpans.limit) == (None, None, None)


def test_a_flex_attention_failure_decodes_the_batch_again_on_sdpa(llama_path, monkeypatch, caplog):
    """Flex attention failing in a decode step (its compile or kernel refusing a shape: raised here by the function
    the decoder calls) costs the batch a second run from its prefill on sdpa, logged once, and later batches stay
    on sdpa: every row's ids still equal `generate` alone."""
    import logging

    import dflash_prep.regen.attention as attention

    engine = engine_for("llama", llama_path, decoder="generate")
    prompts = sorted((prompt_ids(engine, m) for m in PROMPTS), key=len, reverse=True)
    calls = []

    def failing(compiled):
        def attend(*args, **kwargs):
            calls.append(1)
            raise RuntimeError("flex attention: no kernel for this shape\nsecond line")
        return attend

    monkeypatch.setattr(attention, "_flex_attention", failing)
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, decode_kernel="flex")
    ids, mask = padded(engine, prompts)
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="dflash_prep"):
        out = decoder.generate(ids, mask, 6, [DEMO_EOS]).tolist()
        again = decoder.generate(ids, mask, 6, [DEMO_EOS]).tolist()
    assert len(calls) == 1 and decoder.stats.flex_failures == 1 and not decoder.flex and out == again
    warnings = [r.getMessage() for r in caplog.records if "flex attention failed" in r.getMessage()]
    assert warnings == ["regeneration: the decode steps on flex attention failed (RuntimeError: flex attention: no "
                        "kernel for this shape); decoding on sdpa in row spans from now on"]
    for row, p in enumerate(prompts):
        expected = alone(engine, p, new=6)
        assert out[row][:len(expected)] == expected


def test_auto_decodes_on_flex_on_cuda_and_on_sdpa_elsewhere(llama_path):
    """`decode_kernel` auto (the default): flex attention on CUDA (compiled flex-decoding) for an attention-only
    model, sdpa for a Gated DeltaNet hybrid and on other devices (the CPU's flex is PyTorch's unfused reference);
    an explicit kernel is itself on every device."""
    from dflash_prep.regen.decode import DECODE_KERNEL, resolve_decode_kernel

    assert DECODE_KERNEL == "auto"
    assert [resolve_decode_kernel("auto", d) for d in ("cuda", "cpu", "mps")] == ["flex", "sdpa", "sdpa"]
    assert resolve_decode_kernel("auto", "cuda", gated_deltanet=True) == "sdpa"  # the hybrid: level, not faster
    assert [resolve_decode_kernel(k, "cpu") for k in ("sdpa", "flex")] == ["sdpa", "flex"]
    engine = engine_for("llama", llama_path)
    assert engine.decoder.decode_kernel == "sdpa" and not engine.decoder.flex


def test_flex_key_columns_are_block_multiples_then_four_an_octave():
    """The key counts a flex batch is given: multiples of 128 up to 1,024, then four an octave (each step an eighth
    of the octave's top); never fewer than asked, at most 25% more past 1,024."""
    from dflash_prep.regen.attention import flex_key_columns

    assert [flex_key_columns(c) for c in (1, 128, 129, 700, 1024, 1025, 1281, 2048, 2049, 2834, 5000, 40000)] == \
        [128, 128, 256, 768, 1024, 1280, 1536, 2048, 2560, 3072, 5120, 40960]
    values = {flex_key_columns(c) for c in range(1025, 32769)}
    assert sorted(values) == [1024 * 2 ** (k // 4) * (4 + k % 4 + 1) // 4 for k in range(20)]
    assert all(c <= flex_key_columns(c) <= 1.25 * c for c in range(1025, 20000, 7))


def test_flex_batches_past_the_shape_cap_decode_on_sdpa_and_keep_their_answers(llama_path, monkeypatch, caplog):
    """With room for one compiled flex shape, the first batch decodes on flex, a batch of another shape on sdpa
    (counted, said once, no failure), the first shape again on flex; every row's ids equal `generate` alone either
    way."""
    import logging

    import dflash_prep.regen.attention as attention

    monkeypatch.setattr(attention, "FLEX_MAX_SHAPES", 1)
    monkeypatch.setattr(attention, "_flex_shapes", set())
    real, calls = attention._flex_attention, []

    def counting(compiled):
        attend = real(compiled)

        def wrapped(*args, **kwargs):
            calls.append(args[0].shape[0])
            return attend(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(attention, "_flex_attention", counting)
    engine = engine_for("llama", llama_path, decoder="generate")
    prompts = sorted((prompt_ids(engine, m) for m in PROMPTS), key=len, reverse=True)
    decoder = StaticCacheDecoder(engine.model, engine.pad_token_id, decode_kernel="flex")
    results = []
    with torch.inference_mode(), caplog.at_level(logging.WARNING, logger="dflash_prep"):
        for batch in (prompts, prompts[1:], prompts[2:], prompts):
            before = len(calls)
            ids, mask = padded(engine, batch)
            results.append((batch, decoder.generate(ids, mask, 6, [DEMO_EOS]).tolist(), len(calls) > before))
    assert [on_flex for _, _, on_flex in results] == [True, False, False, True]
    assert decoder.stats.flex_shape_overflows == 2 and decoder.stats.flex_failures == 0 and decoder.flex
    assert sum("shapes compiled for flex attention (the cap)" in r.getMessage() for r in caplog.records) == 1
    for batch, out, _ in results:
        for row, p in enumerate(batch):
            expected = alone(engine, p, new=6)
            assert out[row][:len(expected)] == expected


def test_the_engine_pads_flex_batches_to_few_key_counts_and_answers_as_generate_alone(llama_path):
    """The engine on flex decode steps (explicit on the CPU): each batch's width + new tokens is one of
    `flex_key_columns`' values (the prompt padded further left), and every answer's ids equal `generate` alone."""
    from dflash_prep.regen.attention import flex_key_columns

    engine = TransformersEngine(section(llama_path), CPU, 1500, 2, decode_kernel="flex")
    shapes = []
    generate = engine.decoder.generate

    def recording(input_ids, attention_mask, new_tokens, *args, **kwargs):
        shapes.append((input_ids.shape[1], new_tokens, int(attention_mask.sum(-1).max())))
        return generate(input_ids, attention_mask, new_tokens, *args, **kwargs)

    engine.decoder.generate = recording
    answers = engine.answer([make_request(m, seed=i, max_tokens=8) for i, m in enumerate(PROMPTS)])
    assert len(shapes) >= 3
    for width, new, longest in shapes:
        assert flex_key_columns(width + new) == width + new and width >= longest
    for messages, answer in zip(PROMPTS, answers):
        expected = alone(engine, prompt_ids(engine, messages), new=8)
        assert answer.completion_token_ids == expected

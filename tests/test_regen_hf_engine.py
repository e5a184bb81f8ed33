"""The in-process regeneration engine (regen/hf_engine.py) on the tiny demo hybrid (Gated DeltaNet + attention) and on
a tiny Llama-style model, both with random weights, in float32 on the CPU.

Expected answers come from HF `generate` on each prompt alone (the same model object, no padding, no batch), from
the tokenizer's own `apply_chat_template`, or are written by hand; never from the engine. Batches are observed by
recording what reaches `model.generate` (the call still runs).
"""

from __future__ import annotations

import contextlib
import json

import chat_templates as T
import pytest
import torch
from conftest import DEMO

from dflash_prep.recipe.schema import ModelSection
from dflash_prep.regen.engine import Request
from dflash_prep.regen.hf_engine import SeededRowSampler, TransformersEngine

CPU = torch.device("cpu")
NEW = 10  # new tokens per answer: enough to tell answers apart, few enough to stay fast
DEMO_EOS = 0  # the demo tokenizer's <|endoftext|> and the configs' eos_token_id
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]


def llama_config(path, eos_token_id: int = DEMO_EOS, context: int = 2048) -> str:
    """A tiny Llama-style config (3 layers, hidden 64, the demo tokenizer's 1024 ids) written to `path`. A wide
    initialization (0.3) gives answers that differ from prompt to prompt (at 0.02 they repeat one token)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                         initializer_range=0.3, pad_token_id=0, bos_token_id=0, eos_token_id=eos_token_id)
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def section(config: str, tokenizer=DEMO / "tokenizer") -> ModelSection:
    return ModelSection(config=config, tokenizer=str(tokenizer), dtype="float32", init_seed=0)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory) -> str:
    return llama_config(tmp_path_factory.mktemp("llama") / "config.json")


@pytest.fixture(scope="module")
def llama(llama_path) -> TransformersEngine:
    """The tiny Llama engine on its default decoder, the static-cache loop (regen/decode.py)."""
    return TransformersEngine(section(llama_path), CPU, 8192)


@pytest.fixture(scope="module")
def llama_generate(llama_path) -> TransformersEngine:
    """The same on HF `generate` (`decoder="generate"`)."""
    return TransformersEngine(section(llama_path), CPU, 8192, decoder="generate")


@pytest.fixture(scope="module")
def demo() -> TransformersEngine:
    return TransformersEngine(section(str(DEMO / "model_config.json")), CPU, 8192)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def make_request(messages, seed: int = 0, sampling: dict | None = None, max_tokens: int = NEW, tools=None,
            **kwargs) -> Request:
    return Request(messages=messages, tools=tools, sampling=sampling or {}, seed=seed, max_tokens=max_tokens,
                   chat_template_kwargs=kwargs)


# Very different lengths (a few tokens to ~400), a system prompt and a multi-turn conversation in one list.
PROMPTS = [user("Hi"), user("Tell me about the sea. " * 60),
           [{"role": "system", "content": "Be brief."}, *user("What is 2+2?")],
           [*user("Name a fruit."), {"role": "assistant", "content": "Apple."}, *user("And a colour? " * 8)],
           user("Write a long story about a cat who learns to fly over the mountains. " * 25)]


def prompt_ids(engine: TransformersEngine, messages, tools=None, **kwargs) -> list[int]:
    """The tokenizer's own rendering (not the engine's)."""
    return list(engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True, **kwargs)["input_ids"])


def alone(engine: TransformersEngine, ids: list[int], new: int = NEW, eos=DEMO_EOS) -> list[int]:
    """Greedy HF generate on one prompt, no padding: the new ids up to and including the first end-of-sequence."""
    with torch.inference_mode():
        out = engine.model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=int),
                                    max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)
    generated = out[0, len(ids):].tolist()
    return generated[:generated.index(eos) + 1] if eos in generated else generated


@contextlib.contextmanager
def recorded_generate(engine: TransformersEngine):
    """Record each batch the engine's decoder runs (the static-cache loop or `model.generate`): {"rows": batch size, "width": prompt width, "new": max_new_tokens,
    "prompts": each row's attended prompt ids, "generated": each row's new ids}."""
    calls, real = [], engine._generate

    def generate(ids, mask, new_tokens, processors):
        out = real(ids, mask, new_tokens, processors)
        calls.append({"rows": ids.shape[0], "width": ids.shape[1], "new": new_tokens,
                      "prompts": [row[m.bool()].tolist() for row, m in zip(ids, mask)], "generated": out.tolist()})
        return out

    engine._generate = generate
    try:
        yield calls
    finally:
        del engine._generate


@pytest.mark.parametrize("name", [pytest.param("demo", marks=pytest.mark.slow), "llama", "llama_generate"])
def test_batched_greedy_equals_generate_alone(name, request):
    engine = request.getfixturevalue(name)
    with recorded_generate(engine) as calls:
        answers = engine.answer([Request(messages=m, tools=None, sampling={}, seed=i, max_tokens=NEW)
                                 for i, m in enumerate(PROMPTS)])
    assert len(calls) == 1 and calls[0]["rows"] == len(PROMPTS)  # one batch holds them all
    lengths = [len(prompt_ids(engine, m)) for m in PROMPTS]
    assert max(lengths) > 20 * min(lengths)  # left padding from none to hundreds of positions
    for messages, answer, n in zip(PROMPTS, answers, lengths):
        ids = prompt_ids(engine, messages)
        expected = alone(engine, ids)
        # Token for token: the batch row holding this prompt generated the same ids.
        row = calls[0]["prompts"].index(ids)
        assert calls[0]["generated"][row][:len(expected)] == expected
        assert answer.rejected is None and answer.prompt_tokens == n
        assert answer.completion_tokens == len(expected)
        assert answer.content == engine.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                         skip_special_tokens=True)
        assert answer.finish_reason == ("stop" if expected[-1] == DEMO_EOS else "length")


def test_the_token_budget_cuts_batches(llama_path):
    """Seven prompts of one length L: a budget of 3 x (L + new) tokens (+2, not enough for a fourth) runs them 3, 3
    and 1 at a time, each padded to exactly L (length_multiple 1); 7 x (L + new) runs them at once; a
    max_batch_size of 2 runs 2, 2, 2 and 1."""
    messages = user("How far is the moon?")
    buckets = dict(length_multiple=1)
    engine = TransformersEngine(section(llama_path), CPU, 10_000, **buckets)
    length = len(prompt_ids(engine, messages))
    requests = [make_request(messages, seed=i) for i in range(7)]
    for budget, max_batch_size, sizes in ((3 * (length + NEW) + 2, 256, [3, 3, 1]),
                                          (7 * (length + NEW), 256, [7]), (10_000, 2, [2, 2, 2, 1])):
        engine = TransformersEngine(section(llama_path), CPU, budget, max_batch_size, **buckets)
        with recorded_generate(engine) as calls:
            answers = engine.answer(requests)
        assert [c["rows"] for c in calls] == sizes and {c["width"] for c in calls} == {length}
        assert len({a.content for a in answers}) == 1 and answers[0].rejected is None


def test_every_batch_of_mixed_lengths_stays_under_the_budget(llama):
    """12 prompts of 8 to ~400 tokens, a budget of 1,200 tokens: every generate call holds rows x (prompt width + new
    tokens) <= 1,200 and no more than 4 rows, every prompt runs once, its answer equals generate alone."""
    budget, max_batch_size = 1200, 4
    engine = TransformersEngine(llama.section, CPU, budget, max_batch_size)
    messages = [user("word " * (2 * i * i)) for i in range(12)]
    with recorded_generate(engine) as calls:
        answers = engine.answer([make_request(m, seed=i) for i, m in enumerate(messages)])
    assert len(calls) > 3 and all(a.rejected is None for a in answers)
    for call in calls:
        assert call["rows"] * (call["width"] + call["new"]) <= budget and call["rows"] <= max_batch_size
    assert sorted(len(p) for c in calls for p in c["prompts"]) == sorted(len(prompt_ids(engine, m)) for m in messages)
    for m, answer in zip(messages, answers):
        expected = alone(engine, prompt_ids(engine, m))
        assert answer.completion_tokens == len(expected)
        assert answer.content == engine.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                         skip_special_tokens=True)


SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 50}


@pytest.mark.parametrize("name", [pytest.param("demo", marks=pytest.mark.slow), "llama", "llama_generate"])
def test_a_sampled_answer_depends_on_its_seed_not_on_its_batch(name, request):
    """The same request (sampling, seed 7) alone, third in a batch of four prompts of other lengths, and first in
    the reversed batch: the same text. Seed 8: another text. Run again: the same text."""
    engine = request.getfixturevalue(name)
    target = make_request(user("Tell me a joke."), seed=7, sampling=SAMPLING, max_tokens=16)
    others = [make_request(m, seed=100 + i, sampling=SAMPLING, max_tokens=16) for i, m in enumerate(PROMPTS[1:4])]
    batch = [others[0], others[1], target, others[2]]
    with recorded_generate(engine) as calls:
        alone_text = engine.answer([target])[0].content
        in_batch = engine.answer(batch)
        reversed_batch = engine.answer(batch[::-1])
    assert [c["rows"] for c in calls] == [1, 4, 4]
    assert in_batch[2].content == alone_text == reversed_batch[1].content
    assert [a.content for a in in_batch] == [a.content for a in reversed_batch[::-1]]
    assert engine.answer([target])[0].content == alone_text
    other_seed = engine.answer([make_request(user("Tell me a joke."), seed=8, sampling=SAMPLING, max_tokens=16)])
    assert other_seed[0].content != alone_text
    greedy = alone(engine, prompt_ids(engine, user("Tell me a joke.")), new=16)
    assert engine.tokenizer.encode(alone_text, add_special_tokens=False) != greedy  # it did sample


def test_top_k_1_sampling_is_greedy_decoding(llama):
    """Sampling that leaves one candidate (top_k 1) emits the argmax at every step: generate's greedy answer."""
    answers = llama.answer([make_request(m, seed=i, sampling={"temperature": 0.7, "top_k": 1})
                            for i, m in enumerate(PROMPTS)])
    for messages, answer in zip(PROMPTS, answers):
        expected = alone(llama, prompt_ids(llama, messages))
        assert answer.content == llama.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                        skip_special_tokens=True)


def test_a_repetition_penalty_in_a_padded_batch_equals_generate_alone(llama):
    """Greedy with repetition_penalty 1.5, prompts of very different lengths in one batch: generate alone with the
    same penalty (transformers' processor, no padding) gives the same answers."""
    answers = llama.answer([make_request(m, seed=i, sampling={"temperature": 0, "repetition_penalty": 1.5})
                            for i, m in enumerate(PROMPTS)])
    plain = llama.answer([make_request(m) for m in PROMPTS])
    assert [a.content for a in answers] != [a.content for a in plain]  # the penalty changed something
    for messages, answer in zip(PROMPTS, answers):
        ids = prompt_ids(llama, messages)
        with torch.inference_mode():
            out = llama.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW, do_sample=False,
                                       repetition_penalty=1.5, eos_token_id=DEMO_EOS, pad_token_id=0)
        expected = out[0, len(ids):].tolist()
        expected = expected[:expected.index(DEMO_EOS) + 1] if DEMO_EOS in expected else expected
        assert answer.content == llama.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                        skip_special_tokens=True)


def test_the_repetition_penalty_does_not_count_left_padding():
    """Row 0 = [pad, pad, 5, 6], row 1 = [7, 5, 6, 8] (pad id 9): penalty 2 halves the positive scores of the tokens
    each row holds (5, 6 / 7, 5, 6, 8), never the padding id's."""
    from dflash_prep.regen.hf_engine import PaddedRepetitionPenalty

    input_ids = torch.tensor([[9, 9, 5, 6], [7, 5, 6, 8]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    scores = PaddedRepetitionPenalty(2.0, mask)(input_ids, torch.ones(2, 10))
    assert scores[0].tolist() == [1, 1, 1, 1, 1, 0.5, 0.5, 1, 1, 1]
    assert scores[1].tolist() == [1, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 1]


def test_the_seeded_sampler_draws_from_the_distribution():
    """20,000 rows (seeds 0..19,999) drawing from p = (0.5, 0.3, 0.2, 0): frequencies within 0.015 of p (5 standard
    errors), the filtered token never; the same seeds draw the same tokens again."""
    n = 20_000
    scores = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).expand(n, 4).contiguous()

    def draw():
        sampler = SeededRowSampler(list(range(n)), new_tokens=1, prompt_width=0, device=CPU)
        return sampler(torch.zeros(n, 0, dtype=torch.long), scores).argmax(dim=1)

    tokens = draw()
    frequencies = torch.bincount(tokens, minlength=4).double() / n
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64), atol=0.015)
    assert frequencies[3] == 0 and torch.equal(draw(), tokens)


def test_requests_that_cannot_run_are_rejected_with_a_reason_and_the_others_answered(llama, tmp_path):
    """Context 64 tokens: a prompt over the context, a template that fails on a message, max_tokens 0; beside them
    a request that runs, and one near the end of the context whose new tokens are capped by it. Budget 64 tokens
    (context 2048): a prompt that fits the context but not the budget with its new tokens."""
    engine = TransformersEngine(section(llama_config(tmp_path / "config.json", context=64)), CPU, 96)
    near_end = next(m for m in (user("one two " * k) for k in range(40))
                    if 64 - NEW < len(prompt_ids(engine, m)) < 63)  # fewer than NEW tokens left in the context
    n_near = len(prompt_ids(engine, near_end))
    too_long = user("word " * 80)
    requests = [make_request(user("Hi")), make_request(too_long), make_request([{"role": "user", "content": None}]),
                make_request(user("Hi"), max_tokens=0), make_request(near_end)]
    answers = engine.answer(requests)
    assert answers[0].rejected is None and answers[0].completion_tokens > 0
    assert answers[1].rejected == (f"prompt of {len(prompt_ids(engine, too_long))} tokens does not fit the model's "
                                   "context of 64 tokens (max_position_embeddings)")
    assert answers[2].rejected.startswith("chat template failed:")
    assert answers[3].rejected == "max_tokens must be >= 1, got 0"
    expected = alone(engine, prompt_ids(engine, near_end), new=64 - n_near)
    assert answers[4].rejected is None and answers[4].completion_tokens == len(expected) < NEW
    assert answers[4].finish_reason == ("stop" if expected[-1] == DEMO_EOS else "length")
    # a template that renders nothing for one conversation: that row is rejected, the others answered
    silent = TransformersEngine(llama.section, CPU, 8192, chat_template=(
        "{% if messages[0].content != 'nothing' %}{{ messages[0].content }}{% endif %}"))
    empty, said = silent.answer([make_request(user("nothing")), make_request(user("Hi"))])
    assert empty.rejected == "the chat template rendered an empty prompt" and said.rejected is None
    assert said.completion_tokens > 0
    small = TransformersEngine(llama.section, CPU, 64)
    n = len(prompt_ids(small, user("word " * 20)))
    over, fits = small.answer([make_request(user("word " * 20), max_tokens=65 - n), make_request(user("Hi"))])
    assert over.rejected == (f"prompt of {n} tokens + {65 - n} new tokens exceeds the token budget "
                             "max_tokens_per_batch=64")
    assert fits.rejected is None


def test_finish_reason_stop_at_an_end_of_sequence_id_and_length_without_one(llama, tmp_path):
    """The model's eos id set to the 4th token the greedy answer of a prompt holds (found with generate, no eos):
    that answer stops there (`stop`, 4 tokens, the text before it); a prompt whose answer never emits it ends
    at max_tokens (`length`)."""
    ids = prompt_ids(llama, user("Hi"))
    free = alone(llama, ids, eos=None)
    stop_id = free[3]
    assert stop_id not in free[:3] and stop_id != DEMO_EOS
    engine = TransformersEngine(section(llama_config(tmp_path / "config.json", eos_token_id=stop_id)), CPU, 8192)
    other = next(m for m in PROMPTS[1:] if stop_id not in alone(engine, prompt_ids(engine, m), eos=None))
    stopped, cut = engine.answer([make_request(user("Hi")), make_request(other)])
    assert (stopped.finish_reason, stopped.completion_tokens) == ("stop", 4)
    assert stopped.content == engine.tokenizer.decode(free[:3], skip_special_tokens=True)
    assert (cut.finish_reason, cut.completion_tokens) == ("length", NEW)
    assert engine.identity()["model"] != llama.identity()["model"]
    assert engine.identity()["eos_token_ids"] == sorted({stop_id, DEMO_EOS})


def test_a_batch_out_of_memory_is_halved_and_a_request_that_never_fits_is_rejected(llama):
    """A forward of more than 2 rows, or holding the token ids of " zebra zebra zebra", raises CUDA's out-of-memory
    error. Five prompts of one length: 5 rows fail, then 3 (the first half), then 2 + 1 run, then 2; the answers
    equal generate alone. The learned cap (2 rows of that length) cuts the next call's 4 prompts into 2 + 2. The
    "zebra" request is rejected, the one beside it answered."""
    engine = TransformersEngine(llama.section, CPU, 8192)
    zebra = engine.tokenizer.encode(" zebra zebra zebra", add_special_tokens=False)

    def out_of_memory(module, args, kwargs):
        ids = kwargs["input_ids"]
        if ids.shape[0] > 2 or any(zebra == row[i:i + len(zebra)] for row in ids.tolist()
                                   for i in range(len(row) - len(zebra) + 1)):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    questions = [user(f"Question number {i}: why is the sky blue?") for i in range(5)]
    assert len({len(prompt_ids(engine, m)) for m in questions}) == 1
    hook = engine.model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    try:
        with recorded_generate(engine) as calls:
            answers = engine.answer([make_request(m) for m in questions])
            assert [c["rows"] for c in calls] == [2, 1, 2]  # the calls that returned (5 and 3 rows raised)
            del calls[:]
            engine.answer([make_request(m) for m in questions[:4]])
            assert [c["rows"] for c in calls] == [2, 2]
            rejected = engine.answer([make_request(user("A zebra zebra zebra story")), make_request(user("Hi"))])
    finally:
        hook.remove()
    for messages, answer in zip(questions, answers):
        expected = alone(engine, prompt_ids(engine, messages))
        assert answer.rejected is None and answer.completion_tokens == len(expected)
        assert answer.content == engine.tokenizer.decode([t for t in expected if t != DEMO_EOS],
                                                         skip_special_tokens=True)
    assert rejected[0].rejected.startswith("out of memory even alone") and rejected[1].rejected is None


TEMPLATE = {"start_anchor": "<|im_start|>assistant\n", "fields": {
    "reasoning_content": {"open": "<think>", "close": "</think>"},
    "tool_calls": {"open_pattern": r"\s*<tool_call>\s*<function=(?P<name>[^>\n]+)>",
                   "close_pattern": r"</function>\s*</tool_call>", "repeats": True, "content": "xml-inline",
                   "content_args": {"tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>"},
                   "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}},
    "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)"}}}


@pytest.fixture(scope="module")
def qwen36(llama_path, tmp_path_factory) -> TransformersEngine:
    """The Llama-style model behind the demo tokenizer given Qwen3.6's chat template and a declared response
    template (a Qwen3.5-style one written for this test)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO / "tokenizer")
    tokenizer.chat_template = T.QWEN36
    tokenizer.response_template = TEMPLATE
    folder = tmp_path_factory.mktemp("qwen36-tokenizer")
    tokenizer.save_pretrained(folder)
    return TransformersEngine(section(llama_path, tokenizer=folder), CPU, 8192)


AGENT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Zürich?"},
         {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 21}"},
         {"role": "assistant", "content": "21 °C."}, {"role": "user", "content": "And in Oslo?"}]


def test_a_multi_turn_conversation_with_tools_renders_as_the_template_does(qwen36):
    """The OpenAI form (arguments a JSON string) renders as the tokenizer renders the same turns with the arguments
    as an object (what the template iterates), tools and enable_thinking=False included."""
    as_objects = json.loads(json.dumps(AGENT))
    as_objects[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Zürich"}
    expected = prompt_ids(qwen36, as_objects, tools=TOOLS, enable_thinking=False)
    req = make_request(AGENT, tools=TOOLS, enable_thinking=False)
    assert qwen36.render(req) == expected
    text = qwen36.tokenizer.decode(expected)
    assert '"name": "get_weather"' in text and "<parameter=city>\nZürich\n</parameter>" in text
    assert text.endswith("<|im_start|>user\nAnd in Oslo?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answer = qwen36.answer([req])[0]
    assert answer.rejected is None and answer.prompt_tokens == len(expected) and answer.completion_tokens > 0


def _answer_of_text(engine: TransformersEngine, text: str, stop: bool, seed: int = 3, **chat_template_kwargs):
    """The engine's Answer for a generated turn of `text` (+ the end-of-sequence id when `stop`) after the prompt
    of one user message."""
    from dflash_prep.regen.hf_engine import _Prompt

    req = make_request(user("Weather in Paris?"), seed=seed, tools=TOOLS, **chat_template_kwargs)
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    assert engine.tokenizer.decode(ids) == text
    generated = ids + [DEMO_EOS] if stop else ids
    return engine._answer_of(_Prompt(0, req, engine.render(req), len(ids)), generated)


def test_a_declared_response_template_splits_reasoning_and_tool_calls(qwen36):
    """Qwen3.6's template opens the reasoning (`<think>\\n`) in the prompt: the model writes from inside it."""
    text = ("The user wants weather.\n</think>\n\nLet me check.<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>")
    answer = _answer_of_text(qwen36, text, stop=True)
    assert answer.reasoning_content == "The user wants weather."
    assert answer.content == "Let me check."
    assert answer.finish_reason == "tool_calls" and answer.completion_tokens == len(qwen36.tokenizer.encode(text)) + 1
    [call] = answer.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
    assert _answer_of_text(qwen36, text, stop=True).tool_calls[0]["id"] == call["id"]  # a re-run: the same id
    only_call = _answer_of_text(qwen36, text.split("Let me check.")[1], stop=True, enable_thinking=False)
    assert only_call.content is None and only_call.reasoning_content is None
    assert only_call.tool_calls[0]["function"]["name"] == "get_weather" and only_call.finish_reason == "tool_calls"


def test_text_the_parser_would_lose_or_a_call_left_open_stays_whole_in_the_content(qwen36, llama):
    # Text after an end-of-turn marker that is not a stop id: the parser would keep only the last part.
    lossy = _answer_of_text(qwen36, "First part.<|im_end|>Second part.", stop=True, enable_thinking=False)
    assert (lossy.content, lossy.reasoning_content, lossy.tool_calls) == ("First part.Second part.", None, None)
    # A tool call cut by max_tokens: no call invented, the text kept.
    cut = "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    open_call = _answer_of_text(qwen36, cut, stop=False, enable_thinking=False)
    assert (open_call.content, open_call.tool_calls, open_call.finish_reason) == (cut, None, "length")
    # No declared template (the demo tokenizer): the text exactly as generated, reasoning tags included.
    plain = _answer_of_text(llama, "<think>\nhmm\n</think>\n\nHello", stop=True)
    assert (plain.content, plain.reasoning_content, plain.tool_calls) == ("<think>\nhmm\n</think>\n\nHello", None,
                                                                          None)
    assert plain.finish_reason == "stop"


def test_unsupported_sampling_parameters_are_refused_before_any_batch(llama):
    with pytest.raises(ValueError, match="'presence_penalty' = 0.5 is not supported"):
        llama.answer([make_request(user("Hi"), sampling={"temperature": 0.7, "presence_penalty": 0.5})])
    assert llama.answer([make_request(user("Hi"), sampling={"temperature": 0, "presence_penalty": 0.0})])[0].content


def test_the_progress_hears_of_each_batch_as_it_ends(llama_path):
    """on_answered(n) after each `generate` batch: a max_batch_size of 2 over 7 requests reports 2, 2, 2, 1 (the
    progress bar moves per answered request, not once per call)."""
    engine = TransformersEngine(section(llama_path), CPU, 10_000, 2, length_multiple=1)
    heard = []
    answers = engine.answer([make_request(user("How far is the moon?"), seed=i) for i in range(7)],
                            on_answered=heard.append)
    assert heard == [2, 2, 2, 1] and len(answers) == 7


def test_row_spans_let_the_cost_model_merge_batches_with_the_same_answers(llama_path):
    """The decode cost model (regen/batch_sizing.py, run on CUDA) set on a CPU engine, its weights priced at 600 cache
    positions: a ~400-token prompt and eleven short ones are two batches when every row reads the whole cache (the
    long prompt's width would pad eleven rows) and one when the decode steps attend in row spans (the short rows
    read from their own columns); the answers of both equal generate alone."""
    from dflash_prep.regen.batch_sizing import ModelSizes

    messages = [user("word " * 380)] + [user(f"Question {i}?") for i in range(11)]
    requests = [make_request(m, seed=i) for i, m in enumerate(messages)]
    rows = {}
    for spans in (None, 64):
        engine = TransformersEngine(section(llama_path), CPU, 1 << 20, span_cost_keys=spans)
        engine.sizes, engine.memory_limit_bytes = ModelSizes(600, 1, 0, 0), 10**9
        with recorded_generate(engine) as calls:
            answers = engine.answer(requests)
        rows[spans] = [c["rows"] for c in calls]
        for m, answer in zip(messages, answers):
            assert answer.content == engine.tokenizer.decode(
                [t for t in alone(engine, prompt_ids(engine, m)) if t != DEMO_EOS], skip_special_tokens=True)
    assert rows == {None: [1, 11], 64: [12]}

"""The in-process regeneration engine (`engine: transformers`): the target's own copy on this process's device,
length-grouped, left-padded batches under a token budget, each decoded by the static-cache loop of regen/decode.py
(its decode step a CUDA graph on CUDA; `decoder="generate"`: HF `generate`, the reference path), same processors.

What it does with a `Request` (engine.py), step by step:

- **Prompt.** Rendered exactly as the extraction renders the row (data/chat.py `ChatRenderer`): the messages read
  as a row's are, in the template's tool-call form (arguments as objects where the template takes them, as vLLM
  passes them), `apply_chat_template(..., chat_template=data.chat_template, add_generation_prompt=True,
  **chat_template_kwargs)`, tokenized without special tokens added on top, as `transformers serve` and vLLM render a
  chat request. A template that raises gives a rejected answer.
- **Token ids.** Every answer carries `prompt_token_ids` (the prompt above) and `completion_token_ids` (the ids
  generated, the stop token included when it stopped on one).
- **Rejected, never raised** (`Answer.rejected`, one request, the rest of the list goes on): a template error; a
  prompt that leaves no room for one new token in the model's context (`max_position_embeddings`); a prompt whose
  tokens plus its new tokens exceed the token budget (it could not run even alone); one that runs out of device
  memory even alone. Near the end of the context, the new tokens are capped at what the context holds
  (`finish_reason: length`).
- **Batches.** Requests with the same sampling parameters and new-token count are sorted by prompt length, longest
  first (an out-of-memory error shows in the first batch), and cut into consecutive batches: a batch pads every
  prompt to its longest one rounded up to `length_multiple` (few distinct prompt widths: each new shape costs a
  Triton autotune in flash-linear-attention's kernels; on flex decode steps, so that width + new tokens
  is one of a few key counts an octave, each a compile of the flex call), and holds as many requests as batch size x
  (padded prompt + new tokens) <= `max_tokens_per_batch` and <= `max_batch_size` allow. The budget bounds what the
  batch holds at its end (the KV cache, the Gated DeltaNet states) and what its prefill forward runs. Not the
  extraction planner's length buckets (`plan.planner.plan_batches`): a batch of generation costs `max_tokens` decode
  steps whatever its size, and buckets cut one call's requests into at least one batch per bucket, where consecutive
  cutting fills each batch to the budget: the benchmark's 256 prompts (bench/regen_bench.py, 8B settings: 432
  prompt tokens on average, 256 new tokens, a budget of 131,072) make 11 batches in the buckets of `batching`'s
  defaults (16 / 1.25) and 3 consecutive ones, 11 x 256 decode steps against 3 x 256. On CUDA the static decoder's
  batches are cut where regen/batch_sizing.py's decode cost model says (the weights read once a batch step against
  each row's padded cache), within the budget and the device memory free after the weights.
- **Padding.** Left padding with the attention mask; positions from the mask (`cumsum - 1`, as `generate` derives
  them; regen/decode.py passes them explicitly), attention never sees padding, and the Gated DeltaNet layers of the Qwen3.5 hybrid zero padded positions before
  their convolution and recurrence, so padding changes no real token's state (tests: batched greedy answers equal
  `generate` on each prompt alone, token for token, in float32, on a Llama-style model and on the hybrid).
- **Out of memory.** A batch that runs out of device memory is split in halves, each retried (recursively, down to
  one request, as target/backoff.py does for extraction forwards); the first half's padded tokens become a cap on
  every later batch's (a budget learned from the device, never above `max_tokens_per_batch`).
- **Sampling.** `Request.sampling` by OpenAI / vLLM names: `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty` (`presence_penalty` / `frequency_penalty` only at 0). Empty, or `temperature` 0: greedy.
  Otherwise temperature (default 1.0), then top-k (0 or -1: off), top-p, min-p by transformers' own logits warpers,
  after the repetition penalty (transformers' processor, over the prompt and the generated tokens as vLLM counts
  them; the left padding is not counted). The model's `generation_config.json` is not applied here: the caller
  resolves the sampling parameters (the conversation rules default them to it), so the engine runs exactly those.
- **Seeds (the guarantee).** Each row draws its token with its own random stream: the request's `seed` (mod 2**64)
  seeds a CPU `torch.Generator` that draws one float64 uniform per new-token step, and the step's token is the one
  whose interval of the cumulative distribution (float64) holds it. A sampled answer is therefore a function of the
  request alone (prompt, sampling parameters, seed, max_tokens) and of the model's logits: the same request gives
  the same text whichever requests share its batch, in whatever order, in whatever batch size (and on any device,
  as far as the logits agree). What can still differ is what differs for greedy decoding too: another batch shape
  can round the logits differently (padding and shapes pick other kernels), which changes a token only where a
  uniform falls within that rounding of an interval's edge (greedy: where two logits tie within it). On the same
  machine, software and batch composition, an answer is reproduced bit for bit. Greedy rows use no random stream.
- **Stop.** At the end-of-sequence ids of the model's generation config and of the tokenizer (`eos_token_id`),
  or after the request's `max_tokens` new tokens. `finish_reason`: `length` when `max_tokens` (or the context)
  ended the turn before an end-of-sequence token, else `tool_calls` when tool calls were parsed, else `stop`.
  `completion_tokens` counts the generated tokens including the end-of-sequence token that ended the turn (as vLLM
  counts them); `prompt_tokens` the rendered prompt. `ignore_eos=True` (benchmarks) never stops before `max_tokens`.
- **Reasoning and tool calls.** Split off only where the tokenizer declares how: its `response_template`
  (transformers' declarative response format, a key of its `tokenizer_config.json`). Then the generated ids, decoded
  with their special tokens, go through transformers' response parser (`tokenizer.get_response_parser(template,
  prefix=the prompt, tools=tools)`, what `tokenizer.parse_response` runs) and fill `content`, `reasoning_content`
  (a field named `reasoning_content`, `thinking` or `reasoning`) and `tool_calls` (OpenAI form: arguments
  re-serialized as a JSON string, `id` = `call_` + a hash of the request's seed, the call's position and name, so a
  re-run gives the same ids); `content` is None when the turn holds tool calls and no text. The parse is refused,
  and the text kept whole as below, where it would lose text (a non-repeating field written twice: the parser
  keeps the last one) or invent a call (a tool call left open by `max_tokens`), or where the parser raises.
  Without a declared template: `content` is the generated text decoded with `skip_special_tokens=True` (the stop
  token left out), exactly as generated, reasoning tags included; `reasoning_content` and `tool_calls` are None.
  (`transformers serve` also falls back to built-in templates per model type, e.g. Qwen3 and the Qwen3.5 hybrid,
  and vLLM / SGLang use their own reasoning and tool parsers: for a tokenizer without a declared template the
  `openai` engine may split what this one keeps in `content`.)
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dflash_prep.data.chat import ChatRenderer
from dflash_prep.data.conversation import prompt_conversation
from dflash_prep.recipe.schema import ModelSection
from dflash_prep.regen.attention import DEFAULT_SPAN_COST_KEYS, flex_key_columns
from dflash_prep.regen.batch_sizing import MEMORY_FRACTION, ModelSizes, cut_batches
from dflash_prep.regen.decode import DECODE_KERNEL, KEY_LIMIT_GRAPHS, StaticCacheDecoder
from dflash_prep.regen.engine import FINISH_LENGTH, FINISH_STOP, FINISH_TOOL_CALLS, Answer, Request
from dflash_prep.target.backoff import is_oom
from dflash_prep.target.model import (
    load_config,
    load_model,
    load_tokenizer,
    model_fingerprint,
    padding_token_id,
    tokenizer_fingerprint,
    vocab_size_of,
)

log = logging.getLogger("dflash_prep")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
NEUTRAL_ONLY_KEYS = ("presence_penalty", "frequency_penalty")  # accepted at 0 (the OpenAI default) only
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def check_sampling(sampling: dict) -> None:
    """Raise ValueError for a sampling parameter this engine cannot honour (a run-wide setting, not a row's
    fault: the caller stops before the first batch)."""
    for key, value in sampling.items():
        if key in SAMPLING_KEYS or (key in NEUTRAL_ONLY_KEYS and not value):
            continue
        raise ValueError(f"sampling parameter {key!r} = {value!r} is not supported by the transformers engine "
                         f"(supported: {', '.join(SAMPLING_KEYS)}; {', '.join(NEUTRAL_ONLY_KEYS)} only at 0)")


def is_greedy(sampling: dict) -> bool:
    return not sampling or float(sampling.get("temperature", 1.0)) == 0.0


@dataclass
class _Prompt:
    """A request ready to run: its position in the list, prompt ids and the new tokens it may generate."""

    index: int
    request: Request
    ids: list[int]
    new_tokens: int


class TransformersEngine:
    """The target on `device` answering `Request`s with HF `generate` (the module docstring says how).

    model: the recipe's model section (pretrained weights, or random weights from a config).
    max_tokens_per_batch: batch size x (padded prompt + new tokens) per batch at most. max_batch_size: requests per
        batch at most. length_multiple: prompt widths are multiples of it (capped by the budget; on flex decode
        steps, widths + new tokens are `flex_key_columns` values instead).
    ignore_eos: never stop before `max_tokens` (benchmarks with random weights).
    kernels: `model.kernels` to apply (target/kernels.py); None: the section's.
    chat_template: the template text replacing the tokenizer's own (`data.chat_template`, read), or None.
    decoder: `static` (regen/decode.py: static cache, the decode step a CUDA graph on CUDA when `cuda_graphs`,
        prefill in forwards of `prefill_tokens` tokens at most, packed or padded as `prefill` says, decode attention
        in row spans when `span_cost_keys` is set, up to `key_limit_graphs` key limits a batch, or on flex attention
        with `decode_kernel` flex, the default on CUDA (`auto`): decode.py) or `generate` (HF `generate`, the
        reference path).
    Batches are formed within one `answer` call: give it many requests (thousands) for full batches.
    Raises RecipeError (model, tokenizer or kernels that cannot be loaded), ValueError (a budget or batch size < 1).
    """

    def __init__(self, model: ModelSection, device: torch.device, max_tokens_per_batch: int,
                 max_batch_size: int = 256, *, length_multiple: int = 64,
                 ignore_eos: bool = False, kernels=None, decoder: str = "static",
                 prefill_tokens: int = 32768, cuda_graphs: bool = True, chat_template: str | None = None,
                 prefill: str = "auto", span_cost_keys: int | None = DEFAULT_SPAN_COST_KEYS,
                 key_limit_graphs: int = KEY_LIMIT_GRAPHS, decode_kernel: str = DECODE_KERNEL):
        self.section, self.device = model, torch.device(device)
        if max_tokens_per_batch < 2 or max_batch_size < 1 or length_multiple < 1:
            raise ValueError(f"max_tokens_per_batch={max_tokens_per_batch}, max_batch_size={max_batch_size} and "
                             f"length_multiple={length_multiple} must allow one request")
        self.max_tokens_per_batch, self.max_batch_size = max_tokens_per_batch, max_batch_size
        self.length_multiple = length_multiple
        self.tokenizer = load_tokenizer(model)
        self.chat_template = chat_template
        self._renderers: dict[str, ChatRenderer] = {}  # by chat_template_kwargs
        self.config = load_config(model)
        self.kernels = self._load_model(kernels)
        text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self.context_tokens = getattr(text, "max_position_embeddings", None)
        self.pad_token_id = padding_token_id(self.tokenizer, vocab_size_of(self.config))
        self.eos_token_ids = [] if ignore_eos else _eos_ids(self.model.generation_config, self.tokenizer)
        self.ignore_eos = ignore_eos
        # generate() fills every parameter a call leaves unset from the model's generation config (do_sample,
        # top_k, repetition_penalty, suppress_tokens, ...): a bare one makes the call run exactly what it asks.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_token_ids or None,
                                                        pad_token_id=self.pad_token_id)
        self.response_template = getattr(self.tokenizer, "response_template", None)  # declared, or None
        self.token_cap: int | None = None  # padded tokens per batch still expected to fit (after an OOM)
        self.num_generate_calls = 0
        self.num_ooms = 0
        self._identity: dict | None = None
        if decoder not in DECODERS:
            raise ValueError(f"decoder={decoder!r}: one of {', '.join(DECODERS)}")
        self.decoder = None if decoder == "generate" else StaticCacheDecoder(
            self.model, self.pad_token_id, prefill_tokens=prefill_tokens, cuda_graphs=cuda_graphs, prefill=prefill,
            span_cost_keys=span_cost_keys, key_limit_graphs=key_limit_graphs, decode_kernel=decode_kernel)
        self.sizes, self.memory_limit_bytes = self._sizes() if self.decoder is not None else (None, None)
        log.info("regeneration engine: %s", self.decode_path)

    @property
    def decode_path(self) -> str:
        """Which path decodes, in words (`decode_path`); after a failed CUDA graph capture: the eager steps."""
        return decode_path(self.config, self.decoder, self.device)

    def _load_model(self, kernels) -> dict:
        from dflash_prep.target.kernels import apply_kernels, configure_triton_cache, select_kernels

        if self.device.type == "cuda":
            configure_triton_cache(self.section.triton_cache_dir)
        choice = select_kernels(self.section.kernels if kernels is None else kernels, self.config, self.device.type)
        self.model = load_model(self.section, self.config, self.device)
        apply_kernels(self.model, choice)
        return choice.record()

    def identity(self) -> dict:
        """What decides the generated text: model, weights and tokenizer fingerprints (as extraction's job identity),
        the engine, transformers' version, the stop ids and the response template; for random weights the device
        type they were drawn on (CPU and CUDA draw other weights from one seed)."""
        if self._identity is None:
            import transformers

            from dflash_prep.recipe.fingerprints import weights_fingerprint

            template = self.response_template
            self._identity = {
                "engine": "transformers", "transformers_version": transformers.__version__,
                "model": model_fingerprint(self.section, self.config),
                "weights": weights_fingerprint(self.section),
                "tokenizer": tokenizer_fingerprint(self.tokenizer),
                "eos_token_ids": sorted(self.eos_token_ids), "ignore_eos": self.ignore_eos,
                "response_template": None if template is None else
                hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest(),
            }
            if self.section.config is not None:
                self._identity["random_weights_device"] = self.device.type
        return dict(self._identity)

    def answer(self, requests: list[Request], on_answered=None) -> list[Answer]:
        """One Answer per request, in the requests' order; on_answered(n), if given, as n more are answered: with the
        static decoder as its rows finish within a batch (at its checks), else after each `generate` batch; each
        request counted once (rows redone after an out-of-memory split are not counted again). Raises ValueError
        for unsupported sampling parameters; a device error other than out-of-memory propagates."""
        answers: list[Answer | None] = [None] * len(requests)
        groups: dict[tuple, list[_Prompt]] = {}
        for index, request in enumerate(requests):
            check_sampling(request.sampling)
            prompt = self._prepare(index, request)
            if isinstance(prompt, Answer):
                answers[index] = prompt
                continue
            key = (prompt.new_tokens, json.dumps(request.sampling, sort_keys=True))
            groups.setdefault(key, []).append(prompt)
        rejected = sum(a is not None for a in answers)
        if rejected and on_answered is not None:  # answered too (a counted skip), as the OpenAI engine counts them
            on_answered(rejected)
        for (new_tokens, _), prompts in groups.items():
            for members, width in self._batches(prompts, new_tokens):
                progress = _BatchProgress(len(members), on_answered)
                if self.decoder is not None:
                    self.decoder.on_rows_done = progress.add
                try:
                    generated = self._run(members, width, new_tokens, progress)
                finally:
                    if self.decoder is not None:
                        self.decoder.on_rows_done = None
                for prompt, ids in zip(members, generated):
                    answers[prompt.index] = self._answer_of(prompt, ids)
                progress.add(len(members))  # the rest: the batch is answered
        return answers

    def _sizes(self):
        """(ModelSizes, memory limit in bytes): the static decoder's batch sizing on CUDA (regen/batch_sizing.py),
        the limit from the device memory free now (after the weights). (None, None) elsewhere (the cost model is
        a GPU's: a CPU decode step is bound by compute, not by what it reads) and for a config whose sizes cannot
        be read: batches are then cut by the token budget alone."""
        if self.device.type != "cuda":
            return None, None
        try:
            sizes = ModelSizes.of(self.model, self.config)
        except (AttributeError, TypeError, ValueError) as e:
            log.info("regeneration engine: batches by the token budget only (model sizes unknown: %s)", e)
            return None, None
        return sizes, int(torch.cuda.mem_get_info(self.device)[0] * MEMORY_FRACTION)

    def _batches(self, prompts: list[_Prompt], new_tokens: int) -> list[tuple[list[_Prompt], int]]:
        """[(prompts, padded prompt width)]: longest first, consecutive, each under the budget (the learned one
        too); for the static decoder cut where the decode cost model says (regen/batch_sizing.py: weights read
        per batch against the cache a row reads: its padded width, or from its own column when the decode steps
        attend in row spans) within the budget and device memory. A prompt alone always fits: `_prepare` rejected
        those over the budget."""
        budget = min(self.max_tokens_per_batch, self.token_cap or self.max_tokens_per_batch)
        if self.decoder is not None and self.sizes is not None:
            ordered = sorted(prompts, key=lambda p: (-len(p.ids), p.index))
            sizes = self.sizes if self.decoder.prefill_copies_keys else \
                dataclasses.replace(self.sizes, repeat_bytes_per_token=0)
            cuts = cut_batches([len(p.ids) for p in ordered], new_tokens, lambda n: self._width(n, new_tokens),
                               self.max_batch_size, budget, sizes, self.memory_limit_bytes,
                               span_cost_keys=self.decoder.span_cost_keys_in_use)
            return [(ordered[a:b], self._width(len(ordered[a].ids), new_tokens)) for a, b in cuts]
        batches: list[tuple[list[_Prompt], int]] = []
        for prompt in sorted(prompts, key=lambda p: (-len(p.ids), p.index)):
            if batches:
                members, width = batches[-1]
                if len(members) < self.max_batch_size and (len(members) + 1) * (width + new_tokens) <= budget:
                    members.append(prompt)
                    continue
            batches.append(([prompt], self._width(len(prompt.ids), new_tokens)))
        return batches

    def _width(self, prompt_tokens: int, new_tokens: int) -> int:
        """The padded prompt width of a batch whose longest prompt has `prompt_tokens`: rounded up to the multiple
        (for decode steps on flex attention, further, so that width + new tokens is one of a few key counts an
        octave: regen/attention.py's `flex_key_columns`), never past what the budget leaves beside the new tokens."""
        if self.decoder is not None and self.decoder.flex:
            rounded = flex_key_columns(prompt_tokens + new_tokens) - new_tokens
        else:
            rounded = -(-prompt_tokens // self.length_multiple) * self.length_multiple
        return max(prompt_tokens, min(rounded, self.max_tokens_per_batch - new_tokens))

    def close(self) -> None:
        """Drop the model and give its device memory back."""
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def renderer(self, chat_template_kwargs: dict) -> ChatRenderer:
        """The extraction's renderer for this template and these keyword arguments (made once)."""
        key = json.dumps(chat_template_kwargs, sort_keys=True, default=str)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, self.chat_template, chat_template_kwargs)
        return self._renderers[key]

    def render(self, request: Request) -> list[int]:
        """The prompt's token ids, as the module docstring says. Raises what the template raises."""
        renderer = self.renderer(request.chat_template_kwargs)
        conv = prompt_conversation(request.messages, request.tools)
        return renderer.served_prompt_ids(renderer.template_messages(conv), conv.tools)

    def _prepare(self, index: int, request: Request) -> _Prompt | Answer:
        """The request's prompt, or its rejected Answer."""
        try:
            ids = self.render(request)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, raise_exception, a bad message: this row only
            return Answer(rejected=f"chat template failed: {type(e).__name__}: {' '.join(str(e).split())}")
        n = len(ids)
        if n == 0:  # a template that renders nothing for it: no token to continue from
            return Answer(rejected="the chat template rendered an empty prompt", prompt_tokens=0)
        if request.max_tokens < 1:
            return Answer(rejected=f"max_tokens must be >= 1, got {request.max_tokens}", prompt_tokens=n)
        new_tokens = request.max_tokens
        if self.context_tokens is not None:
            if n >= self.context_tokens:
                return Answer(rejected=f"prompt of {n} tokens does not fit the model's context of "
                                       f"{self.context_tokens} tokens (max_position_embeddings)", prompt_tokens=n)
            new_tokens = min(new_tokens, self.context_tokens - n)
        if n + new_tokens > self.max_tokens_per_batch:
            return Answer(rejected=f"prompt of {n} tokens + {new_tokens} new tokens exceeds the token budget "
                                   f"max_tokens_per_batch={self.max_tokens_per_batch}", prompt_tokens=n)
        return _Prompt(index, request, ids, new_tokens)

    def _run(self, prompts: list[_Prompt], width: int, new_tokens: int,
             progress: _BatchProgress | None = None) -> list[list[int] | None]:
        """Generated ids per prompt (None: out of memory even alone), splitting on out-of-memory errors (the rows
        an attempt that ran out of memory reported are credited against the redone rows' reports: `progress`)."""
        padded = width + new_tokens
        rows = max(1, (self.token_cap or len(prompts) * padded) // padded)  # a batch planned before the last OOM
        todo = [(a, min(a + rows, len(prompts))) for a in range(0, len(prompts), rows)][::-1]  # a stack
        results: list[list[int] | None] = [None] * len(prompts)
        while todo:
            a, b = todo.pop()
            if progress is not None:
                progress.begin_attempt()
            out = self._attempt(prompts[a:b], width, new_tokens)
            if out is not None:
                results[a:b] = out
                continue
            if progress is not None:
                progress.attempt_failed()
            self.num_ooms += 1
            if b - a == 1:
                log.warning("a request of %d prompt tokens + %d new tokens does not fit in memory even alone",
                            len(prompts[a].ids), new_tokens)
                continue
            mid = (a + b + 1) // 2
            if self.token_cap is None or (mid - a) * padded < self.token_cap:
                self.token_cap = (mid - a) * padded
                log.warning("out of memory generating %d x %d tokens: later batches hold at most %d padded tokens",
                            b - a, padded, self.token_cap)
            todo += [(mid, b), (a, mid)]
        return results

    def _attempt(self, prompts: list[_Prompt], width: int, new_tokens: int) -> list[list[int]] | None:
        """One `generate` call on `prompts` left-padded to `width`: the new ids per prompt (padding after the
        stop included), or None after an out-of-memory error (memory freed)."""
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt.ids):] = torch.tensor(prompt.ids)
            attention_mask[row, width - len(prompt.ids):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        processors = _processors(prompts[0].request.sampling, [p.request.seed for p in prompts], attention_mask,
                                 new_tokens)
        try:
            self.num_generate_calls += 1
            with torch.inference_mode():
                return self._generate(input_ids, attention_mask, new_tokens, processors).tolist()
        except RuntimeError as e:
            if not is_oom(e):
                raise
        # Outside the `except` block: the traceback's frames (and the activations they hold) are gone.
        out = processors = None  # noqa: F841
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return None

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                  processors) -> torch.Tensor:
        """The new ids [B, <= new_tokens] of one left-padded batch (padding after a row's stop), by the engine's
        decoder: the static-cache loop (regen/decode.py) or HF `generate`."""
        if self.decoder is not None:
            return self.decoder.generate(input_ids, attention_mask, new_tokens, self.eos_token_ids, processors)
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                                  eos_token_id=self.eos_token_ids or None, pad_token_id=self.pad_token_id)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                  logits_processor=processors)
        return out[:, input_ids.shape[1]:]

    def _answer_of(self, prompt: _Prompt, generated: list[int] | None) -> Answer:
        n = len(prompt.ids)
        if generated is None:
            return Answer(rejected=f"out of memory even alone ({n} prompt tokens + {prompt.new_tokens} new tokens)",
                          prompt_tokens=n)
        stop = next((i for i, t in enumerate(generated) if t in self.eos_token_ids), None)
        completion = generated[:stop + 1] if stop is not None else generated[:prompt.new_tokens]
        text_ids = completion[:-1] if stop is not None else completion
        content, reasoning, tool_calls = self._parse(prompt, completion, text_ids)
        finish = FINISH_LENGTH if stop is None else FINISH_TOOL_CALLS if tool_calls else FINISH_STOP
        return Answer(content=content, reasoning_content=reasoning, tool_calls=tool_calls, finish_reason=finish,
                      prompt_tokens=n, completion_tokens=len(completion), prompt_token_ids=list(prompt.ids),
                      completion_token_ids=[int(t) for t in completion])

    def _parse(self, prompt: _Prompt, completion: list[int], text_ids: list[int]):
        """(content, reasoning_content, tool_calls) of the generated turn (module docstring: which, when)."""
        plain = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        if self.response_template is None:
            return plain, None, None
        try:
            parsed = self._parse_lossless(prompt, completion)
        except Exception as e:  # noqa: BLE001 - a malformed tool call etc.: the text is kept whole
            log.debug("response parser failed (%s): content kept as generated", e)
            parsed = None
        if parsed is None:
            return plain, None, None
        reasoning = next((parsed[f] for f in REASONING_FIELDS if parsed.get(f) is not None), None)
        raw_calls = parsed.get("tool_calls") or []
        calls = [_openai_tool_call(call, prompt.request.seed, i) for i, call in enumerate(raw_calls)]
        content = parsed.get("content")
        if not content and calls:
            content = None
        elif content is None:
            content = ""
        return content, reasoning, calls or None

    def _parse_lossless(self, prompt: _Prompt, completion: list[int]) -> dict | None:
        """The response parser's message for the generated ids (decoded with their special tokens, the prompt as
        its prefix), or None where it would lose text: a field that does not repeat written twice (transformers'
        parser keeps the last, e.g. text after an end-of-turn marker that is not a stop id), or a tool call the
        text leaves open (a turn cut by max_tokens)."""
        parser = self.tokenizer.get_response_parser(self.response_template, prefix=self.tokenizer.decode(prompt.ids),
                                                    tools=prompt.request.tools)
        events = list(parser.initial_events) + list(parser.feed(self.tokenizer.decode(completion)))
        message, final_events = parser.finalize()
        fields = self.response_template.get("fields", {})
        closed: dict[str, int] = {}
        for event in events + list(final_events):
            if event["type"] == "region_close" and event.get("value") not in (None, ""):
                closed[event["field"]] = closed.get(event["field"], 0) + 1
        if any(n > 1 and not fields.get(f, {}).get("repeats", False) for f, n in closed.items()):
            return None
        if any(e["type"] == "region_close" and e["field"] == "tool_calls" for e in final_events):
            return None
        return message


DECODERS = ("static", "generate")


class _BatchProgress:
    """One batch's answered count for `on_answered`, each row counted once: reports pass on, capped at the batch's
    size. The rows an attempt reported before it ran out of memory are redone by the sub-batches of its split, which
    report them again: those reports pay back that credit first and are not passed on (a bar shows them once)."""

    def __init__(self, size: int, on_answered):
        self.size, self.reported, self.on_answered = size, 0, on_answered
        self.in_attempt = 0  # passed on during the attempt running now
        self.credit = 0  # passed on by attempts that then ran out of memory, not yet reported again

    def begin_attempt(self) -> None:
        self.in_attempt = 0

    def attempt_failed(self) -> None:
        self.credit += self.in_attempt
        self.in_attempt = 0

    def add(self, n: int) -> None:
        paid = min(n, self.credit)
        self.credit -= paid
        self.in_attempt += paid  # still this attempt's rows, should it fail too
        n = min(n - paid, self.size - self.reported)
        if n > 0 and self.on_answered is not None:
            self.reported += n
            self.in_attempt += n
            self.on_answered(n)


def decode_path(config, decoder: StaticCacheDecoder | None, device=None) -> str:
    """Which path decodes, in words (logged once, in the benchmark's report): the loop, and for the Gated DeltaNet
    hybrid which recurrence kernel transformers' Qwen3.5 layers run (flash-linear-attention's when importable, as
    transformers picks it, else its torch fallback)."""
    import importlib.util

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    loop = "HF generate (dynamic cache)" if decoder is None else decoder.path
    family = getattr(text, "model_type", "?")
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        if importlib.util.find_spec("fla"):
            kernel = "flash-linear-attention's fused_recurrent_gated_delta_rule"
        elif device is not None and torch.device(device).type != "cuda":  # the kernels need a GPU
            kernel = "transformers' torch recurrence (the CPU path)"
        else:
            kernel = "transformers' torch fallback (slow: the `gpu` extra installs flash-linear-attention)"
        return f"{family}: {loop}; Gated DeltaNet decode on {kernel}"
    return f"{family}: {loop}"


def _eos_ids(generation_config, tokenizer) -> list[int]:
    """The end-of-sequence ids of the model's generation config and of the tokenizer, sorted, without repeats."""
    ids = generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if isinstance(tokenizer.eos_token_id, int):
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))


def _openai_tool_call(call: dict, seed: int, position: int) -> dict:
    """A parsed call ({"type": "function", "function": {"name", "arguments"}}) in the OpenAI form, with an id that
    a re-run of the same request gives again."""
    function = call.get("function") or {}
    name = str(function.get("name", ""))
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    digest = hashlib.sha256(f"{seed}:{position}:{name}".encode()).hexdigest()[:24]
    return {"id": f"call_{digest}", "type": "function", "function": {"name": name, "arguments": arguments}}


def _processors(sampling: dict, seeds: list[int], attention_mask: torch.Tensor, new_tokens: int):
    """The logits processors of a batch: the repetition penalty (padding not counted), then for sampling the
    warpers and the per-row seeded draw (greedy decoding's argmax then picks the drawn token)."""
    processors = LogitsProcessorList()
    penalty = float(sampling.get("repetition_penalty", 1.0))
    if penalty != 1.0:
        processors.append(PaddedRepetitionPenalty(penalty, attention_mask))
    if is_greedy(sampling):
        return processors
    temperature = float(sampling.get("temperature", 1.0))
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    top_k = int(sampling.get("top_k") or 0)
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    top_p = sampling.get("top_p")
    if top_p is not None and float(top_p) < 1.0:
        processors.append(TopPLogitsWarper(float(top_p)))
    min_p = float(sampling.get("min_p") or 0.0)
    if min_p > 0.0:
        processors.append(MinPLogitsWarper(min_p))
    processors.append(SeededRowSampler(seeds, new_tokens, attention_mask.shape[1], attention_mask.device))
    return processors


class PaddedRepetitionPenalty(LogitsProcessor):
    """transformers' RepetitionPenaltyLogitsProcessor over each row's real tokens: a left-padding position is given
    the row's first real token (already counted: the penalty is per distinct token), so the padding id is not
    penalized in padded rows only."""

    def __init__(self, penalty: float, attention_mask: torch.Tensor):
        self.inner = RepetitionPenaltyLogitsProcessor(penalty)
        self.real = attention_mask.bool()  # [B, W] of the prompt
        self.first_real = attention_mask.argmax(dim=1, keepdim=True)  # [B, 1]: left padding

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        width = self.real.shape[1]
        prompt = input_ids[:, :width]
        filled = torch.where(self.real, prompt, prompt.gather(1, self.first_real).expand_as(prompt))
        return self.inner(torch.cat([filled, input_ids[:, width:]], dim=1), scores)


class SeededRowSampler(LogitsProcessor):
    """Draws each row's next token from its own random stream (module docstring: the guarantee) and returns scores
    that are -inf everywhere but at the drawn token, so greedy decoding's argmax emits it.

    seeds: one per row; new_tokens: steps at most; prompt_width: the padded prompt's length (step = generated so
    far). The uniforms, [B, new_tokens] float64, are drawn on the CPU at construction and moved to `device` once.
    """

    def __init__(self, seeds: list[int], new_tokens: int, prompt_width: int, device: torch.device):
        rows = [torch.rand(new_tokens, generator=torch.Generator().manual_seed(int(s) % 2**64), dtype=torch.float64)
                for s in seeds]
        self.uniforms = torch.stack(rows).to(device)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        probs = torch.softmax(scores.float(), dim=-1)  # -inf (filtered) -> exactly 0
        cdf = probs.double().cumsum(dim=-1)  # float64: interval edges exact to ~1e-16, whatever the vocabulary
        target = self.uniforms[:, step:step + 1] * cdf[:, -1:]
        token = torch.searchsorted(cdf, target, right=True).clamp_(max=scores.shape[-1] - 1)
        # An interval of width 0 cannot hold the target unless the scan rounded: never emit a filtered token.
        ok = probs.gather(1, token) > 0
        token = torch.where(ok, token, probs.argmax(dim=-1, keepdim=True))
        drawn = torch.full_like(scores, float("-inf"))
        return drawn.scatter_(1, token, 0.0)

"""Load the frozen target: tokenizer, config, model (pretrained weights, or random weights from a config)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from dflash_prep.recipe.fingerprints import WEIGHT_SUFFIXES, weight_files
from dflash_prep.recipe.schema import ModelSection, RecipeError
from dflash_prep.target.fp8_weights import block_fp8_format, from_pretrained_kwargs, install_scaled_mm
from dflash_prep.target.layers import decoder_layers, find_decoder
from dflash_prep.target.moe import apply_moe_experts
from dflash_prep.target.sources import check_model_source, config_source, tokenizer_source
from dflash_prep.target.norms import randomize_norm_gains

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Storage dtypes (`output.dtype`): fp8_e4m3 is float8 e4m3 + per-token fp32 scales (dflash_prep/target/fp8.py).
STORAGE_TORCH_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}


def load_tokenizer(section: ModelSection):
    from transformers import AutoTokenizer

    source, key = tokenizer_source(section)
    check_model_source(source, key)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=section.trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"recipe key `{key}` = {source!r}: cannot load a tokenizer ({e})") from None


def load_config(section: ModelSection):
    """The model's config (no weights): used to resolve layer ids and validate before loading weights."""
    from transformers import AutoConfig

    source, key = config_source(section)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: configs are not validated on load
        StrictDataclassError = ValueError  # noqa: N806
    check_model_source(source, key)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=section.trust_remote_code)
    except (OSError, ValueError, TypeError, StrictDataclassError) as e:  # TypeError, StrictDataclassError: a value
        why = " ".join(str(e).split())  # transformers' config validation rejects (one line)
        raise RecipeError(f"recipe key `{key}` = {source!r}: cannot load a model config ({why})") from None
    try:
        block_fp8_format(config)  # a quantization format we cannot run: refused before anything is loaded
    except RecipeError as e:
        raise RecipeError(f"recipe key `{key}` = {source!r}: {e}") from None
    return config


def check_weight_files(section: ModelSection) -> None:
    """A local model folder must hold the weights `from_pretrained` will read: RecipeError (exit code 2, before the
    output is claimed) naming `model.name_or_path` when it holds no weight file (a config without its weights: a
    download or a copy that did not finish), or when its index (`*.index.json`) lists files that are missing."""
    if section.config is not None or not section.name_or_path:
        return
    folder = Path(section.name_or_path).expanduser()
    if not folder.is_dir():
        return  # a hub id: its files are fetched or found in the hub cache by from_pretrained
    found = weight_files(folder)
    key = f"recipe key `model.name_or_path` = {section.name_or_path!r}"
    if not found:
        raise RecipeError(f"{key}: the folder holds no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)});"
                          f" a download or copy that did not finish? (random weights: set `model.config` instead)")
    for index in sorted(folder.glob("*.index.json")):
        try:
            listed = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            raise RecipeError(f"{key}: {index.name} is not a readable weight index") from None
        missing = sorted(name for name in listed if not (folder / name).is_file())
        if missing:
            raise RecipeError(f"{key}: {index.name} lists {len(missing)} weight file(s) that are not in the folder "
                              f"({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})")


_SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")


def context_length(config) -> tuple[int | None, str]:
    """(positions the model was trained for, how that was found), or (None, why not known). Source: the (text)
    config's `max_position_embeddings`, or, with RoPE scaling (`rope_parameters`, formerly `rope_scaling`; a dict per
    layer type counts its largest), `factor` x `original_max_position_embeddings` (x `max_position_embeddings` when
    the config has no original) when that is larger: transformers' convention for linear, dynamic, YaRN, llama3 and
    longrope scaling (Qwen's YaRN configs keep max_position_embeddings at the original, Llama 3.1's raise it)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = getattr(text, "max_position_embeddings", None)
    if not isinstance(base, int) or isinstance(base, bool) or base <= 0:
        return None, "the config has no max_position_embeddings"
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if not isinstance(params, dict):
        params = {}
    per_layer_type = all(isinstance(v, dict) for v in params.values()) and params
    best, how = base, f"max_position_embeddings {base}"
    for rope in (params.values() if per_layer_type else [params]):
        kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
        if kind not in _SCALED_ROPE_TYPES or not isinstance(factor, (int, float)) or not factor > 1:
            continue
        original = rope.get("original_max_position_embeddings") or base
        if int(factor * original) > best:
            best, how = int(factor * original), f"{kind} RoPE scaling: factor {factor:g} x {original} positions"
    return best, how


def check_context(recipe, config) -> int | None:
    """`data.max_length` against the model's context (`context_length`); -> the context, None when unknown.

    Refused (RecipeError, exit code 2, at start-up), unless `data.allow_beyond_context`: rows longer than the
    context would be extracted at positions the target was never trained on (its states there are not what it
    computes when served: a server refuses such a prompt), silently. With the key, a warning here; the extraction
    then counts the rows past the context."""
    context, how = context_length(config)
    data = recipe.data
    if context is None or data.max_length <= context:
        return context
    if not data.allow_beyond_context:
        raise RecipeError(
            f"recipe key `data.max_length` = {data.max_length}: longer than the model's context of {context} "
            f"positions ({how}); rows past it would be extracted at positions the model was not trained on, "
            f"silently. Set data.max_length to at most {context} (longer rows are then truncated or skipped, "
            f"`data.overlong`), or set data.allow_beyond_context: true to extract them anyway")
    log.warning("data.max_length %d is longer than the model's context of %d positions (%s); "
                "data.allow_beyond_context: rows past it are extracted and counted", data.max_length, context, how)
    return context


def model_fingerprint(section: ModelSection, config, portable: bool = False) -> str:
    """sha256 of the config and where the weights come from (path or random seed).

    The config's own `_name_or_path` (the folder or file it was read from) is left out: the same config read
    from another checkout is the same model. Random weights of a replica of several GPUs are drawn module by module
    (load_replica_model: the same for every replica layout), so they are another model than the same seed's on one
    GPU. `portable`: a local folder's weights count as `local` (their content is the job identity's `weights`),
    so the model stays the same when its folder moves; without it (the form of earlier versions), the folder's
    path is part of the fingerprint.
    """
    def without_source(d):
        return {k: without_source(v) if isinstance(v, dict) else v for k, v in d.items() if k != "_name_or_path"}

    weights = section.name_or_path or f"random:{section.init_seed}"
    if portable and section.name_or_path is not None and Path(os.path.expanduser(section.name_or_path)).is_dir():
        weights = "local"
    if section.name_or_path is None and section.gpus_per_replica > 1:
        weights += ":per-module"  # load_replica_model: drawn module by module, other weights than one GPU's
    payload = {"config": without_source(config.to_dict()), "weights": weights,
               "dtype": section.dtype}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's vocabulary size, chat template and backend (vocab, merges, normalizers)."""
    payload = json.dumps({"vocab": len(tokenizer), "template": getattr(tokenizer, "chat_template", None),
                          "backend": tokenizer.backend_tokenizer.to_str()
                          if hasattr(tokenizer, "backend_tokenizer") else None}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def vocab_size_of(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def padding_token_id(tokenizer, vocab_size: int) -> int:
    """An id to pad batches with that the embedding table holds (0 <= id < vocab_size). Padding is never stored and
    never attended to by real tokens, so any such id gives the same states; the tokenizer's pad token is used when
    it is inside the table, else its eos token, else 0 (a pad token added to a tokenizer past the model's
    embedding rows would make the embedding lookup fail)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(token_id, int) and 0 <= token_id < vocab_size:
            return token_id
    return 0


def hidden_size_of(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def load_model(section: ModelSection, config, device: torch.device) -> nn.Module:
    """The CausalLM in eval mode, frozen, on `device`, in the recipe's compute dtype.

    A block-FP8 checkpoint (fp8_weights.py) runs its linear layers as FP8 on torch scaled_mm on a GPU that has the
    GEMM, dequantized elsewhere or with `model.fp8_weights: dequantize`; the log says which, once. The routed
    experts of an MoE run as `model.moe_experts` picks (moe.py; said in the log).

    Random weights (`model.config`) are drawn on `device` with `init_seed`, so every rank of a run builds the
    same model; their norm gains are drawn too (norms.randomize_norm_gains), not left at unit gain.
    """
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[section.dtype]
    kwargs = dict(dtype=dtype, attn_implementation=section.attn_implementation,
                  trust_remote_code=section.trust_remote_code)
    if section.config is not None:
        torch.manual_seed(section.init_seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        randomize_norm_gains(model, section.init_seed)  # unit gains would hide a before/after-norm mix-up
    else:
        kwargs.update(from_pretrained_kwargs(config, section.fp8_weights, device))
        model = AutoModelForCausalLM.from_pretrained(section.name_or_path, device_map={"": device}, **kwargs)
        said = install_scaled_mm(model, config, section.fp8_weights, device)
        if said:
            log.info("%s", said)
    said = apply_moe_experts(model, section.moe_experts, device.type, section.dtype)
    if said:
        log.info("%s", said)
    model.eval().requires_grad_(False)
    return model


def drop_layers_after(model: nn.Module, last_needed_layer: int) -> int:
    """Remove decoder layers after `last_needed_layer` (their outputs are never stored) to free their memory.

    Returns the number of layers kept. The forward stops at the last captured module anyway (see capture.py);
    this only gives the memory back.
    """
    decoder = find_decoder(model)
    layers = decoder_layers(decoder)
    keep = last_needed_layer + 1
    if keep < len(layers):
        decoder.layers = nn.ModuleList(list(layers)[:keep])
    return min(keep, len(layers))


def decoder_params_in(model: nn.Module, num_layers: int | None = None, active: bool = False) -> int:
    """Parameters of the first `num_layers` decoder layers (all when None): the weights they hold, or with
    `active` those a token runs through (`active_params`: routed experts at num_experts_per_tok / num_experts;
    the same count for a dense model), the count FLOPs per token and MFU are 2 x of."""
    layers = decoder_layers(find_decoder(model))
    chosen = list(layers)[: num_layers if num_layers is not None else len(layers)]
    top_k = experts_per_token(model.config) if active else None
    return sum(active_params(layer, top_k) for layer in chosen)


def experts_per_token(config) -> int | None:
    """The routed experts each token runs through (`num_experts_per_tok`), None for a dense model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    k = getattr(text, "num_experts_per_tok", None)
    return int(k) if isinstance(k, int) and k > 0 else None


def active_params(module: nn.Module, top_k: int | None) -> int:
    """Parameters of `module` one token runs through: all of them, except routed experts, of which a token runs
    `top_k` (`num_experts_per_tok`) of E: the parameters of an experts module (a class whose name ends in `Experts`,
    transformers' fused [E, ...] expert weights, or a ModuleList named `experts`) count top_k / E. Shared experts,
    routers and everything else count fully. `top_k` None: all parameters."""
    if not top_k:
        return _held_params(module)
    total = _own_params(module)
    for name, child in module.named_children():
        E = _num_routed_experts(name, child)
        if E:
            total += _held_params(child) * min(top_k, E) // E
        else:
            total += active_params(child, top_k)
    return total


def _held_params(module: nn.Module) -> int:
    """Every parameter under `module` once (a tied one counted once), and the weights its quantized layers hold
    as buffers (`_buffer_weights`)."""
    return sum(p.numel() for p in module.parameters()) + sum(_buffer_weights(m) for m in module.modules())


def _own_params(module: nn.Module) -> int:
    """The module's own parameters and the weights it holds as buffers (`_buffer_weights`)."""
    return sum(p.numel() for p in module.parameters(recurse=False)) + _buffer_weights(module)


def _buffer_weights(module: nn.Module) -> int:
    """The weights a quantized layer holds as buffers, not parameters, that a token runs through all the same
    (fp8_weights.BlockFP8Linear: `weights_in_buffers`, its unpadded weight and bias); 0 for any other module."""
    held = getattr(module, "weights_in_buffers", None)
    return held() if callable(held) else 0


def _num_routed_experts(name: str, module: nn.Module) -> int | None:
    if type(module).__name__.endswith("Experts"):
        E = getattr(module, "num_experts", None)
        if not isinstance(E, int):
            first = next(module.parameters(), None)
            E = first.shape[0] if first is not None and first.ndim == 3 else None
        return E
    if name == "experts" and isinstance(module, nn.ModuleList):
        return len(module)
    return None


def decoder_params_run(section: ModelSection, config, last_needed_layer: int) -> int | None:
    """Parameters of the decoder layers the extraction runs that a token runs through (`active_params`: for an
    MoE, num_experts_per_tok / num_experts of the routed experts' weights, shared experts fully; for a dense model
    all of them), counted on a meta-device model (no memory); the FLOPs per token are 2 x this. None when the
    architecture cannot be built that way (then only a benchmark of the same model gives a figure)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=section.trust_remote_code)
        kept = drop_layers_after(model, last_needed_layer)
        top_k = experts_per_token(config)
        return sum(active_params(layer, top_k) for layer in list(decoder_layers(find_decoder(model)))[:kept])
    except Exception:  # noqa: BLE001 - remote code or an unusual class: the figures go on without the count
        return None


def describe_source(section: ModelSection) -> str:
    if section.config:
        return f"random weights from {Path(section.config).name} (seed {section.init_seed})"
    return str(section.name_or_path)


def load_replica_model(section: ModelSection, config, layout) -> nn.Module:
    """The CausalLM spread over a replica's GPUs (`model.gpus_per_replica` > 1; replica.py says how), eval mode,
    frozen, in the recipe's compute dtype. Tensor parallel: every process of the replica holds its shards (DTensor
    parameters) on its own GPU; layer split: this process holds the layers spread over the replica's GPUs.

    Random weights (`model.config`) are never drawn on the host (a 70B target is 141 GB in bf16): transformers
    builds the model on the meta device and materializes each parameter (or its shard) on its GPU, then
    `draw_random_weights` draws them per module from `init_seed`, so every layout (tensor parallel of any N, a
    layer split, verify's rebuild) holds the same weights; they differ from a `gpus_per_replica: 1` run's
    (drawn in one pass over the model: `load_model`)."""
    from dflash_prep.target.replica import TENSOR_PARALLEL, load_arguments

    free_bytes = 0  # tensor parallel places by process (each its own GPU), over CPU processes in the tests
    if layout.parallelism != TENSOR_PARALLEL:  # (asking another GPU would open a CUDA context on it)
        free_bytes = min(torch.cuda.mem_get_info(gpu)[0] for gpu in layout.gpu_ids)
    placement = load_arguments(layout, int(0.9 * free_bytes))
    kwargs = dict(dtype=DTYPES[section.dtype], attn_implementation=section.attn_implementation,
                  trust_remote_code=section.trust_remote_code)
    if block_fp8_format(config) is not None and section.fp8_weights != "dequantize":
        raise RecipeError("recipe key `model.gpus_per_replica` > 1: an FP8 checkpoint runs as FP8 on one GPU per "
                          "replica only; set model.fp8_weights: dequantize to split it dequantized")
    if section.config is not None:
        model = build_random_model(section, config, placement)
    else:
        kwargs.update(from_pretrained_kwargs(config, "dequantize", torch.device("cpu")))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(section.name_or_path, **placement, **kwargs)
    if layout.parallelism != TENSOR_PARALLEL:
        log.info("layer split over GPUs %s: layers on %s", list(layout.gpu_ids),
                 sorted(set(map(str, model.hf_device_map.values()))))
    model.eval().requires_grad_(False)
    return model


def build_random_model(section: ModelSection, config, placement: dict) -> nn.Module:
    """Random weights (`model.config`, `init_seed`) as a replica holds them, placed by `placement` (from_pretrained
    keywords: replica.load_arguments, or `{"device_map": {"": device}}` for one device): built on the meta device,
    each parameter (or tensor-parallel shard) materialized where it lives, drawn per module
    (`draw_random_weights`), norm gains drawn (norms.randomize_norm_gains). Eval mode, frozen."""
    kwargs = dict(dtype=DTYPES[section.dtype], attn_implementation=section.attn_implementation,
                  trust_remote_code=section.trust_remote_code)
    torch.manual_seed(section.init_seed)  # transformers' first init pass (drawn again below) is seeded too
    model = _causal_lm_class(config).from_pretrained(None, config=config, state_dict={}, **placement, **kwargs)
    draw_random_weights(model, section.init_seed)
    randomize_norm_gains(model, section.init_seed)
    return model.eval().requires_grad_(False)


def _causal_lm_class(config):
    """The CausalLM class transformers' Auto mapping picks for `config` (its `from_pretrained` accepts no path
    with a config and an empty state dict: every parameter is then missing and initialized where it lives)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.auto_factory import _get_model_class

    return _get_model_class(config, AutoModelForCausalLM._model_mapping)


def _module_seed(seed: int, module_name: str) -> int:
    """A 63-bit seed for one module's draws, from the run's seed and the module's name (stable across processes,
    unlike Python's salted hash)."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def draw_random_weights(model: nn.Module, seed: int) -> int:
    """Draw every parameter of `model` again, module by module, with transformers' own initialization for the
    architecture (`_init_weights`), the RNG seeded from (`seed`, module name) before each module; -> modules drawn.

    The draws do not depend on where the module lives: a tensor-parallel shard (a DTensor parameter) is cut from
    the whole parameter drawn on this process's device (`distribute_tensor(..., src_data_rank=None)`: every process
    draws the same whole tensor, no communication), so a tensor-parallel replica of any size, a layer split and a
    single device hold the same weights (same device type: CUDA's random streams differ from the CPU's).
    Norm gains come out at unit gain; `norms.randomize_norm_gains` draws them next."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    drawn = 0
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        whole = {}
        for param_name, param in own:  # a fresh tensor: transformers' init skips those marked initialized
            shape = param.shape  # a DTensor's shape is the whole parameter's
            local = param.to_local() if isinstance(param, DTensor) else param
            whole[param_name] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=local.device),
                                             requires_grad=False)
        originals = dict(own)
        module._parameters.update(whole)
        torch.manual_seed(_module_seed(seed, name))
        try:
            model._init_weights(module)
        finally:
            module._parameters.update(originals)
        with torch.no_grad():
            for param_name, param in originals.items():
                value = whole[param_name].data
                if isinstance(param, DTensor):
                    value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
                    param.to_local().copy_(value)
                else:
                    param.copy_(value)
        drawn += 1
    return drawn

"""The sampling parameters of a regeneration: the model's own generation_config.json, then the recipe's overrides.

A target is served with the sampling its authors recommend (Qwen3: temperature 0.6, top_p 0.95, top_k 20, in its
generation_config.json), and a drafter should learn the text the target writes that way. So the defaults are read
from the model's `generation_config.json` (transformers' `GenerationConfig`, which reads it), translated to the
OpenAI / vLLM names the engines speak, and `regenerate.sampling` overrides them key by key.

The result is `{}` for greedy decoding (the config does not set `do_sample`, or the temperature is 0: the contract
of engine.Request) and otherwise a dict that always holds `temperature`, plus the other parameters the config or
the recipe set to a value that changes anything (top_k 0 and top_p 1.0 are dropped: they are off).
"""

from __future__ import annotations

import logging
from pathlib import Path

from dflash_prep.recipe.schema import SAMPLING_KEYS, RecipeError, RegenerateSection

log = logging.getLogger("dflash_prep")

# transformers' GenerationConfig attribute -> the OpenAI / vLLM name; all but temperature are off at these values.
_FROM_GENERATION_CONFIG = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty"}
_NEUTRAL = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0}


def generation_config_source(section: RegenerateSection, model_path: str | None) -> str | None:
    """The generation_config.json (or the folder holding one) the defaults come from: `regenerate.generation_config`,
    else the model's own folder or hub id (`model.name_or_path`), else None."""
    return section.generation_config or model_path


def read_generation_defaults(source: str | None) -> tuple[dict, str]:
    """-> (sampling defaults by OpenAI names, `{}` for greedy; where they came from, in words).

    `source`: a generation_config.json file, a folder holding one, or a hub id (read through transformers' cache).
    Raises RecipeError naming `regenerate.generation_config` when a file given there cannot be read."""
    from transformers import GenerationConfig

    if source is None:
        return {}, "no generation_config.json (greedy unless regenerate.sampling says otherwise)"
    path = Path(source)
    try:
        if path.is_file():
            config = GenerationConfig.from_pretrained(str(path.parent), config_file_name=path.name)
        else:
            config = GenerationConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        if path.is_file():
            raise RecipeError(f"recipe key `regenerate.generation_config` = {source!r}: cannot read it as a "
                              f"generation config ({type(e).__name__}: {str(e)[:160]})") from None
        return {}, f"no generation_config.json in {source} (greedy unless regenerate.sampling says otherwise)"
    if not getattr(config, "do_sample", False):
        return {}, f"{source}: greedy (do_sample is not set)"
    defaults = {}
    for attr, name in _FROM_GENERATION_CONFIG.items():
        value = getattr(config, attr, None)
        if value is not None:
            defaults[name] = value
    return defaults, f"{source}: generation_config.json"


def resolve_sampling(defaults: dict, overrides: dict) -> dict:
    """`defaults` (read_generation_defaults) with `overrides` (`regenerate.sampling`) on top -> the request's
    sampling dict: `{}` for greedy (the result's temperature is 0, or neither sets anything: the config's greedy
    default), else temperature (1.0 when unset) and every other parameter not at its neutral value."""
    merged = {**defaults, **overrides}
    if not merged or float(merged.get("temperature", 1.0)) == 0.0:
        return {}
    out = {"temperature": float(merged.get("temperature", 1.0))}
    for key in SAMPLING_KEYS:
        if key == "temperature" or key not in merged:
            continue
        value = merged[key]
        if value is None or value == _NEUTRAL.get(key) or (key == "top_k" and value < 0):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    return out

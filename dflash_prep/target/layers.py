"""Layer-id rules and decoder-layer discovery.

This project speaks one convention: *after-layer, 0-based* ids. Id i is the output of decoder layer i, which
equals HF `outputs.hidden_states[i + 1]` (index 0 there is the embeddings). SGLang, vLLM and speculators use
*before-layer* ids (after-layer id + 1); convert with `to_before_layer_ids` when exporting.

Ids run from 0 to L-2 for a model of L decoder layers. Id L-1 (the last layer) is refused: its output is not
HF's `hidden_states[L]` (transformers 5 puts the final norm's output there), and vLLM's before-layer id L names
the output BEFORE the norm, so either reading of it would be wrong for some consumer. The last layer is stored
with `layers.capture_final` instead, which says which one: `before_norm` or `after_norm` (= `hidden_states[L]`).
"""

from __future__ import annotations

from torch import nn

from dflash_prep.recipe.schema import LayersSection, RecipeError


def dflash_layer_ids(num_hidden_layers: int, num_target_layers: int) -> list[int]:
    """The DFlash rule (z-lab, SpecForge, Model-Optimizer): k ids spread from 1 to L-3, or [L//2] for k == 1.

    >>> dflash_layer_ids(64, 5)
    [1, 16, 31, 46, 61]
    """
    L, k = num_hidden_layers, num_target_layers
    if k < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {k}")
    if k == 1:
        return [L // 2]
    if L < 5:
        raise ValueError(f"the DFlash rule needs at least 5 decoder layers for k > 1, the model has {L}")
    # Python's round() is banker's rounding; the reference implementations use it too.
    ids = _dflash_rule(L, k)
    if len(set(ids)) != k:
        most = max(n for n in range(1, k) if n == 1 or len(set(_dflash_rule(L, n))) == n)
        raise ValueError(f"{k} DFlash layers do not fit in {L} decoder layers (the rule's ids would collide): "
                         f"at most {most} for this model")
    return ids


def _dflash_rule(L: int, k: int) -> list[int]:
    """k > 1 ids spread from 1 to L-3, as DFlash's own `build_target_layer_ids` picks them (round half to
    even, as Python's round), before any check."""
    return [round(1 + j * (L - 4) / (k - 1)) for j in range(k)]


def _eagle3_rule(L: int) -> list[int]:
    return [1, L // 2 - 1, L - 4]


def _eagle3_valid(ids: list[int], L: int) -> bool:
    return ids == sorted(set(ids)) and ids[0] >= 0 and ids[-1] <= L - 2


# The smallest depth whose EAGLE-3 ids are distinct, ascending and valid: L = 6 gives [1, 2, 2], L = 7 [1, 2, 3]
# (1 < L//2 - 1 needs L >= 6; L//2 - 1 < L - 4 needs L >= 7). Found by the same test the rule is checked with.
EAGLE3_MIN_LAYERS = next(L for L in range(1, 64) if _eagle3_valid(_eagle3_rule(L), L))


def eagle3_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers as after-layer ids: [1, L//2 - 1, L - 4] (HF tuple [2, L//2, L-3]).

    Raises ValueError for a model shallower than `EAGLE3_MIN_LAYERS` (7), where the three ids collide."""
    L = num_hidden_layers
    ids = _eagle3_rule(L)
    if not _eagle3_valid(ids, L):
        raise ValueError(f"EAGLE-3 needs at least {EAGLE3_MIN_LAYERS} decoder layers (its ids [1, L//2-1, L-4] must "
                         f"be distinct and ascending; {L} layers give {ids}), the model has {L}")
    return ids


def to_before_layer_ids(after_layer_ids: list[int]) -> list[int]:
    """Convert to the SGLang/vLLM/speculators convention (id = after-layer id + 1)."""
    return [i + 1 for i in after_layer_ids]


def resolve_layer_ids(section: LayersSection, num_hidden_layers: int) -> list[int]:
    """The after-layer ids a recipe asks for, checked against the model's depth.

    Raises RecipeError naming the key for an id out of 0..L-1, and for id L-1 (the last decoder layer: see the
    module docstring; `layers.capture_final` stores it)."""
    try:
        if section.preset == "dflash":
            ids = dflash_layer_ids(num_hidden_layers, section.num_layers)
        elif section.preset == "eagle3":
            ids = eagle3_layer_ids(num_hidden_layers)
        else:
            ids = list(section.ids or [])
    except ValueError as e:
        key, value = ("layers.num_layers", section.num_layers) if section.preset == "dflash" else \
            ("layers.preset", section.preset)
        raise RecipeError(f"recipe key `{key}` = {value!r}: {e}") from None
    bad = [i for i in ids if not 0 <= i < num_hidden_layers]
    if bad:
        raise RecipeError(f"recipe key `layers.ids` = {ids}: ids {bad} out of range; the model has "
                          f"{num_hidden_layers} decoder layers, so after-layer ids are 0..{num_hidden_layers - 2} "
                          f"(the last layer is `layers.capture_final`)")
    last = num_hidden_layers - 1
    if last in ids:
        key = "layers.ids" if section.preset == "explicit" else "layers.preset"
        raise RecipeError(
            f"recipe key `{key}` gives ids {ids}: id {last} is the last decoder layer, whose output HF's "
            f"hidden_states[{num_hidden_layers}] holds AFTER the final norm; store it with `layers.capture_final: "
            f"before_norm` (the layer's own output, vLLM/speculators' final layer) or `after_norm` "
            f"(= hidden_states[{num_hidden_layers}]) and list ids 0..{last - 1} only")
    return ids


def num_decoder_layers(config) -> int:
    """Decoder depth from a (possibly multimodal) transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def find_decoder(model: nn.Module) -> nn.Module:
    """The base decoder (embeddings + layers + final norm, no lm_head) of a CausalLM or VLM model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if not hasattr(decoder, "layers"):
        # Some wrappers return an inner model whose text part sits one level deeper.
        for name in ("language_model", "text_model", "model"):
            inner = getattr(decoder, name, None)
            if inner is not None and hasattr(inner, "layers"):
                return inner
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__}: no `.layers` on "
                        f"{type(decoder).__name__}")
    return decoder


def decoder_layers(decoder: nn.Module) -> nn.ModuleList:
    layers = decoder.layers
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(decoder).__name__}.layers is {type(layers).__name__}, expected nn.ModuleList")
    return layers

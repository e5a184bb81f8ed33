"""RMSNorm facts: the target's final norm stored with the output, and non-trivial norm gains for random weights.

Final norm. speculators wants the final layer BEFORE the final norm, Model-Optimizer and SpecForge's EAGLE-3
AFTER it. An extraction with `layers.capture_final: before_norm` stores the final norm's parameters in
`OUT/final_norm.safetensors` (tensor `weight` float32 [H]; metadata `form` and `eps`) so a reader or an export
can produce the after-norm states from the same shards (`apply_final_norm`), instead of a second extraction.

The norm's form is found by probing the loaded module, not from a table of families: both RMSNorm forms in use
share `x_hat = x / sqrt(mean(x^2) + eps)` (mean over the last dim, in float32) and differ in the gain:
- `weight`: `x_hat * w` (Llama, Qwen2/3, Mistral, ...);
- `one_plus_weight`: `x_hat * (1 + w)` (Gemma, Qwen3.5/3.6: weights stored zero-centred).
A module that matches neither (a LayerNorm with a bias, a norm without eps) is reported as unsupported and the
conversion is refused at read time rather than approximated.

Random weights. transformers initialises norm gains to exactly 1 (`weight` form) or 0 (`one_plus_weight`),
i.e. unit gain, so a random-weight model's states before and after a norm differ little and a mix-up of the
two conventions goes unseen. `randomize_norm_gains` draws every norm gain from 1 + N(0, 0.25^2) (stored as
w or w - 1 by form), seeded, so the demo, the tests and the benchmark's random models have real norms.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash_prep.recipe.location import as_location

FINAL_NORM_NAME = "final_norm.safetensors"
FORMS = ("weight", "one_plus_weight")
NORM_GAIN_STD = 0.25


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon of an RMSNorm module (`variance_epsilon` in Llama-style code, `eps` in Gemma-style), or None."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """A module whose class name says norm and that holds a 1-D `weight` (its gain) and an epsilon."""
    weight = getattr(module, "weight", None)
    return ("norm" in type(module).__name__.lower() and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and norm_eps(module) is not None)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def describe_final_norm(norm: nn.Module) -> dict:
    """-> {"form": one of FORMS or "unsupported", "eps": float | None, "weight": float32 [H] tensor | None}.

    The form is the one whose formula reproduces the module's own output on a float32 probe (relative error
    < 1e-5): transformers' norms upcast to float32, so both forms agree with their module to float32 rounding.
    """
    eps = norm_eps(norm)
    if not is_rms_norm(norm):
        return {"form": "unsupported", "eps": eps, "weight": None}
    weight = norm.weight.detach().float().cpu()
    probe = torch.randn(8, weight.shape[0], generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            reference = _run_in_float32(norm, probe)
    except (TypeError, RuntimeError):  # e.g. a gated norm's forward takes a second input
        return {"form": "unsupported", "eps": eps, "weight": None}
    x_hat = rms_normalize(probe, eps)
    for form, gain in (("weight", weight), ("one_plus_weight", 1.0 + weight)):
        if torch.allclose(x_hat * gain, reference, rtol=1e-5, atol=1e-6):
            return {"form": form, "eps": eps, "weight": weight}
    return {"form": "unsupported", "eps": eps, "weight": None}


def _run_in_float32(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's output for float32 input, on a float32 CPU copy of its gain (the model stays as it is).

    The copy runs its class's own forward: a model placed by a `device_map` over several GPUs (a layer split)
    carries accelerate hooks on modules such as the final norm, which would send the probe to that GPU while the
    copy's gain is on the CPU (then the probe failed and the norm was taken as unsupported: its random gain was
    never drawn)."""
    import copy

    probe_norm = copy.deepcopy(norm).float().cpu()
    return type(probe_norm).forward(probe_norm, x).float()


def apply_final_norm(states_TH: torch.Tensor, norm: dict) -> torch.Tensor:
    """The after-norm states from before-norm ones: float32 [T, H] (round to the storage dtype as needed).

    Raises ValueError when the norm's form is unsupported.
    """
    if norm.get("form") not in FORMS:
        raise ValueError(f"the target's final norm has an unsupported form ({norm.get('form')!r}): after-norm "
                         f"states cannot be derived; extract with layers.capture_final=after_norm")
    gain = norm["weight"].float() + (1.0 if norm["form"] == "one_plus_weight" else 0.0)
    return rms_normalize(states_TH, norm["eps"]) * gain.to(states_TH.device)


def can_derive_after_norm(manifest: dict) -> bool:
    """Whether an output's after-norm final states can be derived: before-norm captured + a supported norm."""
    entry = manifest.get("final_norm") or {}
    return manifest.get("capture_final") == "before_norm" and entry.get("form") in FORMS


def with_after_norm_final(sample: dict, norm: dict) -> dict:
    """`sample` with `final_hidden_states` replaced by its after-norm value, in the stored tensor's dtype."""
    final = sample["final_hidden_states"]
    return {**sample, "final_hidden_states": apply_final_norm(final, norm).to(final.dtype)}


def write_final_norm(out_dir: str | Path, norm: dict) -> dict:
    """`OUT/final_norm.safetensors` (atomic); -> its manifest entry {path, form, eps}."""
    from dflash_prep.io import atomic_save_safetensors

    tensors = {"weight": norm["weight"].contiguous()} if norm["weight"] is not None else {}
    atomic_save_safetensors(Path(out_dir) / FINAL_NORM_NAME, tensors, {"form": norm["form"], "eps": repr(norm["eps"])})
    return {"path": FINAL_NORM_NAME, "form": norm["form"], "eps": norm["eps"]}


def read_final_norm(out_dir: str | Path) -> dict:
    """`OUT/final_norm.safetensors` -> {"form", "eps", "weight"}. Raises FileNotFoundError naming the file."""
    import json
    import struct

    from safetensors.torch import load

    path = as_location(out_dir) / FINAL_NORM_NAME  # a local folder or an object-store URL
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the output did not capture the final layer before the norm "
                                f"(layers.capture_final=before_norm), or was written by an older dflash-prep")
    data = path.read_bytes()  # a small file (one [H] vector)
    meta = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]]).get("__metadata__", {})
    weight = load(data).get("weight")
    eps = float(meta["eps"]) if meta.get("eps") not in (None, "None") else None
    return {"form": meta["form"], "eps": eps, "weight": weight}


def randomize_norm_gains(model: nn.Module, seed: int) -> int:
    """Give every RMSNorm of a random-weight model a gain drawn from 1 + N(0, NORM_GAIN_STD^2); -> norms changed.

    Drawn on the CPU from `seed` in module order, so every rank and every device gets the same gains.
    """
    generator = torch.Generator().manual_seed(seed)
    changed = 0
    for module in model.modules():
        if not is_rms_norm(module):
            continue
        offset = torch.randn(module.weight.shape, generator=generator) * NORM_GAIN_STD
        form = describe_final_norm(module)["form"]
        with torch.no_grad():
            if form == "weight":
                module.weight.copy_(1.0 + offset)
            elif form == "one_plus_weight":
                module.weight.copy_(offset)
            else:
                continue
        changed += 1
    return changed


def final_norm_entry(out_dir: str | Path, capture_final: str) -> dict | None:
    """The manifest's `final_norm` ({path, form, eps}) from OUT/final_norm.safetensors, written by the run that
    loaded the model (a finished output re-run does not load it); None unless capture_final is before_norm."""
    if capture_final != "before_norm":
        return None
    try:
        norm = read_final_norm(out_dir)
    except FileNotFoundError:
        return None
    return {"path": FINAL_NORM_NAME, "form": norm["form"], "eps": norm["eps"]}

"""Judging one layer of one sample: its tolerance (the stored dtype's rounding + the compute dtype's batched-vs-alone
noise), the bound a measured noise floor may widen it to, and the errors of stored states against a reference
(the tables and the reasoning: the package docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

STORAGE_TOLERANCE = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                     "fp8_e4m3": 2.0 ** -4 + 2.0 ** -10 / 448.0}
COMPUTE_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.1}
# A layer's stored states may differ from the alone reference by up to this many times the layer's rounding noise,
# measured as the padded-batch reference vs the alone one: the extraction's batched forward and the padded-batch
# reference both differ from the alone forward by rounding of the same kind and size (other GEMM shapes, masked
# attention kernels), so their worst cases agree to within a small factor; on the Llama-3.3-70B shape (80 random
# layers, bf16, tensor parallel over 2 GPUs) the worst-of-8 relative error varied between runs by well under 2x.
NOISE_FLOOR_FACTOR = 2.0
# A noise floor above this relative error is not used: a padded-batch reference that far from the alone one is
# more likely broken than noisy, and 2x of it would pass almost anything (relative 1 = an error as large as the
# layer's largest value). Such a layer passes only within the fixed tolerance; above it, it is inconclusive (a
# failure). Measured floors: 0.15-0.18 at layer 76 of the 70B shape, 0.12 at layer 61 of the 27B shape.
NOISE_FLOOR_CAP = 0.5


def tolerance_for(storage_dtype: str, compute_dtype: str) -> float:
    return STORAGE_TOLERANCE[storage_dtype] + COMPUTE_TOLERANCE[compute_dtype]


def allowed_error(tolerance: float, noise_floor: float | None, widen: bool = True) -> tuple[float, bool]:
    """(allowed relative error of a layer, conclusive) from the fixed tolerance and the layer's measured noise floor
    (worst padded-batch vs alone relative error; None: not measured). Widened to NOISE_FLOOR_FACTOR x the floor when
    `widen`; a floor above NOISE_FLOOR_CAP (or not finite) is not used and makes an error above the tolerance
    inconclusive (conclusive = False)."""
    if not widen or noise_floor is None:
        return tolerance, True
    if not noise_floor <= NOISE_FLOOR_CAP:  # also NaN
        return tolerance, False
    return max(tolerance, NOISE_FLOOR_FACTOR * noise_floor), True


def judge(relative_error: float, tolerance: float, noise_floor: float | None, widen: bool = True) -> str:
    """"pass", "fail" or "inconclusive" (counted as a failure) for one layer result; see `allowed_error`."""
    allowed, conclusive = allowed_error(tolerance, noise_floor, widen)
    if relative_error <= allowed:  # False for NaN
        return "pass"
    return "fail" if conclusive or math.isnan(relative_error) else "inconclusive"



@dataclass
class LayerResult:
    sample_id: str
    layer: str  # "1", "16", ... (after-layer id) or "final (before_norm)" / "final (after_norm)"
    num_tokens: int
    max_abs_error: float
    max_abs_reference: float
    relative_error: float  # max_abs_error / max_abs_reference
    relative_l2_error: float
    worst_token: int
    ok: bool
    allowed: float = 0.0  # the relative error this layer may reach (tolerance, or 2x its noise floor): judge()
    verdict: str = ""  # "pass", "fail" or "inconclusive" (a failure: the noise floor is above NOISE_FLOOR_CAP)

    def line(self) -> str:
        return (f"sample {self.sample_id} layer {self.layer}: max abs error {self.max_abs_error:.3g} "
                f"(token {self.worst_token}), relative {self.relative_error:.3g}, rel L2 "
                f"{self.relative_l2_error:.3g}, max |ref| {self.max_abs_reference:.3g}")


@dataclass
class NoiseResult:
    """One layer of one sample: its states in a right-padded batch (with the attention mask) vs run alone, both
    computed by the reference model: the rounding noise of the model at that layer."""

    sample_id: str
    layer: str
    relative_error: float  # max abs difference / max |alone| of that layer of that sample
    relative_l2_error: float



def compare(sample_id: str, layer: str, stored_TH: torch.Tensor, reference_TH: torch.Tensor,
            tolerance: float) -> LayerResult:
    """Errors of one layer of one sample (both float32, [T, H])."""
    diff = (stored_TH - reference_TH).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_abs = float(reference_TH.abs().max()) if reference_TH.numel() else 0.0
    worst = int(diff.max(dim=1).values.argmax()) if diff.numel() else 0
    rel = max_abs / ref_abs if ref_abs > 0 else (0.0 if max_abs == 0 else float("inf"))
    rel_l2 = float(torch.linalg.vector_norm(stored_TH - reference_TH) / torch.linalg.vector_norm(reference_TH)) \
        if ref_abs > 0 else rel
    finite = bool(torch.isfinite(stored_TH).all())
    if not finite:
        max_abs = rel = rel_l2 = float("nan")
    return LayerResult(sample_id, layer, int(stored_TH.shape[0]), max_abs, ref_abs, rel, rel_l2, worst,
                       ok=finite and rel <= tolerance)


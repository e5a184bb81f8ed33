"""What verify found: the report of a run (results, noise floors, integrity problems), its verdict, and its text
and JSON forms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash_prep.commands.verify.judge import (
    NOISE_FLOOR_CAP,
    NOISE_FLOOR_FACTOR,
    LayerResult,
    NoiseResult,
    allowed_error,
    judge,
)


class CannotVerify(RuntimeError):
    """The output cannot be verified (exit code 2)."""



@dataclass
class VerifyReport:
    out_dir: str
    dtype: str
    compute_dtype: str
    tolerance: float
    seed: int
    sample_ids: list[str]
    integrity_problems: list[str] = field(default_factory=list)
    results: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0
    kernels: list[str] = field(default_factory=list)  # fused kernels of the reference run (empty: eager)
    reference: str = "one device"  # how the reference model ran: one device, a layer split, a tensor-parallel replica
    is_main_process: bool = True  # False on the other processes of a tensor-parallel reference (they print nothing)
    noise_floor_measured: bool = True  # False with --no-noise-floor (no padded-batch reference)
    widen: bool = True  # False when --tolerance was given: the tolerance is used as given
    noise: list[NoiseResult] = field(default_factory=list)
    fp8_reference: str | None = None  # an FP8 run's reference: "fp8" (the FP8 model alone) or "dequantized"; else None

    @property
    def failures(self) -> list[LayerResult]:
        return [r for r in self.results if not r.ok]

    @property
    def ok(self) -> bool:
        return not self.integrity_problems and not self.failures and bool(self.results)

    def noise_floor_by_layer(self) -> dict[str, dict]:
        """layer -> worst padded-batch vs alone relative error and rel L2 over the samples that have one."""
        out: dict[str, dict] = {}
        for n in self.noise:
            w = out.setdefault(n.layer, {"relative_error": 0.0, "relative_l2_error": 0.0, "num_samples": 0})
            w["relative_error"] = _worst(w["relative_error"], n.relative_error)
            w["relative_l2_error"] = _worst(w["relative_l2_error"], n.relative_l2_error)
            w["num_samples"] += 1
        return out

    def judge(self) -> None:
        """Set each result's allowed error and verdict from the tolerance and its layer's noise floor."""
        floors = self.noise_floor_by_layer()
        for r in self.results:
            floor = floors[r.layer]["relative_error"] if r.layer in floors else None
            r.allowed = allowed_error(self.tolerance, floor, self.widen)[0]
            r.verdict = judge(r.relative_error, self.tolerance, floor, self.widen)
            r.ok = r.verdict == "pass"

    def worst_by_layer(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        floors = self.noise_floor_by_layer()
        for r in self.results:
            w = out.setdefault(r.layer, {"max_abs_error": 0.0, "relative_error": 0.0, "relative_l2_error": 0.0})
            w["max_abs_error"] = _worst(w["max_abs_error"], r.max_abs_error)
            w["relative_error"] = _worst(w["relative_error"], r.relative_error)
            w["relative_l2_error"] = _worst(w["relative_l2_error"], r.relative_l2_error)
        for layer, w in out.items():
            floor = floors.get(layer)
            w["noise_floor_relative_error"] = floor["relative_error"] if floor else None
            w["noise_floor_relative_l2_error"] = floor["relative_l2_error"] if floor else None
            w["noise_floor_samples"] = floor["num_samples"] if floor else 0
            w["allowed_relative_error"], w["conclusive"] = allowed_error(
                self.tolerance, floor["relative_error"] if floor else None, self.widen)
        return out

    def to_json(self) -> dict:
        return {"out_dir": self.out_dir, "ok": self.ok, "dtype": self.dtype, "compute_dtype": self.compute_dtype,
                "tolerance": self.tolerance, "seed": self.seed, "sample_ids": self.sample_ids,
                "noise_floor": {"measured": self.noise_floor_measured, "widen": self.widen,
                                "factor": NOISE_FLOOR_FACTOR, "cap": NOISE_FLOOR_CAP,
                                "by_layer": self.noise_floor_by_layer()},
                "integrity_problems": self.integrity_problems, "worst_by_layer": self.worst_by_layer(),
                "failures": [r.__dict__ for r in self.failures], "results": [r.__dict__ for r in self.results],
                "noise": [n.__dict__ for n in self.noise],
                "seconds": self.seconds, "kernels": self.kernels, "reference": self.reference,
                "fp8_reference": self.fp8_reference}


def _worst(a: float, b: float) -> float:
    """max that keeps a NaN (a non-finite result must show)."""
    return b if math.isnan(b) or b > a else a


def format_report(report: VerifyReport) -> str:
    lines, n = [], len(report.sample_ids)
    worst = report.worst_by_layer()
    for layer, w in worst.items():
        line = (f"layer {layer:>18}: max abs error {w['max_abs_error']:.3g}, relative {w['relative_error']:.3g}, "
                f"rel L2 {w['relative_l2_error']:.3g}")
        if w["noise_floor_samples"]:
            line += (f"; padded-batch vs alone (rounding noise) relative {w['noise_floor_relative_error']:.3g} -> "
                     f"allowed {w['allowed_relative_error']:.3g}")
            if not w["conclusive"]:
                line += f" (noise {_above_cap(w['noise_floor_relative_error'])}: not used)"
            elif not report.widen:
                line += " (--tolerance: not widened)"
            line += f" (worst over {w['noise_floor_samples']} sample(s))"
        else:
            line += f" (worst over {n} sample(s))"
        lines.append(line)
    amplified = [layer for layer, w in worst.items() if w["noise_floor_samples"] and report.widen
                 and w["conclusive"] and w["noise_floor_relative_error"] > report.tolerance]
    if amplified:
        lines.append(f"note: the model amplifies rounding past the {report.compute_dtype} tolerance "
                     f"{report.tolerance:.3g} at layer(s) {', '.join(amplified)} (padded batch vs alone; random "
                     f"weights do): those layers are judged against {NOISE_FLOOR_FACTOR:g} x the measured noise")
    floors = report.noise_floor_by_layer()
    for r in report.failures:
        lines.append(f"FAIL {r.line()} > {_bound(report, r, floors.get(r.layer))}")
    inconclusive = sum(r.verdict == "inconclusive" for r in report.failures)
    verdict = "OK" if report.ok else "FAILED"
    against = {(True, True): f"tolerance {report.tolerance:.3g} or {NOISE_FLOOR_FACTOR:g} x the rounding noise",
               (True, False): f"tolerance {report.tolerance:.3g} (not widened)"}.get(
        (report.noise_floor_measured, report.widen), f"tolerance {report.tolerance:.3g} (no noise floor)")
    lines.append(f"verify: {verdict}: {n} sample(s) x {len(worst)} layer(s) checked against a run alone, {against} "
                 f"({report.dtype}); {len(report.failures)} layer result(s) out of tolerance"
                 f"{f' ({inconclusive} inconclusive)' if inconclusive else ''}, {len(report.integrity_problems)} "
                 f"integrity problem(s); {report.seconds:.1f}s")
    return "\n".join(lines)


def _above_cap(noise_floor: float) -> str:
    """Why a floor is not used: above NOISE_FLOOR_CAP, or not finite (NaN / Inf in the padded-batch reference)."""
    return f"above {NOISE_FLOOR_CAP:g}" if math.isfinite(noise_floor) else "not finite"


def _bound(report: VerifyReport, r: LayerResult, floor: dict | None) -> str:
    """The bound a failed result exceeded, for its FAIL line."""
    if r.verdict == "inconclusive":
        return (f"tolerance {report.tolerance:.3g}; inconclusive: the model's rounding noise at this depth is "
                f"{floor['relative_error']:.3g} (padded batch vs alone, {_above_cap(floor['relative_error'])}: "
                f"not used)")
    if r.allowed > report.tolerance:
        return (f"allowed {r.allowed:.3g} ({NOISE_FLOOR_FACTOR:g} x the rounding noise "
                f"{floor['relative_error']:.3g} at this layer)")
    return f"tolerance {report.tolerance:.3g}"



def finite_or_null(value):
    """`value` (nested dicts and lists of the report) with every NaN or infinite float as None: `--json` stays
    strict JSON (json.dumps would write NaN / Infinity, which JSON parsers other than Python's reject); a null
    error is a non-finite stored value (its verdict says "fail")."""
    if isinstance(value, float) and not math.isfinite(value):  # NaN, inf, -inf
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


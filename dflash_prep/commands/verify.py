"""`dflash-prep verify OUT [--num-samples N]`: prove an output holds what the model computes.

1. Integrity: the manifest and every shard it lists, as `inspect --check` does (size, sha256, tar, members,
   shapes and dtypes, counts).
2. The model: the recipe as run (`OUT/recipe.resolved.yaml`, `--set` overrides allowed, e.g. a new path of the
   weights) is loaded and the model's and tokenizer's fingerprints are compared with the manifest's before any
   weights are loaded; a random-weight model (`model.config`) is rebuilt from its seed on the device type the
   extraction used (its weights depend on the device's random generator).
3. Values: N samples, drawn with `random.Random(seed)` from all sample ids (sorted) and printed, are run ALONE
   (batch of one, no padding, the whole base decoder with `use_cache=False`) in the recipe's compute dtype, with the
   fused kernels the recipe's `model.kernels` selects on this device (as the extraction does: kernels.py; a named
   list that cannot run here falls back to eager; `--set model.kernels=eager` compares with transformers' own
   forward), and compared with the stored states, per layer (and for the final layer when captured): max abs error,
   relative error = max abs error / max |reference| of that sample's layer, and relative L2 error. A layer passes
   when its relative error is <= its allowed bound (the tolerance, or twice the layer's measured rounding noise:
   below); the output passes when every checked layer of every checked sample passes. The reference is transformers'
   own, not a hook: `output_hidden_states=True`, so layer id i is checked against HF `hidden_states[i + 1]` (the
   format's definition), `after_norm` against `hidden_states[L]` (after the final norm) and `before_norm` against
   the final norm's input in that same forward (a pre-hook on the norm module: no transformers switch needed,
   nothing shared with the extraction's hooks on the last decoder layer). An output whose layer ids include L-1
   (refused since; older outputs stored the last layer's output before the norm there) is checked against
   `hidden_states[L]` like any other id, so it fails.

Tolerance = storage term (the stored dtype's rounding, relative to the layer's max |value|) + compute term (the
difference between a sample's states in a padded batch and alone, from the kernels' numerics in the compute dtype):

| stored dtype | storage term | | compute dtype | compute term |
|---|---|---|---|---|
| float32 | 0 | | float32 | 1e-3 |
| float16 | 2^-11 = 4.9e-4 | | float16 | 0.02 |
| bfloat16 | 2^-8 = 3.9e-3 | | bfloat16 | 0.1 |
| fp8_e4m3 | 2^-4 + 2^-10/448 = 0.0625 (fp8.FP8_REL_BOUND, per token) | | | |

The bf16 compute term is wide because the batched and alone bf16 forwards of a deep model really differ that
much (the benchmark measured relative L2 0.005 at layer 1 to 0.053 at layer 61 of the 27B, max abs / max |ref|
8/157 = 0.051): in bf16 `verify` catches wrong samples, layers, masks and corrupted values, not last-bit noise.
Fused kernels round differently from eager ones (fp32: 7.5e-4 relative on 8-layer slices, the level of the batched
vs alone noise); in bf16 61 random-weight layers amplify that past the tolerance (fused output vs eager reference,
27B shape, layer 61: 0.104-0.122 measured), hence the reference runs with the extraction's kernels by default.
`--tolerance` replaces the sum.

Noise floor. A fixed tolerance cannot tell rounding amplified over many layers from a bug at depth: on the
Llama-3.3-70B shape (80 random-weight bf16 layers, tensor parallel over 2 GPUs, verify launched as that replica)
every sample reached relative L2 0.098 at layer 39 and 0.154 at layer 76 (relative 0.15-0.18), with nothing wrong.
So verify measures each layer's rounding noise with a second, independent reference: the drawn samples run TOGETHER
through the same reference model (dtype, kernels, layer mapping) as right-padded batches with their attention mask
(`run_padded_batch`; groups in reading order of at most NOISE_FLOOR_BATCH_TOKENS = 8192 padded tokens, or twice the
longest drawn sample; a sample alone in its group, as with `--num-samples 1`, runs with a filler row of its own
tokens 1.25x as long, `filler_row`, since a batch of one is the run alone itself; in one process a batch that runs
out of memory gives its samples no floor, said in one line). Their real tokens are compared with the alone reference
like the stored states are; a layer's noise floor is the worst relative error over the drawn samples. Right padding
with a mask leaves a causal decoder's real tokens unchanged (in fp32 the floor is ~2e-7 on the tiny Llama and the
Qwen3.5 Gated DeltaNet hybrid through transformers' torch path), so the floor is rounding only. A layer passes when
its relative error is <= max(tolerance, NOISE_FLOOR_FACTOR x floor), factor 2: the extraction's batched forward and
the padded-batch reference differ from the alone forward by rounding of the same kind and size. A floor above
NOISE_FLOOR_CAP = 0.5 is not used (a reference that far off is more likely broken than noisy, and twice it would
pass nearly anything): such a layer passes only within the tolerance, and above it is reported inconclusive ("the
model's rounding noise at this depth is X"), a failure (exit code 1). `--tolerance` is used as given (the floor is
still measured and shown, never widens it); `--no-noise-floor` skips the second reference (the tolerance only). At a
depth where the noise is large a wrong value of the same size passes: the floor bounds what verify can see.

A target larger than one GPU (`model.gpus_per_replica` N > 1): one process rebuilds it split by layers over the
first N GPUs. An output of a tensor-parallel replica is best verified by the same replica:
`dflash-prep launch --multi_gpu --num_processes N -m dflash_prep.commands.cli verify OUT` makes the N processes one
tensor-parallel replica that computes the reference as the extraction computed the states (sharded GEMMs summed
over an all-reduce round differently in bf16 from whole GEMMs: on the Llama-3.3-70B shape, relative L2 0.16 at
layer 76 against a one-process reference, bench/RESULTS.md); every process runs the same alone and padded-batch
forwards in the same order (they read the same samples); its first process hashes the shards after the forwards
and prints the report.

Exit codes: 0 every check passed; 1 a check failed (each failure printed as `FAIL ...`, naming the shard, or the
sample, the layer and the bound it exceeded; an inconclusive layer too); 2 the output cannot be verified (no
manifest, no recipe, model or tokenizer fingerprint differs, device mismatch for random weights, a
`--tolerance` that is not a finite number >= 0, a `--device` that cannot run here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

STORAGE_TOLERANCE = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8,
                     "fp8_e4m3": 2.0 ** -4 + 2.0 ** -10 / 448.0}
COMPUTE_TOLERANCE = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.1}
RECIPE_NAME = "recipe.resolved.yaml"
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
# Padded tokens (rows x longest row) of one padded-batch forward at most, or twice the longest drawn sample when that
# is more (so any two samples share a batch): `output_hidden_states=True` keeps every layer's [B, T, H] states, so
# a batch costs at most twice the memory of the longest sample's run alone (2.5x for a lone sample and its filler
# row, `filler_row`).
NOISE_FLOOR_BATCH_TOKENS = 8192


class CannotVerify(RuntimeError):
    """The output cannot be verified (exit code 2)."""


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
                "seconds": self.seconds, "kernels": self.kernels, "reference": self.reference}


def _worst(a: float, b: float) -> float:
    """max that keeps a NaN (a non-finite result must show)."""
    return b if math.isnan(b) or b > a else a


# -------------------------------------------------------------------------------------------- reference
def run_alone(model, input_ids_T: torch.Tensor, layer_ids: list[int], capture_final: str,
              device: torch.device) -> dict[str, torch.Tensor]:
    """One sample's reference states, run alone through transformers with `output_hidden_states=True`:
    {"<layer id>": [T, H] float32 = HF hidden_states[id + 1], "final": [T, H]} (on the CPU).

    `hidden_states[L]` is after the final norm in transformers 5.x (= `last_hidden_state`), so id L-1 gets that.
    The before-norm final state is the final norm's own input, read by a forward pre-hook on the decoder's norm
    module during the same forward: it needs no transformers switch (`tie_last_hidden_states` exists in some
    versions only) and shares nothing with the extraction's capture hooks (which hook the last decoder layer)."""
    states = _reference_forward(model, input_ids_T.to(device)[None], None, layer_ids, capture_final)
    return {name: s_BTH[0].float().cpu() for name, s_BTH in states.items()}


def run_padded_batch(model, input_ids: list[torch.Tensor], layer_ids: list[int], capture_final: str,
                     device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Several samples' states from ONE right-padded batch with its attention mask (1 on real tokens), through the
    same transformers forward and layer mapping as `run_alone`: per sample {"<layer id>": [T, H], "final": [T, H]},
    its real tokens only, in the compute dtype, on the CPU. Right padding leaves a causal decoder's real tokens as
    they are run alone (attention, and the Gated DeltaNet recurrence and its causal conv of transformers' torch
    path: equal to 2.4e-7 relative in fp32 on the tiny Qwen3.5 hybrid and Llama), so what differs is rounding."""
    lengths = [int(x.shape[0]) for x in input_ids]
    input_ids_BT = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    mask_BT = torch.zeros_like(input_ids_BT)
    for b, x in enumerate(input_ids):
        input_ids_BT[b, :lengths[b]], mask_BT[b, :lengths[b]] = x, 1
    states = _reference_forward(model, input_ids_BT.to(device), mask_BT.to(device), layer_ids, capture_final)
    return [{name: s_BTH[b, :n].cpu() for name, s_BTH in states.items()} for b, n in enumerate(lengths)]


def _reference_forward(model, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None,
                       layer_ids: list[int], capture_final: str) -> dict[str, torch.Tensor]:
    """{"<layer id>": HF hidden_states[id + 1], "final": ...} [B, T, H] of one forward of the base decoder (see
    `run_alone`), on the model's device, in the compute dtype."""
    from dflash_prep.target.layers import find_decoder

    decoder = find_decoder(model)
    norm_input: list[torch.Tensor] = []
    handle = decoder.norm.register_forward_pre_hook(lambda module, args: norm_input.append(args[0].detach())) \
        if capture_final == "before_norm" else None
    try:
        with torch.inference_mode():
            out = decoder(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False,
                          output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    hidden_states, after_norm = out.hidden_states, out.last_hidden_state
    L = len(hidden_states) - 1
    default = [*hidden_states[:L], after_norm]  # index L is after the final norm
    states = {str(i): default[i + 1] for i in layer_ids}
    if capture_final == "after_norm":
        states["final"] = after_norm
    elif capture_final == "before_norm":
        if len(norm_input) != 1:
            raise CannotVerify(f"the final norm ran {len(norm_input)} times in one forward: the before_norm final "
                               f"layer cannot be checked")
        states["final"] = norm_input[0]
    return states


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


# ------------------------------------------------------------------------------------------------ verify
def _extraction_device_type(out_dir: Path) -> str | None:
    """"cuda" or "cpu" from the rank reports (peak GPU memory is recorded on CUDA only), None if unknown."""
    types = set()
    for path in (out_dir / "index").glob("rank-*.done.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        types.add("cuda" if report.get("peak_gpu_memory_bytes") is not None else "cpu")
    return types.pop() if len(types) == 1 else None


def _recipe_layer_ids(section, num_layers: int) -> list[int]:
    """The layer ids the recipe asked for. An explicit list with id L-1 (refused by extraction since, accepted by
    older versions) is still verified, against HF hidden_states[L]; any other refusal cannot be verified."""
    from dflash_prep.recipe.schema import RecipeError
    from dflash_prep.target.layers import resolve_layer_ids

    try:
        return resolve_layer_ids(section, num_layers)
    except RecipeError as e:
        ids = list(section.ids or [])
        if section.preset == "explicit" and num_layers - 1 in ids and all(0 <= i < num_layers for i in ids):
            return ids
        raise CannotVerify(str(e)) from None


def choose_samples(all_ids: list[str], num_samples: int, seed: int) -> list[str]:
    """`num_samples` ids drawn with random.Random(seed) from the sorted ids (all when N >= their number)."""
    ids = sorted(all_ids)
    if num_samples >= len(ids):
        return ids
    return sorted(random.Random(seed).sample(ids, num_samples))


def verify(out_dir: str | Path, num_samples: int = 8, seed: int = 0, overrides: list[str] | None = None,
           device: str | None = None, tolerance: float | None = None, check_shards: bool = True,
           log=print, progress: bool = False, noise_floor: bool = True, widen: bool | None = None) -> VerifyReport:
    """Run the checks of the module docstring; raises `CannotVerify` when they cannot run.

    `noise_floor=False` skips the padded-batch reference (the fixed tolerance only). `widen` (default: when no
    `tolerance` is given) lets a layer pass up to NOISE_FLOOR_FACTOR x its measured noise floor."""
    from dflash_prep.consume.export import sample_ids_by_shard
    from dflash_prep.consume.reader import OutputLayout, shards_of

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    manifest, recipe, config, layer_ids = _output_and_recipe(out_dir, overrides)
    layout = OutputLayout.from_manifest(manifest)
    replica, state = _tensor_parallel_replica(recipe, config) if _num_launched_processes() > 1 else (None, None)
    if state is not None and not state.is_main_process:
        log, progress = (lambda *a: None), False  # one process speaks for the replica
    dev = state.device if state is not None else \
        torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    made_on = _extraction_device_type(out_dir)
    if recipe.model.config is not None and made_on is not None and made_on != dev.type:
        raise CannotVerify(f"the output was extracted on {made_on} with random weights (model.config, seed "
                           f"{recipe.model.init_seed}), which depend on the device's random generator: verify on "
                           f"{made_on} (--device {made_on})")

    tol = tolerance if tolerance is not None else tolerance_for(manifest["dtype"], recipe.model.dtype)
    shards = shards_of(out_dir, manifest)
    report = VerifyReport(str(out_dir), manifest["dtype"], recipe.model.dtype, tol, seed, [],
                          is_main_process=state is None or state.is_main_process, noise_floor_measured=noise_floor,
                          widen=noise_floor and (tolerance is None if widen is None else widen))
    # Under a tensor-parallel reference the shards are hashed after the forwards, by the main process alone: the
    # other processes would otherwise wait in the forward's first collective while a large output is read.
    hash_first = check_shards and replica is None
    if hash_first:
        _check_integrity(out_dir, shards, report, log, progress)
    ids_by_shard = sample_ids_by_shard(out_dir, shards)
    chosen = choose_samples([i for ids in ids_by_shard.values() for i in ids], num_samples, seed)
    report.sample_ids = chosen
    log(f"verify: {len(chosen)} sample(s) drawn with seed {seed}: {', '.join(chosen)}")
    log(f"verify: tolerance {tol:.3g} (relative to each layer's max |value|; stored {manifest['dtype']}, "
        f"computed in {recipe.model.dtype}); {_noise_floor_policy(report)}")
    _hint_parallelism(out_dir, recipe, replica, dev, log)
    model = _reference_model(recipe, config, dev, report, log, manifest.get("kernels"), replica)
    _compare_chosen(model, shards, ids_by_shard, set(chosen), layout, layer_ids, dev, tol, report, log)
    report.judge()
    if state is not None:  # the replica's last collective: its processes leave together, then hash or exit alone
        state.wait_for_everyone()
        torch.distributed.destroy_process_group()
    if check_shards and not hash_first and report.is_main_process:
        _check_integrity(out_dir, shards, report, log, progress)
    report.seconds = time.perf_counter() - t0
    return report


def _check_integrity(out_dir: Path, shards, report: VerifyReport, log, progress: bool) -> None:
    from dflash_prep.commands.inspect import check_output

    log(f"verify: checking the manifest and {len(shards)} shard(s) (sizes, sha256, members)")
    report.integrity_problems = check_output(out_dir, progress=progress)
    for p in report.integrity_problems:
        log(f"FAIL {p}")


def _num_launched_processes() -> int:
    """Processes of this launch (accelerate / torchrun set WORLD_SIZE); 1 for a plain `dflash-prep verify`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _tensor_parallel_replica(recipe, config):
    """(replica, accelerate state) of a verify launched as several processes: they must form ONE tensor-parallel
    replica of `model.gpus_per_replica` processes, which then computes the reference the way a tensor-parallel
    extraction computed the states (sharded GEMMs summed over the replica: in bf16 they round differently from a
    whole-GEMM reference; through the 80 layers of the Llama-3.3-70B shape that difference exceeded the bf16
    tolerance). CannotVerify otherwise."""
    from accelerate import PartialState

    from dflash_prep.recipe.schema import RecipeError
    from dflash_prep.target.replica import TENSOR_PARALLEL, replica_of_process

    state = PartialState(cpu=not torch.cuda.is_available())
    try:
        replica = replica_of_process(state, recipe, config)
    except RecipeError as e:
        raise CannotVerify(str(e)) from None
    if replica.parallelism != TENSOR_PARALLEL or replica.num_replicas != 1:
        raise CannotVerify(f"verify launched as {state.num_processes} processes runs its reference as ONE "
                           f"tensor-parallel replica: launch it with model.gpus_per_replica = "
                           f"{recipe.model.gpus_per_replica} processes, on a target transformers can shard (this "
                           f"launch: {replica.describe()}); or run it as one process")
    return replica, state


def _hint_parallelism(out_dir: Path, recipe, replica, dev: torch.device, log) -> None:
    """Say when a tensor-parallel output is checked by one process (a reference split by layers over the GPUs:
    whole GEMMs, other rounding than the extraction's)."""
    try:
        made = json.loads((out_dir / "summary.json").read_text()).get("replicas") or {}
    except (OSError, ValueError):
        return
    if replica is None and made.get("parallelism") == "tensor_parallel" and recipe.model.gpus_per_replica > 1:
        n = recipe.model.gpus_per_replica
        log(f"verify: the output was extracted by a tensor-parallel replica of {n}; this reference runs in one "
            f"process (whole GEMMs on {dev.type}) and rounds differently, which deep bf16 models can take past "
            f"the tolerance; `dflash-prep launch --multi_gpu --num_processes {n} -m dflash_prep.commands.cli verify "
            f"{out_dir}` computes it tensor parallel, as the extraction did")


def _output_and_recipe(out_dir: Path, overrides: list[str] | None):
    """-> (manifest, recipe, config, layer ids) after checking that the recipe rebuilds the output's model and
    tokenizer (fingerprints) and asks for its layers; raises CannotVerify otherwise."""
    from dflash_prep.recipe.schema import RecipeError, load_recipe
    from dflash_prep.store.manifest import read_manifest
    from dflash_prep.target.layers import num_decoder_layers
    from dflash_prep.target.model import load_config, load_tokenizer, model_fingerprint, tokenizer_fingerprint

    try:
        manifest = read_manifest(out_dir)
    except (FileNotFoundError, ValueError, json.JSONDecodeError) as e:
        raise CannotVerify(str(e)) from None
    recipe_path = out_dir / RECIPE_NAME
    if not recipe_path.is_file():
        raise CannotVerify(f"{recipe_path} not found: the recipe the output was made with is needed to rebuild "
                           f"the model")
    try:
        recipe = load_recipe(recipe_path, overrides)
        config = load_config(recipe.model)
    except RecipeError as e:
        raise CannotVerify(f"{e} (pass --set to point at the model, e.g. --set model.name_or_path=...)") from None
    if model_fingerprint(recipe.model, config) != manifest.get("model_fingerprint"):
        raise CannotVerify("the model of the recipe (config, weight source, compute dtype) does not match the "
                           "manifest's model_fingerprint: this is not the model the output was made with")
    if tokenizer_fingerprint(load_tokenizer(recipe.model)) != manifest.get("tokenizer_fingerprint"):
        raise CannotVerify("the tokenizer of the recipe does not match the manifest's tokenizer_fingerprint")
    layer_ids = _recipe_layer_ids(recipe.layers, num_decoder_layers(config))
    final = manifest.get("capture_final", "none")
    if layer_ids != [int(i) for i in manifest["layer_ids"]] or recipe.layers.capture_final != final:
        raise CannotVerify(f"the recipe asks for layers {layer_ids} / final {recipe.layers.capture_final}, the "
                           f"manifest holds {manifest['layer_ids']} / {final}")
    return manifest, recipe, config, layer_ids


def _reference_model(recipe, config, dev: torch.device, report: VerifyReport, log,
                     extraction_kernels: dict | None = None, replica=None):
    """The whole model (every layer: the reference is the whole HF forward) with the recipe's kernels on `dev`; with
    `model.gpus_per_replica` N > 1, split by layers over the first N GPUs (one process; replica.py), whatever the
    extraction's process model (tensor parallel or layer split hold the same weights); on a CPU, a replica's
    random weights are rebuilt as the replica draws them."""
    from dflash_prep.target.kernels import apply_kernels
    from dflash_prep.target.model import load_model

    t_load = time.perf_counter()
    n = recipe.model.gpus_per_replica
    if replica is not None:  # this process is one of a tensor-parallel replica (_tensor_parallel_replica)
        from dflash_prep.target.model import load_replica_model

        model = load_replica_model(recipe.model, config, replica)
        report.reference = f"tensor parallel over {n} processes"
    elif n > 1 and dev.type == "cuda":  # a target larger than one GPU: a layer split over this process's first n GPUs
        from dflash_prep.target.model import load_replica_model
        from dflash_prep.target.replica import LAYER_SPLIT, ReplicaLayout

        if torch.cuda.device_count() < n:
            raise CannotVerify(f"model.gpus_per_replica = {n}: the model needs {n} GPUs, this machine has "
                               f"{torch.cuda.device_count()}")
        model = load_replica_model(recipe.model, config, ReplicaLayout(n, LAYER_SPLIT, 0, 1, 0, tuple(range(n))))
        report.reference = f"split by layers over {n} GPUs"
    elif n > 1 and recipe.model.config is not None:  # a replica's random weights (drawn per module), on one device
        from dflash_prep.target.model import build_random_model

        model = build_random_model(recipe.model, config, {"device_map": {"": dev}})
    else:
        model = load_model(recipe.model, config, dev)
    kernels = _reference_kernels(recipe, config, dev, extraction_kernels)
    apply_kernels(model, kernels)
    report.kernels = list(kernels.names)
    log(f"verify: model loaded in {time.perf_counter() - t_load:.1f}s on {dev} ({report.reference}); kernels: "
        f"{', '.join(kernels.names) or 'eager'}{f' ({kernels.reason})' if kernels.reason else ''}")
    return model


def _noise_floor_policy(report: VerifyReport) -> str:
    if not report.noise_floor_measured:
        return "no noise floor (--no-noise-floor): the fixed tolerance only"
    if not report.widen:
        return ("noise floor measured (padded batch vs alone) but not used: the tolerance as given (--tolerance)")
    return (f"a layer may also reach {NOISE_FLOOR_FACTOR:g} x its rounding noise (padded batch vs alone, "
            f"used up to {NOISE_FLOOR_CAP:g})")


def _compare_chosen(model, shards, ids_by_shard: dict, wanted: set, layout, layer_ids: list[int],
                    dev: torch.device, tol: float, report: VerifyReport, log=print) -> None:
    """Each chosen sample's stored layers against its reference run alone; results appended to `report` (and,
    unless `report.noise_floor_measured` is off, each sample's padded-batch vs alone rounding noise)."""
    from dflash_prep.consume.reader import ShardFormatError

    drawn = [(shard, {j for j, sid in enumerate(ids_by_shard[shard.rel_path]) if sid in wanted}) for shard in shards]
    drawn = [(shard, positions) for shard, positions in drawn if positions]
    padded = None if not report.noise_floor_measured else _PaddedBatches(
        model, _drawn_input_ids(model, drawn, wanted, layout), layer_ids, layout.capture_final, dev,
        skip_on_oom=_num_launched_processes() == 1, log=log)
    unreadable: set[str] = set()
    for shard, positions in drawn:
        try:
            unreadable |= _compare_shard(model, shard, positions, wanted, layout, layer_ids, dev, tol, report, padded,
                                         log)
        except (ShardFormatError, OSError) as e:  # a damaged or missing shard is a failed check, named
            report.integrity_problems.append(f"{shard.rel_path}: its drawn samples cannot be read ({e})")
            log(f"FAIL {report.integrity_problems[-1]}")
            unreadable |= {ids_by_shard[shard.rel_path][j] for j in positions}
    missing = wanted - {r.sample_id for r in report.results} - unreadable
    if missing:
        report.integrity_problems.append(f"sample(s) not found in the shards: {sorted(missing)[:5]}")
        log(f"FAIL {report.integrity_problems[-1]}")


def _drawn_input_ids(model, drawn: list, wanted: set, layout) -> list[tuple[str, torch.Tensor]]:
    """(sample id, input_ids [T]) of the drawn samples in reading order (the order `_compare_shard` meets them);
    a shard that cannot be read or is missing gives none, nor does a sample that cannot run (`_unrunnable`): they
    get no noise floor; the compare pass names them."""
    from dflash_prep.consume.reader import ShardFormatError, iter_shard

    out: list[tuple[str, torch.Tensor]] = []
    for shard, positions in drawn:
        try:
            found = [(sample["sample_id"], sample["input_ids"]) for sample in iter_shard(
                shard, layout, wanted=lambda j, p=positions: j in p, check_tokens=False, fp8="raw",
                verify_sha256=False)]
        except (ShardFormatError, OSError):  # damaged or missing: the compare pass names it
            continue
        out += [(sid, ids) for sid, ids in found if sid in wanted and not _unrunnable(ids, _vocab_size(model))]
    return out


class _PaddedBatches:
    """The padded-batch reference of the drawn samples (`run_padded_batch`), grouped in reading order under
    NOISE_FLOOR_BATCH_TOKENS padded tokens (or twice the longest sample; a lone last sample takes the previous
    group's last one: two samples always fit; a group of one runs with a `filler_row`), each group run when its
    first sample is compared and dropped at the next: one group's states are held at a time. Every process of a
    tensor-parallel replica reads the same samples in the same order, so they run the same forwards in the same
    order."""

    def __init__(self, model, samples: list[tuple[str, torch.Tensor]], layer_ids: list[int], capture_final: str,
                 device: torch.device, skip_on_oom: bool = False, log=print):
        """`skip_on_oom`: a group that runs out of memory gives no noise floor (one process only: the processes of
        a tensor-parallel replica must run the same collectives, so there it raises)."""
        self.model, self.layer_ids, self.capture_final, self.device = model, layer_ids, capture_final, device
        self.skip_on_oom, self.log = skip_on_oom, log
        cap = max([NOISE_FLOOR_BATCH_TOKENS] + [2 * int(ids.shape[0]) for _, ids in samples])
        self.groups: list[list[tuple[str, torch.Tensor]]] = []
        for sid, ids in samples:
            group = self.groups[-1] if self.groups else None
            if group is None or (len(group) + 1) * max(int(ids.shape[0]), *(int(x.shape[0]) for _, x in group)) > cap:
                self.groups.append(group := [])
            group.append((sid, ids))
        if len(self.groups) > 1 and len(self.groups[-1]) == 1 and len(self.groups[-2]) > 2:
            self.groups[-1].insert(0, self.groups[-2].pop())  # no sample alone in its batch (its noise would be ~0)
        self.group_of = {sid: g for g, group in enumerate(self.groups) for sid, _ in group}
        self._current, self._states = None, {}

    def states(self, sample_id: str) -> dict[str, torch.Tensor] | None:
        """{"<layer id>": [T, H], "final": ...} of the sample in its padded batch; None when it has none."""
        g = self.group_of.get(sample_id)
        if g is None:
            return None
        if g != self._current:
            self._states = {}  # free the previous group before the next forward
            group = self.groups[g]
            self._current = g
            rows = [ids for _, ids in group]
            if len(rows) == 1:  # a batch of one IS the run alone (no noise measured): give it a second row
                rows.append(filler_row(rows[0]))
            try:
                batch = run_padded_batch(self.model, rows, self.layer_ids, self.capture_final, self.device)
            except torch.OutOfMemoryError:
                if not self.skip_on_oom:  # a replica's other processes may be past this forward: stop as before
                    raise
                self.log(f"verify: out of memory in the padded batch of {len(group)} sample(s) "
                         f"({', '.join(sid for sid, _ in group)}): they give no noise floor")
                return None
            self._states = {sid: states for (sid, _), states in zip(group, batch)}
        return self._states.get(sample_id)


def filler_row(input_ids_T: torch.Tensor) -> torch.Tensor:
    """The second row of a padded batch whose group holds one sample: the sample's own tokens repeated to
    T + max(1, T // 4) tokens (int64 [T']), so the sample runs with a batch of two and right padding (at least one
    padded token, up to a quarter of its length: the extraction's `length_growth: 1.25` buckets pad that much);
    the filler's states are not used. Without it the padded batch of a lone sample (`--num-samples 1`, an output of
    one sample) is the very forward of its run alone and its noise floor is 0."""
    T = int(input_ids_T.shape[0])
    return input_ids_T.repeat(2)[:T + max(1, T // 4)]


def _vocab_size(model) -> int:
    return int(model.config.get_text_config().vocab_size)


def _unrunnable(input_ids_T: torch.Tensor, vocab_size: int) -> str | None:
    """Why a stored sample cannot run through the model (no token; a token id outside [0, vocab_size): the
    embedding would raise), None when it can."""
    if input_ids_T.shape[0] == 0:
        return "holds no token"
    low, high = int(input_ids_T.min()), int(input_ids_T.max())
    if low < 0 or high >= vocab_size:
        return f"holds token id {high if high >= vocab_size else low}, outside the model's vocabulary of {vocab_size}"
    return None


def _compare_shard(model, shard, positions: set, wanted: set, layout, layer_ids: list[int], dev: torch.device,
                   tol: float, report: VerifyReport, padded: _PaddedBatches | None = None, log=print) -> set[str]:
    """The drawn samples of one shard against their reference run alone (results appended to `report`); returns
    the ids of those that cannot run (`_unrunnable`: an integrity problem, named)."""
    from dflash_prep.consume.reader import iter_shard

    H, final_name, empty = layout.hidden_size, f"final ({layout.capture_final})", set()
    for sample in iter_shard(shard, layout, wanted=lambda j, p=positions: j in p, check_tokens=False,
                             fp8="float32", verify_sha256=False):  # hashes: check_output
        sid = sample["sample_id"]
        if sid not in wanted:
            raise CannotVerify(f"{shard.path}: sample order differs from the index ({sid})")
        if problem := _unrunnable(sample["input_ids"], _vocab_size(model)):
            report.integrity_problems.append(f"{shard.rel_path}: sample {sid} {problem}")
            log(f"FAIL {report.integrity_problems[-1]}")
            empty.add(sid)
            continue
        ref = run_alone(model, sample["input_ids"], layer_ids, layout.capture_final, dev)
        stored = sample["hidden_states"].float()
        for slot, layer in enumerate(layer_ids):
            report.results.append(compare(sid, str(layer), stored[:, slot * H:(slot + 1) * H], ref[str(layer)], tol))
        if layout.has_final:
            report.results.append(compare(sid, final_name, sample["final_hidden_states"].float(), ref["final"], tol))
        batch = padded.states(sid) if padded is not None else None
        if batch is not None:
            names = [(str(layer), str(layer)) for layer in layer_ids] + ([("final", final_name)] if layout.has_final
                                                                           else [])
            for key, name in names:
                noise = compare(sid, name, batch[key].float(), ref[key], tol)
                report.noise.append(NoiseResult(sid, name, noise.relative_error, noise.relative_l2_error))
    return empty


def _reference_kernels(recipe, config, dev: torch.device, extraction_kernels: dict | None = None):
    """The fused kernels of the recipe's `model.kernels` on `dev`, chosen as the extraction chooses them; `auto`
    is the set the extraction applied (the manifest's `kernels`: a tensor-parallel replica applies none, while the
    reference, split by layers, would choose some). A named list that cannot run here (no CUDA, a library missing)
    gives eager, with the reason."""
    from dflash_prep.recipe.schema import RecipeError
    from dflash_prep.target.kernels import KernelChoice, select_kernels

    requested = recipe.model.kernels
    if requested == "auto" and extraction_kernels is not None and dev.type == "cuda":
        requested = extraction_kernels.get("applied") or "eager"
    try:
        return select_kernels(requested, config, dev.type)
    except RecipeError as e:
        return KernelChoice("eager", (), getattr(config, "model_type", None), f"{e}: eager reference")


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


# --------------------------------------------------------------------------------------------------- CLI
def _finite_or_null(value):
    """`value` (nested dicts and lists of the report) with every NaN or infinite float as None: `--json` stays
    strict JSON (json.dumps would write NaN / Infinity, which JSON parsers other than Python's reject); a null
    error is a non-finite stored value (its verdict says "fail")."""
    if isinstance(value, float) and not math.isfinite(value):  # NaN, inf, -inf
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def build_parser(prog: str = "dflash-prep verify") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Check an output's manifest and shard hashes, then re-run "
                                                       "random samples alone through the model and compare.")
    p.add_argument("out", help="extraction output folder (holds manifest.json and recipe.resolved.yaml)")
    p.add_argument("--num-samples", type=int, default=8, help="samples to re-run (default 8; all when larger)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample draw (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative error per layer, used as given: no widening to the measured rounding noise "
                        "(default: by stored and compute dtype, widened to 2x the noise floor, see docs)")
    p.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                   help="skip the padded-batch reference that measures each layer's rounding noise (fixed "
                        "tolerance only)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of OUT/recipe.resolved.yaml (e.g. a moved model path)")
    p.add_argument("--skip-hash", action="store_true", help="skip re-hashing the shards (values only)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _device_problem(name: str) -> str | None:
    """Why `--device name` cannot run the reference here (not a torch device, or CUDA absent), None if it can."""
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        return f"not a torch device ({str(e).splitlines()[0][:120]})"
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def main(argv: list[str] | None = None) -> int:
    """`dflash-prep verify OUT [--num-samples N] [--seed S]`: 0 pass, 1 fail, 2 cannot verify."""
    args = build_parser().parse_args(argv)
    if args.num_samples < 1:
        print("error: --num-samples must be >= 1", file=sys.stderr)
        return 2
    if args.tolerance is not None and not 0 <= args.tolerance < float("inf"):  # NaN too: it would fail every layer
        print(f"error: --tolerance must be a finite number >= 0 (a relative error), got {args.tolerance}",
              file=sys.stderr)
        return 2
    if args.device is not None and (problem := _device_problem(args.device)):
        print(f"error: --device {args.device}: {problem}", file=sys.stderr)
        return 2
    import transformers

    transformers.logging.set_verbosity_error()  # no kernel-fallback notices on the console
    quiet = args.json
    try:
        report = verify(args.out, args.num_samples, args.seed, args.overrides, args.device, args.tolerance,
                        check_shards=not args.skip_hash, noise_floor=args.noise_floor,
                        log=(lambda *a: None) if quiet else (lambda *a: print(*a, flush=True)), progress=not quiet)
    except CannotVerify as e:
        print(f"error: cannot verify: {e}", file=sys.stderr)
        return 2
    if report.is_main_process:
        print(json.dumps(_finite_or_null(report.to_json()), indent=2, allow_nan=False) if args.json
              else format_report(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

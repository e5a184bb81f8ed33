"""`verify`: the checks in order (the output and its recipe, the integrity of the shards, the reference model, the drawn
samples against it), one report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dflash_prep.commands.verify.compare import choose_samples, compare_chosen
from dflash_prep.commands.verify.judge import NOISE_FLOOR_CAP, NOISE_FLOOR_FACTOR, tolerance_for
from dflash_prep.commands.verify.reference import (
    hint_parallelism,
    num_launched_processes,
    reference_model,
    tensor_parallel_replica,
)
from dflash_prep.commands.verify.report import CannotVerify, VerifyReport
from dflash_prep.recipe.location import as_location, is_remote_path

RECIPE_NAME = "recipe.resolved.yaml"


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


def verify(out_dir: str | Path, num_samples: int = 8, seed: int = 0, overrides: list[str] | None = None,
           device: str | None = None, tolerance: float | None = None, check_shards: bool = True,
           log=print, progress: bool = False, noise_floor: bool = True, widen: bool | None = None,
           fp8_reference: str = "fp8") -> VerifyReport:
    """Run the checks of the package docstring; raises `CannotVerify` when they cannot run.

    `noise_floor=False` skips the padded-batch reference (the fixed tolerance only). `widen` (default: when no
    `tolerance` is given) lets a layer pass up to NOISE_FLOOR_FACTOR x its measured noise floor. `fp8_reference`,
    for an extraction that ran a block-FP8 checkpoint as FP8 (FP8_REFERENCES): "fp8" (default) re-runs each sample
    alone through the same FP8 model, within the compute dtype's tolerance (the extraction's own invariant: its
    batches and packing change nothing); "dequantized" through the same checkpoint dequantized, within
    FP8_COMPUTE_TOLERANCE more (how far the FP8 model is from its bf16 twin: on random weights the format's error
    exceeds that allowance, bench/fp8_emulation.py)."""
    from dflash_prep.consume.export import sample_ids_by_shard
    from dflash_prep.consume.shard_format import OutputLayout, shards_of
    from dflash_prep.target.fp8_weights import FP8_COMPUTE_TOLERANCE, fp8_gemm_available

    t0 = time.perf_counter()
    out_dir = as_location(out_dir)  # a folder, or an object-store URL (recipe/location.py)
    manifest, recipe, config, layer_ids = _output_and_recipe(out_dir, overrides)
    layout = OutputLayout.from_manifest(manifest)
    replica, state = tensor_parallel_replica(recipe, config) if num_launched_processes() > 1 else (None, None)
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
    if fp8_reference not in FP8_REFERENCES:
        raise CannotVerify(f"fp8 reference {fp8_reference!r}: one of {', '.join(FP8_REFERENCES)}")
    fp8_run = _ran_as_fp8(recipe, config, made_on)
    if fp8_run and fp8_reference == "fp8" and not fp8_gemm_available(dev):
        log(f"verify: {dev} has no block-scaled FP8 GEMM (a GPU of compute capability 9.0 has): the reference is the "
            f"checkpoint dequantized, within the FP8 allowance (as --fp8-reference dequantized)")
        fp8_reference = "dequantized"
    if fp8_run and fp8_reference == "dequantized":  # the FP8 activations' rounding is allowed for
        from dataclasses import replace

        recipe = replace(recipe, model=replace(recipe.model, fp8_weights="dequantize"))
        tol = tol if tolerance is not None else tol + FP8_COMPUTE_TOLERANCE
    shards = shards_of(out_dir, manifest)
    report = VerifyReport(str(out_dir), manifest["dtype"], recipe.model.dtype, tol, seed, [],
                          is_main_process=state is None or state.is_main_process, noise_floor_measured=noise_floor,
                          widen=noise_floor and (tolerance is None if widen is None else widen),
                          fp8_reference=fp8_reference if fp8_run else None)
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
        f"computed in {recipe.model.dtype}{FP8_REFERENCE_WORDS[fp8_reference] if fp8_run else ''}); "
        f"{_noise_floor_policy(report)}")
    hint_parallelism(out_dir, recipe, replica, dev, log)
    model = reference_model(recipe, config, dev, report, log, manifest.get("kernels"), replica)
    compare_chosen(model, shards, ids_by_shard, set(chosen), layout, layer_ids, dev, tol, report, log)
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
        recipe = _load_stored_recipe(recipe_path, overrides, load_recipe)
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


def _load_stored_recipe(recipe_path, overrides, load_recipe):
    """The output's resolved recipe (its paths are absolute); one in an object store is read through a local copy."""
    if not is_remote_path(recipe_path):
        return load_recipe(recipe_path, overrides)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dflash-prep-verify-") as tmp:
        local = Path(tmp) / RECIPE_NAME
        local.write_bytes(recipe_path.read_bytes())
        return load_recipe(local, overrides)


def _noise_floor_policy(report: VerifyReport) -> str:
    if not report.noise_floor_measured:
        return "no noise floor (--no-noise-floor): the fixed tolerance only"
    if not report.widen:
        return ("noise floor measured (padded batch vs alone) but not used: the tolerance as given (--tolerance)")
    return (f"a layer may also reach {NOISE_FLOOR_FACTOR:g} x its rounding noise (its padded-batch reference vs "
            f"alone; a noise above {NOISE_FLOOR_CAP:g} relative is not used)")


FP8_REFERENCES = ("fp8", "dequantized")
FP8_REFERENCE_WORDS = {"fp8": "; an FP8 run against the same FP8 model, each sample alone",
                       "dequantized": "; an FP8 run against its dequantized checkpoint"}


def _ran_as_fp8(recipe, config, made_on: str | None) -> bool:
    """The extraction ran a block-FP8 checkpoint as FP8 (a CUDA extraction with `model.fp8_weights: auto`): its
    reference is then the FP8 model alone, or (`fp8_reference="dequantized"`) the same checkpoint dequantized
    (fp8_weights.py) within FP8_COMPUTE_TOLERANCE more."""
    from dflash_prep.target.fp8_weights import block_fp8_format

    return (recipe.model.fp8_weights == "auto" and made_on in (None, "cuda")
            and block_fp8_format(config) is not None)

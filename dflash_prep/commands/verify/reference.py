"""The reference verify compares against: transformers' own forward of a sample run alone (and of a right-padded batch,
for the noise floor), on the model rebuilt from the output's recipe with the extraction's kernels, on one device, split
by layers over a replica's GPUs, or as the tensor-parallel replica that made the output."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from dflash_prep.commands.verify.report import CannotVerify, VerifyReport


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


def num_launched_processes() -> int:
    """Processes of this launch (accelerate / torchrun set WORLD_SIZE); 1 for a plain `dflash-prep verify`."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def tensor_parallel_replica(recipe, config):
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


def hint_parallelism(out_dir: Path, recipe, replica, dev: torch.device, log) -> None:
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



def reference_model(recipe, config, dev: torch.device, report: VerifyReport, log,
                     extraction_kernels: dict | None = None, replica=None):
    """The whole model (every layer: the reference is the whole HF forward) with the recipe's kernels on `dev`; with
    `model.gpus_per_replica` N > 1, split by layers over the first N GPUs (one process; replica.py), whatever the
    extraction's process model (tensor parallel or layer split hold the same weights); on a CPU, a replica's
    random weights are rebuilt as the replica draws them."""
    from dflash_prep.target.kernels import apply_kernels
    from dflash_prep.target.model import load_model

    t_load = time.perf_counter()
    n = recipe.model.gpus_per_replica
    if replica is not None:  # this process is one of a tensor-parallel replica (tensor_parallel_replica)
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
    kernels = reference_kernels(recipe, config, dev, extraction_kernels)
    apply_kernels(model, kernels)
    report.kernels = list(kernels.names)
    log(f"verify: model loaded in {time.perf_counter() - t_load:.1f}s on {dev} ({report.reference}); kernels: "
        f"{', '.join(kernels.names) or 'eager'}{f' ({kernels.reason})' if kernels.reason else ''}")
    return model


def reference_kernels(recipe, config, dev: torch.device, extraction_kernels: dict | None = None):
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


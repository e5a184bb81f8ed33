"""The first stage of a run: this process's rank and logging, then every check of the job that can fail before any
weights load (config, layer ids, replica, kernels, packing, token budget, tokenizer, data source, identity)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dflash_prep import __version__
from dflash_prep.commands.cost import batch_cost_model
from dflash_prep.commands.extract.console import setup_logging
from dflash_prep.commands.extract.peers import Peers
from dflash_prep.commands.job import Run, refuse_unsafe_output_dir, run_identity
from dflash_prep.data.rows import check_data_source, check_recipe_chat_template
from dflash_prep.faults import Faults
from dflash_prep.recipe.location import is_remote
from dflash_prep.recipe.schema import Recipe, RecipeError
from dflash_prep.target.budget import resolve_token_budget
from dflash_prep.target.kernels import configure_triton_cache, select_kernels
from dflash_prep.target.layers import num_decoder_layers, resolve_layer_ids
from dflash_prep.target.model import check_context, check_weight_files, load_config, load_tokenizer
from dflash_prep.target.packing import select_packing
from dflash_prep.target.replica import TENSOR_PARALLEL, ReplicaAgreement, replica_of_process

log = logging.getLogger("dflash_prep")


def start(recipe: Recipe) -> Run:
    """This process's rank and logging; then everything that can be wrong with the recipe fails here, before any
    weights load (config, layer ids, kernels, token budget, tokenizer, data source, identity)."""
    from accelerate import PartialState

    t_start = time.perf_counter()
    # Without GPUs, accelerate only forms a process group when told it is a CPU job (gloo).
    state = PartialState(cpu=not torch.cuda.is_available())
    remote = _remote_output(recipe)
    out_dir = remote.staging if remote is not None else Path(recipe.output.dir)
    # first, by every process: a collective
    peers = Peers(state, out_dir, recipe.output.peer_timeout_seconds, remote=remote)
    refuse_unsafe_output_dir(recipe)
    setup_logging(out_dir, state.process_index, state.is_main_process)  # lines held until the claim: no file yet
    log.info("dflash-prep %s: rank %d of %d on %s", __version__, state.process_index, state.num_processes,
             state.device)
    run = _checked_run(recipe, state, out_dir, t_start)
    run.remote = remote
    # Made only once every check passed: a refused job creates nothing. (Made before the checks and removed on a
    # refusal, two ranks refusing at once raced: one removed the folder while the other was still making it.)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a parent that is a file, a read-only or virtual filesystem: no run can fix that
        raise RecipeError(f"recipe key `output.dir` = {str(out_dir)!r}: cannot create it ({e.strerror or e})") \
            from None
    peers.processes_per_replica = run.replica.processes_per_replica
    run.peers = peers
    return run


def _remote_output(recipe: Recipe):
    """An object-store `output.dir` (store/remote.py) with this node's staging folder, else None."""
    if not is_remote(recipe.output.dir):
        return None
    from dflash_prep.store.remote import RemoteOutput, default_staging_dir

    staging = Path(recipe.output.staging_dir).expanduser() if recipe.output.staging_dir \
        else default_staging_dir(recipe.output.dir)
    return RemoteOutput(recipe.output.dir, recipe.output.storage_options, staging.resolve())


def _checked_run(recipe: Recipe, state, out_dir: Path, t_start: float) -> Run:
    """`start`'s checks and the Run they give (RecipeError and the data errors on a bad job)."""
    # Before anything imports Triton: compiled kernels and autotuning shared by the node's ranks and later runs.
    triton_cache = configure_triton_cache(recipe.model.triton_cache_dir) if state.device.type == "cuda" else None
    if triton_cache is not None and state.is_main_process:
        log.info("triton cache: %s (autotuning cached: %s; from the %s)", triton_cache["dir"],
                 triton_cache["autotuning"], triton_cache["source"])
    config = load_config(recipe.model)
    check_weight_files(recipe.model)
    context = check_context(recipe, config)  # data.max_length within the model's positions
    num_layers = num_decoder_layers(config)
    layer_ids = resolve_layer_ids(recipe.layers, num_layers)
    replica = replica_of_process(state, recipe, config)
    kernels = select_kernels(recipe.model.kernels, config, state.device.type,
                             tensor_parallel=replica.parallelism == TENSOR_PARALLEL)
    packing = select_packing(recipe.batching.packing, config, state.device.type, kernels.names,
                             several_gpus=replica.gpus_per_replica > 1, compute_dtype=recipe.model.dtype)
    recipe, budget_how = resolve_token_budget(
        recipe, config, layer_ids, num_layers,
        torch.cuda.get_device_properties(state.device).total_memory if state.device.type == "cuda" else None)
    if budget_how and state.is_main_process:
        log.info("batching.max_tokens_per_batch: auto = %d (%s)", recipe.batching.max_tokens_per_batch, budget_how)
    tokenizer = load_tokenizer(recipe.model)
    check_data_source(recipe.data)
    check_recipe_chat_template(recipe.data)
    faults = Faults.from_env()  # test-only fault injection (faults.py); None unless DFLASH_PREP_FAULTS is set
    if faults is not None:
        log.warning("fault injection active (DFLASH_PREP_FAULTS): %s", faults)
    return Run(recipe=recipe, state=state, out_dir=out_dir, config=config, num_layers=num_layers,
               layer_ids=layer_ids, kernels=kernels, tokenizer=tokenizer, faults=faults, t_start=t_start,
               replica=replica, identity=run_identity(recipe, config, layer_ids, tokenizer, state.is_main_process),
               triton_cache=triton_cache, packing=packing, agreement=ReplicaAgreement.for_layout(replica),
               # the split's cost numbers (a meta-device build: before the model loads on a thread of its own)
               cost_model=batch_cost_model(recipe, config, layer_ids, num_layers), context_length=context)

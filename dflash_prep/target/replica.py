"""Replicas: `model.gpus_per_replica: N` GPUs of one node hold one copy of the target; data parallelism runs over
replicas.

A run has `num_replicas` replicas; the global plan's uncommitted batches are split over replicas
(`planner.split_across_ranks(todo, num_replicas)[replica_index]`), and each replica writes its shards under its
own `rank-RRRRR` folder from exactly one process (its writer). With N = 1 (the default) a replica is one process
on one GPU: replica index = process index, every process writes, nothing changes.

Process model for N > 1 (`choose_parallelism`, `model.replica_parallelism`), named in the log and in
`OUT/summary.json` (`replicas`):

- `tensor_parallel` (`auto` where transformers has a plan): transformers shards every decoder layer over the
  replica's N GPUs (`DistributedConfig(tp_size=N, tp_plan="auto")`; the architecture's config class must carry a
  `base_model_tp_plan`, as transformers itself decides in `PreTrainedModel.supports_tp_plan`), from a checkpoint
  or, for random weights, materializing each shard on its GPU (model.load_replica_model). One process per GPU:
  launch with `--num_processes` = number of GPUs; ONE replica per run (`check_tensor_parallel_replicas` says
  why). The N processes of a replica (consecutive process indexes on one node) form its tensor-parallel group
  and all run every forward; each holds the whole residual stream that the capture hooks read (the row-parallel
  projections end in an all-reduce: a plain tensor, not a DTensor, leaves every decoder layer; checked on
  transformers 5.17 and 5.24), and only the replica's first process (`rank_in_replica == 0`) writes. Every
  decision that changes which forwards run (a stop, a failure, an OOM split) is agreed over the replica
  (`ReplicaAgreement`).
- `layer_split` (`auto` for an architecture without a plan or a launch of GPUs / N processes per node, or asked
  for): one process per replica holds the replica's N GPUs and the decoder layers are spread over them with a
  `device_map` (accelerate balances them): launch with `--num_processes` = GPUs / N. Only one GPU computes at a
  time.

Errors (`RecipeError`, exit code 2, before any weights load) name `model.gpus_per_replica`: N larger than the
node's GPUs (a replica is GPUs of one node), the node's GPUs not a multiple of N, a launch whose processes do
not fit the process model, or several tensor-parallel replicas.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from dflash_prep.recipe.schema import RecipeError

log = logging.getLogger("dflash_prep")
CPU_REPLICAS_ENV = "DFLASH_PREP_CPU_REPLICAS"  # test-only: tensor-parallel replicas of CPU processes

SINGLE_GPU, TENSOR_PARALLEL, LAYER_SPLIT = "single_gpu", "tensor_parallel", "layer_split"
KEY = "model.gpus_per_replica"


@dataclass(frozen=True)
class ReplicaLayout:
    """This process's place in the run's replicas.

    gpus_per_replica: N; parallelism: `single_gpu` (N = 1), `tensor_parallel` or `layer_split`;
    replica_index in [0, num_replicas); rank_in_replica in [0, N) under tensor parallelism, else 0;
    gpu_ids: the local CUDA ordinals of the replica's GPUs (empty without GPUs)."""

    gpus_per_replica: int
    parallelism: str
    replica_index: int
    num_replicas: int
    rank_in_replica: int
    gpu_ids: tuple[int, ...]

    @property
    def is_writer(self) -> bool:
        """One process per replica writes its shards: the replica's first."""
        return self.rank_in_replica == 0

    @property
    def processes_per_replica(self) -> int:
        return self.gpus_per_replica if self.parallelism == TENSOR_PARALLEL else 1

    def describe(self) -> str:
        """One line for the log, e.g. `replica 1 of 2 (tensor_parallel over GPUs [4, 5, 6, 7], writer)`."""
        role = "writer" if self.is_writer else f"tensor-parallel rank {self.rank_in_replica}, not writing"
        return (f"replica {self.replica_index} of {self.num_replicas} ({self.parallelism} over GPUs "
                f"{list(self.gpu_ids)}, {role})")

    def record(self) -> dict:
        """The summary's `replicas` entry."""
        return {"gpus_per_replica": self.gpus_per_replica, "parallelism": self.parallelism,
                "num_replicas": self.num_replicas, "processes_per_replica": self.processes_per_replica}


def supports_tensor_parallel(config) -> bool:
    """Whether transformers has a tensor-parallel plan for the architecture: the (text) config class's
    `base_model_tp_plan` (what `PreTrainedModel.supports_tp_plan` falls back to; model classes add none for the
    decoders this project captures)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None))


def choose_parallelism(config, gpus_per_replica: int, preference: str = "auto",
                       one_process_per_replica: bool = False) -> str:
    """`single_gpu` for N = 1; else `model.replica_parallelism`: `auto` is `tensor_parallel` where transformers
    has a plan for the architecture, `layer_split` otherwise or when the launch runs one process per replica
    (`one_process_per_replica`: GPUs / N processes per node); `tensor_parallel` asked for an architecture without
    a plan raises RecipeError (exit code 2, before any weights load)."""
    if gpus_per_replica == 1:
        return SINGLE_GPU
    if preference == LAYER_SPLIT or (preference == "auto" and one_process_per_replica):
        return LAYER_SPLIT
    if supports_tensor_parallel(config):
        return TENSOR_PARALLEL
    if preference == TENSOR_PARALLEL:
        raise RecipeError(f"recipe key `model.replica_parallelism` = {TENSOR_PARALLEL!r}: transformers has no "
                          f"tensor-parallel plan for {type(config).__name__}; use `auto` or `{LAYER_SPLIT}`")
    return LAYER_SPLIT


def replica_layout(process_index: int, num_processes: int, local_process_index: int, num_local_processes: int,
                   num_local_gpus: int, gpus_per_replica: int, parallelism: str) -> ReplicaLayout:
    """The replica of a process, from accelerate's process index / number of processes / local process index /
    number of processes on this node, and the node's GPU count. Raises RecipeError naming `model.gpus_per_replica`
    when the GPUs or the processes do not divide into replicas of N GPUs of one node."""
    n = gpus_per_replica
    if n == 1:
        gpus = (local_process_index,) if num_local_gpus else ()
        return ReplicaLayout(1, SINGLE_GPU, process_index, num_processes, 0, gpus)
    if n > num_local_gpus:
        fix = f"set it to at most {num_local_gpus}" if num_local_gpus else "set it to 1 without GPUs"
        raise RecipeError(f"recipe key `{KEY}` = {n}: this node has {num_local_gpus} GPU(s); a replica is GPUs of "
                          f"one node ({fix})")
    if num_local_gpus % n:
        raise RecipeError(f"recipe key `{KEY}` = {n}: does not divide this node's {num_local_gpus} GPUs into "
                          f"replicas (world = GPUs / {n}); choose a divisor of {num_local_gpus}")
    if parallelism == TENSOR_PARALLEL:
        if num_local_processes != num_local_gpus:
            raise RecipeError(
                f"recipe key `{KEY}` = {n}: tensor parallelism runs one process per GPU, but this node runs "
                f"{num_local_processes} process(es) for {num_local_gpus} GPUs; launch with --num_processes "
                f"{num_local_gpus} per node")
        rank_in_replica = local_process_index % n
        first_gpu = local_process_index - rank_in_replica
        return ReplicaLayout(n, TENSOR_PARALLEL, process_index // n, num_processes // n, rank_in_replica,
                             tuple(range(first_gpu, first_gpu + n)))
    if num_local_processes != num_local_gpus // n:
        raise RecipeError(
            f"recipe key `{KEY}` = {n}: a layer split ({parallelism}) runs one process per replica of {n} GPUs, but "
            f"this node runs {num_local_processes} process(es) for {num_local_gpus} GPUs; launch with "
            f"--num_processes {num_local_gpus // n} per node")
    first_gpu = local_process_index * n
    return ReplicaLayout(n, LAYER_SPLIT, process_index, num_processes, 0, tuple(range(first_gpu, first_gpu + n)))


def check_tensor_parallel_replicas(layout: ReplicaLayout) -> None:
    """Tensor parallelism runs ONE replica per run (its N processes are the whole world): transformers builds its
    device mesh over every process of the run, and the only way it offers to have several replicas in it
    (`DistributedConfig(dp_replicate_size=...)`, transformers >= 5.2x; none in 5.17) wraps the model in FSDP,
    whose forwards gather weights across replicas, so replicas running different batches would wait on each
    other. Several replicas: a layer split (one process per replica). RecipeError otherwise."""
    if layout.parallelism == TENSOR_PARALLEL and layout.num_replicas > 1:
        n = layout.gpus_per_replica
        raise RecipeError(
            f"recipe key `{KEY}` = {n}: tensor parallelism runs one replica per run, this launch makes "
            f"{layout.num_replicas}; use gpus_per_replica = the run's {n * layout.num_replicas} GPUs (one node), or "
            f"a layer split: model.replica_parallelism: layer_split and --num_processes GPUs / {n} per node")


def load_arguments(layout: ReplicaLayout, max_memory_bytes_per_gpu: int = 0) -> dict:
    """The keyword arguments of transformers' `from_pretrained` that place the target on the replica's GPUs (what
    `model.load_replica_model` passes, for a checkpoint and for random weights alike), for N > 1:
    - tensor_parallel: `{"distributed_config": DistributedConfig(tp_size=N, tp_plan="auto")}` (one replica: its
      N processes are the run's world, check_tensor_parallel_replicas);
    - layer_split: `{"device_map": "auto", "max_memory": {gpu: max_memory_bytes_per_gpu for each replica GPU}}`
      (only the replica's GPUs, no CPU offload; layers balanced over them by accelerate)."""
    if layout.parallelism == TENSOR_PARALLEL:
        from transformers.distributed.configuration_utils import DistributedConfig

        return {"distributed_config": DistributedConfig(tp_size=layout.gpus_per_replica, tp_plan="auto")}
    if layout.parallelism == LAYER_SPLIT:
        return {"device_map": "auto", "max_memory": {gpu: max_memory_bytes_per_gpu for gpu in layout.gpu_ids}}
    raise ValueError(f"no replica placement for {layout.parallelism}")


class ReplicaAgreement:
    """The processes of a tensor-parallel replica take every decision that changes which forwards run together:
    each runs the same collectives in the same order, so one process leaving the loop (a stop signal, a write
    error or a fatal NaN seen only by the writer) or splitting a batch after an OOM alone would leave the others
    waiting in a collective for ever.

    `agree(*flags)` is an all-reduce (max) of a few booleans over the replica's processes, on a gloo group of
    its own (CPU tensors: no GPU sync, and never interleaved with the forward's NCCL collectives); called once per
    batch by the loop (stop requested, failed). `agree_attempt(oom)` runs once per forward attempt of the OOM
    backoff: it also compares how many collectives each process has issued on the tensor-parallel group (its
    sequence number): equal, a split is safe (every process stopped at the same collective, or after the last);
    different, a process ran out of memory between two collectives its peers went past, and a retry would pair
    mismatched collectives, so the run stops (ExtractionError, resumable). With one process per replica both
    return at once and cost nothing."""

    def __init__(self, group=None, tp_group=None):
        self.group = group
        self.tp_group = tp_group

    @classmethod
    def for_layout(cls, layout: ReplicaLayout) -> "ReplicaAgreement":
        """Every process of the world must call this (group creation is collective), in the same order."""
        if layout.processes_per_replica == 1:
            return cls(None)
        import torch.distributed as dist

        n = layout.processes_per_replica
        groups = [dist.new_group(list(range(r * n, (r + 1) * n)), backend="gloo")
                  for r in range(layout.num_replicas)]
        return cls(groups[layout.replica_index])

    def watch(self, model) -> None:
        """Follow the collectives of `model`'s tensor-parallel group (its DTensor parameters' mesh)."""
        if self.group is not None:
            self.tp_group = tensor_parallel_group(model)

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """-> for each flag, whether any process of the replica raised it."""
        if self.group is None:
            return tuple(bool(f) for f in flags)
        return tuple(v > 0 for v in self._max([int(bool(f)) for f in flags]))

    def agree_attempt(self, oom: bool) -> bool:
        """-> whether any process of the replica ran out of memory in this forward attempt (then all split it).
        Raises ExtractionError when the processes' collectives are out of step (see the class docstring)."""
        if self.group is None:
            return oom
        issued = collectives_issued(self.tp_group)
        any_oom, most, minus_least = self._max([int(oom), issued, -issued])
        if most != -minus_least:
            from dflash_prep.errors import ExtractionError

            raise ExtractionError(
                f"out of memory inside a tensor-parallel forward on some process of the replica, between collectives "
                f"the others went past ({-minus_least} vs {most} issued): a split would pair mismatched collectives, "
                f"so the run stops; committed shards are intact; lower batching.max_tokens_per_batch and re-run the "
                f"same command to resume")
        return any_oom > 0

    def _max(self, values: list[int]) -> list[int]:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in tensor.tolist()]


def tensor_parallel_group(model):
    """The process group of a tensor-parallel model's collectives (its DTensor parameters' mesh, the `tp`
    dimension of a 2-D one), or None."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            if mesh.ndim == 1:
                return mesh.get_group()
            names = mesh.mesh_dim_names or ()
            return mesh.get_group("tp") if "tp" in names else None
    return None


def collectives_issued(group) -> int:
    """Collectives this process has issued on `group` (torch's per-group sequence number, NCCL and gloo), or 0
    when unknown (no group; then the check compares nothing)."""
    if group is None:
        return 0
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return 0


def replica_of_process(state, recipe, config) -> ReplicaLayout:
    """This process's replica (accelerate's `state`: which one, how many, its GPUs, whether it writes); RecipeError
    when the GPUs or the launch do not divide into replicas of `model.gpus_per_replica`. Used by the extraction and
    by verify's tensor-parallel reference. Test-only: without GPUs, `DFLASH_PREP_CPU_REPLICAS=1` lets a node's
    processes stand for its GPUs, so a tensor-parallel replica runs over CPU processes (gloo)."""
    import torch

    n = recipe.model.gpus_per_replica
    num_local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
    num_local_gpus = torch.cuda.device_count()
    one_per_replica = bool(num_local_gpus) and num_local_processes == num_local_gpus // n < num_local_gpus
    parallelism = choose_parallelism(config, n, recipe.model.replica_parallelism, one_per_replica)
    if not num_local_gpus and parallelism == TENSOR_PARALLEL and os.environ.get(CPU_REPLICAS_ENV) == "1":
        num_local_gpus = num_local_processes
    replica = replica_layout(state.process_index, state.num_processes, state.local_process_index,
                             num_local_processes, num_local_gpus, n, parallelism)
    check_tensor_parallel_replicas(replica)
    if replica.parallelism == LAYER_SPLIT:  # the inputs, the capture buffers, the copy events: its first GPU
        torch.cuda.set_device(replica.gpu_ids[0])
    if n > 1:
        log.info("%s", replica.describe(), extra={"console": state.is_main_process})
    return replica

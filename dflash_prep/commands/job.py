"""The job an output folder belongs to: what identifies it, and the run's claim on the folder.

A run resumes into an output only when the output is this job's: the recipe keys that decide the content (model,
tokenizer, data keys, layers, storage dtype) and the content itself (identity.py: the tokenized rows, the
weights) must match; anything else is refused (`OutputMismatchError`, exit 2) naming what changed. Before
anything is created, an `output.overwrite` on a folder that is not an output of this tool, and an output inside
the data, are refused (RecipeError). The claim itself, the repair and the plan's loading run in order in
commands/extract/claim.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_prep.data.rows import data_files_fingerprint, describe_data_files_change
from dflash_prep.plan.planner import PlannedBatch
from dflash_prep.recipe.fingerprints import (
    describe_files_change,
    describe_weights_change,
    input_files_sha256,
    named_inputs,
    portable_files,
    portable_location,
    weights_fingerprint,
)
from dflash_prep.recipe.location import StoreRefusedError, is_remote
from dflash_prep.recipe.schema import Recipe, RecipeError
from dflash_prep.store.locks import LOCKS_DIR, OutputBusyError
from dflash_prep.store.manifest import (
    MANIFEST_NAME,
    STATE_NAME,
    OutputStateError,
    damaged_state,
    read_committed,
    read_manifest,
    read_state_json,
)
from dflash_prep.store.records import FAILED_NAME, SUMMARY_NAME
from dflash_prep.target.model import describe_source, hidden_size_of, model_fingerprint, tokenizer_fingerprint

log = logging.getLogger("dflash_prep")

PLAN_NAME = "plan.json"
RECIPE_NAME = "recipe.resolved.yaml"
SKIPPED_NAME = "skipped.jsonl"


class OutputMismatchError(RuntimeError):
    """Resuming into an output made by a different job."""


# What refuses a run (exit code 2, one line): a bad recipe or input, an output of another job, a damaged one, or
# one another run holds.
REFUSALS = (RecipeError, OutputMismatchError, OutputBusyError, OutputStateError, StoreRefusedError)


def run_identity(recipe: Recipe, config, layer_ids: list[int], tokenizer, is_main: bool) -> dict:
    """What must match between an output and a run that resumes into it. The weights', the small input files' and
    the data files' fingerprints (recipe/fingerprints.py, data/rows.py) are read by the main process only; the
    tokenized rows' fingerprint (`data_rows`) is added once they exist. Files are named as they read from any
    install and any place when compared (`portable_identity`): moving a folder, or reinstalling the package, keeps
    the job."""
    return {
        "model": model_fingerprint(recipe.model, config),  # the form of earlier versions (a local folder's path)
        "model_content": model_fingerprint(recipe.model, config, portable=True),
        "model_source": describe_source(recipe.model),
        "weights": weights_fingerprint(recipe.model) if is_main else None,
        "input_files": input_files_sha256(recipe) if is_main else None,
        "data_files": data_files_fingerprint(recipe.data) if is_main else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": data_identity(recipe),
        "layer_ids": layer_ids,
        "capture_final": recipe.layers.capture_final,
        "dtype": recipe.output.dtype,
        # what a follower (reader.py, follow=True) decodes the shards with before the manifest exists
        "hidden_size": hidden_size_of(config),
    }


def data_identity(recipe: Recipe) -> dict:
    """The `data` section as the job's identity keeps it (not the settings that change how, not what, is read)."""
    return {k: v for k, v in recipe.to_dict()["data"].items() if k not in ("num_proc", "strict", "allow_beyond_context")}


def portable_identity(identity: dict) -> dict:
    """`identity` with its file names in the form that travels (recipe/fingerprints.py): `data.path` and
    `data.chat_template` by their package-relative or last component (the content is in `data_files`,
    `input_files` and `data_rows`), the data files relative to their common folder. Applied to a stored identity
    too, so an output of an earlier version (absolute names) compares alike. An identity that has
    `model_content` is judged on it: `model` (a local folder's path inside) and `model_source` (words) are not
    compared then."""
    out = dict(identity)
    if isinstance(out.get("data"), dict):
        out["data"] = {k: portable_location(v) if k in ("path", "chat_template") else v
                       for k, v in out["data"].items()}
    if isinstance(out.get("data_files"), dict) and isinstance(out["data_files"].get("files"), dict):
        out["data_files"] = {**out["data_files"], "files": portable_files(out["data_files"]["files"])}
    return out


def identity_diffs(previous: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, e.g. ['data.max_length', 'layer_ids']."""
    diffs = []
    for key in sorted(set(previous) | set(current)):
        a, b, name = previous.get(key), current.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += identity_diffs(a, b, f"{name}.")
        elif a != b:
            diffs.append(name)
    return diffs


def _difference(key: str, previous: dict, current: dict, shown: dict | None = None) -> str:
    """How `key` of the identity differs, in words (`shown`: a data file's name -> the path this run reads it at)."""
    if key in ("model", "tokenizer"):
        return f"{key} fingerprint differs"
    if key == "weights":
        return f"model weights differ ({describe_weights_change(previous[key], current[key])})"
    if key == "data_files":
        a, b = previous[key].get("files", {}), current[key].get("files", {})
        if set(a) == set(b):
            changed = [str((shown or {}).get(n, n)) for n in sorted(a) if a[n] != b[n]]
            return (f"data files differ: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}: its bytes "
                    f"changed since the output was made")
        return f"data files differ: {describe_data_files_change(previous[key], current[key])}"
    if key == "input_files":
        return f"input files differ: {describe_files_change(previous[key], current[key], shown)}"
    if key == "model_content":
        return "model fingerprint differs (its config, dtype or where its weights come from)"
    if key == "data_rows":
        return (f"data rows differ: the tokenized rows of data.path are not the ones the output was made from "
                f"({previous[key]['num_rows']} kept rows then, {current[key]['num_rows']} now; edited, shuffled "
                f"or replaced in place)")

    def value(d, dotted):
        for part in dotted.split("."):
            d = d.get(part) if isinstance(d, dict) else None
        return d
    return f"{key}: output has {value(previous, key)!r}, this run has {value(current, key)!r}"


def check_identity(out_dir: Path, identity: dict, recipe: Recipe | None = None) -> None:
    """Refuse (OutputMismatchError, one line) when `out_dir` holds the output of another job. Keys this run has not
    computed (None) and keys an older output did not record are not compared. `recipe`: to name a changed input
    file by its path."""
    path = out_dir / STATE_NAME
    if not path.exists():
        return
    files = (identity.get("data_files") or {}).get("files") or {}
    shown = dict(zip(portable_files(files), files))  # a data file's portable name -> its path in this run
    shown.update({name: str(path) for name, path in (named_inputs(recipe) or {} if recipe is not None else {}).items()})
    previous, identity = portable_identity(read_state_json(path)["identity"]), portable_identity(identity)
    atomic_keys = ("data_files", "data_rows", "input_files")  # compared whole, described by _difference
    by_content = previous.get("model_content") is not None and identity.get("model_content") is not None
    diffs = []
    for key in sorted(set(previous) | set(identity)):
        if previous.get(key) is None or identity.get(key) is None:
            continue
        if by_content and key in ("model", "model_source"):
            continue
        if key == "weights":  # the keys both fingerprints hold (an older output has fewer)
            diffs += [key] if describe_weights_change(previous[key], identity[key]) is not None else []
        elif key in atomic_keys or not (isinstance(previous[key], dict) and isinstance(identity[key], dict)):
            diffs += [key] if previous[key] != identity[key] else []
        else:
            diffs += identity_diffs(previous[key], identity[key], f"{key}.")
    if diffs:
        details = "; ".join(_difference(k, previous, identity, shown) for k in diffs)
        raise OutputMismatchError(
            f"{out_dir} holds an extraction of a different job ({details}). Use another output.dir, or "
            f"--set output.overwrite=true to start afresh.")


_OUTPUT_MARKERS = (STATE_NAME, PLAN_NAME, MANIFEST_NAME)
# what a run may have written before its first marker (a run stopped at start-up): not another tool's files
_RUN_NAMES = {"logs", LOCKS_DIR, "index", "shards", SKIPPED_NAME, FAILED_NAME, SUMMARY_NAME, RECIPE_NAME,
              "kernels.jsonl", "token_freq.safetensors"}


def _foreign_names(names: set[str]) -> list[str]:
    """The names of a folder without output markers that no run of this tool writes (hidden files aside)."""
    return sorted(n for n in names if not n.startswith(".") and n.removesuffix(".tmp") not in _RUN_NAMES)


def refuse_unsafe_output_dir(recipe: Recipe) -> None:
    """Before anything is created: `output.overwrite` on a folder that is not an output of this tool would delete
    the user's files, and an output inside the data (`data.path` a folder holding it, or a glob matching the
    files a run writes there) would be read back as rows. Both raise RecipeError."""
    if is_remote(recipe.output.dir):
        return  # a store's prefix (remote_output_refusals checks it once the store is reached)
    out_dir = Path(recipe.output.dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(f"recipe key `output.dir` = {str(out_dir)!r} is a file, not a folder; choose a new or "
                          f"empty folder")
    names = {p.name for p in out_dir.iterdir()} if out_dir.is_dir() else set()
    if recipe.output.overwrite and names - {"logs", LOCKS_DIR} and not names & set(_OUTPUT_MARKERS):
        raise RecipeError(
            f"recipe key `output.overwrite` = True: {out_dir} is not a dflash-prep output (no "
            f"{', '.join(_OUTPUT_MARKERS)}; it holds {', '.join(sorted(names)[:5])}...): refusing to delete "
            f"its files; set output.dir to a new or empty folder")
    foreign = _foreign_names(names) if not names & set(_OUTPUT_MARKERS) else []
    if foreign:  # another tool's folder (an export, notes): the run's files would be mixed in with them
        raise RecipeError(
            f"recipe key `output.dir` = {str(out_dir)!r} holds files that are not a dflash-prep output "
            f"({', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}); set output.dir to a new or empty "
            f"folder")
    paths = [recipe.data.path] if isinstance(recipe.data.path, str) else recipe.data.path
    hit = next((h for h in (_written_path_matching_data(p, out_dir) for p in paths) if h is not None), None)
    if hit is not None:
        raise RecipeError(
            f"recipe key `output.dir` = {str(out_dir)!r}: it lies inside the data (`data.path` = "
            f"{recipe.data.path!r} would read {hit} as rows); put the output outside the data")


def _written_path_matching_data(data_path: str, out_dir: Path) -> Path | None:
    """A file the run writes under `out_dir` that `data_path` (a folder or a glob) would read, or None."""
    import fnmatch

    data = Path(data_path).expanduser()
    out_dir = out_dir.resolve()
    written = [out_dir / n for n in (SKIPPED_NAME, FAILED_NAME, SUMMARY_NAME, PLAN_NAME, STATE_NAME, MANIFEST_NAME,
                                     "index/rank-00000.jsonl", "index/rank-00000.done.json",
                                     "shards/rank-00000/shard-000000.tar")]
    if not any(c in data_path for c in "*?["):
        return written[0] if data.is_dir() and out_dir.is_relative_to(data.resolve()) else None

    def matches(parts: list[str], pattern: list[str]) -> bool:
        if not pattern:
            return not parts
        if pattern[0] == "**":
            return any(matches(parts[i:], pattern[1:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and matches(parts[1:], pattern[1:])

    pattern = Path(os.path.abspath(data)).parts
    return next((w for w in written if matches(list(w.parts), list(pattern))), None)


def manifest_readable(out_dir: Path) -> bool:
    """A manifest that reads back (an output finished by some run, unless damaged since)."""
    try:
        read_manifest(out_dir)
        return True
    except (OSError, ValueError):
        return False


def read_stored_plan(path: Path, lengths: list[int]) -> dict:
    """OUT/plan.json, checked against the kept samples' `lengths`: OutputMismatchError when it plans another number
    of samples (the dataset changed), OutputStateError when it is damaged or edited into something that is not a
    plan of them (`_check_stored_plan`)."""
    stored = read_state_json(path)
    if isinstance(stored, dict) and _is_int(stored.get("num_samples")) and stored["num_samples"] != len(lengths):
        raise OutputMismatchError(f"{path} plans {stored['num_samples']} samples but the data has {len(lengths)}: "
                                  f"the dataset changed; use --set output.overwrite=true")
    _check_stored_plan(stored, lengths, path)
    return stored


def _check_stored_plan(stored, lengths: list[int], path: Path) -> None:
    """OutputStateError (one line, exit code 2) unless `stored` is a plan of these samples: its keys, each batch
    `[padded length, [sample indices]]` with indices in range and a length that holds its samples (their sum for
    a packed row, the longest for a padded batch), and every sample in exactly one batch. A plan edited or damaged
    in place would otherwise write a sample twice, or never finish."""
    if not isinstance(stored, dict) or not isinstance(stored.get("batches"), list) \
            or not isinstance(stored.get("batching"), dict) or stored.get("num_samples") != len(lengths):
        raise damaged_state(path, f"expected the keys num_samples (= {len(lengths)}), batching and batches")
    packed, count = bool(stored.get("packed", False)), [0] * len(lengths)
    for i, batch in enumerate(stored["batches"]):
        ok = isinstance(batch, list) and len(batch) == 2 and _is_int(batch[0]) and isinstance(batch[1], list) \
            and batch[1] and all(_is_int(j) and 0 <= j < len(lengths) for j in batch[1])
        if not ok:
            raise damaged_state(path, f"batch {i} is not [padded length, [sample indices in 0..{len(lengths) - 1}]]")
        needed = (sum if packed else max)(lengths[j] for j in batch[1])
        if batch[0] < needed:
            raise damaged_state(path, f"batch {i}: padded length {batch[0]} < the {needed} tokens of its samples")
        for j in batch[1]:
            count[j] += 1
    twice, never = [j for j, c in enumerate(count) if c > 1], [j for j, c in enumerate(count) if c == 0]
    if twice or never:
        raise damaged_state(path, f"samples planned twice: {twice[:5]}, never: {never[:5]}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Run:
    """What the stages of one rank's run share: the recipe (token budget resolved), this process's place in the
    run (accelerate's PartialState, and its replica: replica.py), the target's facts and the job's identity.

    A rank of the output (its shard folder `rank-R`, its share of the plan) is a replica: `rank` is the replica's
    index and `world` the number of replicas (with `model.gpus_per_replica: 1`, the process index and the number
    of processes); only the replica's writer process writes."""

    recipe: Recipe
    state: Any  # accelerate.PartialState
    out_dir: Path
    config: Any  # transformers PretrainedConfig
    num_layers: int
    layer_ids: list[int]
    kernels: Any  # kernels.KernelChoice
    tokenizer: Any
    identity: dict
    faults: Any  # faults.Faults | None (test-only fault injection)
    t_start: float  # time.perf_counter() at the start
    replica: Any  # replica.ReplicaLayout: this process's replica, its GPUs, whether it writes
    triton_cache: dict | None = None  # kernels.configure_triton_cache's record (CUDA runs), else None
    cost_model: Any = None  # planner.BatchCostModel: each batch's predicted seconds, for the split over ranks
    startup_seconds: dict = field(default_factory=dict)  # start, tokenize, plan, model_load(_wait), first_batch
    packing: Any = None  # packing.PackingChoice: packed rows or padded batches (the stored plan's layout wins)
    agreement: Any = None  # replica.ReplicaAgreement: the decisions a tensor-parallel replica's processes share
    inputs_stamp: dict | None = None  # fingerprints.inputs_stamp as the output was claimed (main process)
    remote: Any = None  # remote.RemoteOutput of an object-store output.dir (out_dir is then its staging folder)
    peers: Any = None  # peers.Peers: the waits every process of the run meets at, bounded
    run_id: str | None = None  # this run's id (the main process's, shared): in its leases and its shards' names
    locks: list = field(default_factory=list)  # locks.OutputLock held by this process (run, rank)
    fence: Any = None  # locks.OutputFence / remote.RemoteFence: checked at every commit (claim.py sets it)
    context_length: int | None = None  # model.check_context: the model's positions (None: unknown)

    @property
    def rank(self) -> int:
        return self.replica.replica_index

    @property
    def world(self) -> int:
        return self.replica.num_replicas

    @property
    def is_writer(self) -> bool:
        return self.replica.is_writer

    @property
    def is_main(self) -> bool:
        return self.state.is_main_process

    @property
    def device(self):
        """Where a batch's inputs go: accelerate's device, or the first GPU of a layer-split replica."""
        from dflash_prep.target.replica import LAYER_SPLIT

        if self.replica.parallelism == LAYER_SPLIT:
            import torch

            return torch.device("cuda", self.replica.gpu_ids[0])
        return self.state.device


@dataclass
class RankPlan:
    """The global plan's figures and what is left of it: `todo` over all ranks, `mine` for this rank."""

    lengths: list[int]  # tokens of each kept sample, in dataset order
    stats: dict  # planner.plan_stats of the whole plan
    committed: list  # manifest.read_committed before this run's batches
    todo: list[PlannedBatch]
    mine: list[PlannedBatch]
    predicted_seconds: list[float] = field(default_factory=list)  # each rank's predicted finish (planner)


def committed_records(run: "Run") -> list:
    """The committed shards now: the rank indexes in the store for an object-store output, else in OUT/index."""
    return run.remote.committed() if run.remote is not None else read_committed(run.out_dir)

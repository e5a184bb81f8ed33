"""What the extraction can answer before it imports torch, transformers or datasets (seconds on a cold machine): a
recipe that does not read (a typo: exit code 2) and an output that is already finished with its inputs untouched
(exit code 0, or 3 when it holds more failed samples than the recipe allows); a data source that cannot be read
(`data.path` missing, files of mixed formats) or a model source that cannot load (a missing folder, a hub id with
no hub in reach: target/sources.py) is refused here too, with exit code 2.

Finished means: `output.overwrite` is off, no process holds the output's locks, its manifest and summary read back,
every committed shard is in place (size, first sample) and no uncommitted file is left, and run_state.json's
`finished_inputs` (recipe/fingerprints.py `inputs_stamp`, recorded by the run that finished it) equals this recipe's
stamp now: the same content keys and every local input file of the same size, modification and change time. An
input whose stamp moved is compared by content with the fingerprints the output's identity keeps (`changed_content`:
the small files' sha256, the weights' fingerprint, the data files' sha256): other bytes (weights, tokenizer or template replaced
in place) are refused with exit code 2 naming the file, before torch is imported; the same bytes (a reinstall of the
package, a moved folder, a file written again) go the full way, which finds the output finished. Anything else, a hub
input among them, goes the full way too (the job's content checks decide, as before).

`dflash-prep launch` calls `preflight` with the script's arguments before it imports accelerate, so a typo or a
finished output costs no launcher start-up either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_prep.data.rows import check_data_source
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES
from dflash_prep.recipe.fingerprints import (
    WEIGHT_SUFFIXES,
    describe_files_change,
    describe_weights_change,
    files_sha256,
    input_files_sha256,
    inputs_stamp,
    named_inputs,
    weights_fingerprint,
)
from dflash_prep.recipe.location import is_remote
from dflash_prep.recipe.schema import Recipe, RecipeError, add_recipe_args, load_recipe
from dflash_prep.store.locks import running_holders
from dflash_prep.store.manifest import (
    FINISHED_INPUTS,
    MANIFEST_NAME,
    STATE_NAME,
    OutputStateError,
    damaged_shards,
    read_committed,
    read_manifest,
    read_state_json,
    uncommitted_files,
)
from dflash_prep.store.records import FAILED_NAME, SUMMARY_NAME
from dflash_prep.target.sources import check_model_sources

DESCRIPTION = "The extraction: recipe -> tokenized rows -> global plan -> this rank's batches -> hooks -> shards."


def parse_recipe(argv: list[str] | None) -> Recipe:
    """The recipe of `[--recipe PATH] [--set key=value ...]` (RecipeError when it does not read; argparse exits on
    arguments it does not know)."""
    parser = argparse.ArgumentParser(prog="dflash-prep extract", description=DESCRIPTION)
    add_recipe_args(parser)
    args = parser.parse_args(argv)
    return load_recipe(args.recipe, args.overrides)


class ChangedJobError(RuntimeError):
    """A finished output whose inputs changed in content (weights, tokenizer, template, data files): exit code 2."""


def finished_summary(recipe: Recipe) -> dict | None:
    """The summary of `recipe`'s output when it is finished and its inputs hold what they held when it finished
    (module docstring), else None (the full run decides). Raises ChangedJobError naming the input file that
    changed."""
    if is_remote(recipe.output.dir):
        return None  # an object-store output: the run itself checks it (its lease, the store's indexes)
    out_dir = Path(recipe.output.dir)
    if recipe.output.overwrite or not (out_dir / MANIFEST_NAME).is_file():
        return None
    try:
        if running_holders(out_dir):
            return None
        read_manifest(out_dir)
        state = read_state_json(out_dir / STATE_NAME)
        recorded, now = state.get(FINISHED_INPUTS), inputs_stamp(recipe)
        summary = json.loads((out_dir / SUMMARY_NAME).read_text())
        if recorded is None or now is None or recorded.get("recipe") != now["recipe"] \
                or recorded.get("data") != now["data"]:
            return None  # another recipe, an older output's stamp, a hub input: the content checks decide
        if recorded != now:
            change = changed_content(recipe, state.get("identity") or {}, recorded["files"], now["files"])
            if change:
                raise ChangedJobError(f"{out_dir} holds an extraction of a different job ({change}). Use another "
                                      f"output.dir, or --set output.overwrite=true to start afresh.")
            return None  # the same bytes, or nothing to compare with: the full run checks the rest and answers
        committed = read_committed(out_dir)
        if damaged_shards(out_dir, committed) or uncommitted_files(out_dir, committed):
            return None
    except (OSError, ValueError, OutputStateError, AttributeError, KeyError, TypeError):
        return None  # anything unexpected: the full run decides
    return summary if isinstance(summary, dict) and "num_failed" in summary else None


def changed_content(recipe: Recipe, identity: dict, recorded: dict, now: dict) -> str | None:
    """How the inputs whose stamps differ (`recorded` and `now`: {name: [bytes, mtime_ns, ctime_ns]}) differ in
    content from the fingerprints the output's identity keeps: '' when they hold the same bytes (a reinstall, a
    moved folder, a file written again), a phrase naming the file and what changed, or None when the identity
    lacks a fingerprint to compare (an output of an earlier version: the full run decides). Reads only the
    inputs whose stamp moved, and of weight files only their fingerprint's windows (well under a second)."""
    moved = {n for n in set(recorded) | set(now) if recorded.get(n) != now.get(n)}
    small = {n for n in moved if not n.startswith("data/") and not n.endswith(WEIGHT_SUFFIXES)}
    if small:
        if identity.get("input_files") is None:
            return None
        current = input_files_sha256(recipe)
        if current != identity["input_files"]:
            named = named_inputs(recipe) or {}
            shown = {n: str(named.get(n, n)) for n in set(current) | set(identity["input_files"])}
            return f"input files differ: {describe_files_change(identity['input_files'], current, shown)}"
    if any(not n.startswith("data/") and n.endswith(WEIGHT_SUFFIXES) for n in moved):
        if identity.get("weights") is None:
            return None
        change = describe_weights_change(identity["weights"], weights_fingerprint(recipe.model))
        if change is not None:
            return f"model weights differ ({change})"
    data = {n for n in moved if n.startswith("data/")}
    if data:
        kept = (identity.get("data_files") or {}).get("files") or {}
        named = named_inputs(recipe) or {}

        def recorded_digest(name):  # the identity names data files by path (older) or portably: match the tail
            tail = name[len("data/"):]
            found = [d for k, d in kept.items() if k == tail or k.endswith(("/" + tail, ":" + tail))]
            return found[0] if len(found) == 1 else None
        if any(n in named and recorded_digest(n) is None for n in data):
            return None  # a file the identity does not name (more files, another layout): the full run decides
        digests = files_sha256([named[n] for n in sorted(data) if n in named])
        changed = [str(named.get(n, n)) for n in sorted(data)
                   if n not in named or digests[str(named[n])] != recorded_digest(n)]
        if changed:
            return f"data files differ: {', '.join(changed[:3])}: its bytes changed since the output was made"
    return ""


def failed_samples_code(recipe: Recipe, summary: dict | None) -> int:
    """EXIT_FAILED_SAMPLES (with its one line) when the output holds more failed samples than
    `output.max_failed_samples`, else 0."""
    limit = recipe.output.max_failed_samples
    if summary is not None and limit is not None and summary["num_failed"] > limit:
        print(f"error: {summary['num_failed']} sample(s) failed {summary['failed']}, more than "
              f"output.max_failed_samples={limit}; they are listed in {Path(recipe.output.dir) / FAILED_NAME} and "
              f"the output is otherwise complete (set output.max_failed_samples to accept them)", file=sys.stderr)
        return EXIT_FAILED_SAMPLES
    return 0


def answer_finished(recipe: Recipe, summary: dict) -> int:
    """Say that the output is finished; its exit code."""
    print(f"[dflash-prep] the output was already finished and its inputs are unchanged: manifest and summary left as "
          f"they are ({summary.get('num_samples_written')} samples, {summary.get('num_tokens_written')} tokens) -> "
          f"{Path(recipe.output.dir) / MANIFEST_NAME}", file=sys.stderr)
    return failed_samples_code(recipe, summary)


def preflight(argv: list[str] | None) -> int | None:
    """The exit code when the run is decided without the heavy imports (a recipe error: 2; a finished output: 0 or
    3), None when it must run. Argument errors and --help exit as argparse does."""
    try:
        recipe = parse_recipe(argv)
        check_data_source(recipe.data)  # a missing or unreadable data file: refused before the launcher starts
        check_model_sources(recipe.model)  # a mistyped model folder, a hub id with no hub in reach: the same
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    try:
        summary = finished_summary(recipe)
    except ChangedJobError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    return None if summary is None else answer_finished(recipe, summary)

"""What the extraction can answer before it imports torch, transformers or datasets (seconds on a cold machine): a
recipe that does not read (a typo: exit code 2) and an output that is already finished with its inputs untouched
(exit code 0, or 3 when it holds more failed samples than the recipe allows).

Finished means: `output.overwrite` is off, no process holds the output's locks, its manifest and summary read back,
every committed shard is in place (size, first sample) and no uncommitted file is left, and run_state.json's
`finished_inputs` (recipe/fingerprints.py `inputs_stamp`, recorded by the run that finished it) equals this recipe's
stamp now: the same content keys and every local input file of the same size and modification time. Anything else,
a hub input among them, goes the full way (the job's content checks decide, as before).

`dflash-prep launch` calls `preflight` with the script's arguments before it imports accelerate, so a typo or a
finished output costs no launcher start-up either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES
from dflash_prep.recipe.fingerprints import inputs_stamp
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

DESCRIPTION = "The extraction: recipe -> tokenized rows -> global plan -> this rank's batches -> hooks -> shards."


def parse_recipe(argv: list[str] | None) -> Recipe:
    """The recipe of `[--recipe PATH] [--set key=value ...]` (RecipeError when it does not read; argparse exits on
    arguments it does not know)."""
    parser = argparse.ArgumentParser(prog="dflash-prep extract", description=DESCRIPTION)
    add_recipe_args(parser)
    args = parser.parse_args(argv)
    return load_recipe(args.recipe, args.overrides)


def finished_summary(recipe: Recipe) -> dict | None:
    """The summary of `recipe`'s output when it is finished and its inputs are untouched (module docstring), else
    None (the full run decides)."""
    if is_remote(recipe.output.dir):
        return None  # an object-store output: the run itself checks it (its lease, the store's indexes)
    out_dir = Path(recipe.output.dir)
    if recipe.output.overwrite or not (out_dir / MANIFEST_NAME).is_file():
        return None
    try:
        if running_holders(out_dir):
            return None
        read_manifest(out_dir)
        recorded = read_state_json(out_dir / STATE_NAME).get(FINISHED_INPUTS)
        summary = json.loads((out_dir / SUMMARY_NAME).read_text())
        if recorded is None or recorded != inputs_stamp(recipe):
            return None
        committed = read_committed(out_dir)
        if damaged_shards(out_dir, committed) or uncommitted_files(out_dir, committed):
            return None
    except (OSError, ValueError, OutputStateError, AttributeError):  # anything unexpected: the full run decides
        return None
    return summary if isinstance(summary, dict) and "num_failed" in summary else None


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
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_RECIPE
    summary = finished_summary(recipe)
    return None if summary is None else answer_finished(recipe, summary)

"""The last stage of a run, on the main process once every rank is done: merge the rank indexes into the
manifest, written last.

Before the manifest: every planned sample must be committed or recorded as failed (else ExtractionError: re-run
the same command), the supervised-token frequencies of exactly the written samples (vocab.py), `failed.jsonl` and
`summary.json`. A write error here leaves every shard committed: re-running writes the manifest without
recomputing anything.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

from dflash_prep import __version__
from dflash_prep.commands.job import FAILED_NAME, SUMMARY_NAME, RankPlan, Run, manifest_readable
from dflash_prep.consume.vocab import count_supervised_tokens, write_token_freq
from dflash_prep.errors import ExtractionError
from dflash_prep.io import atomic_write_json, atomic_write_jsonl
from dflash_prep.signals import ignore_stop_signals
from dflash_prep.store.manifest import (
    FINISHED_INPUTS,
    MANIFEST_NAME,
    STATE_NAME,
    build_manifest,
    read_committed,
    read_state_json,
    write_manifest,
)
from dflash_prep.target.kernels import kernels_history, last_kernels_record
from dflash_prep.target.model import describe_source, hidden_size_of, vocab_size_of
from dflash_prep.target.norms import final_norm_entry
from dflash_prep.units import format_bytes, format_rate

log = logging.getLogger("dflash_prep")

DISK_BOUND_FRACTION = 0.10  # a rank whose loop waited this share of its time on its writers was disk-bound


def finish_run(run: Run, data, rank_plan: RankPlan) -> dict:
    """Manifest (last), summary, failed.jsonl and token_freq.safetensors of the whole output; -> the summary.

    A re-run of a finished output (nothing to do, a readable manifest and summary) changes nothing: it returns
    the summary of the run that finished it."""
    out_dir = run.out_dir
    if run.remote is not None:  # the store's rank indexes and reports (ranks of other nodes wrote theirs there)
        run.remote.pull("index/")
    previous = _previous_summary(out_dir) if not rank_plan.todo else None  # nothing ran: keep its run's figures
    if previous is not None and manifest_readable(out_dir):
        log.info("the output was already finished: manifest and summary left as they are -> %s",
                 run.remote.name(MANIFEST_NAME) if run.remote is not None else out_dir / MANIFEST_NAME)
        if run.remote is None:  # inputs found the same by content (moved, reinstalled): the next re-run's preflight
            _refresh_finished_inputs(out_dir, run.inputs_stamp)  # answers from the stamp, before any import
        return previous
    reports = [json.loads(p.read_text()) for p in sorted((out_dir / "index").glob("rank-*.done.json"))]
    reports = [r for r in reports if r["rank"] < run.world]
    records = read_committed(out_dir)
    # Failed samples are recorded in the index line of the shard that committed their batch.
    failed_rows = sorted((f for r in records for f in r.failed), key=lambda f: f["sample_id"])
    manifest = build_manifest(records, _manifest_info(run, data, failed_rows))
    written = {s for r in records for s in r.sample_ids}
    accounted = written | {f["sample_id"] for f in failed_rows}
    if accounted != set(data.kept["sample_id"]):
        raise ExtractionError(
            f"{len(rank_plan.lengths)} samples planned, {manifest['num_samples']} committed and {len(failed_rows)} "
            f"recorded as failed: {len(set(data.kept['sample_id']) - accounted)} missing; re-run the same command "
            f"to finish")
    # The draft vocabulary's input: supervised-token frequencies over exactly the samples the manifest lists.
    counts = count_supervised_tokens(data.kept, vocab_size_of(run.config), written)
    summary = previous or _summary(run, data, rank_plan, manifest, reports)
    manifest["summary"] = {k: summary[k] for k in ("num_batches", "padding_efficiency", "num_ranks")}
    try:  # every write of the end phase: a full disk or a quota here is one line, exit code 1
        manifest["token_freq"] = write_token_freq(out_dir, counts, len(written))
        atomic_write_jsonl(out_dir / FAILED_NAME, failed_rows)
        if previous is None:
            atomic_write_json(out_dir / SUMMARY_NAME, summary)
        _record_finished_inputs(out_dir, run.inputs_stamp)
        if run.faults is not None:
            run.faults.at_commit("manifest")
        write_manifest(out_dir, manifest, run.fence)  # only while this run holds the output
        if run.remote is not None:
            run.remote.push_state(fence=run.fence)  # every small file the run wrote, the manifest last
    except OSError as e:
        raise ExtractionError(f"writing the end files (token counts, summary, manifest) failed ({e}); every shard "
                              f"is committed: re-run the same command (nothing is recomputed) to write them") from e
    ignore_stop_signals()  # the output is finished: a Ctrl-C from here on could only report a failure (signals.py)
    _log_done(summary, data.skipped_counts, run.remote.name(MANIFEST_NAME) if run.remote is not None
              else out_dir / MANIFEST_NAME, rebuilt=previous is not None)
    return summary


def _record_finished_inputs(out_dir, stamp: dict | None) -> None:
    """run_state.json's `finished_inputs`: the inputs as this run found them (preflight.py compares a re-run's)."""
    state = read_state_json(out_dir / STATE_NAME)
    state.pop(FINISHED_INPUTS, None)
    if stamp is not None:
        state[FINISHED_INPUTS] = stamp
    atomic_write_json(out_dir / STATE_NAME, state)


def _refresh_finished_inputs(out_dir, stamp: dict | None) -> None:
    """`finished_inputs` set to `stamp` when it differs (best effort: a folder that cannot be written keeps the old
    stamp, and a re-run then goes the full way again, as before)."""
    try:
        if stamp is not None and read_state_json(out_dir / STATE_NAME).get(FINISHED_INPUTS) != stamp:
            _record_finished_inputs(out_dir, stamp)
    except (OSError, ValueError) as e:
        log.debug("finished_inputs not refreshed: %s", e)


def _previous_summary(out_dir) -> dict | None:
    """The summary of the run that computed the output's states, when it reads back, else None."""
    try:
        return json.loads((out_dir / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None


def _manifest_info(run: Run, data, failed_rows: list[dict]) -> dict:
    """The manifest's run facts (docs/FORMAT.md), before the shard list and totals."""
    recipe = run.recipe
    return {
        "dflash_prep_version": __version__,
        "model": describe_source(recipe.model),
        "model_fingerprint": run.identity["model"],
        "tokenizer_fingerprint": run.identity["tokenizer"],
        "weights_fingerprint": run.identity["weights"],
        "data_rows_fingerprint": run.identity["data_rows"],
        "attn_implementation": recipe.model.attn_implementation,
        "recipe_fingerprint": recipe.fingerprint(),
        "model_type": getattr(run.config, "model_type", None),
        "num_hidden_layers": run.num_layers,
        "layer_ids": run.layer_ids,
        "layer_id_convention": "after-layer, 0-based (id i = HF hidden_states[i+1])",
        "hidden_size": hidden_size_of(run.config),
        "dtype": recipe.output.dtype,
        "capture_final": recipe.layers.capture_final,
        "final_norm": final_norm_entry(run.out_dir, recipe.layers.capture_final),
        "num_rows": data.num_rows,
        "num_sample_candidates": data.num_candidates,  # kept + skipped: num_rows but for rows cut per turn
        "num_skipped": sum(data.skipped_counts.values()),
        "skipped": data.skipped_counts,
        "samples": data.samples,  # data.samples: rows whole / per turn, generated turns by source (ON_POLICY.md)
        "num_failed": len(failed_rows),
        "failed": dict(sorted(Counter(f["reason"] for f in failed_rows).items())),
        "kernels": last_kernels_record(run.out_dir),
        "kernels_history": kernels_history(run.out_dir),
        "packing": run.packing.record(),
    }


def _summary(run: Run, data, rank_plan: RankPlan, manifest: dict, reports: list[dict]) -> dict:
    """OUT/summary.json: the whole output's figures and this run's (per rank in `ranks`)."""
    real = sum(r["num_real_tokens"] for r in reports)
    padded = sum(r["num_padded_tokens"] for r in reports)
    kernels = run.kernels.record()
    return {
        "output_dir": str(run.out_dir),
        "num_rows": data.num_rows,
        "num_samples_written": manifest["num_samples"],
        "num_tokens_written": manifest["num_tokens"],
        "num_samples_this_run": sum(r["num_samples"] for r in reports),
        "num_tokens_this_run": real,
        # what earlier runs had committed when this one started (a resume: the job's progress was not 0)
        "num_samples_committed_before": sum(r.num_samples for r in rank_plan.committed),
        "num_tokens_committed_before": sum(r.num_tokens for r in rank_plan.committed),
        "num_skipped": manifest["num_skipped"],
        "skipped": data.skipped_counts,
        "samples": data.samples,
        "num_failed": manifest["num_failed"],
        "failed": manifest["failed"],
        "num_failed_this_run": sum(r.get("num_failed", 0) for r in reports),
        "num_oom": sum(r.get("num_oom", 0) for r in reports),
        # rows longer than the model's context, extracted under data.allow_beyond_context (None: context unknown)
        "num_samples_beyond_context": samples_beyond_context(run, rank_plan.lengths),
        "num_batches": rank_plan.stats["num_batches"],
        "num_shapes_planned": rank_plan.stats["num_shapes"],
        # the whole output's (each batch is padded to its planned length, OOM splits included), whatever share of
        # it this run computed; this run's own is below
        "padding_efficiency": rank_plan.stats["padding_efficiency"],
        "padding_efficiency_this_run": real / padded if padded else None,
        "planned_padding_efficiency": rank_plan.stats["padding_efficiency"],
        "num_ranks": run.world,  # replicas (processes that write)
        "replicas": run.replica.record(),  # gpus_per_replica, parallelism (replica.py)
        "wall_seconds": time.perf_counter() - run.t_start,  # this run's
        "loop_seconds": max((r["loop_seconds"] for r in reports), default=0.0),  # this run's slowest rank's loop
        "tokens_per_second": real / max(max((r["loop_seconds"] for r in reports), default=0.0), 1e-9),  # this run's
        "bytes_written_this_run": sum(r["bytes_written"] for r in reports),
        "bytes_total": manifest["num_bytes"],
        "num_shards": len(manifest["shards"]),
        "kernels": kernels if rank_plan.todo else {**kernels, "applied": [],
                                                   "reason": "nothing to run: the model was not loaded"},
        "triton_cache": run.triton_cache,
        "packing": run.packing.record(),
        "disk": disk_verdict(reports, run.recipe.output.dtype, run.remote is not None,
                             run.recipe.output.max_uploads_in_flight),
        # where the main process's start-up went (seconds): each rank's is in `ranks`
        "startup_seconds": next((r.get("startup_seconds") for r in reports if r["rank"] == run.rank), None),
        "ranks": reports,
    }


def samples_beyond_context(run: Run, lengths: list[int]) -> int | None:
    """Samples longer than the model's context (model.check_context), None when the context is not known."""
    return None if run.context_length is None else sum(n > run.context_length for n in lengths)


def disk_verdict(reports: list[dict], storage_dtype: str, object_store: bool = False,
                 max_uploads_in_flight: int | None = None) -> dict | None:
    """Whether the disk (`object_store`: the store the shards are uploaded to), not the model, set this run's pace,
    with the figures (per rank, the slowest one):

    - `needed_bytes_per_second`: what the model produced, bytes written / the loop's time not spent waiting on the
      writers or draining them (what the disk must take for the GPU never to wait);
    - `achieved_bytes_per_second`: bytes written / the whole loop (what the writers sustained end to end);
    - `wait_fraction`: the loop's time blocked on the writers or draining them after the last forward.
    `disk_bound` when that fraction exceeds DISK_BOUND_FRACTION; `fixes` then lists what would help. None when
    nothing was written."""
    busy = [r for r in reports if r.get("bytes_written") and r.get("loop_seconds")]
    if not busy:
        return None
    worst = max(busy, key=lambda r: (r.get("writer_wait_seconds", 0) + r.get("writer_drain_seconds", 0))
                / r["loop_seconds"])
    waited = worst.get("writer_wait_seconds", 0.0) + worst.get("writer_drain_seconds", 0.0)
    fraction = waited / worst["loop_seconds"]
    verdict = {"disk_bound": fraction > DISK_BOUND_FRACTION, "wait_fraction": fraction, "rank": worst["rank"],
               "needed_bytes_per_second": worst["bytes_written"] / max(worst["loop_seconds"] - waited, 1e-9),
               "achieved_bytes_per_second": worst["bytes_written"] / worst["loop_seconds"],
               "num_writer_threads": worst.get("num_writer_threads")}
    verdict["where"] = "object store" if object_store else "disk"
    if verdict["disk_bound"]:
        fewer = [] if storage_dtype == "fp8_e4m3" else ["output.dtype: fp8_e4m3 (half the bytes)"]
        verdict["fixes"] = fewer + ([  # a staged shard waits on its upload, not on the local writer
            f"more output.max_uploads_in_flight (now {max_uploads_in_flight})",
            "a store endpoint closer to the GPUs (same region or network), or a local output.dir"] if object_store
            else [f"more output.num_writer_threads (now {worst.get('num_writer_threads')})",
                  "a faster disk for output.dir"])
    return verdict


def _log_done(summary: dict, skipped_counts: dict, manifest_name, rebuilt: bool = False) -> None:
    """Two lines: what the output holds (every run's work), then what this run did and its own rate (`rebuilt`:
    this run computed nothing, it wrote the end files again; the summary is of the run that computed them)."""
    log.info("done: %d samples, %d tokens written (%d skipped%s, %d failed%s), padding efficiency %s, %s in "
             "%d shards -> %s", summary["num_samples_written"], summary["num_tokens_written"],
             summary["num_skipped"], f" {skipped_counts}" if skipped_counts else "",
             summary["num_failed"], f" {summary['failed']}" if summary["failed"] else "",
             f"{summary['padding_efficiency']:.3f}" if summary["padding_efficiency"] else "n/a",
             format_bytes(summary["bytes_total"]), summary["num_shards"], manifest_name)
    if rebuilt:
        log.info("this run: nothing to compute; it wrote the manifest and end files again from the committed "
                 "shards (summary.json keeps the figures of the run that computed them)")
        return
    before = summary.get("num_samples_committed_before", 0)
    log.info("this run: %d samples, %d tokens in %.1fs wall; its loop %.1fs at %.0f tok/s%s%s",
             summary["num_samples_this_run"], summary["num_tokens_this_run"], summary["wall_seconds"],
             summary.get("loop_seconds", 0.0), summary["tokens_per_second"], _replicas_phrase(summary.get("replicas")),
             f" (a resume: {before} samples were committed before it)" if before else "")
    disk = summary.get("disk")
    if disk and disk["disk_bound"]:
        store = disk.get("where", "disk") == "object store"  # summaries written before `where` are of disks
        lane = "uploads" if store else "writers"
        log.warning("the %s set the pace: rank %d waited on its %s %.0f%% of its loop; the model produced %s, the %s "
                    "sustained %s. To go faster: %s", "object store" if store else "disk", disk["rank"], lane,
                    100 * disk["wait_fraction"], format_rate(disk["needed_bytes_per_second"]), lane,
                    format_rate(disk["achieved_bytes_per_second"]), "; ".join(disk["fixes"]))


def _replicas_phrase(replicas: dict | None) -> str:
    """` on 2 replicas of 4 GPUs (tensor_parallel)` for a run of replicas of several GPUs, else nothing (also for
    the summary of an output made before replicas were recorded)."""
    if replicas is None or replicas["gpus_per_replica"] == 1:
        return ""
    return (f" on {replicas['num_replicas']} replica(s) of {replicas['gpus_per_replica']} GPUs "
            f"({replicas['parallelism']})")

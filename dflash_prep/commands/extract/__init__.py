"""The extraction: recipe -> tokenized rows -> global plan -> this rank's batches -> hooks -> shards.

Run under `dflash-prep launch` / `accelerate launch` (any number of processes, nodes; the script `extract.py` or the
module `-m dflash_prep.commands.extract`) or plain `python`: each process is one rank with its own model copy and its
own shards; the batch plan is global and deterministic, so ranks agree on it without communicating, and the main
process merges the rank indexes into `OUT/manifest.json` at the end. With `model.gpus_per_replica` N > 1 a rank is a
replica of N GPUs (replica.py: N tensor-parallel processes of which the first writes, or one process holding N GPUs).

Resume: the plan is frozen in `OUT/plan.json` by the first run. Re-running the same command keeps committed
shards, discards uncommitted files, and runs only the batches no index lists, split over however many ranks
the new run has. An output made by a different job is refused unless `output.overwrite` is set: recipe keys
(model, data, layers, storage dtype) and content (fingerprints.py: the tokenized rows, the weights) must match. A
committed shard whose file is missing, cut or swapped is dropped and its batches redone; a finished output
re-runs without loading the model.

Failures: a CUDA OOM in a forward splits the batch and retries (backoff.py); a sample that does not fit alone,
or whose states hold a NaN/Inf, is recorded as failed in the index line of the shard that commits its batch, so
a resume neither redoes nor forgets it; the manifest counts failed samples by reason and OUT/failed.jsonl lists
them. A write error (a full disk) or `output.nan_policy: fatal` stops the run with `ExtractionError`: committed
shards intact, nothing partial visible, a message saying what is committed and that re-running resumes.
Exit codes of `main`: 0 done, 1 stopped (resumable), 2 refused (bad recipe, an output of another job or a
damaged one), 3 done but more samples failed than `output.max_failed_samples`. `accelerate launch` turns 2 and 3
into 1; `dflash-prep launch` (launch.py) keeps them.

Modules, one concern each (the run's stages in run.py read top to bottom as the data flow):

    entry.py        the command line, its errors and exit codes
    preflight.py    what is answered before torch is imported: a recipe that does not read, a finished output
    run.py          run_extraction: the stages in order, each a short function or a module below
    start.py        the rank, logging, every check of the job before any weights load
    claim.py        the output's bookkeeping in order: claim, identity, repair, the run's record, the plan
    target_load.py  the model loading on a thread of its own, then kernels and packed attention
    loop.py         the forward loop: batches -> forward -> host copy -> writer lanes
    host_copy.py    the device-to-host copy on a stream of its own, the forwards' GPU time
    stop.py         SIGTERM / Ctrl-C at a batch boundary; DataLoader workers that die with their rank
    console.py      the console, the rank log files, the progress bar
    report.py       a rank's figures, the message of a run that stopped
    finish.py       the main process's merge: summary, failed.jsonl, token frequencies, manifest last
"""

from dflash_prep.commands.extract.entry import main
from dflash_prep.errors import EXIT_BAD_RECIPE, EXIT_FAILED_SAMPLES, EXIT_STOPPED

__all__ = ["main", "run_extraction", "EXIT_BAD_RECIPE", "EXIT_FAILED_SAMPLES", "EXIT_STOPPED",
           "OutputMismatchError"]


def __getattr__(name: str):
    """`run_extraction` and `OutputMismatchError` import torch: loaded when first asked for, so that `main` can
    answer a recipe error before the heavy imports."""
    if name == "run_extraction":
        from dflash_prep.commands.extract.run import run_extraction

        return run_extraction
    if name == "OutputMismatchError":
        from dflash_prep.commands.job import OutputMismatchError

        return OutputMismatchError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

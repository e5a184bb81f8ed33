"""dflash-prep: fast, exact, resumable hidden-state extraction for training speculative-decoding drafters.

The folders follow the data flow, each importing only those before it (tests/test_layout.py enforces it):

    io, errors, signals, faults
                         the ground floor: atomic writes, exit codes, stop signals, test-only fault injection
    recipe/              the recipe and the fingerprints of a job's inputs
    data/                rows in: load, chat template, token ids, loss mask
    plan/                lengths -> batches or packed rows, rank split, collation
    target/              the model, its kernels and packing, replicas, the capture hooks
    store/               shards out: writer lanes, index, manifest, locks, sizes
    regen/               the target's own answers (on-policy data): engines, conversation rules, resumable output
    consume/             reader, exporters, draft vocabulary
    commands/            extract, plan, inspect, verify, launch, the CLI
"""

__version__ = "0.1.0"

"""The extraction benchmark (`python bench/run_bench.py`) and its parts, one module per concern:

    models.py     benchmark models (config + defaults), parameter counts, weights checksum, token budget
    samples.py    the one pre-drawn sample list every mode reads, and its parquet for dflash-prep
    context.py    the run context every mode gets (device, model section, samples, output folder), environment
    timing.py     GEMM peak, synchronous and CUDA-event timers, per-mode derived figures (tok/s, MFU)
    outputs.py    what each mode wrote, read back from disk, and the comparison of two modes' states
    profiling.py  torch.profiler kernel categories
    modes.py      per_sample, fixed_batch, dflash_prep and its warm / variant / profile passes
    report.py     the JSON and Markdown report
    scenarios.py  the device rounds as named scenarios: `python3 -m bench run SCENARIO` (list: `python3 -m bench list`)
    device_round.py  a round's environment, steps under one deadline, logs and outcomes
"""

import os

# Same allocator setting as dflash-prep's extract.py, set for every mode before torch touches CUDA (fair, and
# fewer fragmentation OOMs for the batches of changing shapes of the baselines). A user setting wins.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

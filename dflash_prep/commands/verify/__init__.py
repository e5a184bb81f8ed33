"""`dflash-prep verify OUT [--num-samples N]`: prove an output holds what the model computes.

1. Integrity: the manifest and every shard it lists, as `inspect --check` does (size, sha256, tar, members,
   shapes and dtypes, counts).
2. The model: the recipe as run (`OUT/recipe.resolved.yaml`, `--set` overrides allowed, e.g. a new path of the
   weights) is loaded and the model's and tokenizer's fingerprints are compared with the manifest's before any
   weights are loaded; a random-weight model (`model.config`) is rebuilt from its seed on the device type the
   extraction used (its weights depend on the device's random generator).
3. Values: N samples, drawn with `random.Random(seed)` from all sample ids (sorted) and printed, are run ALONE
   (batch of one, no padding, the whole base decoder with `use_cache=False`) in the recipe's compute dtype, with the
   fused kernels the recipe's `model.kernels` selects on this device (as the extraction does: kernels.py; a named
   list that cannot run here falls back to eager; `--set model.kernels=eager` compares with transformers' own
   forward), and compared with the stored states, per layer (and for the final layer when captured): max abs error,
   relative error = max abs error / max |reference| of that sample's layer, and relative L2 error. A layer passes
   when its relative error is <= its allowed bound (the tolerance, or twice the layer's measured rounding noise:
   below); the output passes when every checked layer of every checked sample passes. The reference is transformers'
   own, not a hook: `output_hidden_states=True`, so layer id i is checked against HF `hidden_states[i + 1]` (the
   format's definition), `after_norm` against `hidden_states[L]` (after the final norm) and `before_norm` against
   the final norm's input in that same forward (a pre-hook on the norm module: no transformers switch needed,
   nothing shared with the extraction's hooks on the last decoder layer). An output whose layer ids include L-1
   (refused since; older outputs stored the last layer's output before the norm there) is checked against
   `hidden_states[L]` like any other id, so it fails.

Tolerance = storage term (the stored dtype's rounding, relative to the layer's max |value|) + compute term (the
difference between a sample's states in a padded batch and alone, from the kernels' numerics in the compute dtype):

| stored dtype | storage term | | compute dtype | compute term |
|---|---|---|---|---|
| float32 | 0 | | float32 | 1e-3 |
| float16 | 2^-11 = 4.9e-4 | | float16 | 0.02 |
| bfloat16 | 2^-8 = 3.9e-3 | | bfloat16 | 0.1 |
| fp8_e4m3 | 2^-4 + 2^-10/448 = 0.0625 (fp8.FP8_REL_BOUND, per token) | | | |

The bf16 compute term is wide because the batched and alone bf16 forwards of a deep model really differ that
much (the benchmark measured relative L2 0.005 at layer 1 to 0.053 at layer 61 of the 27B, max abs / max |ref|
8/157 = 0.051): in bf16 `verify` catches wrong samples, layers, masks and corrupted values, not last-bit noise.
Fused kernels round differently from eager ones (fp32: 7.5e-4 relative on 8-layer slices, the level of the batched
vs alone noise); in bf16 61 random-weight layers amplify that past the tolerance (fused output vs eager reference,
27B shape, layer 61: 0.104-0.122 measured), hence the reference runs with the extraction's kernels by default.
`--tolerance` replaces the sum.

Noise floor. A fixed tolerance cannot tell rounding amplified over many layers from a bug at depth: on the
Llama-3.3-70B shape (80 random-weight bf16 layers, tensor parallel over 2 GPUs, verify launched as that replica)
every sample reached relative L2 0.098 at layer 39 and 0.154 at layer 76 (relative 0.15-0.18), with nothing wrong.
So verify measures each layer's rounding noise with a second, independent reference: the drawn samples run TOGETHER
through the same reference model (dtype, kernels, layer mapping) as right-padded batches with their attention mask
(`run_padded_batch`; groups in reading order of at most NOISE_FLOOR_BATCH_TOKENS = 8192 padded tokens, or twice the
longest drawn sample; a sample alone in its group, as with `--num-samples 1`, runs with a filler row of its own
tokens 1.25x as long, `filler_row`, since a batch of one is the run alone itself; in one process a batch that runs
out of memory gives its samples no floor, said in one line). Their real tokens are compared with the alone reference
like the stored states are; a layer's noise floor is the worst relative error over the drawn samples. Right padding
with a mask leaves a causal decoder's real tokens unchanged (in fp32 the floor is ~2e-7 on the tiny Llama and the
Qwen3.5 Gated DeltaNet hybrid through transformers' torch path), so the floor is rounding only. A layer passes when
its relative error is <= max(tolerance, NOISE_FLOOR_FACTOR x floor), factor 2: the extraction's batched forward and
the padded-batch reference differ from the alone forward by rounding of the same kind and size. A floor above
NOISE_FLOOR_CAP = 0.5 is not used (a reference that far off is more likely broken than noisy, and twice it would
pass nearly anything): such a layer passes only within the tolerance, and above it is reported inconclusive ("the
model's rounding noise at this depth is X"), a failure (exit code 1). `--tolerance` is used as given (the floor is
still measured and shown, never widens it); `--no-noise-floor` skips the second reference (the tolerance only). At a
depth where the noise is large a wrong value of the same size passes: the floor bounds what verify can see.

A target larger than one GPU (`model.gpus_per_replica` N > 1): one process rebuilds it split by layers over the
first N GPUs. An output of a tensor-parallel replica is best verified by the same replica:
`dflash-prep launch --multi_gpu --num_processes N -m dflash_prep.commands.cli verify OUT` makes the N processes one
tensor-parallel replica that computes the reference as the extraction computed the states (sharded GEMMs summed
over an all-reduce round differently in bf16 from whole GEMMs: on the Llama-3.3-70B shape, relative L2 0.16 at
layer 76 against a one-process reference, bench/RESULTS.md); every process runs the same alone and padded-batch
forwards in the same order (they read the same samples); its first process hashes the shards after the forwards
and prints the report.

Exit codes: 0 every check passed; 1 a check failed (each failure printed as `FAIL ...`, naming the shard, or the
sample, the layer and the bound it exceeded; an inconclusive layer too); 2 the output cannot be verified (no
manifest, no recipe, model or tokenizer fingerprint differs, device mismatch for random weights, a
`--tolerance` that is not a finite number >= 0, a `--device` that cannot run here).

Modules, one concern each:

    entry.py      the command line, its errors and exit codes
    run.py        `verify`: the checks in order, one report
    compare.py    the drawn samples, read from their shards and compared with their references
    reference.py  the reference model and its forwards (alone, a padded batch), one device, a layer split or the replica
    noise.py      the noise floor's padded batches
    judge.py      tolerances, the bound a noise floor allows, one layer's errors and verdict
    report.py     the report, its verdict, its text and JSON
"""

from dflash_prep.commands.verify.compare import choose_samples
from dflash_prep.commands.verify.entry import build_parser, main
from dflash_prep.commands.verify.judge import (
    COMPUTE_TOLERANCE,
    NOISE_FLOOR_CAP,
    NOISE_FLOOR_FACTOR,
    STORAGE_TOLERANCE,
    LayerResult,
    NoiseResult,
    allowed_error,
    compare,
    judge,
    tolerance_for,
)
from dflash_prep.commands.verify.noise import NOISE_FLOOR_BATCH_TOKENS, filler_row
from dflash_prep.commands.verify.reference import run_alone, run_padded_batch
from dflash_prep.commands.verify.report import CannotVerify, VerifyReport, format_report
from dflash_prep.commands.verify.run import verify

__all__ = ["build_parser", "main", "COMPUTE_TOLERANCE", "NOISE_FLOOR_CAP", "NOISE_FLOOR_FACTOR", "STORAGE_TOLERANCE",
           "LayerResult", "NoiseResult", "allowed_error", "compare", "judge", "tolerance_for",
           "NOISE_FLOOR_BATCH_TOKENS", "filler_row", "run_alone", "run_padded_batch", "CannotVerify", "VerifyReport",
           "format_report", "choose_samples", "verify"]

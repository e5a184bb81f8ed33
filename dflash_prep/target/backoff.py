"""One batch's forward that never ends the run on an out-of-memory error, and flags non-finite states.

`BatchRunner.run(batch, tensors)` runs `LayerCapture.run` on a collated batch. On a CUDA OOM (or any
RuntimeError whose message says "out of memory") it frees what the failed attempt held, splits the samples in
two halves and runs each (recursively, down to one sample). Sub-batches keep the planned padded length T: they
are row slices of the already padded batch (no re-collation, no new shapes beyond smaller batch sizes of the
planned lengths). A packed row splits the same way, by samples: a piece is the slice of the row holding those
samples, a packed row of its own without tail padding (packing.packed_piece). A sample that does not fit even alone is reported in `failed` with reason `out_of_memory`;
the others are concatenated back in batch order, so the batch is still written and committed as one unit.

Each OOM also lowers a per-padded-length cap (the largest batch size of that T still expected to fit); later
batches of that T are pre-split into pieces of at most the cap, so one OOM is paid once, not once per batch.
For packed rows the cap is in tokens (rows hold from a few to thousands of samples): later rows are pre-split
into runs of consecutive samples of at most that many tokens.

Non-finite values: for every sample the runner computes on the device whether its captured states hold a NaN
or an Inf (`nonfinite_B`, one bool per sample, copied to the host with the states: no extra sync); the writer
then records the sample as failed (`non_finite_hidden_states`) or stops the run (`output.nan_policy: fatal`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from dflash_prep.plan.batches import Batch, SampleInfo
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.fp8 import finite_rows as finite_rows_fp8
from dflash_prep.target.fp8 import packed_width

log = logging.getLogger("dflash_prep")

FAIL_OOM = "out_of_memory"
FAIL_NON_FINITE = "non_finite_hidden_states"


def is_oom(e: BaseException) -> bool:
    """True for a device out-of-memory error (torch.cuda.OutOfMemoryError or a RuntimeError saying so)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e).lower()
                                            or "CUBLAS_STATUS_ALLOC_FAILED" in str(e))


@dataclass
class ForwardOutput:
    """What a batch's forward produced: the states of `samples` (batch order, failed ones left out)."""

    samples: list[SampleInfo]
    hidden_states_NK: torch.Tensor  # [N, k*H], N = tokens of `samples`
    final_NH: torch.Tensor | None  # [N, H] or None
    nonfinite_B: torch.Tensor | None  # [len(samples)] bool: a NaN/Inf somewhere in the sample's states
    failed: list[tuple[SampleInfo, str]] = field(default_factory=list)  # (sample, reason)
    num_pieces: int = 1  # forwards that succeeded for this batch (1 unless it was split)


def _finite_rows(buf: torch.Tensor, k: int) -> torch.Tensor:
    """[N] bool: the row holds no NaN and no Inf. Two row reductions (amax/amin propagate NaN, and an Inf shows
    in one of them), so no [N, W] temporary. Packed fp8 rows (uint8): their scales tell (fp8.finite_rows)."""
    if buf.dtype == torch.uint8:
        return finite_rows_fp8(buf, k)
    return torch.isfinite(buf.amax(dim=1)) & torch.isfinite(buf.amin(dim=1))


def sample_of_token(tensors: dict, padded_length: int) -> torch.Tensor:
    """[N] int64: the position in the batch of the sample each real token belongs to, on the device: row b of
    b*T + t for a padded batch; for a packed row, the segment of the token (samples are the first segments)."""
    if tensors.get("cu_seqlens") is not None:
        return torch.searchsorted(tensors["cu_seqlens"][1:].to(torch.int64), tensors["flat_index"], right=True)
    return torch.div(tensors["flat_index"], padded_length, rounding_mode="floor")


def nonfinite_per_sample(hs_NK: torch.Tensor, final_NH: torch.Tensor | None, row_N: torch.Tensor,
                         batch_size: int, num_layers: int) -> torch.Tensor:
    """[B] bool, true where a sample's rows hold a NaN or an Inf (`row_N`: sample_of_token); computed on the
    device, no host sync."""
    ok_N = _finite_rows(hs_NK, num_layers)
    if final_NH is not None:
        ok_N &= _finite_rows(final_NH, 1)
    bad_B = torch.zeros(batch_size, dtype=torch.float32, device=hs_NK.device)
    bad_B.index_add_(0, row_N, (~ok_N).float())
    return bad_B > 0


class BatchRunner:
    """Forward with OOM split-and-retry and learned per-length batch caps (see the module docstring)."""

    def __init__(self, capture: LayerCapture, faults=None, agree_oom=None):
        """`agree_oom(bool) -> bool`: whether any process of a tensor-parallel replica ran out of memory in this
        attempt (replica.ReplicaAgreement), so every process splits the same batches the same way; None: alone."""
        self.capture = capture
        self.faults = faults
        self.agree_oom = agree_oom
        self.caps: dict[int, int] = {}  # padded length -> largest batch size still expected to fit
        self.packed_token_cap: int | None = None  # packed rows: most tokens per forward still expected to fit
        self.num_ooms = 0
        self.num_split_batches = 0

    def run(self, batch: Batch, tensors: dict[str, torch.Tensor]) -> ForwardOutput:
        T = int(batch.input_ids.shape[1])
        lengths = [s.num_tokens for s in batch.samples]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        todo = self._first_spans(batch, offsets, T)
        todo.reverse()  # a stack: pop() takes the first span
        pieces: list[tuple[int, tuple]] = []
        failed: list[tuple[SampleInfo, str]] = []
        split_logged = False
        while todo:
            a, b = todo.pop()
            out = self._attempt(batch, tensors, a, b, offsets, T)
            if self.agree_oom is not None and self.agree_oom(out is None) and out is not None:
                out = None  # another process of the replica ran out of memory: drop this result, split with it
            if out is not None:
                pieces.append((a, out))
                continue
            self.num_ooms += 1
            if b - a == 1:
                s = batch.samples[a]
                failed.append((s, FAIL_OOM))
                log.warning("sample %s (batch %d, %d tokens padded to %d) does not fit in memory even alone: "
                            "recorded as failed (%s)", s.sample_id, batch.batch_id, s.num_tokens, T, FAIL_OOM)
                continue
            mid = (a + b + 1) // 2
            if not split_logged:
                self.num_split_batches += 1
                split_logged = True
            self._learn(batch, a, mid, b, offsets, T)
            todo.append((mid, b))
            todo.append((a, mid))
        if len(pieces) == 1 and not failed:
            hs, final, bad = pieces[0][1]
            return ForwardOutput(list(batch.samples), hs, final, bad)
        return self._join(batch, pieces, failed)

    def _attempt(self, batch: Batch, tensors: dict, a: int, b: int, offsets: list[int], T: int):
        """(hs, final, nonfinite) for samples [a, b), or None after an out-of-memory error (memory freed)."""
        try:
            if self.faults is not None:
                self.faults.before_forward(batch.batch_id, [s.sample_id for s in batch.samples[a:b]])
            sub = self._piece(batch, tensors, a, b, offsets, T)
            captured = self.capture.run(**sub)
            if self.faults is not None:
                self.faults.after_forward(batch.batch_id)
            hs, final = captured.hidden_states_NK, captured.final_hidden_states_NH
            if self.faults is not None and self.faults.nan_samples:
                self.faults.poison(hs, [s.sample_id for s in batch.samples[a:b]],
                                   [s.num_tokens for s in batch.samples[a:b]])
            return hs, final, nonfinite_per_sample(hs, final, sample_of_token(sub, T), b - a,
                                                   len(self.capture.layer_ids))
        except RuntimeError as e:
            if not is_oom(e):
                raise
        # Outside the `except` block: the exception, its traceback and the frames holding activations are gone.
        sub = captured = None  # noqa: F841
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None

    def _first_spans(self, batch: Batch, offsets: list[int], T: int) -> list[tuple[int, int]]:
        """The sample spans [a, b) to run, pre-split by what earlier OOMs taught: at most `caps[T]` samples per
        forward for a padded batch; consecutive samples of at most `packed_token_cap` tokens for a packed row."""
        B = len(batch.samples)
        cap = self.packed_token_cap if batch.packed else self.caps.get(T)
        if cap is None or (offsets[-1] if batch.packed else B) <= cap:
            return [(0, B)]
        if not batch.packed:
            todo = [(a, min(a + cap, B)) for a in range(0, B, cap)]
        else:
            todo, a = [], 0
            for b in range(1, B + 1):
                if b == B or offsets[b + 1] - offsets[a] > cap:
                    todo.append((a, b))
                    a = b
        self.num_split_batches += 1
        shape = f"packed row of {B} samples, {offsets[-1]} tokens" if batch.packed else f"{B} x {T}"
        log.info("batch %d (%s): pre-split into %d pieces of at most %d%s (learned from an earlier OOM)",
                 batch.batch_id, shape, len(todo), cap, " tokens" if batch.packed else "")
        return todo

    def _learn(self, batch: Batch, a: int, mid: int, b: int, offsets: list[int], T: int) -> None:
        """An OOM on samples [a, b): lower the cap to the first half's size (samples of padded length T, or the
        tokens of a packed piece), so later batches are pre-split."""
        if batch.packed:
            tokens = offsets[mid] - offsets[a]
            if self.packed_token_cap is None or tokens < self.packed_token_cap:
                self.packed_token_cap = tokens
                log.warning("batch %d: out of memory on a packed row of %d tokens; splitting it, later packed rows "
                            "run at most %d tokens per forward", batch.batch_id, offsets[b] - offsets[a], tokens)
        elif self.caps.get(T, b - a) >= b - a:
            self.caps[T] = mid - a
            log.warning("batch %d: out of memory on %d x %d; splitting it, later batches of padded length %d "
                        "run at most %d samples per forward", batch.batch_id, b - a, T, T, mid - a)

    @staticmethod
    def _piece(batch: Batch, tensors: dict, a: int, b: int, offsets: list[int], T: int) -> dict:
        """The forward's inputs for samples [a, b) of the batch: the whole batch, rows a..b-1 of a padded batch
        (their real tokens are one contiguous run of flat_index), or a packed row of those samples alone."""
        if a == 0 and b == len(batch.samples):
            return tensors
        if batch.packed:
            from dflash_prep.target.packing import packed_piece

            return packed_piece(tensors, a, b, offsets, [s.num_tokens for s in batch.samples])
        sub = {name: tensors[name][a:b] for name in ("input_ids", "attention_mask", "position_ids")}
        sub["flat_index"] = tensors["flat_index"][offsets[a]:offsets[b]] - a * T
        return sub

    def _join(self, batch: Batch, pieces: list[tuple[int, tuple]], failed: list) -> ForwardOutput:
        """Concatenate the pieces in batch order, on the host (after an OOM the device has no room to spare)."""
        pieces.sort(key=lambda p: p[0])
        failed_ids = {s.sample_id for s, _ in failed}
        samples = [s for s in batch.samples if s.sample_id not in failed_ids]
        hs = [p[1][0].cpu() for p in pieces]
        final = [p[1][1].cpu() for p in pieces] if self.capture.capture_final != "none" else None
        bad = [p[1][2].cpu() for p in pieces]
        if not pieces:  # every sample failed: empty buffers of the capture's layout
            H, k = self.capture._hidden_size(), len(self.capture.layer_ids)
            if getattr(self.capture, "fp8", False):
                empty, empty_final = (torch.empty(0, packed_width(k, H), dtype=torch.uint8),
                                      torch.empty(0, packed_width(1, H), dtype=torch.uint8))
            else:
                empty, empty_final = (torch.empty(0, k * H, dtype=self.capture.storage_dtype),
                                      torch.empty(0, H, dtype=self.capture.storage_dtype))
            return ForwardOutput([], empty, empty_final if final is not None else None,
                                 torch.zeros(0, dtype=torch.bool), failed, 0)
        return ForwardOutput(samples, torch.cat(hs), torch.cat(final) if final is not None else None,
                             torch.cat(bad), failed, len(pieces))

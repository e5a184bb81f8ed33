"""Right-padded batches from a planned list of samples.

`Batch` holds what the forward needs (`input_ids`, `attention_mask`, `position_ids`, and `flat_index`, the
positions b*T + t of real tokens used to unpad on the device) and what the writer needs (per-sample ids,
token ids and loss masks, kept on the host). A packed row (`collate_packed`, the layout in target/packing.py) has no attention mask and
carries `cu_seqlens` and `max_length` instead. `PlannedBatches` is a map-style dataset of whole batches, so a
`DataLoader(batch_size=None, num_workers=...)` collates ahead of the GPU and pins memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset

from dflash_prep.plan.planner import PlannedBatch


@dataclass
class SampleInfo:
    sample_id: str
    source_row: int
    source_id: str | None
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class Batch:
    batch_id: int
    input_ids: torch.Tensor  # int64 [B, T]
    attention_mask: torch.Tensor | None  # int64 [B, T], 1 on real tokens (a prefix of each row); None when packed
    position_ids: torch.Tensor  # int64 [B, T], 0..len-1 then 0 on padding (packed: restarting per segment)
    flat_index: torch.Tensor  # int64 [N], b*T + t for every real token, in (b, t) order
    lengths: torch.Tensor  # int64 [B]
    samples: list[SampleInfo] = field(default_factory=list)
    cu_seqlens: torch.Tensor | None = None  # packed row only: int32 [segments + 1] (packing.py)
    max_length: int | None = None  # packed row only: the longest segment

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_real_tokens(self) -> int:
        return int(self.flat_index.shape[0])

    @property
    def num_padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def pin_memory(self) -> "Batch":
        # Called by DataLoader(pin_memory=True) on custom batch types.
        for name in ("input_ids", "attention_mask", "position_ids", "flat_index", "cu_seqlens"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).pin_memory())
        return self

    def tensors_on(self, device: torch.device) -> dict:
        """The forward's inputs (LayerCapture.run's arguments) on `device`; a packed row adds `cu_seqlens` and
        `max_length` (a Python int: no device-to-host sync to read it)."""
        nb = device.type == "cuda"
        out = {name: None if getattr(self, name) is None else getattr(self, name).to(device, non_blocking=nb)
               for name in ("input_ids", "attention_mask", "position_ids", "flat_index")}
        if self.packed:
            out.update(cu_seqlens=self.cu_seqlens.to(device, non_blocking=nb), max_length=self.max_length)
        return out


def collate(samples: list[SampleInfo], padded_length: int, pad_token_id: int, batch_id: int = -1) -> Batch:
    """Right-pad `samples` to `padded_length` (which must be >= every sample's length)."""
    B, T = len(samples), padded_length
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    if B == 0 or lengths.max() > T:
        raise ValueError(f"batch {batch_id}: cannot pad lengths {lengths.tolist()} to {T}")
    input_ids = np.full((B, T), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, T), dtype=np.int64)
    position_ids = np.zeros((B, T), dtype=np.int64)
    flat = []
    for b, s in enumerate(samples):
        n = s.num_tokens
        input_ids[b, :n] = s.input_ids
        attention_mask[b, :n] = 1
        position_ids[b, :n] = np.arange(n)
        flat.append(np.arange(b * T, b * T + n, dtype=np.int64))
    return Batch(batch_id=batch_id, input_ids=torch.from_numpy(input_ids),
                 attention_mask=torch.from_numpy(attention_mask), position_ids=torch.from_numpy(position_ids),
                 flat_index=torch.from_numpy(np.concatenate(flat)), lengths=torch.from_numpy(lengths),
                 samples=list(samples))


def samples_from_rows(rows: dict) -> list[SampleInfo]:
    """Columns of a tokenized `datasets` slice -> SampleInfo list."""
    return [SampleInfo(sample_id=rows["sample_id"][j], source_row=int(rows["source_row"][j]),
                       source_id=rows["source_id"][j],
                       input_ids=np.asarray(rows["input_ids"][j], dtype=np.int32),
                       loss_mask=np.asarray(rows["loss_mask"][j], dtype=np.uint8))
            for j in range(len(rows["sample_id"]))]


class PlannedBatches(Dataset):
    """Item i = the collated `Batch` of `batches[i]`, reading its rows from the tokenized dataset."""

    def __init__(self, tokenized, batches: list[PlannedBatch], pad_token_id: int):
        self.tokenized = tokenized.select_columns(["sample_id", "source_row", "source_id", "input_ids",
                                                   "loss_mask"])
        self.batches = list(batches)
        self.pad_token_id = pad_token_id

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Batch:
        planned = self.batches[i]
        rows = self.tokenized[list(planned.sample_indices)]
        if planned.packed:
            return collate_packed(samples_from_rows(rows), planned.padded_length, self.pad_token_id,
                                  planned.batch_id)
        return collate(samples_from_rows(rows), planned.padded_length, self.pad_token_id, planned.batch_id)


def collate_packed(samples: list[SampleInfo], row_length: int, pad_token_id: int, batch_id: int = -1) -> Batch:
    """The packed row of `samples` (the layout in the module docstring); ValueError when they do not fit."""
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    num_real = int(lengths.sum())
    if not samples or num_real > row_length:
        raise ValueError(f"batch {batch_id}: cannot pack lengths {lengths.tolist()} into a row of {row_length}")
    segments = lengths.tolist() + ([row_length - num_real] if row_length > num_real else [])
    input_ids = np.full((1, row_length), pad_token_id, dtype=np.int64)
    input_ids[0, :num_real] = np.concatenate([s.input_ids for s in samples])
    position_ids = np.concatenate([np.arange(n, dtype=np.int64) for n in segments])[None, :]
    cu_seqlens = np.concatenate([[0], np.cumsum(segments)]).astype(np.int32)
    return Batch(batch_id=batch_id, input_ids=torch.from_numpy(input_ids), attention_mask=None,
                 position_ids=torch.from_numpy(position_ids),
                 flat_index=torch.arange(num_real, dtype=torch.int64), lengths=torch.from_numpy(lengths),
                 samples=list(samples), cu_seqlens=torch.from_numpy(cu_seqlens), max_length=max(segments))

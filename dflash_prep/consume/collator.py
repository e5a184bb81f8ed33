"""Trainer batches from the reader's samples: `DFlashCollator` (padded `[B, T]` or packed `[1, N]` with cu_seqlens),
samples without a DFlash anchor dropped."""

from __future__ import annotations

from typing import Any

import torch


def has_supervised_pair(loss_mask_T: torch.Tensor) -> bool:
    """True when some p has loss_mask[p] and loss_mask[p+1] both nonzero (a DFlash anchor exists)."""
    m = loss_mask_T.bool()
    return bool((m[:-1] & m[1:]).any()) if m.shape[0] >= 2 else False


SEQUENCE_KEYS = ("input_ids", "loss_mask", "hidden_states", "final_hidden_states", "hidden_states_scales",
                 "final_hidden_states_scales")


def truncate_sample(sample: dict[str, Any], max_length: int) -> dict[str, Any]:
    """The sample's first `max_length` tokens (views; every per-token tensor cut alike)."""
    out = dict(sample)
    for name in SEQUENCE_KEYS:
        if name in out:
            out[name] = out[name][:max_length]
    return out


class DFlashCollator:
    """Build DFlash trainer batches from `ShardDataset` samples.

    Each sample is first truncated to `max_length` tokens; samples that then lack two consecutive supervised
    tokens (no DFlash anchor) are dropped (counted in `num_dropped`). Returns None when every sample was
    dropped.

    mode="padded" (SpecForge-style `[B, T]`, T = longest kept sample, or rounded up to `pad_to_multiple_of`):
        input_ids int64 [B, T] (pad_token_id on padding), loss_mask int64 [B, T] (0 on padding),
        attention_mask int64 [B, T] (1 on real tokens, a prefix of each row), position_ids int64 [B, T]
        (0..len-1, 0 on padding), hidden_states [B, T, k*H] (zeros on padding), final_hidden_states
        [B, T, H] when present, lengths int64 [B].
    mode="packed" (speculators-style `[1, N]`: documents back to back, N = total kept tokens, or rounded up to
    `pad_to_multiple_of`):
        input_ids / loss_mask / position_ids (restart at 0 per document) / document_ids (0..D-1, -1 on
        padding) int64 [1, N], hidden_states [1, N, k*H], final_hidden_states [1, N, H] when present,
        lengths int64 [D], cu_seqlens int32 [D+1] (document boundaries, for varlen attention kernels).
    Both: sample_ids list[str] (batch order), num_dropped int.
    Guarantee: row b (padded) / document d (packed) holds exactly the tokens and states of the b-th/d-th kept
    sample after truncation, bit for bit; padding never carries loss.
    """

    def __init__(self, max_length: int, mode: str = "padded", pad_token_id: int = 0,
                 pad_to_multiple_of: int | None = None):
        if mode not in ("padded", "packed"):
            raise ValueError(f"mode must be 'padded' or 'packed', got {mode!r}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.max_length = max_length
        self.mode = mode
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def _round_up(self, n: int) -> int:
        m = self.pad_to_multiple_of
        return n if m is None else -(-n // m) * m

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any] | None:
        kept = []
        for s in samples:
            s = truncate_sample(s, self.max_length)
            if has_supervised_pair(s["loss_mask"]):
                kept.append(s)
        num_dropped = len(samples) - len(kept)
        if not kept:
            return None
        has_final = all("final_hidden_states" in s for s in kept)
        if not has_final and any("final_hidden_states" in s for s in kept):
            raise ValueError("some samples carry final_hidden_states and some do not")
        batch = self._padded(kept, has_final) if self.mode == "padded" else self._packed(kept, has_final)
        batch["sample_ids"] = [s["sample_id"] for s in kept]
        batch["num_dropped"] = num_dropped
        return batch

    def _padded(self, kept: list[dict[str, Any]], has_final: bool) -> dict[str, Any]:
        lengths_B = torch.tensor([s["input_ids"].shape[0] for s in kept], dtype=torch.int64)
        B, T = len(kept), self._round_up(int(lengths_B.max()))
        first = kept[0]
        input_ids_BT = torch.full((B, T), self.pad_token_id, dtype=torch.int64)
        loss_mask_BT = torch.zeros(B, T, dtype=torch.int64)
        attention_mask_BT = torch.zeros(B, T, dtype=torch.int64)
        position_ids_BT = torch.zeros(B, T, dtype=torch.int64)
        hidden_states_BTK = first["hidden_states"].new_zeros(B, T, first["hidden_states"].shape[1])
        final_BTH = first["final_hidden_states"].new_zeros(B, T, first["final_hidden_states"].shape[1]) \
            if has_final else None
        for b, s in enumerate(kept):
            n = s["input_ids"].shape[0]
            input_ids_BT[b, :n] = s["input_ids"]
            loss_mask_BT[b, :n] = s["loss_mask"]
            attention_mask_BT[b, :n] = 1
            position_ids_BT[b, :n] = torch.arange(n)
            hidden_states_BTK[b, :n] = s["hidden_states"]
            if final_BTH is not None:
                final_BTH[b, :n] = s["final_hidden_states"]
        out = {"input_ids": input_ids_BT, "loss_mask": loss_mask_BT, "attention_mask": attention_mask_BT,
               "position_ids": position_ids_BT, "hidden_states": hidden_states_BTK, "lengths": lengths_B}
        if final_BTH is not None:
            out["final_hidden_states"] = final_BTH
        return out

    def _packed(self, kept: list[dict[str, Any]], has_final: bool) -> dict[str, Any]:
        lengths_D = torch.tensor([s["input_ids"].shape[0] for s in kept], dtype=torch.int64)
        total = int(lengths_D.sum())
        N = self._round_up(total)
        pad = N - total
        cu_seqlens = torch.zeros(len(kept) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(lengths_D, 0).to(torch.int32)

        def cat(name: str, fill=0, dtype=None) -> torch.Tensor:
            parts = [s[name] for s in kept]
            if pad:
                parts.append(parts[0].new_full((pad, *parts[0].shape[1:]), fill))
            t = torch.cat(parts, 0)
            return (t if dtype is None else t.to(dtype)).unsqueeze(0)

        document_ids_N = torch.repeat_interleave(torch.arange(len(kept), dtype=torch.int64), lengths_D)
        position_ids_N = torch.cat([torch.arange(int(n), dtype=torch.int64) for n in lengths_D])
        if pad:
            document_ids_N = torch.cat([document_ids_N, torch.full((pad,), -1, dtype=torch.int64)])
            position_ids_N = torch.cat([position_ids_N, torch.zeros(pad, dtype=torch.int64)])
        out = {"input_ids": cat("input_ids", self.pad_token_id), "loss_mask": cat("loss_mask", 0),
               "position_ids": position_ids_N.unsqueeze(0), "document_ids": document_ids_N.unsqueeze(0),
               "hidden_states": cat("hidden_states"), "lengths": lengths_D, "cu_seqlens": cu_seqlens}
        if has_final:
            out["final_hidden_states"] = cat("final_hidden_states")
        return out


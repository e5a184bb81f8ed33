"""Capture hidden states with forward hooks, unpadded on the device.

`LayerCapture` registers one forward hook per captured decoder layer (and, optionally, on the final layer or
the final norm). Each hook gathers the real tokens of its layer's output into one packed `[N, k*H]` buffer
(N = real tokens of the batch, layers concatenated in ascending id order) in the storage dtype, so padding is
never copied off the device and no full `[B, T, H]` output is kept alive after its layer ran (a packed row: its
first N tokens, a view, no gather). The hook on the deepest needed module raises `_StopForward`: layers after it,
the final norm and the lm_head never run.

Guarantees: hooks are removed when the context exits, also on an exception; the base decoder is called with
`use_cache=False` under `torch.inference_mode()`; for a right-padded batch with an attention mask, the packed
rows of sample b are exactly its states in the batched forward (which equal its states run alone, up to the
kernels' numerical noise: tests assert it).

fp8 storage (`storage_dtype=torch.float8_e4m3fn`): each hook quantizes its layer's gathered rows on the device,
per token, with an fp32 scale of amax/448 (dflash_prep/target/fp8.py), and the buffers hold packed uint8 rows,
`[N, k*H + 4k]` (e4m3 bytes, then the k scales) and `[N, H + 4]` for the final layer: half the bytes of bf16
cross to the host, in the same single copy. `fp8.unpack_rows` splits them; `fp8.finite_rows` tells which rows
held a NaN or an Inf (their scale is then not finite).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dflash_prep.target.fp8 import FP8_DTYPE, packed_width, store_block
from dflash_prep.target.layers import decoder_layers, find_decoder


class _StopForward(Exception):
    """Raised by the deepest hook to end the forward early (nothing after it is needed)."""


@dataclass
class CapturedBatch:
    """Packed states of a batch. fp8 storage: uint8 rows `[N, k*H + 4k]` and `[N, H + 4]` (dflash_prep/target/fp8.py)."""

    hidden_states_NK: torch.Tensor  # [N, k*H], N = real tokens of the batch, samples in batch order
    final_hidden_states_NH: torch.Tensor | None  # [N, H] or None


def _output_tensor(output) -> torch.Tensor:
    # transformers 5.x decoder layers return a Tensor; older ones (and some remote code) a tuple.
    return output[0] if isinstance(output, (tuple, list)) else output


class LayerCapture:
    """Context manager: `with LayerCapture(model, [1, 16], ...) as cap: out = cap.run(batch_tensors)`."""

    def __init__(self, model: nn.Module, layer_ids: list[int], *, capture_final: str = "none",
                 storage_dtype: torch.dtype = torch.bfloat16, padding_mask: bool = True):
        """`padding_mask=False` calls the model without the attention mask and with positions 0..T-1 on every row
        (padding included): the batches are right-padded and the supported decoders are causal (attention, the
        Gated DeltaNet recurrence and its causal conv), so a real token never sees the padding after it and its
        states are the same; the model may then take its mask-free causal kernels."""
        if list(layer_ids) != sorted(set(layer_ids)):
            raise ValueError(f"layer ids must be distinct and ascending, got {layer_ids}")
        self.decoder = find_decoder(model)
        self.layers = decoder_layers(self.decoder)
        self.layer_ids = list(layer_ids)
        self.capture_final = capture_final
        self.storage_dtype = storage_dtype
        self.fp8 = storage_dtype == FP8_DTYPE
        self.padding_mask = padding_mask
        self.hidden_size = None
        self._handles: list = []
        self._buf_NK: torch.Tensor | None = None
        self._final_NH: torch.Tensor | None = None
        self._flat_index: torch.Tensor | None = None
        self._real_prefix: int | None = None  # a packed row's real tokens (its first N; packing.py)
        if capture_final == "after_norm" and not hasattr(self.decoder, "norm"):
            raise TypeError(f"{type(self.decoder).__name__} has no `.norm`: cannot capture after the final norm")

    # -- hooks -------------------------------------------------------------------------------------------
    def _gather(self, hs_BTH: torch.Tensor) -> torch.Tensor:
        """The real tokens' rows [N, H], on the capture buffers' device (a layer split over a replica's GPUs runs
        later layers on other GPUs: replica.py; on one device nothing moves)."""
        if self._real_prefix is not None:  # a packed row: the real tokens are its first N, a view (no gather copy)
            hs_NH = hs_BTH.reshape(-1, hs_BTH.shape[-1])[:self._real_prefix]
            return hs_NH if hs_NH.device == self._buf_NK.device else hs_NH.to(self._buf_NK.device)
        index = self._flat_index if self._flat_index.device == hs_BTH.device else self._flat_index.to(hs_BTH.device)
        hs_NH = hs_BTH.reshape(-1, hs_BTH.shape[-1]).index_select(0, index)
        return hs_NH if hs_NH.device == self._buf_NK.device else hs_NH.to(self._buf_NK.device)

    def _layer_hook(self, slot: int, stop: bool):
        def hook(module, args, output):
            if self._flat_index is None:
                return None  # a forward outside `run()` (e.g. a reference pass) passes through untouched
            hs_NH = self._gather(_output_tensor(output))
            H = hs_NH.shape[-1]
            if self.fp8:
                if slot >= 0:
                    store_block(self._buf_NK, slot, len(self.layer_ids), hs_NH)
                if self._final_NH is not None and module is self._final_module:
                    store_block(self._final_NH, 0, 1, hs_NH)
            else:
                if slot >= 0:
                    self._buf_NK[:, slot * H:(slot + 1) * H].copy_(hs_NH)
                if self._final_NH is not None and module is self._final_module:
                    self._final_NH.copy_(hs_NH)
            if stop:
                raise _StopForward
        return hook

    @property
    def _final_module(self) -> nn.Module | None:
        if self.capture_final == "before_norm":
            return self.layers[len(self.layers) - 1]
        if self.capture_final == "after_norm":
            return self.decoder.norm
        return None

    def __enter__(self) -> "LayerCapture":
        n = len(self.layers)
        bad = [i for i in self.layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"layer ids {bad} out of range for a decoder with {n} layers")
        modules: dict[int, tuple[nn.Module, int]] = {}  # id(module) -> (module, slot)
        for slot, i in enumerate(self.layer_ids):
            modules[id(self.layers[i])] = (self.layers[i], slot)
        final = self._final_module
        if final is not None and id(final) not in modules:
            modules[id(final)] = (final, -1)
        deepest = final if final is not None else self.layers[self.layer_ids[-1]]
        try:
            for module, slot in modules.values():
                # prepend=True: run before any output-capturing hooks transformers installs itself.
                self._handles.append(module.register_forward_hook(
                    self._layer_hook(slot, stop=module is deepest), prepend=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._buf_NK = self._final_NH = self._flat_index = None

    # -- forward -----------------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
            flat_index: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
            max_length: int | None = None) -> CapturedBatch:
        """One forward of the base decoder on a right-padded batch, or on a packed row (`cu_seqlens` int32
        [segments + 1] and `max_length` given: no mask, transformers' flash-attention kwargs; packing.py).

        `flat_index` [N] holds the positions b*T + t of the real tokens (from the collator), so the gather
        needs no device-to-host sync.
        """
        if not self._handles:
            raise RuntimeError("LayerCapture.run() outside its `with` block")
        H = self._hidden_size()
        N = flat_index.shape[0]
        device = input_ids.device
        self._flat_index = flat_index
        if self.fp8:  # packed rows: e4m3 bytes + fp32 scales (see the module docstring)
            self._buf_NK = torch.empty(N, packed_width(len(self.layer_ids), H), dtype=torch.uint8, device=device)
            self._final_NH = (torch.empty(N, packed_width(1, H), dtype=torch.uint8, device=device)
                              if self.capture_final != "none" else None)
        else:
            self._buf_NK = torch.empty(N, len(self.layer_ids) * H, dtype=self.storage_dtype, device=device)
            self._final_NH = (torch.empty(N, H, dtype=self.storage_dtype, device=device)
                              if self.capture_final != "none" else None)
        extra, self._real_prefix = {}, None
        if cu_seqlens is not None:
            from dflash_prep.target.packing import flash_kwargs

            attention_mask, extra, self._real_prefix = None, flash_kwargs(cu_seqlens, max_length), N
        elif not self.padding_mask:
            # No mask and no position ids: transformers then counts positions 0..T-1 itself and takes the causal
            # kernel without inspecting a tensor. Explicit positions would be read on the host (its packed-sequence
            # check), a device-to-host sync in every forward.
            attention_mask, position_ids = None, None
        try:
            with torch.inference_mode():
                self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False, **extra)
            raise RuntimeError("the forward ended without reaching the deepest captured module")
        except _StopForward:
            out = CapturedBatch(self._buf_NK, self._final_NH)
        finally:  # also after an error (an OOM is retried on a smaller batch): drop the buffers of this forward
            self._buf_NK = self._final_NH = self._flat_index = None
        return out

    def _hidden_size(self) -> int:
        if self.hidden_size is None:
            config = getattr(self.decoder, "config", None)
            text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
            self.hidden_size = int(text.hidden_size)
        return self.hidden_size

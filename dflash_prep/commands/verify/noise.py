"""The noise floor's second reference: the drawn samples run together as right-padded batches through the reference
model (the package docstring says why and how it is used)."""

from __future__ import annotations

import torch

from dflash_prep.commands.verify.reference import run_padded_batch

# Padded tokens (rows x longest row) of one padded-batch forward at most, or twice the longest drawn sample when that
# is more (so any two samples share a batch): `output_hidden_states=True` keeps every layer's [B, T, H] states, so
# a batch costs at most twice the memory of the longest sample's run alone (2.5x for a lone sample and its filler
# row, `filler_row`).
NOISE_FLOOR_BATCH_TOKENS = 8192


class PaddedBatches:
    """The padded-batch reference of the drawn samples (`run_padded_batch`), grouped in reading order under
    NOISE_FLOOR_BATCH_TOKENS padded tokens (or twice the longest sample; a lone last sample takes the previous
    group's last one: two samples always fit; a group of one runs with a `filler_row`), each group run when its
    first sample is compared and dropped at the next: one group's states are held at a time. Every process of a
    tensor-parallel replica reads the same samples in the same order, so they run the same forwards in the same
    order."""

    def __init__(self, model, samples: list[tuple[str, torch.Tensor]], layer_ids: list[int], capture_final: str,
                 device: torch.device, skip_on_oom: bool = False, log=print):
        """`skip_on_oom`: a group that runs out of memory gives no noise floor (one process only: the processes of
        a tensor-parallel replica must run the same collectives, so there it raises)."""
        self.model, self.layer_ids, self.capture_final, self.device = model, layer_ids, capture_final, device
        self.skip_on_oom, self.log = skip_on_oom, log
        cap = max([NOISE_FLOOR_BATCH_TOKENS] + [2 * int(ids.shape[0]) for _, ids in samples])
        self.groups: list[list[tuple[str, torch.Tensor]]] = []
        for sid, ids in samples:
            group = self.groups[-1] if self.groups else None
            if group is None or (len(group) + 1) * max(int(ids.shape[0]), *(int(x.shape[0]) for _, x in group)) > cap:
                self.groups.append(group := [])
            group.append((sid, ids))
        if len(self.groups) > 1 and len(self.groups[-1]) == 1 and len(self.groups[-2]) > 2:
            self.groups[-1].insert(0, self.groups[-2].pop())  # no sample alone in its batch (its noise would be ~0)
        self.group_of = {sid: g for g, group in enumerate(self.groups) for sid, _ in group}
        self._current, self._states = None, {}

    def states(self, sample_id: str) -> dict[str, torch.Tensor] | None:
        """{"<layer id>": [T, H], "final": ...} of the sample in its padded batch; None when it has none."""
        g = self.group_of.get(sample_id)
        if g is None:
            return None
        if g != self._current:
            self._states = {}  # free the previous group before the next forward
            group = self.groups[g]
            self._current = g
            rows = [ids for _, ids in group]
            if len(rows) == 1:  # a batch of one IS the run alone (no noise measured): give it a second row
                rows.append(filler_row(rows[0]))
            try:
                batch = run_padded_batch(self.model, rows, self.layer_ids, self.capture_final, self.device)
            except torch.OutOfMemoryError:
                if not self.skip_on_oom:  # a replica's other processes may be past this forward: stop as before
                    raise
                self.log(f"verify: out of memory in the padded batch of {len(group)} sample(s) "
                         f"({', '.join(sid for sid, _ in group)}): they give no noise floor")
                return None
            self._states = {sid: states for (sid, _), states in zip(group, batch)}
        return self._states.get(sample_id)


def filler_row(input_ids_T: torch.Tensor) -> torch.Tensor:
    """The second row of a padded batch whose group holds one sample: the sample's own tokens repeated to
    T + max(1, T // 4) tokens (int64 [T']), so the sample runs with a batch of two and right padding (at least one
    padded token, up to a quarter of its length: the extraction's `length_growth: 1.25` buckets pad that much);
    the filler's states are not used. Without it the padded batch of a lone sample (`--num-samples 1`, an output of
    one sample) is the very forward of its run alone and its noise floor is 0."""
    T = int(input_ids_T.shape[0])
    return input_ids_T.repeat(2)[:T + max(1, T // 4)]


"""The work split of one epoch over its consumers (ranks x DataLoader workers): whole shards dealt to the least loaded
consumer, or every shard with sample striding; the epoch's seeded shard order (the rule and its bounds: reader.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import webdataset as wds

from dflash_prep.consume.shard_format import ShardInfo

SPLIT_MODES = ("auto", "shard", "sample")


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): the explicit values, else torch.distributed's when initialized, else (0, 1)."""
    if (rank is None) != (world_size is None):
        raise ValueError("pass both rank and world_size, or neither")
    if rank is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            rank, world_size = 0, 1
    if not (world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return int(rank), int(world_size)


@dataclass(frozen=True)
class ConsumerPlan:
    """What one consumer reads in one epoch.

    `shards` in reading order. Mode "shard": every sample of each listed shard. Mode "sample": the shards are
    all shards of the epoch, `first_positions[i]` is the global position of shard i's first sample, and the
    consumer keeps the samples with `(first_positions[i] + j) % num_consumers == consumer`.
    """

    mode: str
    consumer: int
    num_consumers: int
    shards: tuple[ShardInfo, ...]
    first_positions: tuple[int, ...]

    def wanted(self, shard_index: int):
        """The `wanted(position)` filter for `iter_tar_samples` on `shards[shard_index]` (None: all)."""
        if self.mode == "shard":
            return None
        base, C, c = self.first_positions[shard_index], self.num_consumers, self.consumer
        return lambda j: (base + j) % C == c

    @property
    def num_samples(self) -> int:
        if self.mode == "shard":
            return sum(s.num_samples for s in self.shards)
        total = sum(s.num_samples for s in self.shards)
        C, c = self.num_consumers, self.consumer
        return total // C + (1 if c < total % C else 0)


def epoch_shard_order(shards: list[ShardInfo], shuffle: bool, seed: int, epoch: int) -> list[ShardInfo]:
    """The epoch's shard order: manifest order, or a permutation seeded by (seed, epoch), the same on every
    consumer (`webdataset.SimpleShardList`, seeded with a string of seed and epoch)."""
    by_url = {str(s.path): s for s in shards}
    return [by_url[d["url"]] for d in shard_list(shards, shuffle, seed, epoch)] if shards else []


def shard_list(shards: list[ShardInfo], shuffle: bool, seed: int, epoch: int) -> wds.SimpleShardList:
    return wds.SimpleShardList([str(s.path) for s in shards],
                               seed=f"dflash-prep:shards:{seed}:{epoch}" if shuffle else None)


def plan_consumer(shards: list[ShardInfo], consumer: int, num_consumers: int, split: str = "auto",
                  shuffle: bool = False, seed: int = 0, epoch: int = 0) -> ConsumerPlan:
    """Consumer `consumer` of `num_consumers`'s share of one epoch (see reader.py's docstring for the rule)."""
    return plan_from_order(epoch_shard_order(shards, shuffle, seed, epoch), consumer, num_consumers, split)


def plan_from_order(order: list[ShardInfo], consumer: int, num_consumers: int, split: str = "auto") -> ConsumerPlan:
    """Consumer `consumer`'s share of an epoch whose shards come in `order`: whole shards dealt to the least
    loaded consumer, or every shard with sample striding (reader.py's rule)."""
    if split not in SPLIT_MODES:
        raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
    if not 0 <= consumer < num_consumers:
        raise ValueError(f"consumer {consumer} is not in [0, {num_consumers})")
    mode = split if split != "auto" else ("shard" if len(order) >= num_consumers else "sample")
    if mode == "shard":
        load = [0] * num_consumers
        mine = []
        for shard in order:
            c = min(range(num_consumers), key=lambda j: (load[j], j))
            load[c] += shard.num_samples
            if c == consumer:
                mine.append(shard)
        return ConsumerPlan("shard", consumer, num_consumers, tuple(mine), ())
    firsts, position = [], 0
    for s in order:
        firsts.append(position)
        position += s.num_samples
    return ConsumerPlan("sample", consumer, num_consumers, tuple(order), tuple(firsts))


class SplitByConsumer:
    """A webdataset pipeline stage, in place of `split_by_node` + `split_by_worker`: from the epoch's stream of
    `{"url": ...}` (every consumer sees the same order), yield this consumer's shards as
    `{"url", "shard": ShardInfo, "wanted": position filter or None}` (`plan_from_order`'s rule)."""

    def __init__(self, shards: list[ShardInfo], consumer: int, num_consumers: int, split: str):
        self.by_url = {str(s.path): s for s in shards}
        self.consumer, self.num_consumers, self.split = consumer, num_consumers, split

    def __call__(self, src: Iterable[dict]) -> Iterator[dict]:
        order = [self.by_url[d["url"]] for d in src]
        plan = plan_from_order(order, self.consumer, self.num_consumers, self.split)
        for i, shard in enumerate(plan.shards):
            yield {"url": str(shard.path), "shard": shard, "wanted": plan.wanted(i)}


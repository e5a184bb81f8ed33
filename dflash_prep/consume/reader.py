"""Read an extraction output: the shards listed in `OUT/manifest.json` -> per-sample tensors -> DFlash batches.

`ShardDataset(out_dir)` is a torch `IterableDataset`; `DFlashCollator` turns its samples into trainer batches.

Guarantees of `ShardDataset`:
- it reads `OUT/manifest.json` once, at construction, and reads only the shards it lists (the manifest lists
  committed shards only, so a partial shard is never read); it never lists folders nor opens every shard up
  front: a shard is opened when its consumer reaches it;
- each sample is one dict: `sample_id` (str), `input_ids` int64 [T], `loss_mask` int64 [T], `hidden_states`
  [T, k*H] in the output's storage dtype (`manifest["dtype"]`, bf16 by default; the k captured layers
  concatenated in ascending `layer_ids` order, after-layer 0-based ids), and `final_hidden_states` [T, H] when
  the extraction captured it (`manifest["capture_final"]` != "none"); values are exactly the stored bytes;
- fp8 outputs (`manifest["dtype"] == "fp8_e4m3"`): by default (`fp8="bfloat16"`) the states come back
  dequantized to bf16 (e4m3 value x its token's fp32 scale, formed in fp32, then rounded to bf16), with the same
  keys and shapes as a bf16 output; `fp8="float32"` gives float32; `fp8="raw"` gives the stored tensors:
  `hidden_states` float8_e4m3fn [T, k*H] + `hidden_states_scales` float32 [T, k] (and `final_hidden_states`
  [T, H] + `final_hidden_states_scales` [T, 1]); `fp8.dequantize` turns them into values;
- safetensors members are decoded with `safetensors.torch.load` (bytes) and npy members with
  `np.load(allow_pickle=False)`: no pickle, no code execution; `meta.json` is parsed only with `include_meta`;
- a shard whose content disagrees with the manifest or the format (missing member, wrong dtype or shape,
  repeated key, sample count different from the manifest) raises `ShardFormatError` naming the shard;
- integrity (`verify_sha256=True`, the default): at construction, the manifest's shard list must name each
  path once and its sample counts must add up to `num_samples` (else `ShardFormatError`, before any shard is
  opened); while a shard is streamed, every byte of it (also the bytes of samples another consumer keeps, and
  the tar's end blocks) goes through sha256, and at the end of the shard a size or digest different from the
  manifest's raises `ShardFormatError` naming the shard. The check cannot come before the shard's samples
  (that would read every shard twice): a corrupted sample is yielded, then the error ends the iteration, so a
  training loop or an export stops instead of going on. Cost: one sha256 pass over the bytes read (about
  1-2 GB/s per consumer). `verify_sha256=False` skips the digest (the counts are still checked);
- work split ("consumers" = distributed ranks x DataLoader workers; rank/world from the explicit arguments,
  else from `torch.distributed` when it is initialized, else 0/1; the worker from
  `torch.utils.data.get_worker_info()`): all consumers of an epoch together yield every sample of the
  manifest exactly once. The rule (`split="auto"`): when the output has at least as many shards as consumers,
  whole shards are dealt: walking the epoch's shard order, each shard goes to the consumer with the fewest
  samples so far (manifest counts; ties to the lowest consumer), so no consumer opens a shard it does not
  read; otherwise every consumer walks every shard and keeps the samples whose global position p (in the
  epoch's shard order) has p % C == c (it reads the others' bytes too, not decoding them: tars are read as
  streams). `split="shard"` / `split="sample"` force one rule. With shard granularity,
  consumers' sample counts can differ by up to one shard's worth; with sample striding, by at most one (use
  `split="sample"` when a DDP loop needs equal step counts). `num_samples_for()` gives the exact count of a
  rank for the current epoch;
- shuffle (`shuffle=True`): the shard order is a permutation seeded by (seed, epoch), the same on every
  consumer, and each consumer passes its samples through a buffer of `shuffle_buffer` samples seeded by
  (seed, epoch, consumer). It changes the order, never the content. Call `set_epoch(e)` before creating the
  epoch's iterator (DataLoader workers get a copy of the dataset when the iterator is created, so with
  `persistent_workers=True` they do not see later `set_epoch` calls: use non-persistent workers to reshuffle).

Built on webdataset (1.0): each consumer's epoch is a `webdataset.DataPipeline` (`ShardDataset.pipeline`):
`SimpleShardList` (the seeded shard order) -> `SplitByConsumer` -> tar parsing and grouping into samples
(`tariterators.tar_file_expander` + `group_by_keys`, in `iter_tar_samples`) -> our decoding and checks ->
`webdataset.shuffle` (a `random.Random` seeded by (seed, epoch, consumer)). What stays ours, and why:
- the split (`SplitByConsumer`, one stage for ranks and workers): `split_by_node` / `split_by_worker` deal shards
  round-robin (`islice`), take the rank from the RANK/WORLD_SIZE environment variables before torch.distributed
  and accept no explicit rank. Round-robin loses the bound above (up to one shard's worth between consumers;
  with shards of 600, 10, 600, 10 samples and 2 consumers it gives 1200 and 20), and with fewer shards than
  consumers some consumers would get nothing. The sample-level split is a position filter given to the shard
  reader, so the others' samples are not decoded (`webdataset.slice` would stride only after decoding);
- no `with_epoch`: it re-runs the pipeline until n samples are out (a second pass repeats samples) and stops
  with `islice` right after the n-th sample, before the last shard's end, so that shard's digest and count would
  never be checked. An epoch here is one pass, its length known exactly (`num_samples_for`);
- integrity: webdataset's opener has no digest (`HashingReader` hashes the stream it reads), and its grouping
  yields a key repeated later in a shard as a second sample: both are checked here, as are the manifest's counts.
Cost, measured on the demo output (700 samples, 91 MB in 6 shards, one process, no workers, best of 3 x 5 runs
on a shared 2-core CPU): webdataset reads a tar as a stream (10 KB chunks, member bytes copied more often than a
seeking reader's one read): 3,682 samples/s against 4,321 before with sha256 (-15%), 4,837 against 6,386 with
`verify_sha256=False` (-24%); one consumer of 4 with `split="sample"` 1,187 against 1,494 (sha256) and 1,657
against 2,792 (no hash: it used to seek over the others' samples).

Modules: shard_format.py (member names, `OutputLayout`, the manifest's shard list), shard_read.py (one shard: tar,
sha256, decoding), split.py (the work split over consumers), this module (`ShardDataset`: the pipeline of an epoch),
collator.py (`DFlashCollator`: trainer batches). Every public name of those is importable from here.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from dflash_prep.consume.collator import SEQUENCE_KEYS, DFlashCollator, has_supervised_pair, truncate_sample
from dflash_prep.consume.follow import (
    DEFAULT_POLL_SECONDS,
    DEFAULT_UNHELD_TIMEOUT_SECONDS,
    OutputNotHeldError,
    follow_shards,
)
from dflash_prep.consume.shard_format import (
    FP8_MODES,
    MEMBER_INPUT_IDS,
    MEMBER_LOSS_MASK,
    MEMBER_META,
    MEMBER_STATES,
    REQUIRED_MEMBERS,
    TORCH_DTYPES,
    OutputLayout,
    ShardFormatError,
    ShardInfo,
    manifest_shard_problems,
    shards_of,
)
from dflash_prep.consume.shard_read import HashingReader, decode_sample, iter_shard, iter_tar_samples, sample_key
from dflash_prep.consume.split import (
    SPLIT_MODES,
    ConsumerPlan,
    SplitByConsumer,
    epoch_shard_order,
    plan_consumer,
    plan_from_order,
    resolve_rank_world,
    shard_list,
)
from dflash_prep.recipe.location import as_location
from dflash_prep.store.manifest import read_manifest
from dflash_prep.target.norms import can_derive_after_norm, read_final_norm, with_after_norm_final

FINAL_MODES = ("as_stored", "before_norm", "after_norm")  # the final layer the reader returns

__all__ = ["MEMBER_INPUT_IDS", "MEMBER_LOSS_MASK", "MEMBER_STATES", "MEMBER_META", "REQUIRED_MEMBERS",
           "TORCH_DTYPES", "SPLIT_MODES", "FP8_MODES", "FINAL_MODES", "ShardFormatError", "ShardInfo", "OutputLayout",
           "manifest_shard_problems", "shards_of", "sample_key", "HashingReader", "iter_tar_samples", "decode_sample",
           "iter_shard", "resolve_rank_world", "ConsumerPlan", "epoch_shard_order", "plan_consumer",
           "plan_from_order", "SplitByConsumer", "ShardDataset", "has_supervised_pair", "SEQUENCE_KEYS",
           "truncate_sample", "DFlashCollator", "OutputNotHeldError"]


class ShardDataset(IterableDataset):
    """Samples of an extraction output, split across ranks and DataLoader workers (see the module docstring).

    Args:
        out_dir: the extraction's output folder (holding `manifest.json`), or its object-store URL
            (`s3://bucket/prefix`; credentials from the store's own configuration, `storage_options` for fsspec).
        shuffle: shuffle shard order and samples (per epoch, seeded); off: manifest order, file order.
        seed: shuffle seed.
        shuffle_buffer: samples held by each consumer's shuffle buffer (memory: this many samples).
        rank, world_size: this process's place among the readers; default: torch.distributed, else 0 of 1.
        split: "auto" (shards when shards >= consumers, else samples), "shard" or "sample".
        include_meta: also yield `meta` (the sample's meta.json).
        fp8: for an fp8 output, "bfloat16" (default: dequantized to bf16), "float32", or "raw" (e4m3 tensors +
            their fp32 `*_scales`).
        final: "as_stored" (default) or "after_norm": on a `capture_final: before_norm` output, the after-norm
            final states derived with the stored final norm (norms.py; exact to the storage dtype's rounding,
            returned in the stored dtype); "before_norm"/"after_norm" matching what is stored is a no-op.
            Raises ValueError when the asked form cannot be had (a norm cannot be undone).
        verify_sha256: hash each shard while streaming it and raise `ShardFormatError` at its end when the
            digest differs from the manifest's (default); False skips the hash (sample and token counts are still
            checked).
        follow: read the output while its extraction runs (consume/follow.py): each committed shard's samples
            once as it lands, polling every `poll_seconds`, until the manifest appears; `timeout_seconds`: raise
            TimeoutError after that long without a new shard or the manifest; `unheld_timeout_seconds` (600;
            None: forever): raise OutputNotHeldError (one line) after that long with no run holding the output and
            no manifest (said once, as a warning, when first seen). The split is by shard (a stable hash of its
            path; a redone shard's samples stay with the consumer that had them); `shuffle` shuffles within the
            buffer only; `num_samples` and `len()` need the manifest (read once it exists).
        storage_options: fsspec options of an object-store URL (non-secret: endpoint_url, ...).

    Raises `ShardFormatError` at construction when the manifest names a shard twice or its shards' sample
    counts do not add up to `num_samples`.
    """

    def __init__(self, out_dir: str | Path, *, shuffle: bool = False, seed: int = 0, shuffle_buffer: int = 256,
                 rank: int | None = None, world_size: int | None = None, split: str = "auto",
                 include_meta: bool = False, fp8: str = "bfloat16", verify_sha256: bool = True,
                 final: str = "as_stored", follow: bool = False, poll_seconds: float = DEFAULT_POLL_SECONDS,
                 timeout_seconds: float | None = None,
                 unheld_timeout_seconds: float | None = DEFAULT_UNHELD_TIMEOUT_SECONDS,
                 storage_options: dict | None = None):
        super().__init__()
        if fp8 not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {fp8!r}")
        if split not in SPLIT_MODES:
            raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        if (rank is None) != (world_size is None):
            raise ValueError("pass both rank and world_size, or neither")
        self.out_dir = as_location(out_dir, storage_options)  # a folder, or an object-store URL (fsspec)
        self.follow, self.poll_seconds, self.timeout_seconds = follow, poll_seconds, timeout_seconds
        self.unheld_timeout_seconds = unheld_timeout_seconds
        if follow and not (self.out_dir / "manifest.json").is_file():
            if final != "as_stored":
                raise ValueError(f"final={final!r} needs the finished output's final norm: follow=True reads the final "
                                 f"layer as stored (or follow a finished output)")
            self.manifest, self.layout, self.shards = None, None, []  # follow.py: decoded as they land
            self._set_options(verify_sha256, shuffle, seed, shuffle_buffer, rank, world_size, split, include_meta, fp8)
            self.final_norm = None
            return
        self.manifest = read_manifest(self.out_dir)
        self.layout = OutputLayout.from_manifest(self.manifest)
        problems = manifest_shard_problems(self.manifest)
        if problems:
            raise ShardFormatError(f"{self.out_dir / 'manifest.json'}: {'; '.join(problems[:5])}")
        self.shards = shards_of(self.out_dir, self.manifest)
        self._set_options(verify_sha256, shuffle, seed, shuffle_buffer, rank, world_size, split, include_meta, fp8)
        self.final_norm = self._final_norm_to_apply(final)

    def _set_options(self, verify_sha256, shuffle, seed, shuffle_buffer, rank, world_size, split, include_meta, fp8):
        self.verify_sha256 = verify_sha256
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.split = split
        self.include_meta = include_meta
        self.fp8 = fp8
        self.epoch = 0

    def _final_norm_to_apply(self, final: str) -> dict | None:
        """The final norm to apply to `final_hidden_states` (final="after_norm" on a before-norm output), or None."""
        if final not in FINAL_MODES:
            raise ValueError(f"final must be one of {FINAL_MODES}, got {final!r}")
        stored = self.layout.capture_final
        if final == "as_stored" or final == stored:
            return None
        if stored == "none":
            raise ValueError(f"final={final!r}: the output did not capture the final layer; re-extract with "
                             f"layers.capture_final=before_norm (gives both) or {final}")
        if final == "before_norm":
            raise ValueError("final='before_norm': the output stores the final layer after the norm, which cannot "
                             "be undone; re-extract with layers.capture_final=before_norm")
        if not can_derive_after_norm(self.manifest):
            raise ValueError(f"final='after_norm': {self.out_dir} stores no supported final norm "
                             f"(final_norm={self.manifest.get('final_norm')}); re-extract with "
                             f"layers.capture_final=after_norm")
        if self.layout.is_fp8 and self.fp8 == "raw":
            raise ValueError("final='after_norm' needs values: use fp8='bfloat16' or 'float32', not 'raw'")
        return read_final_norm(self.out_dir)

    # -- facts ---------------------------------------------------------------------------------------------
    def _manifest_now(self) -> dict | None:
        """The manifest; a follower built before it existed reads it once it does (then it is kept)."""
        if self.manifest is None and self.follow and (self.out_dir / "manifest.json").is_file():
            self.manifest = read_manifest(self.out_dir)
            self.layout = self.layout or OutputLayout.from_manifest(self.manifest)
        return self.manifest

    @property
    def num_samples(self) -> int:
        """Samples in the whole output (all ranks together) per epoch. A follower: once the manifest exists
        (ValueError before)."""
        if self._manifest_now() is None:
            raise ValueError(f"{self.out_dir}: the number of samples is known once the extraction wrote its manifest")
        return int(self.manifest["num_samples"])

    def __bool__(self) -> bool:  # a dataset is truthy, also while len() cannot answer yet
        return True

    def __len__(self) -> int:
        """Samples this reader yields per epoch, all its DataLoader workers together: `num_samples` for a reader of
        one rank (every sample once, whatever the number of workers). Several ranks: a rank's count depends on its
        number of workers, so len() raises TypeError naming `num_samples_for(rank, world_size, num_workers)`.
        A follower: once the manifest exists (TypeError before)."""
        if self._manifest_now() is None:
            raise TypeError(f"{self.out_dir}: a follower's length is known once the extraction wrote its manifest")
        _, world_size = resolve_rank_world(self.rank, self.world_size)
        if world_size != 1:
            raise TypeError(f"len() of a reader of rank {self.rank} of {world_size}: its count depends on the "
                            f"DataLoader workers; use num_samples_for(rank, world_size, num_workers)")
        return self.num_samples

    @property
    def layer_ids(self) -> list[int]:
        """Captured layers, after-layer 0-based ids, in the column order of `hidden_states`."""
        return list(self.layout.layer_ids)

    @property
    def hidden_size(self) -> int:
        return self.layout.hidden_size

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose (seeded) order the next iterator yields."""
        self.epoch = int(epoch)

    def plan(self, consumer: int, num_consumers: int) -> ConsumerPlan:
        """One consumer's share of the current epoch."""
        return plan_consumer(self.shards, consumer, num_consumers, self.split, self.shuffle, self.seed, self.epoch)

    def num_samples_for(self, rank: int | None = None, world_size: int | None = None, num_workers: int = 1) -> int:
        """Exact number of samples rank `rank` (all its `num_workers` workers together) yields this epoch."""
        if rank is None and world_size is None:
            rank, world_size = resolve_rank_world(self.rank, self.world_size)
        else:
            rank, world_size = resolve_rank_world(rank, world_size)
        workers = max(num_workers, 1)  # num_workers=0: the main process is the one consumer
        return sum(self.plan(rank * workers + w, world_size * workers).num_samples for w in range(workers))

    # -- iteration -----------------------------------------------------------------------------------------
    def _consumer(self) -> tuple[int, int]:
        rank, world_size = resolve_rank_world(self.rank, self.world_size)
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank * num_workers + worker, world_size * num_workers

    def _decode_shards(self, src: Iterable[dict]) -> Iterator[dict[str, Any]]:
        """Pipeline stage: this consumer's shards -> its decoded, checked samples (`iter_shard`)."""
        for item in src:
            for sample in iter_shard(item["shard"], self.layout, item["wanted"], self.include_meta, fp8=self.fp8,
                                     verify_sha256=self.verify_sha256):
                yield sample if self.final_norm is None else with_after_norm_final(sample, self.final_norm)

    def _follow_samples(self, consumer: int, num_consumers: int) -> Iterator[dict[str, Any]]:
        """follow=True: this consumer's samples of each shard as it is committed, until the manifest (follow.py)."""
        yielded: set[str] = set()
        for shard, layout, wanted in follow_shards(self.out_dir, consumer, num_consumers, self.poll_seconds,
                                                   self.timeout_seconds, self.unheld_timeout_seconds):
            for sample in iter_shard(shard, layout, None, self.include_meta, fp8=self.fp8,
                                     verify_sha256=self.verify_sha256):
                if wanted is not None and sample["sample_id"] not in wanted:
                    continue  # a redone sample another consumer owns (follow.py `sample_owners`)
                if sample["sample_id"] not in yielded:
                    yielded.add(sample["sample_id"])
                    yield sample if self.final_norm is None else with_after_norm_final(sample, self.final_norm)

    def pipeline(self, consumer: int, num_consumers: int) -> wds.DataPipeline:
        """The webdataset pipeline of one consumer for the current epoch: shard list (seeded order) -> this
        consumer's shards -> tar -> decoded samples -> seeded shuffle buffer (with `shuffle`). follow=True: the
        shards as they are committed (follow.py), in commit order, then the shuffle buffer."""
        if self.follow:
            stages = [functools.partial(self._follow_samples, consumer, num_consumers)]
            if self.shuffle:
                rng = random.Random(f"dflash-prep:samples:{self.seed}:{self.epoch}:{consumer}")
                stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng))
            return wds.DataPipeline(*stages)
        stages = [shard_list(self.shards, self.shuffle, self.seed, self.epoch) if self.shards else [],
                  SplitByConsumer(self.shards, consumer, num_consumers, self.split), self._decode_shards]
        if self.shuffle:
            rng = random.Random(f"dflash-prep:samples:{self.seed}:{self.epoch}:{consumer}")
            stages.append(wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng))
        return wds.DataPipeline(*stages)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.pipeline(*self._consumer()))


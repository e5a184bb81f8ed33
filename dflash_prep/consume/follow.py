"""Train while the extraction runs: the shards of an output as they are committed (`ShardDataset(out, follow=True)`).

A follower polls the output (a local folder or an object-store URL) every `poll_seconds`:

- what it reads is what the rank indexes commit: `OUT/index/rank-*.jsonl`, complete lines only (a line being
  appended, without its newline, is left for the next poll). A shard is listed there only once its file (or object)
  is whole under its final name, so no partial shard is ever opened; a shard file no index lists (being written, or
  left by a killed run and removed by its resume) is never looked at;
- each committed shard is yielded once, keyed by what the index commits (its path and sha256): a resume after a
  kill keeps the committed shards as they are and redoes the rest into new shards, which the follower then reads;
  a shard number reused by a resume for other content (its earlier object was never committed) is another key. A
  consumer also never yields one sample id twice, and neither do the consumers of one reader together: a resume
  that finds a committed shard damaged appends its index line to `index/superseded.jsonl` before it redoes it, and
  every consumer sends the samples of a superseded shard to that shard's consumer (`sample_owners`), whichever new
  shard holds them (the superseded file is read after the indexes, so a redone record is never seen without it);
- a plan batch held by two committed records (a run frozen past its lease committed it late beside the run that took
  over; the store keeps the later run's at the end) is read from the one committed first: a consumer meets the
  records new in a poll in commit order (`committed_now`: line order within a rank's file, commit time across
  files), so the first it meets is the one any consumer that polled between the two commits saw alone, and every
  consumer that has met it leaves the second's copies out. Left open: two records in two rank files written by
  hosts whose clocks differ by more than the time between the two commits can still have two consumers each read
  one;
- before the manifest exists, the samples are decoded with the layout the run recorded when it claimed the output
  (`run_state.json`: layer ids, hidden size, storage dtype, final layer); the follower waits for that file;
- it ends when `OUT/manifest.json` appears: the shards it lists and the follower has not read yet are read, then the
  iteration stops. `timeout_seconds` (default none): a TimeoutError when no new shard and no manifest came for that
  long. `unheld_timeout_seconds` (default 600): while nothing lands the follower looks every HOLDER_CHECK_SECONDS
  at whether a run holds the output (its lease records, never its flock); when none does, it says so once (a
  warning) and raises OutputNotHeldError after that long (an extraction that died and is not resumed);
- several consumers (ranks x DataLoader workers): shard i goes to consumer sha256(path) mod C, so each committed
  shard is read by exactly one of them whatever the order they poll in.

Cost: per poll, one listing and one read of each rank index (small) and of `manifest.json`'s existence.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator

from dflash_prep.consume.shard_format import TORCH_DTYPES, OutputLayout, ShardInfo, shards_of
from dflash_prep.recipe.location import fresh_listing, read_whole
from dflash_prep.store.lease import StoreError, store_call
from dflash_prep.store.manifest import MANIFEST_NAME, STATE_NAME, read_manifest
from dflash_prep.store.record_store import SUPERSEDED_NAME
from dflash_prep.store.records import INDEX_DIR, ShardRecord

DEFAULT_POLL_SECONDS = 5.0
DEFAULT_UNHELD_TIMEOUT_SECONDS = 600.0  # a follower of an output no run holds gives up after this long
HOLDER_CHECK_SECONDS = 30.0  # how often a follower without news looks at the output's run lease (< a minute)


class OutputNotHeldError(TimeoutError):
    """A followed output has no manifest and no run has held it for `unheld_timeout_seconds`: its extraction died
    and was not resumed. One line."""

log = logging.getLogger("dflash_prep")


def _complete_records(index) -> list[ShardRecord]:
    """The complete, readable lines of one index file, up to its first bad line ([] when absent)."""
    try:
        data = read_whole(index)
    except FileNotFoundError:
        return []
    records = []
    for line in data[:data.rfind(b"\n") + 1].splitlines():
        if not line.strip():
            continue
        try:
            records.append(ShardRecord(**json.loads(line)))
        except (ValueError, TypeError):
            break
    return records


def committed_now(out_dir) -> list[ShardRecord]:
    """The shards the rank indexes commit at this moment: every complete, readable line of every
    `index/rank-*.jsonl` (reading stops at a file's first bad line, as `read_committed`), in commit order: within a
    file its line order (appends: the order they landed, whatever the clocks of the hosts that wrote them said),
    across files by commit time (`committed_at`; a line without a usable one goes with the line before it). Of two
    records of one plan batch a consumer meets in one poll, the first is then the one any consumer that polled
    between the two commits saw alone, and read."""
    ordered, seen = [], set()
    for index in sorted((out_dir / INDEX_DIR).glob("rank-*.jsonl"), key=str):
        latest = -math.inf  # the file's commit time so far: its lines stay in their order
        for record in _complete_records(index):
            at = record.committed_at
            if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
                latest = max(latest, float(at))
            if record.path not in seen:
                seen.add(record.path)
                ordered.append((latest, record))
    return [record for _, record in sorted(ordered, key=lambda item: item[0])]  # stable: ties keep file order


def superseded_now(out_dir) -> list[ShardRecord]:
    """The records a resume dropped (committed shards found damaged, then redone), in the order it dropped them
    (`index/superseded.jsonl`, store/manifest.py `drop_records`)."""
    return _complete_records(out_dir / INDEX_DIR / SUPERSEDED_NAME)


def sample_owners(superseded: list[ShardRecord], num_consumers: int) -> dict[str, int]:
    """Sample id -> the consumer that owned it first: a dropped record's samples stay with the consumer of the
    dropped shard (which may have yielded them already), whichever shard the resume redid them into. The first
    dropped record listing a sample decides; every consumer computes the same map from the same file."""
    owners: dict[str, int] = {}
    for record in superseded:
        consumer = consumer_of(record.path, num_consumers)
        for sample_id in record.sample_ids:
            owners.setdefault(sample_id, consumer)
    return owners


def wanted_of(record_sample_ids: list[str], path: str, owners: dict[str, int], consumer: int,
              num_consumers: int) -> frozenset[str] | None | bool:
    """What `consumer` reads of a committed shard: None (all of it: the usual case, no sample of it was in a
    dropped shard), the set of its sample ids this consumer owns, or False (none)."""
    default = consumer_of(path, num_consumers)
    if not owners or not any(s in owners for s in record_sample_ids):
        return None if default == consumer else False
    mine = frozenset(s for s in record_sample_ids if owners.get(s, default) == consumer)
    if not mine:
        return False
    return None if len(mine) == len(record_sample_ids) else mine


def _without_batches_read(record: ShardRecord, wanted: frozenset[str] | None | bool,
                          batch_first: dict[int, tuple[str, str]], key: tuple[str, str],
                          out_dir) -> frozenset[str] | None | bool:
    """`wanted` less the samples of the plan batches an earlier record already held (`batch_first`, updated here
    with the batches `record` is first to hold). Two records hold one batch when a run frozen past its lease
    committed it late beside the run that took over (RecordStore.resolve keeps the later run's at the end; the
    follower has read one of them by then): the second one's copies are not read again, the first records looked
    up in `out_dir`'s indexes."""
    earlier = {batch_first[b] for b in record.batch_ids if b in batch_first} - {key}
    for b in record.batch_ids:
        batch_first.setdefault(b, key)
    if not earlier:
        return wanted
    seen = {s for r in committed_now(out_dir) if (r.path, r.sha256) in earlier for s in r.sample_ids}
    mine = set(record.sample_ids) if wanted is None else set() if wanted is False else set(wanted)
    left = mine - seen
    if left == mine:
        return wanted
    log.warning("%s: %d sample(s) of %s were read from another run's shard already (a run that lost its lease "
                "committed them too): not read twice", out_dir, len(mine & seen), record.path)
    return frozenset(left) if left else False


def output_held(out_dir) -> bool:
    """Whether a live run holds the output now: a local folder's live lease (store/locks.py; its records are read,
    its flocks never probed), an object-store output's run lease present and renewed (store/lease.py)."""
    from dflash_prep.recipe.location import is_remote_path

    if not is_remote_path(out_dir):
        from dflash_prep.store.locks import held_by_a_run

        return held_by_a_run(out_dir)
    from dflash_prep.store.lease import Lease

    lease = Lease(out_dir.fs, (out_dir / "locks" / "run.lease").path)
    content, _ = lease.read()
    return content is not None and not lease.stale(content)


def layout_before_manifest(out_dir) -> OutputLayout | None:
    """The output's layout from `run_state.json` (written when a run claims the output), None while absent or
    when it lacks a key (an output of a version that did not record the hidden size)."""
    try:
        identity = json.loads(read_whole(out_dir / STATE_NAME))["identity"]
        return OutputLayout(layer_ids=tuple(int(i) for i in identity["layer_ids"]),
                            hidden_size=int(identity["hidden_size"]), dtype=TORCH_DTYPES[identity["dtype"]],
                            capture_final=identity.get("capture_final", "none"), dtype_name=identity["dtype"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def consumer_of(path: str, num_consumers: int) -> int:
    """The consumer that reads the shard at `path` (relative to OUT): stable across processes and polls."""
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "big") % num_consumers


def _manifest_or_none(out_dir) -> dict | None:
    if not (out_dir / MANIFEST_NAME).is_file():
        return None
    return read_manifest(out_dir)


@store_call
def _poll(out_dir, layout: OutputLayout | None
          ) -> tuple[dict | None, OutputLayout | None, list[ShardInfo], list[ShardRecord], list[ShardRecord]]:
    """One look at the output: (its manifest or None, the layout, the committed shards in commit order, their
    records, the superseded records). The superseded records are read after the indexes: a record committed by a
    redo is then always seen with the dropped record it replaces (written before the redo began)."""
    fresh_listing(out_dir)
    manifest = _manifest_or_none(out_dir)
    if manifest is not None:
        shards = shards_of(out_dir, manifest)
        indexed = {r.path: r for r in committed_now(out_dir)}  # the manifest lists no sample ids; the indexes do
        records = [indexed.get(s.rel_path) or ShardRecord(path=s.rel_path, num_samples=s.num_samples,
                                                          num_tokens=s.num_tokens, num_bytes=s.num_bytes,
                                                          sha256=s.sha256) for s in shards]
        return manifest, OutputLayout.from_manifest(manifest), shards, records, superseded_now(out_dir)
    layout = layout or layout_before_manifest(out_dir)
    if layout is None:
        return None, None, [], [], []
    records = committed_now(out_dir)
    shards = [ShardInfo(path=out_dir / r.path, rel_path=r.path, num_samples=r.num_samples, num_tokens=r.num_tokens,
                        num_bytes=r.num_bytes, sha256=r.sha256) for r in records]
    return None, layout, shards, records, superseded_now(out_dir)


class _Holder:
    """The follower's watch on whether a run holds the output: looked at every HOLDER_CHECK_SECONDS while nothing
    lands; says once (a warning) when no run holds it, and raises OutputNotHeldError after `timeout_seconds`."""

    def __init__(self, out_dir, timeout_seconds: float | None, speaks: bool):
        self.out_dir, self.timeout_seconds, self.speaks = out_dir, timeout_seconds, speaks
        self.unheld_since: float | None = None
        self.checked_at = -float("inf")

    def news(self) -> None:
        self.unheld_since = None

    def check(self, now: float) -> None:
        if now - self.checked_at < HOLDER_CHECK_SECONDS:
            self._raise_if_past(now)
            return
        self.checked_at = now
        try:
            held = output_held(self.out_dir)
        except Exception as e:  # noqa: BLE001 - a lease that cannot be read: look again next time
            log.debug("%s: cannot read its run lease: %s", self.out_dir, e)
            return
        if held:
            if self.unheld_since is not None and self.speaks:
                log.warning("%s: a run holds the output again; following it", self.out_dir)
            self.unheld_since = None
        elif self.unheld_since is None:
            self.unheld_since = now
            if self.speaks:
                ends = (f"stops in {self.timeout_seconds:g} s unless one resumes it (unheld_timeout_seconds)"
                        if self.timeout_seconds is not None else "waits for one to resume it")
                log.warning("%s: no extraction holds this output and it has no manifest (none started yet, or its "
                            "run died): the follower %s", self.out_dir, ends)
        self._raise_if_past(now)

    def _raise_if_past(self, now: float) -> None:
        if (self.unheld_since is not None and self.timeout_seconds is not None
                and now - self.unheld_since > self.timeout_seconds):
            raise OutputNotHeldError(
                f"{self.out_dir}: no extraction has held this output for {now - self.unheld_since:.0f} s and it has "
                f"no manifest (its run died and was not resumed): re-run the extraction's command to resume it, or "
                f"follow with a larger unheld_timeout_seconds (None: wait forever)")


def follow_shards(out_dir, consumer: int, num_consumers: int, poll_seconds: float = DEFAULT_POLL_SECONDS,
                  timeout_seconds: float | None = None,
                  unheld_timeout_seconds: float | None = DEFAULT_UNHELD_TIMEOUT_SECONDS,
                  ) -> Iterator[tuple[ShardInfo, OutputLayout, frozenset[str] | None]]:
    """This consumer's committed shards, each once, as they land: (shard, layout, the sample ids to keep, None for
    all); ends at the manifest (module docstring)."""
    done: set[tuple[str, str]] = set()
    batch_first: dict[int, tuple[str, str]] = {}  # plan batch id -> the first record read that holds it
    layout = None
    last_news = time.monotonic()
    holder = _Holder(out_dir, unheld_timeout_seconds, speaks=consumer == 0)
    while True:
        try:
            manifest, layout, shards, records, superseded = _poll(out_dir, layout)
        except (OSError, StoreError) as e:  # the store or the network failed this once: look again next time
            log.warning("%s: %s; looking again in %g s", out_dir, e, poll_seconds)
            manifest, shards, records, superseded = None, [], [], []
        owners = sample_owners(superseded, num_consumers)
        news = [(s, r) for s, r in zip(shards, records) if (s.rel_path, s.sha256) not in done]
        for shard, record in news:
            done.add((shard.rel_path, shard.sha256))
            wanted = wanted_of(record.sample_ids, shard.rel_path, owners, consumer, num_consumers)
            wanted = _without_batches_read(record, wanted, batch_first, (shard.rel_path, shard.sha256), out_dir)
            if wanted is not False:
                yield shard, layout, wanted
        if manifest is not None:
            return
        now = time.monotonic()
        if news:
            last_news = now
            holder.news()
        else:
            if timeout_seconds is not None and now - last_news > timeout_seconds:
                raise TimeoutError(f"{out_dir}: no new committed shard and no manifest for {timeout_seconds:g} s "
                                   f"(is the extraction running?)")
            holder.check(now)
        time.sleep(poll_seconds)

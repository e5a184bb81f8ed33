"""Train while the extraction runs: the shards of an output as they are committed (`ShardDataset(out, follow=True)`).

A follower polls the output (a local folder or an object-store URL) every `poll_seconds`:

- what it reads is what the rank indexes commit: `OUT/index/rank-*.jsonl`, complete lines only (a line being
  appended, without its newline, is left for the next poll). A shard is listed there only once its file (or object)
  is whole under its final name, so no partial shard is ever opened; a shard file no index lists (being written, or
  left by a killed run and removed by its resume) is never looked at;
- each committed shard is yielded once, keyed by what the index commits (its path and sha256): a resume after a
  kill keeps the committed shards as they are and redoes the rest into new shards, which the follower then reads;
  a shard number reused by a resume for other content (its earlier object was never committed) is another key. A
  consumer also never yields one sample id twice (a committed shard found damaged and redone by a resume would
  otherwise give its samples again);
- before the manifest exists, the samples are decoded with the layout the run recorded when it claimed the output
  (`run_state.json`: layer ids, hidden size, storage dtype, final layer); the follower waits for that file;
- it ends when `OUT/manifest.json` appears: the shards it lists and the follower has not read yet are read, then the
  iteration stops. `timeout_seconds` (default none): a TimeoutError when no new shard and no manifest came for that
  long (an extraction that died and is not resumed);
- several consumers (ranks x DataLoader workers): shard i goes to consumer sha256(path) mod C, so each committed
  shard is read by exactly one of them whatever the order they poll in.

Cost: per poll, one listing and one read of each rank index (small) and of `manifest.json`'s existence.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator

from dflash_prep.consume.shard_format import TORCH_DTYPES, OutputLayout, ShardInfo, shards_of
from dflash_prep.recipe.location import fresh_listing, read_whole
from dflash_prep.store.lease import StoreError, store_call
from dflash_prep.store.manifest import MANIFEST_NAME, STATE_NAME, read_manifest
from dflash_prep.store.records import INDEX_DIR, ShardRecord

DEFAULT_POLL_SECONDS = 5.0

log = logging.getLogger("dflash_prep")


def committed_now(out_dir) -> list[ShardRecord]:
    """The shards the rank indexes commit at this moment: every complete, readable line of every
    `index/rank-*.jsonl`, in file and line order (reading stops at a file's first bad line, as `read_committed`)."""
    records, seen = [], set()
    for index in sorted((out_dir / INDEX_DIR).glob("rank-*.jsonl"), key=str):
        try:
            data = read_whole(index)
        except FileNotFoundError:
            continue
        for line in data[:data.rfind(b"\n") + 1].splitlines():
            if not line.strip():
                continue
            try:
                record = ShardRecord(**json.loads(line))
            except (ValueError, TypeError):
                break
            if record.path not in seen:
                seen.add(record.path)
                records.append(record)
    return records


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
def _poll(out_dir, layout: OutputLayout | None) -> tuple[dict | None, OutputLayout | None, list[ShardInfo]]:
    """One look at the output: (its manifest or None, the layout, the committed shards in commit order)."""
    fresh_listing(out_dir)
    manifest = _manifest_or_none(out_dir)
    if manifest is not None:
        return manifest, OutputLayout.from_manifest(manifest), shards_of(out_dir, manifest)
    layout = layout or layout_before_manifest(out_dir)
    return None, layout, [] if layout is None else [
        ShardInfo(path=out_dir / r.path, rel_path=r.path, num_samples=r.num_samples, num_tokens=r.num_tokens,
                  num_bytes=r.num_bytes, sha256=r.sha256) for r in committed_now(out_dir)]


def follow_shards(out_dir, consumer: int, num_consumers: int, poll_seconds: float = DEFAULT_POLL_SECONDS,
                  timeout_seconds: float | None = None) -> Iterator[tuple[ShardInfo, OutputLayout]]:
    """This consumer's committed shards, each once, as they land; ends at the manifest (module docstring)."""
    done: set[tuple[str, str]] = set()
    layout = None
    last_news = time.monotonic()
    while True:
        try:
            manifest, layout, shards = _poll(out_dir, layout)
        except (OSError, StoreError) as e:  # the store or the network failed this once: look again next time
            log.warning("%s: %s; looking again in %g s", out_dir, e, poll_seconds)
            manifest, shards = None, []
        news = [s for s in shards if (s.rel_path, s.sha256) not in done]
        for shard in news:
            done.add((shard.rel_path, shard.sha256))
            if consumer_of(shard.rel_path, num_consumers) == consumer:
                yield shard, layout
        if manifest is not None:
            return
        now = time.monotonic()
        if news:
            last_news = now
        elif timeout_seconds is not None and now - last_news > timeout_seconds:
            raise TimeoutError(f"{out_dir}: no new committed shard and no manifest for {timeout_seconds:g} s (is the "
                               f"extraction running?)")
        time.sleep(poll_seconds)

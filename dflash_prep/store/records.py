"""What an output folder is made of, by name: the shard and index folders, a rank's name, and the record of one
committed shard (a line of the rank index, an entry of the manifest). No torch here: the checks that answer before
the heavy imports (a finished output) read these."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_prep.store.record_store import INDEX_DIR  # noqa: F401 - one name of the index folder, for every stage

SHARDS_DIR = "shards"
SUMMARY_NAME = "summary.json"
FAILED_NAME = "failed.jsonl"


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


@dataclass
class ShardRecord:
    """One committed shard, as listed in the rank index and the manifest."""

    path: str  # relative to OUT
    num_samples: int
    num_tokens: int
    num_bytes: int
    sha256: str
    batch_ids: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)  # [{sample_id, source_row, source_id, batch_id, reason}]
    committed_at: float | None = None  # unix time of the commit (progress and ETA of a running job)
    fence: int | None = None  # the committing run's fencing token (its run lease's generation; None: older versions)

    def to_json(self) -> dict:
        fence = {} if self.fence is None else {"fence": self.fence}
        return dict(path=self.path, num_samples=self.num_samples, num_tokens=self.num_tokens,
                    num_bytes=self.num_bytes, sha256=self.sha256, batch_ids=self.batch_ids,
                    sample_ids=self.sample_ids, failed=self.failed, committed_at=self.committed_at, **fence)

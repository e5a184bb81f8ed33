"""Test-only fault injection: make the failures a real run meets (OOM, NaN, a full disk, a crash) on demand.

Set the environment variable `DFLASH_PREP_FAULTS` to a JSON object; `run_extraction` (and `regenerate`, for
`plan_delay_*`) reads it once at its start. Unset (the normal case), `Faults.from_env()` returns None and no code
path pays for it. Keys (all optional):

    oom_batches            [batch_id, ...]   the first forward of each listed batch raises a CUDA OOM (its
                                             halves then run; later batches of its padded length are pre-split)
    oom_samples            [sample_id, ...]  every forward holding a listed sample raises a CUDA OOM, so the
                                             sample fails alone (recorded as failed `out_of_memory`)
    oom_after_forward_batches [batch_id, ...] the first forward of each listed batch raises a CUDA OOM after it
                                             ran (as an allocation after a tensor-parallel forward's last
                                             collective would)
    oom_process            P                 only the process of index P (torchrun's RANK) raises the OOMs of
                                             oom_after_forward_batches (default: every process)
    nan_samples            [sample_id, ...]  a NaN is written into the captured states of each listed sample
    enospc_shard           N                 writing into shard number N raises OSError(ENOSPC) after part of
                                             the shard is on disk
    enospc_rank            R                 only on rank R (default: every rank)
    exit_after_rename_shard N                the process dies (os._exit(137)) right after shard N is renamed into
                                             place and before its index line is written: the narrowest crash
                                             window of a commit
    forward_delay_seconds  S                 every forward first sleeps S seconds (a slow GPU: keeps a run alive
                                             long enough for a test to start a second one beside it)
    write_delay_seconds    S                 every batch a writer thread writes first sleeps S seconds (a slow disk)
    load_delay_seconds     S                 the model load first sleeps S seconds (a checkpoint of tens of GB)
    plan_delay_seconds     S                 the process sleeps S seconds before it reads what is committed and
                                             takes its share of the plan (a rank slow to start: its peers may
                                             already be committing)
    plan_delay_process     P                 only the process of index P (torchrun's RANK) does (default: every
                                             process)
    sigterm_after_batches  K                 the process sends itself SIGTERM (a preemption notice) after its
                                             K-th batch
    sigterm_process        P                 only the process of index P does (default: every process)
    stop_at_commit         {"point": P, "shard": N}  the process stops itself (SIGSTOP, as a frozen VM) at commit
                                             point P of shard N: "checked" (its fence checked, not yet renamed),
                                             "renamed" (renamed, no index line yet), "appending" (checked again,
                                             the line not yet appended: the window fencing cannot close), or
                                             "manifest" (N ignored: before the manifest's fence check); SIGCONT
                                             wakes it
    upload_part_bytes      N                 an object-store output uploads shards above 2N bytes as multipart
                                             uploads of N-byte parts (default 64 MiB; S3 takes >= 5 MiB): small
                                             test shards then cross the multipart path

Example: DFLASH_PREP_FAULTS='{"oom_batches": [3, 5], "nan_samples": ["0000000012"], "enospc_shard": 1}'.
It is a test hook: it never mocks the model; the forward, the writer and the commit all run for real.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field

ENV_VAR = "DFLASH_PREP_FAULTS"
KNOWN_KEYS = ("oom_batches", "oom_samples", "nan_samples", "enospc_shard", "enospc_rank", "exit_after_rename_shard",
              "forward_delay_seconds", "write_delay_seconds", "sigterm_after_batches", "sigterm_process",
              "oom_after_forward_batches", "oom_process", "load_delay_seconds", "upload_part_bytes",
              "stop_at_commit", "plan_delay_seconds", "plan_delay_process")


@dataclass
class Faults:
    oom_batches: set[int] = field(default_factory=set)
    oom_samples: set[str] = field(default_factory=set)
    nan_samples: set[str] = field(default_factory=set)
    enospc_shard: int | None = None
    enospc_rank: int | None = None
    exit_after_rename_shard: int | None = None
    forward_delay_seconds: float = 0.0
    write_delay_seconds: float = 0.0
    load_delay_seconds: float = 0.0
    sigterm_after_batches: int | None = None
    sigterm_process: int | None = None
    oom_after_forward_batches: set[int] = field(default_factory=set)
    oom_process: int | None = None
    upload_part_bytes: int | None = None
    stop_at_commit: dict | None = None
    plan_delay_seconds: float = 0.0
    plan_delay_process: int | None = None
    _oom_fired: set[int] = field(default_factory=set)
    _oom_after_fired: set[int] = field(default_factory=set)

    @classmethod
    def from_env(cls) -> "Faults | None":
        text = os.environ.get(ENV_VAR)
        if not text:
            return None
        spec = json.loads(text)
        if not isinstance(spec, dict) or set(spec) - set(KNOWN_KEYS):
            raise ValueError(f"{ENV_VAR}: expected a JSON object with keys among {KNOWN_KEYS}, got {text!r}")
        return cls(oom_batches={int(b) for b in spec.get("oom_batches", [])},
                   oom_samples={str(s) for s in spec.get("oom_samples", [])},
                   nan_samples={str(s) for s in spec.get("nan_samples", [])},
                   enospc_shard=spec.get("enospc_shard"), enospc_rank=spec.get("enospc_rank"),
                   exit_after_rename_shard=spec.get("exit_after_rename_shard"),
                   forward_delay_seconds=float(spec.get("forward_delay_seconds", 0.0)),
                   write_delay_seconds=float(spec.get("write_delay_seconds", 0.0)),
                   load_delay_seconds=float(spec.get("load_delay_seconds", 0.0)),
                   sigterm_after_batches=spec.get("sigterm_after_batches"), sigterm_process=spec.get("sigterm_process"),
                   oom_after_forward_batches={int(b) for b in spec.get("oom_after_forward_batches", [])},
                   oom_process=spec.get("oom_process"), upload_part_bytes=spec.get("upload_part_bytes"),
                   stop_at_commit=spec.get("stop_at_commit"),
                   plan_delay_seconds=float(spec.get("plan_delay_seconds", 0.0)),
                   plan_delay_process=spec.get("plan_delay_process"))

    # -- model load ----------------------------------------------------------------------------------------
    def before_load(self) -> None:
        if self.load_delay_seconds:
            import time

            time.sleep(self.load_delay_seconds)

    def before_plan(self) -> None:
        """Sleep before this process reads the committed set, where the spec asks for it."""
        if self.plan_delay_seconds and self.plan_delay_process in (None, int(os.environ.get("RANK", "0"))):
            import time

            time.sleep(self.plan_delay_seconds)

    # -- forward -------------------------------------------------------------------------------------------
    def before_forward(self, batch_id: int, sample_ids: list[str]) -> None:
        """Sleep and raise an injected OOM where the spec asks for them."""
        import time

        import torch

        if self.forward_delay_seconds:
            time.sleep(self.forward_delay_seconds)
        if batch_id in self.oom_batches and batch_id not in self._oom_fired:
            self._oom_fired.add(batch_id)
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by {ENV_VAR} on batch {batch_id})")
        hit = self.oom_samples.intersection(sample_ids)
        if hit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by {ENV_VAR} for {sorted(hit)})")

    def after_forward(self, batch_id: int) -> None:
        """Raise an injected OOM after a forward ran, once per listed batch, on the listed process."""
        if (batch_id in self.oom_after_forward_batches and batch_id not in self._oom_after_fired
                and self.oom_process in (None, int(os.environ.get("RANK", "0")))):
            import torch

            self._oom_after_fired.add(batch_id)
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by {ENV_VAR} after batch {batch_id})")

    def after_batch(self, process_index: int, num_batches: int) -> None:
        """SIGTERM to this process after its `sigterm_after_batches`-th batch, where the spec asks for it."""
        if num_batches == self.sigterm_after_batches and self.sigterm_process in (None, process_index):
            import signal

            os.kill(os.getpid(), signal.SIGTERM)

    def poison(self, hidden_states_NK, sample_ids: list[str], lengths: list[int]) -> None:
        """Write a NaN into the first captured value of each listed sample (in place); in a packed fp8 buffer
        (uint8 rows), into the last scale of the sample's first row."""
        import torch

        start = 0
        for sid, n in zip(sample_ids, lengths):
            if sid in self.nan_samples:
                if hidden_states_NK.dtype == torch.uint8:
                    nan = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8)
                    hidden_states_NK[start, -4:] = nan.to(hidden_states_NK.device)
                else:
                    hidden_states_NK[start, 0] = float("nan")
            start += n

    # -- writer --------------------------------------------------------------------------------------------
    def before_batch_write(self) -> None:
        if self.write_delay_seconds:
            import time

            time.sleep(self.write_delay_seconds)

    def on_shard_write(self, rank: int, shard_number: int, tmp_path) -> None:
        if self.enospc_shard == shard_number and self.enospc_rank in (None, rank):
            raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV_VAR})", str(tmp_path))

    def at_commit(self, point: str, shard_number: int | None = None) -> None:
        """SIGSTOP this process at the commit point the spec names (once)."""
        spec = self.stop_at_commit
        if spec and spec.get("point") == point and (point == "manifest" or spec.get("shard") == shard_number):
            import signal

            self.stop_at_commit = None
            os.kill(os.getpid(), signal.SIGSTOP)

    def after_rename(self, shard_number: int) -> None:
        if self.exit_after_rename_shard == shard_number:
            os._exit(137)

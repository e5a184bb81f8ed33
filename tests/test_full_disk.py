"""A full disk in the end phase: the extraction's output on a real tmpfs mount, filled to a few free pages once
every shard is committed, so that the run gets through its claim and resume and meets the full disk in its last
writes (the draft-vocabulary counts written as safetensors, failed.jsonl, summary, run state, manifest, lease
records, log lines). Each ends with one error line and exit code 1, no traceback, no `--- Logging error ---`, no
`.tmp` left anywhere; with the space back, the same command finishes the output, which holds the first run's shards.

Needs `mount -t tmpfs` (root, or a container that allows it): skipped with that reason where it is refused."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import REPO

PAGE = 4096
SETTINGS = ["--set", "data.max_samples=16", "--set", "batching.num_workers=0",
            "--set", "output.max_shard_bytes=200KB", "--set", "output.num_writer_threads=1"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop("DFLASH_PREP_FAULTS", None)
END_FILES = ("manifest.json", "summary.json", "token_freq.safetensors")


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    """A 32 MB tmpfs mounted for this module."""
    mount = tmp_path_factory.mktemp("tmpfs")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not allowed here ({proc.stderr.strip() or proc.returncode}); the full-disk "
                    f"cases need a real small filesystem")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def extract(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "extract.py", "--set", f"output.dir={out}", *SETTINGS], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)


def fill(mount: Path, free_pages: int) -> Path:
    """A filler file that leaves `free_pages` pages of the mount free."""
    st = os.statvfs(mount)
    filler = mount / f"filler-{uuid.uuid4().hex[:8]}"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(st.f_bavail * st.f_frsize - free_pages * PAGE, 0))
    return filler


def tmp_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name.endswith(".tmp"))


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("[dflash-prep]")]


@pytest.fixture(scope="module")
def finished(tmpfs) -> tuple[Path, dict]:
    """The output, extracted whole on the tmpfs: (its folder, its manifest)."""
    out = tmpfs / "out"
    proc = extract(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / "manifest.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("free_pages", [0, 1, 3])
def test_a_full_disk_in_the_end_phase_is_one_line_and_the_rerun_finishes(tmpfs, finished, free_pages):
    out, manifest = finished
    for name in END_FILES:  # back to "every shard committed, not finished": the re-run goes to the end phase
        (out / name).unlink(missing_ok=True)
    filler = fill(tmpfs, free_pages)
    try:
        proc = extract(out)
    finally:
        filler.unlink()
    lines = error_lines(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Logging error" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "No space left on device" in lines[0], lines
    if free_pages:  # it got through the claim and the resume: the end phase is what failed
        assert "end files" in lines[0], lines
    assert tmp_files(out) == [], "a failed write left its tmp file"
    assert not (out / "manifest.json").exists()

    proc = extract(out)  # the space is back: the same command finishes
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tmp_files(out) == [], "tmp files left after the successful run"
    again = json.loads((out / "manifest.json").read_text())
    assert [(s["path"], s["sha256"]) for s in again["shards"]] == [(s["path"], s["sha256"]) for s in manifest["shards"]]
    assert again["token_freq"] == manifest["token_freq"]


def test_the_token_counts_on_a_full_disk_raise_an_oserror_and_leave_nothing(tmpfs):
    """safetensors' own writer raises SafetensorError (not an OSError) and leaves its tmp file."""
    import numpy as np

    from dflash_prep.consume.vocab import write_token_freq

    folder = tmpfs / "counts"
    folder.mkdir()
    filler = fill(tmpfs, 0)
    try:
        with pytest.raises(OSError) as raised:
            write_token_freq(folder, np.arange(50_000, dtype=np.int64), 10)
    finally:
        filler.unlink()
    assert raised.value.errno == errno.ENOSPC
    assert list(folder.iterdir()) == []


def test_a_log_file_on_a_full_disk_prints_no_logging_error(tmpfs, capfd):
    """A rank's log file (console.LogFileHandler) counts the lines it cannot write; logging's FileHandler prints
    `--- Logging error ---` with a traceback for each (checked too: the disk is really full)."""
    from dflash_prep.commands.extract.console import LogFileHandler

    def log_many(handler: logging.Handler) -> None:
        logger = logging.getLogger(f"full-disk-{uuid.uuid4().hex}")
        logger.propagate = False
        logger.addHandler(handler)
        for i in range(50):
            logger.warning("line %d %s", i, "x" * 2000)
        try:
            handler.close()
        except OSError:  # logging's FileHandler: its close flushes the unwritten tail and raises
            pass

    (tmpfs / "logs").mkdir(exist_ok=True)
    filler = fill(tmpfs, 0)
    try:
        plain = logging.FileHandler(tmpfs / "logs" / "plain.log")
        log_many(plain)
        assert "--- Logging error ---" in capfd.readouterr().err
        ours = LogFileHandler(tmpfs / "logs" / "ours.log")
        log_many(ours)
        assert capfd.readouterr().err == ""
        assert ours.failed_writes > 0 and isinstance(ours.first_error, OSError)
    finally:
        filler.unlink()

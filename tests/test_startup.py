"""Start-up: the model loads on a thread of its own while the rows are tokenized and the plan made; the written
records are the same as with the load after tokenizing, the summary says where the start-up seconds went, and a
refusal while the ranks load ends every rank at once with its exit code."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, cpu_2proc_config, processes_writing, raw_records

from dflash_prep.commands.extract import run_extraction
from dflash_prep.faults import ENV_VAR
from dflash_prep.recipe.schema import load_recipe

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop(ENV_VAR, None)
LAUNCH = [sys.executable, "-m", "dflash_prep.commands.cli", "launch"]  # what `dflash-prep launch` runs
CPU_2PROC = ["--config_file", cpu_2proc_config()]
STAGES = {"start", "tokenize", "plan", "model_load", "model_load_wait", "model_load_overlapped", "first_batch"}


def _data(path: Path, num_rows: int = 24, reverse: bool = False) -> Path:
    """The first rows of the demo's conversations, as a data file of their own."""
    lines = []
    for f in sorted(glob.glob(str(REPO / "dflash_prep" / "demo" / "tiny-demo" / "data" / "*.jsonl"))):
        lines += [line for line in Path(f).read_text().splitlines() if line.strip()]
    lines = lines[:num_rows]
    path.write_text("\n".join(reversed(lines) if reverse else lines) + "\n")
    return path


def _run(data: Path, out: Path, *extra: str) -> dict:
    return run_extraction(load_recipe(None, [f"data.path={data}", f"output.dir={out}", "batching.num_workers=0",
                                             *extra]))


@pytest.mark.slow
def test_the_overlapped_load_writes_the_records_of_a_load_after_tokenizing(tmp_path):
    """The default (load during tokenizing, random weights drawn on the load thread) against a run whose load
    follows tokenizing (`data.num_proc: 2` keeps the load in the main thread): byte-identical records."""
    data = _data(tmp_path / "rows.jsonl")
    overlapped = _run(data, tmp_path / "overlapped")
    after = _run(data, tmp_path / "after", "data.num_proc=2")
    assert overlapped["startup_seconds"]["model_load_overlapped"] is True
    assert after["startup_seconds"]["model_load_overlapped"] is False
    assert set(overlapped["startup_seconds"]) == set(after["startup_seconds"]) == STAGES
    records = raw_records(tmp_path / "overlapped")
    assert len(records) == 24 and records == raw_records(tmp_path / "after")


@pytest.mark.slow
def test_startup_seconds_show_the_load_hidden_behind_tokenizing_and_planning(tmp_path, monkeypatch):
    """A slow load (3 s): the main thread waits for it only what tokenizing and planning did not hide."""
    monkeypatch.setenv(ENV_VAR, json.dumps({"load_delay_seconds": 3.0}))
    summary = _run(_data(tmp_path / "rows.jsonl"), tmp_path / "out")
    s = summary["startup_seconds"]
    assert s["model_load_overlapped"] and s["model_load"] >= 3.0
    assert abs(s["model_load_wait"] - max(0.0, s["model_load"] - s["tokenize"] - s["plan"])) < 0.5, s
    assert summary["ranks"][0]["startup_seconds"] == s


def test_a_finished_output_rerun_loads_nothing(tmp_path, monkeypatch):
    data = _data(tmp_path / "rows.jsonl")
    _run(data, tmp_path / "out")
    monkeypatch.setenv(ENV_VAR, json.dumps({"load_delay_seconds": 60.0}))  # a load would take a minute
    t0 = time.perf_counter()
    _run(data, tmp_path / "out")
    assert time.perf_counter() - t0 < 30



@pytest.mark.slow
def test_a_refusal_on_the_main_process_while_both_ranks_load_ends_the_run_at_once_with_exit_code_2(tmp_path):
    """2 processes under the README's launch command; the main process refuses the job (the recipe's chat template
    file was edited in place, the data files were not: the template's bytes are compared before anything loads, and
    the tokenized rows would differ too) while both ranks' loads would take two more minutes: exit code 2 in one
    line, well before the loads end, and no process left."""
    data = _data(tmp_path / "rows.jsonl")
    template = tmp_path / "template.jinja"
    original = (REPO / "dflash_prep" / "demo" / "tiny-demo" / "tokenizer" / "chat_template.jinja").read_text()
    template.write_text(original)
    out = tmp_path / "out"
    _run(data, out, "data.max_samples=12", f"data.chat_template={template}")
    template.write_text("Conversation follows.\n" + original)  # the same data: other rows
    env = {**ENV, ENV_VAR: json.dumps({"load_delay_seconds": 120.0})}
    t0 = time.perf_counter()
    proc = subprocess.run([*LAUNCH, *CPU_2PROC, "extract.py", "--set", f"output.dir={out}", "--set",
                           f"data.path={data}", "--set", "data.max_samples=12", "--set",
                           f"data.chat_template={template}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert elapsed < 100, f"took {elapsed:.0f}s: waited for the loads"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and ("template.jinja: its bytes changed" in errors[0] or "data rows differ" in errors[0]), \
        proc.stderr[-3000:]
    # rank 1, waiting in a barrier, may see its peer gone before the launcher stops it (as without the overlap)
    assert not [line for line in proc.stderr.splitlines() if "Traceback" in line and not line.startswith("[rank1]")]
    assert not processes_writing(out)


@pytest.mark.slow
def test_two_processes_record_their_startup_and_predicted_seconds_and_the_balance_report_reads_them(tmp_path):
    """2 CPU processes (each loads while the rows are tokenized): the records are the one-process run's; each
    rank's report has its start-up stages and the predicted seconds of its share; bench/balance_report.py (the
    GPU check's last step) reads the output."""
    data = _data(tmp_path / "rows.jsonl")
    one = tmp_path / "one"
    _run(data, one)
    two = tmp_path / "two"
    proc = subprocess.run([*LAUNCH, *CPU_2PROC, "extract.py", "--set", f"output.dir={two}", "--set",
                           f"data.path={data}", "--set", "batching.num_workers=0"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert raw_records(two) == raw_records(one)
    summary = json.loads((two / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for r in summary["ranks"]:
        assert set(r["startup_seconds"]) == STAGES and r["startup_seconds"]["model_load_overlapped"] is True
        assert r["predicted_seconds"] > 0
    report = subprocess.run([sys.executable, "bench/balance_report.py", str(two)], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "rank 1: loop" in report.stdout and "split by padded tokens (before)" in report.stdout


@pytest.mark.slow
def test_a_token_budget_smaller_than_a_sample_is_a_refusal_in_one_line(tmp_path):
    """`batching.max_tokens_per_batch` below one sample's padded length: the plan cannot be made, which the recipe
    must change (exit code 2, one `error:` line naming the key), not a ValueError traceback with exit code 1."""
    data = _data(tmp_path / "rows.jsonl")
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "extract", "--set",
                           f"output.dir={tmp_path / 'out'}", "--set", f"data.path={data}", "--set",
                           "batching.max_tokens_per_batch=16", "--set", "batching.packing=false"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "batching.max_tokens_per_batch" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

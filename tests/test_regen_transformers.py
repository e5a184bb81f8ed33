"""`engine: transformers` (dflash_prep/regen/hf_engine.py, the in-process engine) through `dflash-prep regenerate`:
greedy answers equal HF `generate` run alone on each prompt, kills anywhere resume to the uninterrupted run's
rows (SIGKILL, SIGTERM, 2 processes finished by 1), and the one-recipe form on the demo (CPU, offline).

The engine is called through the interface the command uses:
    TransformersEngine(recipe.model, device, max_tokens_per_batch=..., max_batch_size=...)
    .identity() -> dict, .answer(list[Request]) -> list[Answer], .close()
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import interrupt_group_until_exit, read_stderr_until
from regen_server import (
    ENV,
    REPO,
    STOP_IDS,
    descendants,
    free_port,
    index_lines,
    kill_tree,
    rows_of,
    save_tiny_model,
    start_and_wait,
)

from dflash_prep.commands.regenerate import main as regenerate_main
from dflash_prep.regen.output import read_committed

pytestmark = pytest.mark.slow

MAX_TOKENS = 24  # long enough that a signal after the first commit lands mid-run
ROWS = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"Tell me about item {i}, please."}]}
        for i in range(14)] + [{"id": "multi", "messages": [
            {"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
            {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("regen-hf") / "model")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("regen-hf-data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def args(model_dir: Path, data: Path, out: Path, **sets) -> list[str]:
    keys = {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(model_dir),
            "model.dtype": "float32", "data.path": str(data), "output.dir": str(out.parent / f"{out.name}-states"),
            "regenerate.output_dir": str(out), "regenerate.engine": "transformers",
            "regenerate.max_tokens": MAX_TOKENS, "regenerate.turns": "all", "regenerate.rows_per_shard": 2,
            "regenerate.max_rows_in_flight": 1, "regenerate.max_tokens_per_batch": 512, **sets}
    return [a for k, v in keys.items() for a in ("--set", f"{k}={v}")]


def regenerate_cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_prep.commands.regenerate", *argv]


@pytest.fixture(scope="module")
def reference(model_dir, data, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("regen-hf-reference") / "out"
    assert regenerate_main(args(model_dir, data, out)) == 0
    return rows_of(out)


def test_greedy_answers_equal_generate_alone(model_dir, reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert [r["id"] for r in reference] == [r["id"] for r in ROWS]
    for row in reference:
        messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt")
            with torch.inference_mode():
                out = model.generate(**prompt, max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=STOP_IDS, pad_token_id=0)
            generated = out[0, prompt["input_ids"].shape[1]:].tolist()
            if generated and generated[-1] in STOP_IDS:  # the stop token ends the turn and is not its text
                generated = generated[:-1]  # (as vLLM answers; these stop ids are ordinary tokens here)
            expected = tokenizer.decode(generated, skip_special_tokens=True)
            assert message["content"] == expected, (row["id"], i)


def test_sigkill_and_sigterm_then_resume_equal_an_uninterrupted_run(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = args(model_dir, data, out)
    rng = random.Random(5)
    proc = start_and_wait(regenerate_cmd(argv), out, new_commits=1)
    time.sleep(rng.uniform(0.0, 0.3))
    kill_tree(proc)
    proc = start_and_wait(regenerate_cmd(argv), out, new_commits=1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "stopped on SIGTERM" in err, err[-2000:]
    committed = read_committed(out)
    positions = [p for r in committed.values() for p in r.rows]
    assert len(positions) == len(set(positions)) and len(committed) < len(ROWS) // 2
    assert regenerate_main(argv) == 0
    assert rows_of(out) == reference
    assert sorted(p for r in read_committed(out).values() for p in r.rows) == list(range(len(ROWS)))


def test_two_processes_killed_then_finished_by_one(model_dir, data, reference, tmp_path):
    out = tmp_path / "out"
    argv = args(model_dir, data, out)
    cmd = [sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), "-m", "dflash_prep.commands.regenerate", *argv]
    proc = start_and_wait(cmd, out, new_commits=2, timeout=300)
    kill_tree(proc)
    assert index_lines(out) < len(ROWS) // 2 + 1 and not descendants(proc.pid)
    assert regenerate_main(argv) == 0
    assert rows_of(out) == reference


def test_the_demo_regenerates_in_process_then_extracts(tmp_path):
    from dflash_prep.commands.extract import main as extract_main

    out = tmp_path / "demo"
    sets = {"output.dir": out, "data.max_samples": 6, "batching.num_workers": 0, "regenerate": "{}",
            "regenerate.max_tokens": 8, "regenerate.output_dir": tmp_path / "demo-answers"}
    assert extract_main([a for k, v in sets.items() for a in ("--set", f"{k}={v}")]) == 0
    summary = json.loads((tmp_path / "demo-answers" / "summary.json").read_text())
    assert summary["engine"] == "transformers" and summary["num_rows"] == 6
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_rows"] == summary["num_answered"]
    done = subprocess.run([sys.executable, "-m", "dflash_prep.commands.regenerate", *[
        a for k, v in sets.items() for a in ("--set", f"{k}={v}")]], env=ENV, cwd=REPO, capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0 and "already finished" in done.stderr, done.stderr[-2000:]


def test_ctrl_c_once_the_regeneration_is_written_leaves_it_finished_with_exit_code_0(tmp_path):
    """`dflash-prep regenerate` from its `done:` line on: Ctrl-C to the whole group (every 50 ms until it exits)
    neither reports a stop nor ends the process by the signal (exit code 130), and prints no traceback."""
    sets = {"data.max_samples": 4, "batching.num_workers": 0, "regenerate": "{}", "regenerate.max_tokens": 8,
            "regenerate.output_dir": tmp_path / "answers"}
    proc = subprocess.Popen([sys.executable, "-m", "dflash_prep.commands.regenerate",
                             *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]], env=ENV, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = read_stderr_until(proc, "] done: ")
    assert any("] done: " in line for line in lines), "".join(lines)[-3000:]
    err = "".join(lines) + interrupt_group_until_exit(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "error:" not in err, err[-3000:]
    assert (tmp_path / "answers" / "manifest.json").exists()


def test_inspect_and_verify_of_regenerated_rows_say_what_the_folder_holds(model_dir, data, tmp_path, capsys):
    """`inspect` and `verify` pointed at a regeneration's output (rows, not hidden states): exit code 2 and one line
    that says so and names the extraction to run, not a format-version complaint."""
    from dflash_prep.commands.inspect import main as inspect_main
    from dflash_prep.commands.verify.entry import main as verify_main

    out = tmp_path / "rows"
    assert regenerate_main(args(model_dir, data, out, **{"data.max_samples": 2})) == 0
    capsys.readouterr()
    for command in (inspect_main, verify_main):
        assert command([str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds regenerated rows" in err[0] and f"data.path={out}" in err[0], err
        assert "format_version" not in err[0]


def test_the_one_recipe_form_refuses_an_output_of_other_data_before_regenerating(tmp_path, capsys):
    """The one-recipe form into `output.dir` that already holds an extraction of other data (the demo's own rows, a
    quick start's output): exit code 2 and one line naming the data path, before any answer is generated (no
    regeneration output); the same recipe into a fresh folder runs, and its re-run is answered as finished."""
    from dflash_prep.commands.extract import main as extract_main

    out = tmp_path / "states"
    base = {"output.dir": out, "data.max_samples": 4, "batching.num_workers": 0}
    assert extract_main([a for k, v in base.items() for a in ("--set", f"{k}={v}")]) == 0  # the quick start's job
    capsys.readouterr()
    sets = {**base, "regenerate": "{}", "regenerate.max_tokens": 4, "regenerate.output_dir": tmp_path / "answers"}
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert extract_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an extraction of a different job" in err[0] and "data.path" in err[0], err
    assert not (tmp_path / "answers").exists()
    fresh = [a for k, v in {**sets, "output.dir": tmp_path / "fresh"}.items() for a in ("--set", f"{k}={v}")]
    assert extract_main(fresh) == 0 and extract_main(fresh) == 0
    assert "already finished" in capsys.readouterr().err

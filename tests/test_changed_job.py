"""A finished output is refused (exit code 2) when the job's inputs changed in content under the same paths:
weights, a tokenizer file, the model's config or the chat template's file replaced in place. The extraction answers
before torch is imported, from the fingerprints the output keeps; the regeneration (in-process engine) before its
engine loads. Each message names the file and what changed. And the other way: the same bytes at another place (a
moved data folder) keep the job."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEMO, REPO
from regen_server import save_tiny_model

from dflash_prep.commands.regenerate import main as regenerate_main

pytestmark = pytest.mark.slow
HEAVY = ("torch", "transformers", "datasets", "accelerate")
PROBE = """
import json, sys, time
from dflash_prep.commands.cli import main
t0 = time.perf_counter()
code = main(json.loads(sys.argv[1]))
print(json.dumps([code, sorted(m for m in {heavy!r} if m in sys.modules), time.perf_counter() - t0]))
""".format(heavy=HEAVY)


def probe(args: list[str]) -> tuple[int, list[str], float, str]:
    """(exit code, heavy modules imported, seconds in the command, stderr) of `dflash-prep ARGS`, a process of its
    own."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    code, heavy, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    return code, heavy, seconds, out.stderr


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A finished extraction of 8 rows from a local checkpoint (weights, config, tokenizer in one folder) with a
    chat template file of its own; -> (folder, arguments)."""
    root = tmp_path_factory.mktemp("changed")
    model = save_tiny_model(root / "model")
    template = root / "template.jinja"
    template.write_text(json.loads((model / "tokenizer_config.json").read_text()).get("chat_template")
                        or (model / "chat_template.jinja").read_text())
    data = root / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text("".join((DEMO / "data" / "conversations.jsonl").read_text()
                                             .splitlines(keepends=True)[:8]))
    args = ["--set", "model.config=null", "--set", f"model.name_or_path={model}", "--set", "model.tokenizer=null",
            "--set", f"data.chat_template={template}", "--set", f"output.dir={root / 'out'}",
            "--set", "batching.num_workers=0"]
    code, _, _, err = probe(["extract", "--set", f"data.path={data / 'rows.jsonl'}", *args])
    assert code == 0, err[-3000:]
    return root, args


def _refused_at_once(job, path: Path, edit, what: str) -> None:
    root, args = job
    before = path.read_bytes()
    try:
        edit(path)
        code, heavy, seconds, err = probe(["extract", "--set", f"data.path={root / 'data' / 'rows.jsonl'}", *args])
    finally:
        path.write_bytes(before)
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert (code, heavy) == (2, []), err[-3000:]
    assert f"{path}: {what}" in line or f"({path.name}: {what}" in line, line
    assert "None" not in line and "output.overwrite=true" in line
    assert seconds < 5, seconds  # well under a second unloaded: no model, no tokenizer, no rows are loaded


def test_a_tokenizer_file_replaced_in_place_is_refused_naming_it(job):
    def edit(p):
        config = json.loads(p.read_text())
        config["model_max_length"] = 123
        p.write_text(json.dumps(config))
    _refused_at_once(job, job[0] / "model" / "tokenizer_config.json", edit, "its bytes changed")


def test_the_chat_template_file_replaced_in_place_is_refused_naming_it(job):
    _refused_at_once(job, job[0] / "template.jinja", lambda p: p.write_text(p.read_text() + "\n"),
                     "its bytes changed")


def test_the_model_config_replaced_in_place_is_refused_naming_it(job):
    def edit(p):
        config = json.loads(p.read_text())
        config["rms_norm_eps"] = 1e-3
        p.write_text(json.dumps(config))
    _refused_at_once(job, job[0] / "model" / "config.json", edit, "its bytes changed")


def test_weights_replaced_in_place_are_refused_naming_the_file(job, tmp_path):
    other = save_tiny_model(tmp_path / "other", seed=1)  # same config, other weights
    _refused_at_once(job, job[0] / "model" / "model.safetensors",
                     lambda p: p.write_bytes((other / "model.safetensors").read_bytes()),
                     "tensors (a window of every tensor) differ")


def test_the_same_bytes_written_again_or_moved_are_still_the_job(job):
    root, args = job
    rows = root / "data" / "rows.jsonl"
    rows.write_bytes(rows.read_bytes())  # a new change time, the same bytes
    shutil.move(root / "data", root / "moved")
    try:
        code, _, _, err = probe(["extract", "--set", f"data.path={root / 'moved' / 'rows.jsonl'}", *args])
        # that run recorded the inputs where they are now: the next re-run is answered before any heavy import
        again, heavy, _, err_again = probe(["extract", "--set", f"data.path={root / 'moved' / 'rows.jsonl'}", *args])
    finally:
        shutil.move(root / "moved", root / "data")
    assert code == 0 and "already finished" in err, err[-3000:]
    assert (again, heavy) == (0, []) and "inputs are unchanged" in err_again, err_again[-3000:]


def test_a_finished_regeneration_refuses_weights_or_a_tokenizer_replaced_in_place(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"Item {i}?"}]})
                            + "\n" for i in range(3)))
    argv = [a for k, v in {"model.config": "null", "model.tokenizer": "null", "model.name_or_path": str(model),
                           "model.dtype": "float32", "data.path": str(rows), "output.dir": str(tmp_path / "states"),
                           "regenerate.output_dir": str(tmp_path / "regen"), "regenerate.engine": "transformers",
                           "regenerate.max_tokens": 4}.items() for a in ("--set", f"{k}={v}")]
    assert regenerate_main(argv) == 0
    other = save_tiny_model(tmp_path / "other", seed=1)
    for name, what in (("model.safetensors", "model weights differ (model.safetensors: tensors (a window of every "
                                             "tensor) differ)"),
                       ("tokenizer_config.json", "tokenizer_config.json: its bytes changed")):
        before = (model / name).read_bytes()
        replacement = (other / name).read_bytes() if name.endswith(".safetensors") else \
            json.dumps({**json.loads(before), "model_max_length": 77}).encode()
        (model / name).write_bytes(replacement)
        capsys.readouterr()
        t0 = time.perf_counter()
        try:
            assert regenerate_main(argv) == 2
        finally:
            (model / name).write_bytes(before)
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith("error:")]
        assert what in line and "output has None" not in line, line
        assert "engine ready" not in err  # refused before the engine (the model) loads
        assert time.perf_counter() - t0 < 120
    assert regenerate_main(argv) == 0  # restored: the same job, finished

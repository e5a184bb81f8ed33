"""What is committed is what this job would write now: a resume refuses data rows or weights that changed in place
(exit code 2, one line naming what changed), redoes the batches of a committed shard whose file is gone, cut or
swapped, re-runs a finished output without loading the model, and refuses output folders that are unsafe to use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DEMO, build, raw_records, tiny_qwen35_config

from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main
from dflash_prep.commands.inspect import check_output

SETTINGS = ["--set", "batching.num_workers=0", "--set", "batching.max_tokens_per_batch=4096",
            "--set", "output.max_shard_bytes=1MB"]
NUM_ROWS = 24


def argv(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--set", f"output.dir={out}", "--set", f"data.path={data}", *SETTINGS, *extra]


def models_loaded(out: Path) -> int:
    return (out / "logs" / "rank-00000.log").read_text().count("model loaded")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """The first NUM_ROWS conversations of the demo, as a file of their own (tests edit copies of it)."""
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    lines = (DEMO / "data" / "conversations.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:NUM_ROWS]))
    return path


@pytest.fixture(scope="module")
def output(tmp_path_factory, data_file) -> Path:
    out = tmp_path_factory.mktemp("identity") / "out"
    assert main(argv(out, data_file)) == 0
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) >= 3
    return out


def test_data_rows_edited_or_shuffled_in_place_are_refused_naming_the_rows(output, copy, data_file, tmp_path, capsys):
    lines = data_file.read_text().splitlines(keepends=True)
    edited = tmp_path / "edited.jsonl"
    row = json.loads(lines[5])
    row["messages"][-1]["content"] += " (edited)"
    edited.write_text("".join(lines[:5] + [json.dumps(row) + "\n"] + lines[6:]))
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(reversed(lines)))
    original = data_file.read_bytes()
    for changed in (edited, shuffled):
        out = tmp_path / f"out-{changed.stem}"
        shutil.copytree(copy, out)
        shutil.copy(changed, data_file)  # the same path and recipe as the output's run, other content
        try:
            code = main(argv(out, data_file))
        finally:
            data_file.write_bytes(original)
        err = capsys.readouterr().err
        assert code == EXIT_BAD_RECIPE, err[-2000:]
        assert f"data files differ: {data_file}: its bytes changed" in err and "output.overwrite=true" in err
        assert "Traceback" not in err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1
        assert models_loaded(out) == 1  # the output's own run only
        # refused before the rows are read (their files' content differs: data/rows.py), so before the run claimed
        # the folder: the output's log is its own run's only
        assert "refused" not in (out / "logs" / "rank-00000.log").read_text()


def test_weights_overwritten_in_place_are_refused_naming_the_file(tmp_path, data_file, capsys):
    checkpoint = tmp_path / "checkpoint"
    build(tiny_qwen35_config(), seed=0).save_pretrained(checkpoint)
    out = tmp_path / "out"
    model = ["--set", "model.config=null", "--set", f"model.name_or_path={checkpoint}", "--set", "data.max_samples=4"]
    assert main(argv(out, data_file, *model)) == 0
    build(tiny_qwen35_config(), seed=1).save_pretrained(checkpoint)  # same path, same config, other weights
    capsys.readouterr()
    assert main(argv(out, data_file, *model)) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert "model weights differ (model.safetensors: tensors (a window of every tensor) differ)" in err, err[-2000:]
    assert models_loaded(out) == 1
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["attn_implementation"] == "sdpa"
    assert set(manifest["weights_fingerprint"]["files"]) == {"model.safetensors"}


def test_a_finished_output_re_runs_without_loading_the_model(output, copy, data_file, capsys):
    before = {str(p.relative_to(copy)): p.read_bytes() for p in copy.rglob("*")
              if p.is_file() and "logs" not in p.parts and "locks" not in p.parts}
    assert main(argv(copy, data_file)) == 0
    assert models_loaded(copy) == 1
    assert check_output(copy) == []
    # and without touching a file (manifest, summary, rank reports, skipped rows): the run that finished it is the
    # one they describe; the run state only records where the inputs are now (`finished_inputs`: a copy's moved)
    assert {name: (copy / name).read_bytes() for name in before if name != "run_state.json"} == \
        {name: data for name, data in before.items() if name != "run_state.json"}
    state, state_before = json.loads((copy / "run_state.json").read_text()), json.loads(before["run_state.json"])
    assert {k: v for k, v in state.items() if k != "finished_inputs"} == \
        {k: v for k, v in state_before.items() if k != "finished_inputs"}
    # a damaged manifest is rebuilt from the shards, keeping the figures of the run that computed them
    (copy / "manifest.json").write_bytes(before["manifest.json"][:300])
    capsys.readouterr()
    assert main(argv(copy, data_file)) == 0
    assert (copy / "manifest.json").read_bytes() == before["manifest.json"]
    assert (copy / "summary.json").read_bytes() == before["summary.json"]
    # its own line says it computed nothing (not the figures of the run that did, as if they were its own)
    assert "this run: nothing to compute" in capsys.readouterr().err
    # and so is one edited into valid JSON of other types (readers would trip on it), not taken as finished
    edited = json.loads(before["manifest.json"])
    edited["shards"] = None
    (copy / "manifest.json").write_text(json.dumps(edited))
    assert main(argv(copy, data_file)) == 0
    assert (copy / "manifest.json").read_bytes() == before["manifest.json"]


def test_committed_shards_deleted_truncated_or_swapped_are_redone(output, copy, data_file, capsys):
    manifest = json.loads((copy / "manifest.json").read_text())
    paths = [copy / s["path"] for s in manifest["shards"]]
    paths[0].unlink()
    with open(paths[1], "r+b") as f:
        f.truncate(paths[1].stat().st_size // 2)
    paths[2].write_bytes((output / manifest["shards"][0]["path"]).read_bytes())  # another shard's bytes
    assert main(argv(copy, data_file)) == 0
    log = (copy / "logs" / "rank-00000.log").read_text()
    assert log.count("is damaged") == 3 and "missing" in log and "its index record says" in log
    assert check_output(copy) == []  # every shard the manifest lists is there, whole, with its hash
    assert raw_records(copy) == raw_records(output)  # the same samples, byte for byte
    # the figures are the whole output's, not those of the batches this run redid
    summary, reference = (json.loads((o / "summary.json").read_text()) for o in (copy, output))
    assert summary["padding_efficiency"] == reference["padding_efficiency"]
    assert json.loads((copy / "manifest.json").read_text())["summary"] == \
        json.loads((output / "manifest.json").read_text())["summary"]


def _edit_plan(edit: str, plan: dict) -> str:
    """One edit of a stored plan that keeps it valid JSON -> what the error must name."""
    batches = plan["batches"]
    if edit == "sample twice":
        batch = next(b for b in batches if len(b[1]) > 1)
        batch[1].append(batch[1][0])  # a padded batch: its length still holds it
        return "planned twice"
    if edit == "sample dropped":
        next(b for b in batches if len(b[1]) > 1)[1].pop()
        return "never"
    if edit == "index out of range":
        batches[0][1][0] = 10**6
        return "batch 0 is not"
    if edit == "row too short":
        batches[0][0] = 1
        return "batch 0: padded length 1"
    if edit == "not a plan":
        plan.clear()
        plan.update({"rows": [1, 2, 3]})
        return "expected the keys"
    batches[0][0] = "long"  # a length that is not an integer
    return "batch 0 is not"


@pytest.mark.parametrize("edit", ["sample twice", "sample dropped", "index out of range", "row too short",
                                  "not a plan", "length not an int"])
def test_a_plan_edited_in_place_is_one_line_naming_it(output, copy, data_file, edit, capsys):
    """A plan.json that is still JSON but no longer a plan of these samples (a sample twice or never, an index
    out of range, a row that cannot hold its samples, keys missing) is refused before any work: exit code 2."""
    path = copy / "plan.json"
    plan = json.loads(path.read_text())
    expected = _edit_plan(edit, plan)
    path.write_text(json.dumps(plan))
    assert main(argv(copy, data_file)) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{path} is damaged" in errors[0] and expected in errors[0], errors


@pytest.mark.parametrize("name", ["plan.json", "run_state.json"])
def test_a_truncated_state_file_is_one_line_naming_it(output, copy, data_file, name, capsys):
    path = copy / name
    path.write_bytes(path.read_bytes()[:40])
    assert main(argv(copy, data_file)) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{path} is damaged" in errors[0] and "output.overwrite=true" in errors[0]


def test_overwrite_refuses_a_folder_that_is_not_an_output(tmp_path, data_file, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own file")
    assert main(argv(folder, data_file, "--set", "output.overwrite=true")) == EXIT_BAD_RECIPE
    assert "is not a dflash-prep output" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]  # nothing deleted, nothing created


def test_a_folder_of_other_files_is_refused_as_an_output_and_left_as_it_was(tmp_path, data_file, capsys):
    """An export's folder or the user's notes as output.dir: refused in one line naming a file (exit 2), nothing
    written beside them. A folder holding only what a run stopped at start-up leaves (logs, locks) is taken."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own file")
    (folder / "000000.safetensors").write_bytes(b"an export's file")
    assert main(argv(folder, data_file, "--set", "data.max_samples=4")) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds files that are not a dflash-prep output (000000.safetensors, notes.txt)" \
        in errors[0], errors
    assert sorted(p.name for p in folder.iterdir()) == ["000000.safetensors", "notes.txt"]
    started = tmp_path / "started"
    (started / "logs").mkdir(parents=True)
    (started / "logs" / "rank-00000.log").write_text("a run stopped before its plan\n")
    assert main(argv(started, data_file, "--set", "data.max_samples=4")) == 0
    assert (started / "manifest.json").is_file()


@pytest.mark.parametrize("pattern", ["**/*.jsonl", "*"], ids=["glob", "folder"])
def test_an_output_inside_the_data_is_refused(tmp_path, data_file, pattern, capsys):
    shutil.copy(data_file, tmp_path / "rows.jsonl")
    data = tmp_path / pattern if pattern != "*" else tmp_path
    assert main(argv(tmp_path / "out", data, "--set", "data.max_samples=4")) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert "it lies inside the data" in err and "`output.dir`" in err
    assert not (tmp_path / "out").exists()


def test_a_job_refused_before_it_starts_leaves_no_new_folder(tmp_path, data_file, capsys):
    """A bad chat template (the recipe's own) is refused before the output is claimed: exit code 2, one line naming
    the key and the line, and no folder left where none was; a folder the user made stays as it was."""
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    out = tmp_path / "new" / "out"
    assert main(argv(out, data_file, "--set", f"data.chat_template={template}")) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "`data.chat_template`" in errors[0] and "line 2" in errors[0]
    assert not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert main(argv(mine, data_file, "--set", f"data.chat_template={template}")) == EXIT_BAD_RECIPE
    assert mine.is_dir()


def test_a_copied_index_line_counts_once_and_a_conflicting_one_is_refused(output, copy, data_file, capsys):
    index = sorted((copy / "index").glob("rank-*.jsonl"))[0]
    lines = index.read_text().splitlines(keepends=True)
    assert len(lines) >= 2
    index.write_text("".join(lines + [lines[0]]))  # the same commit listed twice
    assert main(argv(copy, data_file)) == 0
    assert raw_records(copy) == raw_records(output)  # nothing written twice
    second = json.loads(lines[1])
    second["sample_ids"] = second["sample_ids"][:-1] + [json.loads(lines[0])["sample_ids"][0]]  # another claim
    index.write_text("".join([lines[0], json.dumps(second) + "\n"] + lines[2:]))
    assert main(argv(copy, data_file)) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "index is damaged" in errors[0] and "listed in two shards" in errors[0], errors

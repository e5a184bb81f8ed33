"""Tests for dflash_prep.commands.inspect: the report, and `--check` on a fresh output, a shard with one flipped
byte, a manifest whose counts disagree, and a missing shard. One small extraction is shared by the module;
each corruption test works on its own copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.commands.inspect import check_output, describe, main

NUM_ROWS = 20
OVERRIDES = [f"data.max_samples={NUM_ROWS}", "data.max_length=256", "batching.max_tokens_per_batch=1024",
             "batching.num_workers=0", "output.max_shard_bytes=1"]


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    out = tmp_path_factory.mktemp("inspect") / "out"
    run_extraction(load_recipe(None, [f"output.dir={out}", *OVERRIDES]))
    assert (out / "manifest.json").is_file()
    return out


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_report_shows_what_is_in_the_output(output, capsys):
    m = _manifest(output)
    assert main([str(output)]) == 0
    text = capsys.readouterr().out
    for expected in (f"{m['layer_ids']} after-layer", f"before-layer/vLLM ids {[i + 1 for i in m['layer_ids']]}",
                     "bfloat16", f"{NUM_ROWS} of {NUM_ROWS} rows (0 skipped, 0 failed)",
                     f"{m['num_tokens']:,}", f"{len(m['shards'])}, ", "not captured", m["model"]):
        assert expected in text, expected
    facts = describe(output)
    H, k = m["hidden_size"], len(m["layer_ids"])
    assert facts["bytes_per_token"] == k * H * 2 and facts["num_bytes"] == m["num_bytes"]


def test_the_two_rates_are_named_by_their_basis(output, capsys):
    """The run's tokens over its wall time and the loop's rate are different figures: each says which it is."""
    s = json.loads((output / "summary.json").read_text())
    assert main([str(output)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("extraction")]
    wall_rate = s["num_tokens_this_run"] / s["wall_seconds"]
    assert f"{s['wall_seconds']:.1f} s wall ({wall_rate:,.0f} tok/s over the wall time)" in line, line
    assert f"its loop {s['loop_seconds']:.1f} s at {s['num_tokens_this_run'] / s['loop_seconds']:,.0f} tok/s" in line


def test_check_passes_on_a_fresh_output(output, capsys):
    assert check_output(output) == []
    assert main([str(output), "--check", "--no-progress"]) == 0
    assert "check: OK" in capsys.readouterr().out


def test_json_report(output, capsys):
    assert main([str(output), "--check", "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["check"] == {"ok": True, "problems": []}
    assert facts["num_samples"] == NUM_ROWS and facts["unlisted_shard_files"] == []


def test_one_flipped_byte_fails_naming_the_shard(copy, capsys):
    m = _manifest(copy)
    victim = m["shards"][1]["path"]
    path = copy / victim
    data = bytearray(path.read_bytes())
    at = len(data) // 2  # inside some tensor's data: the tar still parses, only the hash can tell
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    assert main([str(copy), "--check", "--no-progress"]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert fails and all(victim in line for line in fails)
    assert any("sha256" in line for line in fails)
    assert "check: FAILED" in out


def test_the_repair_the_failed_check_names_brings_the_output_back(copy, capsys):
    """What `--check` says to do about a damaged shard, done as it says: delete that file, run the extraction's
    command again; the output then passes the check with every sample back."""
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    before = _manifest(copy)
    victim = copy / before["shards"][0]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    assert main([str(copy), "--check", "--no-progress"]) == 1
    (advice,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("to repair:")]
    assert "delete the shard files named above" in advice and "run the extraction's command again" in advice
    victim.unlink()
    run_extraction(load_recipe(None, [f"output.dir={copy}", *OVERRIDES]))
    assert main([str(copy), "--check", "--no-progress"]) == 0
    after = _manifest(copy)
    assert after["num_samples"] == before["num_samples"] == NUM_ROWS
    assert after["num_tokens"] == before["num_tokens"]


def test_count_mismatch_fails_naming_the_shard(copy, capsys):
    m = _manifest(copy)
    m["shards"][0]["num_tokens"] += 1
    (copy / "manifest.json").write_text(json.dumps(m))
    problems = check_output(copy)
    victim = m["shards"][0]["path"]
    assert any(p.startswith(victim) and "tokens" in p for p in problems)
    assert any(p.startswith("manifest.json: num_tokens") for p in problems)  # totals no longer add up
    assert main([str(copy), "--check", "--no-progress"]) == 1
    m["shards"][0]["num_tokens"] -= 1
    m["num_skipped"] = 1  # rows - skipped - failed no longer equals the samples written
    (copy / "manifest.json").write_text(json.dumps(m))
    assert check_output(copy) == [
        "manifest.json: num_samples is 20 but num_sample_candidates - num_skipped - num_failed is 19"]


def test_missing_and_truncated_shards(copy):
    m = _manifest(copy)
    (copy / m["shards"][0]["path"]).unlink()
    truncated = copy / m["shards"][-1]["path"]
    truncated.write_bytes(truncated.read_bytes()[:1000])
    problems = check_output(copy)
    assert f"{m['shards'][0]['path']}: file is missing" in problems
    assert any(p.startswith(m["shards"][-1]["path"]) and "size" in p for p in problems)
    assert not any(p.startswith(m["shards"][1]["path"]) for p in problems)


def test_unlisted_files_are_reported_but_not_failures(copy, capsys):
    m = _manifest(copy)
    stray = copy / Path(m["shards"][0]["path"]).parent / "shard-999999.tar.tmp"
    stray.write_bytes(b"partial")
    assert main([str(copy), "--check", "--no-progress"]) == 0
    assert "shard-999999.tar.tmp" in capsys.readouterr().out


def test_no_manifest_exits_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err


def test_report_lists_skipped_reasons(copy, capsys):
    m = _manifest(copy)
    m.update(num_rows=23, num_sample_candidates=23, num_skipped=3,
             skipped={"no_assistant_turn": 2, "longer_than_max_length": 1})
    (copy / "manifest.json").write_text(json.dumps(m))
    assert main([str(copy)]) == 0
    text = capsys.readouterr().out
    assert f"{NUM_ROWS} of 23 rows (3 skipped, 0 failed)" in text
    assert "longer_than_max_length: 1, no_assistant_turn: 2" in text
    assert check_output(copy) == []  # 23 - 3 - 0 == 20: consistent


@pytest.mark.parametrize("edit", ["layer_ids", "layer_ids_and_hidden_size"])
def test_check_fails_a_manifest_whose_layers_or_width_were_edited(copy, capsys, edit):
    """A manifest edited so that k x H still matches the tensors ([1, 3, 5] -> [1, 3, 6]; or 3 x 64 -> 6 x 32) is
    caught by comparing with every sample's meta.json and the stored width."""
    m = _manifest(copy)
    assert m["layer_ids"] == [1, 3, 5] and m["hidden_size"] == 64 and m["capture_final"] == "none"
    if edit == "layer_ids":
        m["layer_ids"] = [1, 3, 6]
    else:
        m.update(layer_ids=[0, 1, 2, 3, 4, 5], hidden_size=32)
    (copy / "manifest.json").write_text(json.dumps(m))
    assert main([str(copy), "--check", "--no-progress"]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    meta = [line for line in fails if "meta.json layer_ids [1, 3, 5] differ from the manifest's" in line]
    width = [line for line in fails if "192 wide = 3 layers (meta.json) x 64, but the manifest's hidden_size is 32"
             in line]
    assert len(meta) == NUM_ROWS and len(width) == (0 if edit == "layer_ids" else NUM_ROWS)
    assert len(fails) == len(meta) + len(width)  # nothing else is wrong with the output


def test_a_damaged_manifest_or_plan_is_one_line_naming_the_file(copy, tmp_path, capsys):
    """inspect, export and verify on a manifest cut short (a copy interrupted, a full disk): exit 2, one line that
    names the file, no traceback; the same for an unfinished output's plan.json."""
    from dflash_prep.commands.verify import main as verify_main
    from dflash_prep.consume.export import main as export_main

    manifest = copy / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])
    for run in (lambda: main([str(copy)]),
                lambda: export_main([str(copy), "--to", "specforge", "--dest", str(tmp_path / "d"), "--no-progress"]),
                lambda: verify_main([str(copy), "--num-samples", "1"])):
        assert run() == 2
        err = capsys.readouterr().err
        assert str(manifest) in err and "damaged" in err and "Traceback" not in err
    manifest.unlink()
    plan = copy / "plan.json"
    plan.write_bytes(plan.read_bytes()[:50])
    assert main([str(copy)]) == 2
    err = capsys.readouterr().err
    assert str(plan) in err and "damaged" in err
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "no such folder" in capsys.readouterr().err


MANIFEST_EDITS = {  # valid JSON of the wrong types: each what a reader would trip on -> the words the error uses
    "shards null": (lambda m: m.update(shards=None), "shards is NoneType, not a list"),
    "shards gone": (lambda m: m.pop("shards"), "shards is NoneType, not a list"),
    "count as text": (lambda m: m.update(num_samples="many"), "num_samples is 'many', not a count"),
    "unknown dtype": (lambda m: m.update(dtype="float7"), "dtype 'float7' is not one of"),
    "path outside": (lambda m: m["shards"][0].update(path="../x.tar"), "shard path '../x.tar' is not a relative"),
    "digest": (lambda m: m["shards"][0].update(sha256=None), "sha256 None is not a hex digest"),
    "layer ids": (lambda m: m.update(layer_ids="1,3,5"), "layer_ids '1,3,5' is not a list of layer ids"),
}


@pytest.mark.parametrize("edit", sorted(MANIFEST_EDITS))
def test_a_manifest_edited_into_other_types_is_damaged_in_one_line(copy, tmp_path, capsys, edit):
    """inspect (with and without --check), export and verify on a manifest that is valid JSON but holds a field of
    another type than the format's: exit 2, one line naming the file and the field, no traceback."""
    from dflash_prep.commands.verify import main as verify_main
    from dflash_prep.consume.export import main as export_main

    change, words = MANIFEST_EDITS[edit]
    manifest = copy / "manifest.json"
    m = json.loads(manifest.read_text())
    change(m)
    manifest.write_text(json.dumps(m))
    for run in (lambda: main([str(copy)]), lambda: main([str(copy), "--check", "--no-progress"]),
                lambda: export_main([str(copy), "--to", "specforge", "--dest", str(tmp_path / "d"), "--no-progress"]),
                lambda: verify_main([str(copy), "--num-samples", "1"])):
        assert run() == 2
        err = capsys.readouterr().err
        assert f"{manifest} is damaged" in err and words in err and "Traceback" not in err, err
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


def test_progress_of_an_unfinished_output_ignores_commit_times_that_are_not_numbers(copy, capsys):
    """An unfinished output (no manifest) whose index lines carry a `committed_at` another tool or a hand wrote as
    text, null or a boolean: the progress report counts every committed sample and leaves those times out of its
    rate, rather than failing on them."""
    (copy / "manifest.json").unlink()
    index = copy / "index" / "rank-00000.jsonl"
    lines = [json.loads(line) for line in index.read_text().splitlines()]
    assert len(lines) >= 3
    for line, stamp in zip(lines, ["2026-12-02T10:00:00", None, True]):
        line["committed_at"] = stamp
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main([str(copy), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "Traceback" not in err, err
    report = json.loads(out)
    assert report["finished"] is False and report["num_samples"] == NUM_ROWS and report["committed_batches"] == len(lines)
    assert report["samples_per_second_recent"] is None or report["samples_per_second_recent"] > 0


def test_after_a_resume_the_figures_say_they_are_the_last_runs(tmp_path, capsys, monkeypatch):
    """A run stopped (SIGTERM after 2 batches, exit 1) and resumed: the wall and loop figures are the resume's
    alone, and the report says so with the tokens earlier runs committed (the summary's figures, which the
    report cannot otherwise tell apart from a whole run's)."""
    from dflash_prep.commands.extract import main as extract_main

    out = tmp_path / "out"
    argv = [a for kv in [f"output.dir={out}", *OVERRIDES] for a in ("--set", kv)]
    monkeypatch.setenv("DFLASH_PREP_FAULTS", json.dumps({"sigterm_after_batches": 2}))
    assert extract_main(argv) == 1
    monkeypatch.delenv("DFLASH_PREP_FAULTS")
    assert extract_main(argv) == 0
    s = json.loads((out / "summary.json").read_text())
    before = s["num_tokens_committed_before"]
    total = _manifest(out)["num_tokens"]
    assert 0 < before < total and s["num_tokens_this_run"] == total - before
    capsys.readouterr()
    assert main([str(out)]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("extraction")]
    assert f"the last run, a resume ({before:,} tokens were committed by earlier runs): " in line, line
    assert f"{s['wall_seconds']:.1f} s wall" in line

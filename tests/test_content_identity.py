"""A content identity that an edit in place cannot fool: data files edited with their modification time kept (what
`cp -p`, `rsync -t`, `touch -r`, `tar x` leave) are read again and refuse a resume; an edit of one small tensor of
a checkpoint is seen on resume; a target folder without weights and a `data.max_length` past the model's context
are refused at start-up (exit code 2)."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import DEMO, build, raw_records, tiny_llama_config

from dflash_prep.commands.extract import EXIT_BAD_RECIPE, EXIT_STOPPED, main
from dflash_prep.commands.inspect import check_output
from dflash_prep.faults import ENV_VAR

NUM_ROWS = 24
SETTINGS = ["--set", "batching.num_workers=0", "--set", "batching.max_tokens_per_batch=4096",
            "--set", "output.max_shard_bytes=100KB", "--set", "output.num_writer_threads=1"]


def argv(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--set", f"output.dir={out}", "--set", f"data.path={data}", *SETTINGS, *extra]


@pytest.fixture
def data_file(tmp_path) -> Path:
    """The first NUM_ROWS demo conversations, plus a row of its own (a fresh id), so that no datasets cache of an
    earlier test run holds this file's rows."""
    lines = (DEMO / "data" / "conversations.jsonl").read_text().splitlines(keepends=True)[:NUM_ROWS]
    row = json.loads(lines[0])
    row["id"] = f"fresh-{uuid.uuid4().hex}"
    path = tmp_path / "data" / "rows.jsonl"
    path.parent.mkdir()
    path.write_text("".join(lines + [json.dumps(row) + "\n"]))
    return path


def edit_keeping_mtime(path: Path, old: str, new: str) -> None:
    """Replace `old` by `new` (same length: the size stays too) in row 5, then set the modification time back."""
    assert len(old) == len(new)
    st = path.stat()
    lines = path.read_text().splitlines(keepends=True)
    assert old in lines[5]
    lines[5] = lines[5].replace(old, new, 1)
    path.write_text("".join(lines))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def decoded_sample(out: Path, sample_id: str) -> str:
    from transformers import AutoTokenizer

    ids = np.load(__import__("io").BytesIO(raw_records(out)[sample_id]["input_ids.npy"]))
    return AutoTokenizer.from_pretrained(DEMO / "tokenizer").decode(ids.tolist())


@pytest.mark.slow
def test_an_edit_in_place_that_keeps_the_mtime_is_read_by_a_new_output(tmp_path, data_file):
    """`datasets` keys its cache of a local file on the path and modification time: the second output would hold
    the rows the file no longer has."""
    assert main(argv(tmp_path / "before", data_file)) == 0
    assert "Most people" in decoded_sample(tmp_path / "before", "0000000005")
    edit_keeping_mtime(data_file, "Most people", "Most ZEBRAs")
    assert main(argv(tmp_path / "after", data_file)) == 0
    text = decoded_sample(tmp_path / "after", "0000000005")
    assert "Most ZEBRAs" in text and "Most people" not in text


def test_a_resume_after_an_edit_in_place_that_keeps_the_mtime_is_refused_naming_the_file(tmp_path, data_file,
                                                                                          monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv(ENV_VAR, json.dumps({"enospc_shard": 2}))  # an interrupted run: 2 shards committed
    assert main(argv(out, data_file)) == EXIT_STOPPED
    monkeypatch.delenv(ENV_VAR)
    finished = tmp_path / "finished"
    assert main(argv(finished, data_file)) == 0
    edit_keeping_mtime(data_file, "Most people", "Most ZEBRAs")
    capsys.readouterr()
    for output in (out, finished):  # a resume, and a re-run of a finished output
        assert main(argv(output, data_file)) == EXIT_BAD_RECIPE, output
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
        assert f"data files differ: {data_file}: its bytes changed since the output was made" in errors[0]
        assert "output.overwrite=true" in errors[0]


def _checkpoint(tmp_path: Path) -> Path:
    """A 29 MB Llama checkpoint (one safetensors file, > the 8 x 1 MiB a file's sampled chunks cover)."""
    config = tiny_llama_config(vocab_size=1024, num_layers=8)
    config.hidden_size, config.intermediate_size = 256, 1024
    path = tmp_path / "checkpoint"
    build(config, seed=0).save_pretrained(path)
    return path


def _tensors(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, {k: v for k, v in json.loads(f.read(length)).items() if k != "__metadata__"}


def _norm_outside_the_sampled_chunks(path: Path) -> tuple[str, int, int]:
    """A norm's weight (a 1 KiB tensor) whose bytes lie outside the 8 chunks of 1 MiB spread evenly over the file
    (where a sampled fingerprint reads): -> (name, start, end) in the file."""
    size, chunk = path.stat().st_size, 1 << 20
    windows = [((size - chunk) * i // 7, (size - chunk) * i // 7 + chunk) for i in range(8)]
    base, tensors = _tensors(path)
    for name, t in sorted(tensors.items()):
        start, end = base + t["data_offsets"][0], base + t["data_offsets"][1]
        if "norm" in name and all(end <= a or start >= b for a, b in windows):
            return name, start, end
    raise AssertionError("every norm lies in a sampled chunk: choose another shape")


def test_one_small_tensor_scaled_in_place_is_refused_on_resume(tmp_path, data_file, capsys):
    checkpoint = _checkpoint(tmp_path)
    weights = checkpoint / "model.safetensors"
    assert weights.stat().st_size > 16 << 20
    model = ["--set", "model.config=null", "--set", f"model.name_or_path={checkpoint}",
             "--set", f"model.tokenizer={DEMO / 'tokenizer'}", "--set", "data.max_samples=4"]
    out = tmp_path / "out"
    assert main(argv(out, data_file, *model)) == 0
    name, start, end = _norm_outside_the_sampled_chunks(weights)
    with open(weights, "r+b") as f:  # a norm's gains x 1.5, in place (float32)
        f.seek(start)
        gains = np.frombuffer(f.read(end - start), dtype="<f4") * np.float32(1.5)
        f.seek(start)
        f.write(gains.astype("<f4").tobytes())
    capsys.readouterr()
    assert main(argv(out, data_file, *model)) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert "model weights differ (model.safetensors: tensors (a window of every tensor) differ)" in err, err[-2000:]


def test_a_target_folder_without_weights_is_refused_before_the_output_is_claimed(tmp_path, data_file, capsys):
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_llama_config().to_dict()))
    out = tmp_path / "out"
    model = ["--set", "model.config=null", "--set", f"model.name_or_path={folder}",
             "--set", f"model.tokenizer={DEMO / 'tokenizer'}"]
    assert main(argv(out, data_file, *model)) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"recipe key `model.name_or_path` = {str(folder)!r}" in errors[0], errors
    assert "holds no weight files" in errors[0]
    assert not out.exists()
    # an index that lists a shard the folder lacks
    build(tiny_llama_config(), seed=0).save_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert main(argv(out, data_file, *model)) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert "lists 1 weight file(s) that are not in the folder (model-00002-of-00002.safetensors)" in err
    assert not out.exists()


# -- the model's context ----------------------------------------------------------------------------------------


def _short_context_config(tmp_path: Path, rope: dict | None = None) -> Path:
    """A Llama config of 256 positions (with `rope` parameters, when given)."""
    config = tiny_llama_config().to_dict()
    config["max_position_embeddings"] = 256
    if rope is not None:
        config["rope_parameters"] = {**config.get("rope_parameters", {}), **rope}
    path = tmp_path / f"short-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(config))
    return path


def test_the_context_counts_rope_scaling():
    from transformers import LlamaConfig

    from dflash_prep.target.model import context_length

    plain = LlamaConfig(max_position_embeddings=4096)
    assert context_length(plain) == (4096, "max_position_embeddings 4096")
    # Qwen's YaRN recipe: max_position_embeddings stays at the original, the factor extends it
    qwen = LlamaConfig(max_position_embeddings=32768, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6})
    assert context_length(qwen)[0] == 131072
    # Llama 3.1: max_position_embeddings already holds the extended length
    llama31 = LlamaConfig(max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "rope_theta": 5e5})
    assert context_length(llama31)[0] == 131072


def test_rows_longer_than_the_models_context_are_refused_at_start_up_or_extracted_and_counted(tmp_path, data_file,
                                                                                              capsys):
    out = tmp_path / "out"
    short = ["--set", f"model.config={_short_context_config(tmp_path)}", "--set", "data.max_length=1024",
             "--set", "layers.num_layers=2"]
    assert main(argv(out, data_file, *short)) == EXIT_BAD_RECIPE
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "recipe key `data.max_length` = 1024: longer than the model's context of 256 " \
        "positions (max_position_embeddings 256)" in errors[0] and "data.allow_beyond_context" in errors[0], errors
    assert not out.exists()
    # allowed: extracted, the rows past the context counted (the demo rows run to ~1,000 tokens)
    assert main(argv(out, data_file, *short, "--set", "data.allow_beyond_context=true")) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    lengths = [len(np.load(__import__("io").BytesIO(r["input_ids.npy"]))) for r in raw_records(out).values()]
    assert summary["num_samples_beyond_context"] == sum(n > 256 for n in lengths) > 0
    assert f"{summary['num_samples_beyond_context']} kept row(s) are longer than the model's context of 256" in err
    assert check_output(out) == []
    # YaRN x4 over 256 positions: 1,024 fit
    scaled = ["--set", f"model.config={_short_context_config(tmp_path, {'rope_type': 'yarn', 'factor': 4.0})}",
              "--set", "data.max_length=1024", "--set", "layers.num_layers=2", "--set", "data.max_samples=2"]
    assert main(argv(tmp_path / "scaled", data_file, *scaled)) == 0


def test_a_save_to_disk_folder_is_keyed_on_the_files_it_loads_from(tmp_path, monkeypatch):
    """A regenerated-rows folder (a `save_to_disk` dataset) also holds an index, locks and logs that change on every
    run of it; the data's identity follows the Arrow files and the dataset's own json files only."""
    import datasets

    from dflash_prep.data.rows import data_files_fingerprint
    from dflash_prep.recipe.schema import DataSection

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = tmp_path / "rows"
    datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]).save_to_disk(str(folder))
    section = DataSection(path=str(folder))
    first = data_files_fingerprint(section)
    (folder / "locks").mkdir()
    (folder / "locks" / "run.lease-000001").write_text("{}")
    (folder / "index.jsonl").write_text("{}\n")
    assert data_files_fingerprint(section) == first
    (arrow,) = [name for name in first["files"] if name.endswith(".arrow")]
    Path(arrow).write_bytes(Path(arrow).read_bytes()[:-8] + b"\0" * 8)
    assert data_files_fingerprint(section)["files"][arrow] != first["files"][arrow]

"""Tests for dflash_prep.consume.export: each layout's file names, keys, shapes, dtypes and values (as each trainer reads them),
the refusals (what the extraction did not capture), export order, and the CLI.

Two small extractions (final layer before / after the norm) are shared by the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_prep.consume.export import (
    EXPORT_INFO_NAME,
    ExportError,
    check_exportable,
    export,
    main,
    sample_ids_by_shard,
    specforge_path,
)
from dflash_prep.consume.reader import ShardDataset, shards_of

NUM_ROWS = 24
BASE = [f"data.max_samples={NUM_ROWS}", "data.max_length=256", "batching.max_tokens_per_batch=1024",
        "batching.num_workers=0", "output.max_shard_bytes=1"]


def _extract(out_dir: Path, capture_final: str) -> Path:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    run_extraction(load_recipe(None, [f"output.dir={out_dir}", *BASE, f"layers.capture_final={capture_final}"]))
    assert (out_dir / "manifest.json").is_file()
    return out_dir


@pytest.fixture(scope="module")
def out_before(tmp_path_factory) -> Path:
    return _extract(tmp_path_factory.mktemp("export") / "before", "before_norm")


@pytest.fixture(scope="module")
def out_after(tmp_path_factory) -> Path:
    return _extract(tmp_path_factory.mktemp("export") / "after", "after_norm")


def _samples_in_export_order(out: Path) -> list[dict]:
    """The reader's samples sorted by sample_id: export index i = i-th sample."""
    samples = sorted(ShardDataset(out), key=lambda s: s["sample_id"])
    assert len(samples) == NUM_ROWS
    return samples


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _owns_exactly_its_bytes(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


# --------------------------------------------------------------------------------------------- SpecForge
def test_specforge_dflash_layout(out_before, tmp_path):
    dest = tmp_path / "sf"
    report = export(out_before, "specforge", dest, progress=False)
    samples = _samples_in_export_order(out_before)
    m = _manifest(out_before)
    k, H = len(m["layer_ids"]), m["hidden_size"]
    assert report.num_samples == NUM_ROWS and report.num_tokens == m["num_tokens"]
    assert _files(dest) == {f"rows_0-2000/data_{i}.ckpt" for i in range(NUM_ROWS)} | {EXPORT_INFO_NAME}
    for i, s in enumerate(samples):
        d = torch.load(dest / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"}
        T = s["input_ids"].shape[0]
        assert d["input_ids"].dtype == torch.int64 and tuple(d["input_ids"].shape) == (T,)
        assert d["loss_mask"].dtype == torch.int64 and tuple(d["loss_mask"].shape) == (T,)
        assert d["hidden_states"].dtype == torch.bfloat16 and tuple(d["hidden_states"].shape) == (1, T, k * H)
        assert torch.equal(d["input_ids"], s["input_ids"]) and torch.equal(d["loss_mask"], s["loss_mask"])
        assert _bits(d["hidden_states"][0]) == _bits(s["hidden_states"])
        assert all(_owns_exactly_its_bytes(t) for t in d.values())  # no stray storage in the file
    info = json.loads((dest / EXPORT_INFO_NAME).read_text())
    assert info["sample_ids"] == [s["sample_id"] for s in samples] == sorted(info["sample_ids"])
    assert info["layer_ids_after_layer"] == m["layer_ids"]
    assert info["trainer_config"] == {"dflash_config.target_layer_ids": m["layer_ids"]}


def test_specforge_groups_of_2000():
    assert specforge_path(Path("d"), 0) == Path("d/rows_0-2000/data_0.ckpt")
    assert specforge_path(Path("d"), 1999) == Path("d/rows_0-2000/data_1999.ckpt")
    assert specforge_path(Path("d"), 2000) == Path("d/rows_2000-4000/data_2000.ckpt")
    assert specforge_path(Path("d"), 4123) == Path("d/rows_4000-6000/data_4123.ckpt")


def test_specforge_eagle3_layout(out_after, tmp_path):
    dest = tmp_path / "sf3"
    export(out_after, "specforge", dest, strategy="eagle3", progress=False)
    samples = _samples_in_export_order(out_after)
    H = _manifest(out_after)["hidden_size"]
    assert len(_manifest(out_after)["layer_ids"]) == 3
    for i, s in enumerate(samples):
        d = torch.load(specforge_path(dest, i), weights_only=True)
        T = s["input_ids"].shape[0]
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert tuple(d["aux_hidden_state"].shape) == (1, T, 3 * H) and d["aux_hidden_state"].dtype == torch.bfloat16
        assert tuple(d["hidden_state"].shape) == (1, T, H) and d["hidden_state"].dtype == torch.bfloat16
        assert _bits(d["aux_hidden_state"][0]) == _bits(s["hidden_states"])
        assert _bits(d["hidden_state"][0]) == _bits(s["final_hidden_states"])
        assert torch.equal(d["input_ids"], s["input_ids"]) and d["input_ids"].dtype == torch.int64


# ------------------------------------------------------------------------------------------- speculators
def test_speculators_layout(out_before, tmp_path):
    import datasets

    dest = tmp_path / "spec"
    export(out_before, "speculators", dest, progress=False)
    samples = _samples_in_export_order(out_before)
    m = _manifest(out_before)
    k, H = len(m["layer_ids"]), m["hidden_size"]
    hs_files = {f"hidden_states/hs_{i}.safetensors" for i in range(NUM_ROWS)}
    files = _files(dest)
    assert hs_files <= files
    assert files - hs_files - {EXPORT_INFO_NAME, "token_freq.pt"} == {
        "state.json", "dataset_info.json", "data-00000-of-00001.arrow"}  # save_to_disk's files only
    # speculators' frequency file: {token id: count} of the supervised tokens, counted here from the samples
    freq: dict[int, int] = {}
    for s in samples:
        for t in s["input_ids"][s["loss_mask"] == 1].tolist():
            freq[t] = freq.get(t, 0) + 1
    assert torch.load(dest / "token_freq.pt", weights_only=True) == freq
    ds = datasets.load_from_disk(str(dest))
    assert ds.format["type"] == "torch" and len(ds) == NUM_ROWS
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert list(ds.with_format(None)["seq_len"]) == [s["input_ids"].shape[0] for s in samples]
    for i, s in enumerate(samples):
        row = ds[i]
        T = s["input_ids"].shape[0]
        assert row["input_ids"].dtype == torch.int64 and row["loss_mask"].dtype == torch.int64
        assert torch.equal(row["input_ids"], s["input_ids"]) and torch.equal(row["loss_mask"], s["loss_mask"])
        assert int(row["seq_len"]) == T
        f = load_file(dest / "hidden_states" / f"hs_{i}.safetensors")
        assert set(f) == {"hidden_states", "token_ids"}
        assert f["hidden_states"].dtype == torch.bfloat16 and tuple(f["hidden_states"].shape) == (T, k + 1, H)
        assert f["token_ids"].dtype == torch.int64 and torch.equal(f["token_ids"], row["input_ids"])
        # speculators' reader: aux = hidden_states[:, :-1].flatten(1), verifier last = hidden_states[:, -1]
        assert _bits(f["hidden_states"][:, :-1].flatten(1)) == _bits(s["hidden_states"])
        assert _bits(f["hidden_states"][:, -1]) == _bits(s["final_hidden_states"])
    info = json.loads((dest / EXPORT_INFO_NAME).read_text())
    assert info["trainer_config"]["--target-layer-ids"] == [i + 1 for i in m["layer_ids"]]


# --------------------------------------------------------------------------------------- Model-Optimizer
def test_modelopt_layout(out_after, tmp_path):
    dest = tmp_path / "mo"
    export(out_after, "modelopt", dest, progress=False)
    samples = _samples_in_export_order(out_after)
    m = _manifest(out_after)
    k, H = len(m["layer_ids"]), m["hidden_size"]
    assert _files(dest) == {f"{s['sample_id']}.pt" for s in samples} | {EXPORT_INFO_NAME}
    for s in samples:
        d = torch.load(dest / f"{s['sample_id']}.pt", weights_only=True)
        T = s["input_ids"].shape[0]
        assert set(d) == {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask", "conversation_id"}
        assert d["conversation_id"] == s["sample_id"]
        assert d["input_ids"].dtype == torch.int64 and tuple(d["input_ids"].shape) == (T,)
        assert d["loss_mask"].dtype == torch.int64 and tuple(d["loss_mask"].shape) == (T,)
        assert d["hidden_states"].dtype == torch.bfloat16 and tuple(d["hidden_states"].shape) == (T, H)
        assert d["aux_hidden_states"].dtype == torch.bfloat16 and tuple(d["aux_hidden_states"].shape) == (T, k * H)
        assert _bits(d["hidden_states"]) == _bits(s["final_hidden_states"])
        assert _bits(d["aux_hidden_states"]) == _bits(s["hidden_states"])
        assert torch.equal(d["input_ids"], s["input_ids"]) and torch.equal(d["loss_mask"], s["loss_mask"])


# ------------------------------------------------------------------------------------------------ refusals
def test_wrong_final_layer_fails_at_once_naming_the_key(out_after, tmp_path):
    dest = tmp_path / "dest"
    with pytest.raises(ExportError, match=r"layers\.capture_final=before_norm"):
        export(out_after, "speculators", dest, progress=False)
    assert not dest.exists() and not dest.with_name("dest.partial").exists()


@pytest.mark.parametrize(("target", "strategy"), [("modelopt", "dflash"), ("specforge", "eagle3")])
def test_no_final_layer_for_an_after_norm_target_points_at_the_re_extraction_that_serves_every_exporter(
        out_before, target, strategy):
    """Without the final layer, an after-norm layout (Model-Optimizer, SpecForge EAGLE-3) suggests before_norm first,
    as speculators' refusal does: one re-extraction then serves all three."""
    manifest = dict(_manifest(out_before), capture_final="none", final_norm=None)
    with pytest.raises(ExportError) as refused:
        check_exportable(manifest, target, strategy)
    message = str(refused.value)
    assert message.index("capture_final=before_norm") < message.index("capture_final=after_norm")


@pytest.mark.parametrize(("target", "strategy"), [("modelopt", "dflash"), ("specforge", "eagle3")])
def test_before_norm_without_a_stored_final_norm_is_refused_for_after_norm_targets(out_before, target, strategy):
    """An output written before final_norm.safetensors existed (or with an unsupported norm) cannot derive it."""
    manifest = _manifest(out_before)
    for final_norm in (None, {**manifest["final_norm"], "form": "unsupported"}):
        with pytest.raises(ExportError, match=r"layers\.capture_final=after_norm"):
            check_exportable(dict(manifest, final_norm=final_norm), target, strategy)


@pytest.mark.parametrize(("target", "strategy"), [("modelopt", "dflash"), ("specforge", "eagle3")])
def test_after_norm_export_from_a_before_norm_extraction_equals_a_real_after_norm_one(out_before, out_after,
                                                                                      tmp_path, target, strategy):
    """One extraction serves every final-layer convention: Model-Optimizer's and SpecForge EAGLE-3's after-norm
    final layer, derived from a before_norm output with its stored final norm, equals an after_norm extraction's
    export within bf16 rounding (two roundings: the stored before-norm states, the derived result)."""
    exported = {}
    for name, out in (("before", out_before), ("after", out_after)):
        export(out, target, tmp_path / name, strategy=strategy, progress=False)
        exported[name] = tmp_path / name
    key = "hidden_states" if target == "modelopt" else "hidden_state"
    pattern = "*.pt" if target == "modelopt" else "rows_*/data_*.ckpt"
    files = sorted(p.relative_to(exported["after"]) for p in exported["after"].glob(pattern))
    assert len(files) == NUM_ROWS
    for rel in files:
        derived = torch.load(exported["before"] / rel, weights_only=True)[key].float()
        real = torch.load(exported["after"] / rel, weights_only=True)[key].float()
        assert ((derived - real).abs() <= 2 ** -7 * real.abs() + 1e-6).all(), rel
    info = json.loads((exported["before"] / EXPORT_INFO_NAME).read_text())
    assert info["final_norm_applied_at_export"] is True


@pytest.mark.parametrize(("target", "wanted"), [("speculators", "before_norm"), ("modelopt", "after_norm")])
def test_no_final_layer_fails_naming_the_key(out_before, target, wanted):
    manifest = dict(_manifest(out_before), capture_final="none")
    with pytest.raises(ExportError, match=rf"did not capture the final layer.*layers\.capture_final={wanted}"):
        check_exportable(manifest, target)
    check_exportable(manifest, "specforge")  # SpecForge DFlash needs no final layer


def test_other_refusals(out_before):
    m = _manifest(out_before)
    with pytest.raises(ExportError, match="output.dtype=bfloat16"):
        check_exportable(dict(m, dtype="float32"), "specforge")
    check_exportable(dict(m, dtype="float32"), "specforge", cast_to_bfloat16=True)
    with pytest.raises(ExportError, match="exactly 3 auxiliary layers.*layers.preset=eagle3"):
        check_exportable(dict(m, layer_ids=[1, 3], capture_final="after_norm"), "specforge", "eagle3")
    with pytest.raises(ExportError, match="--strategy applies to --to specforge only"):
        check_exportable(m, "speculators", "eagle3")


# ------------------------------------------------------------------------------------------ order and CLI
def test_export_order_is_the_same_without_the_rank_indexes(out_before, tmp_path):
    """Sample ids come from index/*.jsonl when it agrees with the manifest, else from the tar headers."""
    m = _manifest(out_before)
    copy = tmp_path / "no-index"
    copy.mkdir()
    (copy / "shards").symlink_to(out_before / "shards")
    (copy / "manifest.json").write_text(json.dumps(m))
    from_index = sample_ids_by_shard(out_before, shards_of(out_before, m))
    from_tars = sample_ids_by_shard(copy, shards_of(copy, m))
    assert from_index == from_tars and sum(map(len, from_tars.values())) == NUM_ROWS


def test_cli_refuses_a_non_empty_dest_and_overwrites_on_request(out_before, tmp_path, capsys):
    dest = tmp_path / "cli"
    dest.mkdir()
    (dest / "keep.txt").write_text("x")
    args = [str(out_before), "--to", "specforge", "--dest", str(dest), "--no-progress"]
    assert main(args) == 2
    assert "not empty" in capsys.readouterr().err and (dest / "keep.txt").exists()
    assert main(args + ["--overwrite"]) == 2  # not an earlier export: the user's file stays
    assert "is not an earlier export" in capsys.readouterr().err and (dest / "keep.txt").exists()
    (dest / "keep.txt").unlink()
    assert main(args) == 0  # an empty folder
    assert main(args) == 2 and "not empty" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0  # an earlier export is replaced
    assert "exported 24 samples" in capsys.readouterr().err
    assert (dest / "rows_0-2000" / "data_23.ckpt").is_file()
    assert main([str(out_before), "--to", "modelopt", "--dest", str(tmp_path / "mo"), "--no-progress",
                 "--cast-to-bfloat16", "--hidden-states-backend", "fp8"]) == 2
    assert "--hidden-states-backend applies to --to speculators only" in capsys.readouterr().err
    assert not (tmp_path / "mo").exists()


def test_float32_output_needs_an_explicit_cast(tmp_path):
    out = tmp_path / "fp32"
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    run_extraction(load_recipe(None, [f"output.dir={out}", *BASE[:1], "data.max_samples=6", *BASE[1:],
                                      "output.dtype=float32"]))
    with pytest.raises(ExportError, match=r"output\.dtype=bfloat16.*--cast-to-bfloat16"):
        export(out, "specforge", tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
    export(out, "specforge", tmp_path / "cast", cast_to_bfloat16=True, progress=False)
    samples = sorted(ShardDataset(out), key=lambda s: s["sample_id"])
    assert len(samples) == 6 and samples[0]["hidden_states"].dtype == torch.float32
    for i, s in enumerate(samples):
        d = torch.load(specforge_path(tmp_path / "cast", i), weights_only=True)
        assert d["hidden_states"].dtype == torch.bfloat16
        assert _bits(d["hidden_states"][0]) == _bits(s["hidden_states"].to(torch.bfloat16))
    assert json.loads((tmp_path / "cast" / EXPORT_INFO_NAME).read_text())["cast_to_bfloat16"] is True


def test_verify_refuses_a_corrupt_shard_and_leaves_no_dest(out_before, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copytree(out_before / "shards", copy / "shards")
    (copy / "manifest.json").write_text((out_before / "manifest.json").read_text())
    victim = copy / _manifest(copy)["shards"][-1]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x80
    victim.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    assert main([str(copy), "--to", "specforge", "--dest", str(dest), "--verify", "--no-progress"]) == 1
    assert not dest.exists() and not (tmp_path / "dest.partial").exists()


def _corrupt_copy(out: Path, dest: Path, edit=None) -> tuple[Path, str]:
    """A copy of `out` (shards + manifest) with one byte flipped in the middle of its last shard."""
    import shutil

    dest.mkdir()
    shutil.copytree(out / "shards", dest / "shards")
    manifest = _manifest(out)
    if edit is not None:
        edit(manifest)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    victim = manifest["shards"][-1]["path"]
    data = bytearray((dest / victim).read_bytes())
    data[len(data) // 2] ^= 0x80
    (dest / victim).write_bytes(bytes(data))
    return dest, victim


def test_export_verifies_every_shard_by_default(out_before, tmp_path, capsys):
    """A corrupted shard stops the export (exit 1, naming the shard) without any flag; nothing is left at DEST.
    `--skip-hash` is the documented way to export without the check."""
    bad, victim = _corrupt_copy(out_before, tmp_path / "bad")
    dest = tmp_path / "dest"
    assert main([str(bad), "--to", "specforge", "--dest", str(dest), "--no-progress"]) == 1
    assert f"{victim}: sha256" in capsys.readouterr().err
    assert not dest.exists() and not (tmp_path / "dest.partial").exists()
    assert main([str(bad), "--to", "specforge", "--dest", str(dest), "--no-progress", "--skip-hash"]) == 0


@pytest.mark.parametrize("edit", ["drop", "duplicate"])
def test_export_refuses_a_manifest_whose_shards_do_not_add_up(out_before, tmp_path, capsys, edit):
    def change(m):
        if edit == "drop":
            del m["shards"][0]
        else:
            m["shards"].append(dict(m["shards"][0]))

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "shards").symlink_to(out_before / "shards")
    m = _manifest(out_before)
    change(m)
    (bad / "manifest.json").write_text(json.dumps(m))
    dest = tmp_path / "dest"
    assert main([str(bad), "--to", "specforge", "--dest", str(dest), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert ("shards add up to" if edit == "drop" else "listed 2 times") in err and not dest.exists()


def test_one_export_per_dest_and_files_counted_after_the_rename(out_before, tmp_path, capsys):
    """While another process holds DEST.lock a second export into DEST is refused (exit 2) and touches nothing;
    once it is free the export's reported file count is what DEST holds (counted here by walking DEST)."""
    import subprocess
    import sys

    dest = tmp_path / "dest"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from dflash_prep.store.locks import FileLock; "
         "assert FileLock(sys.argv[1]).try_acquire(); print('held', flush=True); sys.stdin.read()",
         str(tmp_path / "dest.lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main([str(out_before), "--to", "specforge", "--dest", str(dest), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "another export into" in err and f"pid {holder.pid}" in err
        assert not dest.exists() and not (tmp_path / "dest.partial").exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    report = export(out_before, "specforge", dest, progress=False)
    assert report.num_files == len(_files(dest)) == NUM_ROWS + 1  # + dflash_prep_export.json
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"]  # no dest.lock left beside it


def test_a_lock_file_removed_by_its_holder_is_not_held_twice(tmp_path, monkeypatch):
    """An export removes DEST.lock as it ends. A process that had opened the old file just before must not lock
    that removed file while another holds the new one at the path: its try_acquire retakes the lock on the file
    the path names now."""
    import os

    import dflash_prep.store.locks as locks

    path = tmp_path / "dest.lock"
    first = locks.FileLock(path)
    assert first.try_acquire()
    stale_fd = os.open(path, os.O_RDWR)  # opened by a second process between the first's lock and its release
    first.release(remove=True)
    assert not path.exists()
    third = locks.FileLock(path)
    assert third.try_acquire()  # the new file at the path
    real_open, opened = os.open, []

    def open_stale_first(*args, **kwargs):
        opened.append(args[0])
        return stale_fd if len(opened) == 1 else real_open(*args, **kwargs)

    monkeypatch.setattr(locks.os, "open", open_stale_first)
    second = locks.FileLock(path)
    assert not second.try_acquire()  # the removed file's flock was free, but it is not the path's lock
    assert len(opened) == 2
    monkeypatch.undo()
    third.release(remove=True)
    assert second.try_acquire() and path.exists()
    second.release(remove=True)
    assert not path.exists()


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_an_export_never_deletes_or_alters_its_source(out_before, tmp_path, where):
    """A --dest that is the output, holds it, or lies inside it is refused before anything is touched (with
    --overwrite the export would otherwise delete the output it reads)."""
    import shutil

    root = tmp_path / "root"
    out = root / "out"
    shutil.copytree(out_before, out)
    dest = {"same": out, "parent": root, "inside": out / "shards"}[where]
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert main([str(out), "--to", "specforge", "--dest", str(dest), "--overwrite", "--no-progress"]) == 2
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before


def test_overwrite_replaces_only_an_earlier_export(out_before, tmp_path, capsys):
    """--overwrite never deletes a folder that is not an export (a user's files, another extraction output)."""
    import shutil

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("important")
    other_output = tmp_path / "other-output"
    shutil.copytree(out_before, other_output)
    for dest in (precious, other_output):
        before = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
        assert main([str(out_before), "--to", "specforge", "--dest", str(dest), "--overwrite", "--no-progress"]) == 2
        assert "is not an earlier export" in capsys.readouterr().err
        assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == before

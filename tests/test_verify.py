"""`dflash-prep verify`: passes on a fresh output (errors at the level of bf16 rounding), fails naming the sample
and the layer when one stored value is altered and the shard hash updated (so only the value check can catch
it), fails on a shard whose hash is wrong, refuses another model, and draws its samples with the printed seed.

One small extraction (bf16 storage, fp32 compute, final layer after the norm) is shared by the module; each
corruption works on its own copy.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tarfile
from pathlib import Path

import pytest
import torch

from dflash_prep.verify import STORAGE_TOLERANCE, choose_samples, main, verify

NUM_ROWS = 12
BASE = [f"data.max_samples={NUM_ROWS}", "data.max_length=192", "batching.max_tokens_per_batch=1024",
        "batching.num_workers=0", "layers.capture_final=after_norm", "output.max_shard_bytes=100KB"]


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from dflash_prep.extract import run_extraction
    from dflash_prep.recipe import load_recipe

    out = tmp_path_factory.mktemp("verify") / "out"
    run_extraction(load_recipe(None, [f"output.dir={out}", *BASE]))
    return out


def _quiet(*args) -> None:
    pass


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fresh_output_passes_with_bf16_rounding_errors(output, capsys):
    report = verify(output, num_samples=NUM_ROWS, log=_quiet)
    assert report.ok and report.integrity_problems == []
    assert len(report.sample_ids) == NUM_ROWS
    layers = {r.layer for r in report.results}
    assert layers == {"1", "3", "5", "final (after_norm)"} and len(report.results) == NUM_ROWS * 4
    # fp32 compute: batched == alone up to kernel noise, so what is left is bf16 storage rounding (2^-8).
    worst = max(r.relative_error for r in report.results)
    assert 0 < worst <= STORAGE_TOLERANCE["bfloat16"] + 1e-5, worst
    assert main([str(output), "--num-samples", "2"]) == 0
    assert "verify: OK" in capsys.readouterr().out


def _alter_one_value(out: Path, sample_id: str, slot: int, token: int, column: int, factor: float) -> tuple:
    """Add `factor` x (max |value| of that layer of that sample) to one stored bf16 value, in place in its shard,
    and update the manifest's sha256 so that only a value check can see it. Returns (old, new) values."""
    manifest = json.loads((out / "manifest.json").read_text())
    H = manifest["hidden_size"]
    for entry in manifest["shards"]:
        path = out / entry["path"]
        with tarfile.open(path, "r:") as tar:
            member = next((m for m in tar if m.name == f"{sample_id}.hidden_states.safetensors"), None)
        if member is None:
            continue
        data = bytearray(path.read_bytes())
        start = member.offset_data
        (n,) = struct.unpack("<Q", data[start:start + 8])
        header = json.loads(data[start + 8:start + 8 + n])
        info = header["hidden_states"]
        T, W = info["shape"]
        base = start + 8 + n + info["data_offsets"][0]
        states = torch.frombuffer(bytearray(data[base:base + T * W * 2]), dtype=torch.bfloat16).view(T, W)
        layer_max = float(states[:, slot * H:(slot + 1) * H].float().abs().max())
        old = states[token, slot * H + column].clone()
        new = (old.float() + factor * layer_max).to(torch.bfloat16)
        at = base + (token * W + slot * H + column) * 2
        data[at:at + 2] = new.reshape(1).view(torch.uint8).numpy().tobytes()
        path.write_bytes(bytes(data))
        entry["sha256"] = _sha256(path)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return float(old), float(new)
    raise AssertionError(f"sample {sample_id} not found")


def test_one_altered_value_fails_naming_the_sample_and_the_layer(copy, capsys):
    from dflash_prep.inspect_output import check_output

    sample_id = sorted(json.loads((copy / "index" / "rank-00000.jsonl").read_text().splitlines()[0])["sample_ids"])[0]
    old, new = _alter_one_value(copy, sample_id, slot=1, token=5, column=17, factor=0.02)
    assert old != new
    assert check_output(copy) == []  # hashes and format agree: inspect --check cannot see it
    assert main([str(copy), "--num-samples", str(NUM_ROWS)]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1, out
    assert fails[0].startswith(f"FAIL sample {sample_id} layer 3:") and "(token 5)" in fails[0]
    report = verify(copy, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
    assert [(r.sample_id, r.layer) for r in report.failures] == [(sample_id, "3")]
    assert report.failures[0].max_abs_error == pytest.approx(abs(new - old), rel=0.2)


def test_a_shard_whose_bytes_changed_fails_the_hash_check(copy, capsys):
    shard = next(iter(sorted((copy / "shards").rglob("*.tar"))))
    data = bytearray(shard.read_bytes())
    data[-20000] ^= 0x01  # inside the last sample's states, hash not updated
    shard.write_bytes(bytes(data))
    assert main([str(copy), "--num-samples", "1"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {shard.relative_to(copy)}: sha256" in out and "verify: FAILED" in out


def test_a_shard_whose_tar_header_is_damaged_fails_without_a_traceback(copy, capsys):
    """Samples drawn from an unreadable shard: the hash check and the read both fail, named; the other shards' samples
    are still compared and the verdict line is printed (exit code 1)."""
    shard = next(iter(sorted((copy / "shards").rglob("*.tar"))))
    data = bytearray(shard.read_bytes())
    data[:136] = b"\0" * 136  # the first member's tar header
    shard.write_bytes(bytes(data))
    assert main([str(copy), "--num-samples", str(NUM_ROWS)]) == 1
    out = capsys.readouterr().out
    rel = str(shard.relative_to(copy))
    assert f"FAIL {rel}: sha256" in out and f"{rel}: its drawn samples cannot be read" in out
    assert "verify: FAILED" in out and "layer result(s) out of tolerance" in out


def test_samples_are_drawn_with_the_printed_seed(output, capsys):
    assert main([str(output), "--num-samples", "3", "--seed", "7", "--skip-hash"]) == 0
    out = capsys.readouterr().out
    ids = [line for line in out.splitlines() if "drawn with seed 7" in line][0].rsplit(": ", 1)[1].split(", ")
    all_ids = [f"{i:010d}" for i in range(NUM_ROWS)]
    assert ids == choose_samples(all_ids, 3, 7) and len(set(ids)) == 3
    assert choose_samples(all_ids, 3, 8) != ids and choose_samples(all_ids, 99, 0) == all_ids


def test_another_model_cannot_verify(output, capsys):
    assert main([str(output), "--set", "model.init_seed=1"]) == 2
    assert "model_fingerprint" in capsys.readouterr().err
    assert main([str(output.parent / "missing")]) == 2


def _rewrite_as_last_layer_id(src: Path, dest: Path) -> None:
    """Rewrite a `capture_final: before_norm` output of the 8-layer demo model as versions that accepted id L-1
    wrote `layers.ids: [1, 3, 5, 7]`: id 7 = the last layer's hook output, i.e. BEFORE the final norm (while the
    format says id i = HF hidden_states[i+1], which for i = 7 is after it); no final layer."""
    import io
    import shutil

    import yaml
    from safetensors.torch import load as st_load
    from safetensors.torch import save as st_save

    shutil.copytree(src, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    ids = manifest["layer_ids"] + [manifest["num_hidden_layers"] - 1]
    for entry in manifest["shards"]:
        path = dest / entry["path"]
        with tarfile.open(path) as tar:
            members = [(info, tar.extractfile(info).read()) for info in tar]
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for info, data in members:
                if info.name.endswith(".hidden_states.safetensors"):
                    t = st_load(data)
                    data = st_save({"hidden_states": torch.cat([t["hidden_states"], t["final_hidden_states"]], 1)})
                elif info.name.endswith(".meta.json"):
                    data = json.dumps(dict(json.loads(data), layer_ids=ids)).encode()
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        entry.update(sha256=_sha256(path), num_bytes=path.stat().st_size)
    manifest.update(layer_ids=ids, capture_final="none", num_bytes=sum(e["num_bytes"] for e in manifest["shards"]))
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    recipe = yaml.safe_load((dest / "recipe.resolved.yaml").read_text())
    recipe["layers"].update(preset="explicit", ids=ids, capture_final="none")
    (dest / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe))


def test_verify_compares_with_hf_hidden_states_not_with_our_hooks(tmp_path, capsys):
    """The reference is transformers' output_hidden_states on the sample alone: a before_norm output passes
    (its final layer = the pre-norm hidden_states[L]); the same states relabelled as layer id 7 = L-1 (what
    versions that accepted that id stored) fail on layer 7 only, since HF's hidden_states[8] is after the norm."""
    from dflash_prep.extract import run_extraction
    from dflash_prep.inspect_output import check_output
    from dflash_prep.recipe import load_recipe

    src = tmp_path / "before"
    run_extraction(load_recipe(None, [f"output.dir={src}", *BASE, "layers.capture_final=before_norm"]))
    report = verify(src, num_samples=3, log=_quiet)
    assert report.ok and {r.layer for r in report.results} == {"1", "3", "5", "final (before_norm)"}
    relabelled = tmp_path / "last-layer-id"
    _rewrite_as_last_layer_id(src, relabelled)
    assert check_output(relabelled) == []  # a well-formed output: only the values can tell
    assert main([str(relabelled), "--num-samples", "3"]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 3 and all(" layer 7:" in line for line in fails)
    report = verify(relabelled, num_samples=3, check_shards=False, log=_quiet)
    assert {r.layer for r in report.failures} == {"7"} and min(r.relative_error for r in report.failures) > 0.5


def test_the_reference_runs_the_recipes_kernels_as_the_extraction_chooses_them(output, capsys):
    assert main([str(output), "--num-samples", "2", "--skip-hash"]) == 0
    assert "kernels: eager (no CUDA device (cpu): eager)" in capsys.readouterr().out
    # a named list that cannot run here: eager reference, said so
    assert main([str(output), "--num-samples", "2", "--skip-hash", "--set", "model.kernels=[liger_rms_norm]"]) == 0
    out = capsys.readouterr().out
    assert "kernels: eager (recipe key `model.kernels` = ['liger_rms_norm']: fused kernels need a CUDA device" in out


def test_a_final_layer_stored_after_the_norm_fails_as_before_norm(copy):
    """The before-norm reference (the final norm's input in transformers' own forward) can fail: the after-norm
    states of the module's output, relabelled as before_norm, differ by the norm's gain and scale."""
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["capture_final"] == "after_norm"
    (copy / "manifest.json").write_text(json.dumps(dict(manifest, capture_final="before_norm")))
    recipe = copy / "recipe.resolved.yaml"
    recipe.write_text(recipe.read_text().replace("capture_final: after_norm", "capture_final: before_norm"))
    report = verify(copy, num_samples=3, check_shards=False, log=_quiet)
    assert {r.layer for r in report.failures} == {"final (before_norm)"}
    assert min(r.relative_error for r in report.failures) > 0.2


def test_the_reference_applies_the_kernels_the_extraction_applied():
    """model.kernels: auto on a GPU is what the extraction applied (the manifest's `kernels`): none for a
    tensor-parallel replica (its reference, split by layers, would otherwise choose fused kernels)."""
    from conftest import tiny_llama_config
    from dflash_prep.recipe import load_recipe
    from dflash_prep.verify import _reference_kernels

    recipe, config, cuda = load_recipe(None), tiny_llama_config(), torch.device("cuda")
    tensor_parallel = {"requested": "auto", "applied": [], "reason": "tensor parallel: not measured on sharded layers"}
    assert _reference_kernels(recipe, config, cuda, tensor_parallel).requested == "eager"
    assert _reference_kernels(recipe, config, cuda, None).requested == "auto"  # no record: chosen as then
    assert _reference_kernels(recipe, config, torch.device("cpu"), tensor_parallel).requested == "auto"  # eager on CPU

"""`dflash-prep verify`: passes on a fresh output (errors at the level of bf16 rounding), fails naming the sample
and the layer when one stored value is altered and the shard hash updated (so only the value check can catch
it), fails on a shard whose hash is wrong, refuses another model, and draws its samples with the printed seed.
Its noise floor (padded batch vs alone, per layer) is what plain transformers gives, widens a layer's bound to 2x
that floor only without --tolerance, and is skipped with --no-noise-floor.

Two small extractions (bf16 storage, fp32 or bf16 compute, final layer after the norm) are shared by the module;
each corruption works on its own copy.
"""

from __future__ import annotations

import hashlib
import json
import struct
import tarfile
from pathlib import Path

import pytest
import torch

from dflash_prep.commands.verify import (
    NOISE_FLOOR_CAP,
    NOISE_FLOOR_FACTOR,
    STORAGE_TOLERANCE,
    LayerResult,
    NoiseResult,
    VerifyReport,
    allowed_error,
    choose_samples,
    format_report,
    judge,
    main,
    verify,
)

NUM_ROWS = 12
BASE = [f"data.max_samples={NUM_ROWS}", "data.max_length=192", "batching.max_tokens_per_batch=1024",
        "batching.num_workers=0", "layers.capture_final=after_norm", "output.max_shard_bytes=100KB"]


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    out = tmp_path_factory.mktemp("verify") / "out"
    run_extraction(load_recipe(None, [f"output.dir={out}", *BASE]))
    return out


@pytest.fixture(scope="module")
def bf16_output(tmp_path_factory) -> Path:
    """The same rows computed in bfloat16: batched and alone forwards round differently (a noise floor > 0)."""
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    out = tmp_path_factory.mktemp("verify-bf16") / "out"
    run_extraction(load_recipe(None, [f"output.dir={out}", "model.dtype=bfloat16", *BASE]))
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


def _rewrite_states(out: Path, sample_id: str, change) -> None:
    """Apply `change(states [T, k*H] bf16)` in place to one sample's stored states in its shard, and update the
    manifest's sha256 so that only a value check can see it."""
    manifest = json.loads((out / "manifest.json").read_text())
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
        change(states)
        data[base:base + T * W * 2] = states.view(torch.uint8).numpy().tobytes()
        path.write_bytes(bytes(data))
        entry["sha256"] = _sha256(path)
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return
    raise AssertionError(f"sample {sample_id} not found")


def _alter_one_value(out: Path, sample_id: str, slot: int, token: int, column: int, factor: float) -> tuple:
    """Add `factor` x (max |value| of that layer of that sample) to one stored bf16 value (see `_rewrite_states`).
    Returns (old, new) values."""
    H = json.loads((out / "manifest.json").read_text())["hidden_size"]
    values = []

    def change(states):
        layer_max = float(states[:, slot * H:(slot + 1) * H].float().abs().max())
        old = states[token, slot * H + column].clone()
        states[token, slot * H + column] = (old.float() + factor * layer_max).to(torch.bfloat16)
        values.extend([float(old), float(states[token, slot * H + column])])

    _rewrite_states(out, sample_id, change)
    return tuple(values)


def test_one_altered_value_fails_naming_the_sample_and_the_layer(copy, capsys):
    from dflash_prep.commands.inspect import check_output

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
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.commands.inspect import check_output
    from dflash_prep.recipe.schema import load_recipe

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

    from dflash_prep.commands.verify.reference import reference_kernels
    from dflash_prep.recipe.schema import load_recipe

    recipe, config, cuda = load_recipe(None), tiny_llama_config(), torch.device("cuda")
    tensor_parallel = {"requested": "auto", "applied": [], "reason": "tensor parallel: not measured on sharded layers"}
    assert reference_kernels(recipe, config, cuda, tensor_parallel).requested == "eager"
    assert reference_kernels(recipe, config, cuda, None).requested == "auto"  # no record: chosen as then
    assert reference_kernels(recipe, config, torch.device("cpu"), tensor_parallel).requested == "auto"  # eager on CPU


# ------------------------------------------------------------------------------------- noise floor (padded batch)
def _padded_vs_alone_by_layer(out: Path) -> dict[str, float]:
    """Worst relative error per layer (max abs difference / max |alone|) of every sample's states in ONE
    right-padded batch with its attention mask vs run alone: plain transformers on the output's model."""
    import io

    import numpy as np
    from conftest import raw_records

    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.target.model import load_config, load_model

    manifest = json.loads((out / "manifest.json").read_text())
    recipe = load_recipe(out / "recipe.resolved.yaml")
    decoder = load_model(recipe.model, load_config(recipe.model), torch.device("cpu")).model
    records = raw_records(out)
    ids = [torch.from_numpy(np.load(io.BytesIO(records[k]["input_ids.npy"])).astype(np.int64)) for k in sorted(records)]
    T = max(len(x) for x in ids)
    batch, mask = torch.zeros(len(ids), T, dtype=torch.int64), torch.zeros(len(ids), T, dtype=torch.int64)
    for b, x in enumerate(ids):
        batch[b, :len(x)], mask[b, :len(x)] = x, 1
    names = {str(i): i + 1 for i in manifest["layer_ids"]} | {"final (after_norm)": -1}
    worst = dict.fromkeys(names, 0.0)
    with torch.inference_mode():
        padded = decoder(input_ids=batch, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states
        for b, x in enumerate(ids):
            alone = decoder(input_ids=x[None], use_cache=False, output_hidden_states=True).hidden_states
            for name, k in names.items():
                ref = alone[k][0].float()
                diff = float((padded[k][b, :len(x)].float() - ref).abs().max() / ref.abs().max())
                worst[name] = max(worst[name], diff)
    return worst


def test_the_noise_floor_is_the_padded_batch_vs_alone_difference_per_layer(output, bf16_output, capsys):
    """A correct output passes and reports, per layer, the worst padded-batch vs alone relative error: what plain
    transformers gives (fp32: equal up to kernel noise, right padding changes no real token; bf16: rounding > 0)."""
    for out, compute in ((output, "float32"), (bf16_output, "bfloat16")):
        report = verify(out, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
        assert report.ok and report.compute_dtype == compute
        floors = {layer: f["relative_error"] for layer, f in report.noise_floor_by_layer().items()}
        expected = _padded_vs_alone_by_layer(out)
        assert floors == pytest.approx(expected, rel=1e-3, abs=1e-9)
        assert all(f["num_samples"] == NUM_ROWS for f in report.noise_floor_by_layer().values())
        if compute == "float32":
            assert max(floors.values()) < 1e-5
        else:
            assert max(floors.values()) > 1e-3  # measured > 0: batched and alone bf16 forwards round differently
        worst = report.to_json()["worst_by_layer"]
        assert set(worst) == {"1", "3", "5", "final (after_norm)"}
        for layer, w in worst.items():
            assert w["noise_floor_relative_error"] == floors[layer] >= 0
            assert w["allowed_relative_error"] == max(report.tolerance, 2 * floors[layer])
    assert main([str(bf16_output), "--num-samples", "3", "--skip-hash", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["noise_floor"]["measured"] and data["noise_floor"]["widen"] and data["noise_floor"]["factor"] == 2
    assert set(data["noise_floor"]["by_layer"]) == {"1", "3", "5", "final (after_norm)"}
    assert all(r["allowed"] >= data["tolerance"] and r["verdict"] == "pass" for r in data["results"])
    assert main([str(bf16_output), "--num-samples", "3", "--skip-hash"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layer ")]
    assert len(lines) == 4 and all("; padded-batch vs alone (rounding noise) relative " in line
                                   and " -> allowed 0.104 (worst over 3 sample(s))" in line for line in lines)


def test_one_layer_of_one_sample_scaled_by_1_3_fails_with_the_noise_floor_on(bf16_output, tmp_path, capsys):
    import shutil

    copy = tmp_path / "scaled"
    shutil.copytree(bf16_output, copy)
    H = json.loads((copy / "manifest.json").read_text())["hidden_size"]
    sample_id = "0000000004"

    def scale_layer_5(states):
        states[:, 2 * H:3 * H] = (states[:, 2 * H:3 * H].float() * 1.3).to(torch.bfloat16)

    _rewrite_states(copy, sample_id, scale_layer_5)
    assert main([str(copy), "--num-samples", str(NUM_ROWS)]) == 1
    out = capsys.readouterr().out
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL sample {sample_id} layer 5:"), out
    assert fails[0].endswith("> tolerance 0.104")  # the floor (< 0.052 here) does not widen it
    report = verify(copy, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
    assert [(r.sample_id, r.layer, r.verdict) for r in report.failures] == [(sample_id, "5", "fail")]
    assert report.failures[0].relative_error == pytest.approx(0.3, abs=0.02)


def test_the_bound_is_the_tolerance_or_twice_the_noise_floor_under_a_cap():
    """Numbers chosen here: relative 0.15 against the bf16 tolerance 0.104."""
    assert (NOISE_FLOOR_FACTOR, NOISE_FLOOR_CAP) == (2.0, 0.5)
    assert judge(0.15, 0.104, 0.1) == "pass" and allowed_error(0.104, 0.1) == (pytest.approx(0.2), True)
    assert judge(0.15, 0.104, 0.05) == "fail" and allowed_error(0.104, 0.05) == (0.104, True)
    assert judge(0.15, 0.104, 0.6) == "inconclusive" and allowed_error(0.104, 0.6) == (0.104, False)
    assert judge(0.1, 0.104, 0.6) == "pass"  # within the fixed tolerance whatever the floor
    assert judge(0.15, 0.104, float("nan")) == "inconclusive"  # a broken padded reference widens nothing
    assert judge(0.15, 0.104, 0.1, widen=False) == "fail" and judge(0.15, 0.104, None) == "fail"
    assert judge(float("nan"), 0.104, 0.1) == "fail" and judge(float("nan"), 0.104, 0.6) == "fail"


def _report(floor_by_layer: dict[str, float], errors: dict[str, float], widen: bool = True) -> VerifyReport:
    report = VerifyReport("OUT", "bfloat16", "bfloat16", 0.104, 0, ["s1"], widen=widen)
    for layer, rel in errors.items():
        report.results.append(LayerResult("s1", layer, 10, rel * 100, 100.0, rel, rel / 2, 3, ok=True))
        report.noise.append(NoiseResult("s1", layer, floor_by_layer[layer], floor_by_layer[layer] / 2))
    report.judge()
    return report


def test_the_report_names_the_bound_each_layer_failed_and_notes_amplified_rounding():
    report = _report({"1": 0.01, "39": 0.1, "76": 0.17, "79": 0.6}, {"1": 0.011, "39": 0.25, "76": 0.176, "79": 0.2})
    assert [(r.layer, r.verdict) for r in report.results] == [("1", "pass"), ("39", "fail"), ("76", "pass"),
                                                              ("79", "inconclusive")]
    text = format_report(report)
    assert "layer                 76: max abs error 17.6, relative 0.176, rel L2 0.088; padded-batch vs alone " \
           "(rounding noise) relative 0.17 -> allowed 0.34 (worst over 1 sample(s))" in text
    assert "layer                 79: max abs error 20, relative 0.2, rel L2 0.1; padded-batch vs alone " \
           "(rounding noise) relative 0.6 -> allowed 0.104 (noise above 0.5: not used)" in text
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "at layer(s) 76" in notes[0] and "2 x the measured noise" in notes[0]
    fails = [line for line in text.splitlines() if line.startswith("FAIL")]
    assert fails[0].startswith("FAIL sample s1 layer 39:") and fails[0].endswith(
        "> allowed 0.2 (2 x the rounding noise 0.1 at this layer)")
    assert fails[1].startswith("FAIL sample s1 layer 79:") and fails[1].endswith(
        "> tolerance 0.104; inconclusive: the model's rounding noise at this depth is 0.6 (padded batch vs alone, "
        "above 0.5: not used)")
    assert "verify: FAILED" in text and "2 layer result(s) out of tolerance (1 inconclusive)" in text
    assert not _report({"76": 0.17}, {"76": 0.176}, widen=False).ok


def _layer_3_floor_and_tampered_copy(bf16_output: Path, dest: Path) -> tuple[float, str]:
    """(layer 3's measured noise floor f, sample id) after adding 1.4 f x the layer's max |value| to one stored value
    of layer 3 of that sample in a copy: an error above 1.1 f that 2 f covers."""
    import shutil

    floor = verify(bf16_output, num_samples=NUM_ROWS, check_shards=False, log=_quiet).noise_floor_by_layer()
    f = floor["3"]["relative_error"]
    shutil.copytree(bf16_output, dest)
    sample_id = "0000000005"
    _alter_one_value(dest, sample_id, slot=1, token=7, column=11, factor=1.4 * f)
    return f, sample_id


def test_the_noise_floor_widens_the_bound_only_without_a_given_tolerance(bf16_output, tmp_path, capsys):
    """An error of 1.4x the measured floor: with a tolerance of 1.1x the floor, widening to 2x the floor passes it;
    `--tolerance` (no widening) and a run without widening fail it."""
    f, sample_id = _layer_3_floor_and_tampered_copy(bf16_output, tmp_path / "tampered")
    tol = 1.1 * f
    widened = verify(tmp_path / "tampered", num_samples=NUM_ROWS, check_shards=False, log=_quiet, tolerance=tol,
                     widen=True)
    tampered = next(r for r in widened.results if (r.sample_id, r.layer) == (sample_id, "3"))
    assert tol < tampered.relative_error <= NOISE_FLOOR_FACTOR * f and tampered.ok
    assert tampered.allowed == pytest.approx(2 * f)
    fixed = verify(tmp_path / "tampered", num_samples=NUM_ROWS, check_shards=False, log=_quiet, tolerance=tol)
    assert not fixed.widen and (sample_id, "3") in [(r.sample_id, r.layer) for r in fixed.failures]
    assert all(r.allowed == tol and r.ok == (r.relative_error <= tol) for r in fixed.results)
    assert main([str(tmp_path / "tampered"), "--num-samples", str(NUM_ROWS), "--skip-hash",
                 "--tolerance", repr(tol)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL sample {sample_id} layer 3:" in out and f"> tolerance {tol:.3g}" in out
    assert "(--tolerance: not widened)" in out and "(not widened)" in out.splitlines()[-1]


def test_no_noise_floor_runs_no_padded_batch_reference(bf16_output, capsys):
    report = verify(bf16_output, num_samples=3, check_shards=False, log=_quiet, noise_floor=False)
    assert report.ok and report.noise == [] and not report.noise_floor_measured and not report.widen
    assert all(r.allowed == report.tolerance for r in report.results)
    assert main([str(bf16_output), "--num-samples", "3", "--skip-hash", "--no-noise-floor"]) == 0
    out = capsys.readouterr().out
    assert "no noise floor (--no-noise-floor): the fixed tolerance only" in out and "padded-batch" not in out
    assert "tolerance 0.104 (no noise floor)" in out.splitlines()[-1]


def test_padded_batches_group_the_drawn_samples_in_reading_order_under_the_token_cap():
    from dflash_prep.commands.verify.noise import NOISE_FLOOR_BATCH_TOKENS, PaddedBatches

    def groups(lengths):
        samples = [(f"s{i}", torch.zeros(n, dtype=torch.int64)) for i, n in enumerate(lengths)]
        batches = PaddedBatches(None, samples, [1], "none", torch.device("cpu"))
        return [[int(sid[1:]) for sid, _ in group] for group in batches.groups]

    assert NOISE_FLOOR_BATCH_TOKENS == 8192
    assert groups([100] * 8) == [list(range(8))]  # 800 padded tokens: one batch
    # cap max(8192, 2 x 5000): [5000, 3000] (10000), then 3000, 100, 100 (9000); reading order kept
    assert groups([5000, 3000, 3000, 100, 100]) == [[0, 1], [2, 3, 4]]
    # 4000 x 3 = 12000 > 8192: the lone last sample joins the previous batch's last one
    assert groups([1000, 1000, 1000, 4000]) == [[0, 1], [2, 3]]
    assert groups([50]) == [[0]]


def test_a_padded_batch_out_of_memory_gives_no_noise_floor_in_one_process(output, monkeypatch):
    """One process: the samples of a padded batch that ran out of memory are judged on the tolerance alone."""
    import dflash_prep.commands.verify.noise as noise_module

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(noise_module, "run_padded_batch", out_of_memory)
    lines = []
    report = verify(output, num_samples=3, check_shards=False, log=lines.append)
    assert report.ok and report.noise == [] and all(r.allowed == report.tolerance for r in report.results)
    assert any(line.startswith("verify: out of memory in the padded batch of 3 sample(s)") for line in lines)
    assert "padded-batch" not in format_report(report)


def _lone_padded_vs_alone_by_layer(out: Path, sample_id: str) -> dict[str, float]:
    """Relative error per layer of one sample's states in a right-padded batch of two rows (the sample; its own
    tokens repeated to T + max(1, T // 4), the documented filler) vs run alone: plain transformers."""
    import io

    import numpy as np
    from conftest import raw_records

    from dflash_prep.recipe.schema import load_recipe
    from dflash_prep.target.model import load_config, load_model

    manifest = json.loads((out / "manifest.json").read_text())
    recipe = load_recipe(out / "recipe.resolved.yaml")
    decoder = load_model(recipe.model, load_config(recipe.model), torch.device("cpu")).model
    x = torch.from_numpy(np.load(io.BytesIO(raw_records(out)[sample_id]["input_ids.npy"])).astype(np.int64))
    T = len(x)
    filler = torch.cat([x, x])[:T + max(1, T // 4)]
    batch, mask = torch.zeros(2, len(filler), dtype=torch.int64), torch.zeros(2, len(filler), dtype=torch.int64)
    batch[0, :T], mask[0, :T], batch[1], mask[1] = x, 1, filler, 1
    names = {str(i): i + 1 for i in manifest["layer_ids"]} | {"final (after_norm)": -1}
    with torch.inference_mode():
        padded = decoder(input_ids=batch, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states
        alone = decoder(input_ids=x[None], use_cache=False, output_hidden_states=True).hidden_states
    return {name: float((padded[k][0, :T].float() - alone[k][0].float()).abs().max() / alone[k][0].float().abs().max())
            for name, k in names.items()}


def test_a_lone_drawn_sample_measures_its_noise_in_a_batch_of_two(bf16_output, monkeypatch):
    """--num-samples 1 (or an output of one sample): a padded batch of that sample alone is its run alone, whose
    noise is 0 by construction; a filler row makes it a real padded batch (the real forward is watched: two rows,
    the second longer), and the floor is what plain transformers gives for the sample in that batch. Whether that
    batch rounds differently from the run alone depends on the CPU's bf16 kernels: seed 0's sample did (> 1e-4) on
    the machines this test first ran on, and gave exactly the run alone's states (0 on every layer) on a Xeon with
    AMX bf16 tiles; the equality holds either way."""
    import dflash_prep.commands.verify.noise as noise

    batches = []
    real = noise.run_padded_batch

    def watched(model, rows, *args, **kwargs):
        batches.append([int(r.shape[0]) for r in rows])
        return real(model, rows, *args, **kwargs)

    monkeypatch.setattr(noise, "run_padded_batch", watched)
    report = verify(bf16_output, num_samples=1, seed=0, check_shards=False, log=_quiet)
    (sample_id,) = report.sample_ids
    ((T, filler),) = batches
    assert filler == T + max(1, T // 4), batches
    expected = _lone_padded_vs_alone_by_layer(bf16_output, sample_id)
    floors = report.noise_floor_by_layer()
    assert {layer: f["relative_error"] for layer, f in floors.items()} == pytest.approx(expected, rel=1e-3, abs=1e-9)
    assert all(f["num_samples"] == 1 for f in floors.values()) and report.ok


def test_a_tolerance_that_is_negative_nan_or_infinite_is_refused(output, capsys):
    """-0.1 or nan would fail every layer of a correct output, inf would pass any: bad input, exit code 2, one
    line, before the model loads."""
    for value in ("-0.1", "nan", "inf"):
        assert main([str(output), "--num-samples", "1", "--skip-hash", "--tolerance", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --tolerance must be a finite number >= 0") and err.count("\n") == 1, err


def test_a_missing_shard_fails_naming_it_without_a_traceback(copy, capsys):
    """A shard file deleted after the extraction: with or without --skip-hash, exit code 1 naming the shard (its
    drawn samples cannot be read), with the noise floor on or off; the other shards' samples are still checked."""
    manifest = json.loads((copy / "manifest.json").read_text())
    missing = manifest["shards"][0]["path"]
    (copy / missing).unlink()
    for extra in (["--skip-hash"], ["--skip-hash", "--no-noise-floor"], []):
        assert main([str(copy), "--num-samples", str(NUM_ROWS), *extra]) == 1
        out = capsys.readouterr().out
        assert f"FAIL {missing}: its drawn samples cannot be read" in out, out
        assert "verify: FAILED" in out.splitlines()[-1]
    report = verify(copy, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
    checked = {r.sample_id for r in report.results}
    assert len(checked) == NUM_ROWS - manifest["shards"][0]["num_samples"] and report.failures == []


def test_json_stays_strict_when_a_stored_value_is_not_finite(copy, capsys):
    """A stored Inf and NaN (hash updated): exit code 1 naming both layers, and `--json` is strict JSON (no NaN /
    Infinity literals, which other parsers reject): their errors are null, their verdicts "fail"."""
    sample_id = "0000000004"

    def not_finite(states):
        states[3, 5] = float("inf")
        states[4, states.shape[1] - 1] = float("nan")

    _rewrite_states(copy, sample_id, not_finite)
    assert main([str(copy), "--num-samples", str(NUM_ROWS), "--skip-hash", "--json"]) == 1

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    data = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert [(f["sample_id"], f["layer"], f["relative_error"], f["verdict"]) for f in data["failures"]] == [
        (sample_id, "1", None, "fail"), (sample_id, "5", None, "fail")]  # column 5 of layer 1, the last of 5
    assert data["worst_by_layer"]["1"]["relative_error"] is None and not data["ok"]


def test_a_device_that_cannot_run_here_is_refused_in_one_line(output, capsys):
    """`--device bogus` (not a torch device) was a RuntimeError traceback; `--device cuda` on a machine without
    CUDA is refused the same way: exit code 2, one line naming the flag."""
    cases = ["bogus"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in cases:
        assert main([str(output), "--num-samples", "1", "--skip-hash", "--device", device]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --device {device}: ") and err.count("\n") == 1, err


def _rewrite_first_sample(out: Path, empty: bool, token_id: int = 0) -> str:
    """Cut the first sample of the first shard to 0 tokens (input_ids, loss_mask and states) when `empty`, else set
    its input id 5 to `token_id`; the tar rewritten, the manifest's size and sha256 updated. Returns its id."""
    import io

    import numpy as np
    from safetensors.torch import load, save

    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["shards"][0]
    path = out / entry["path"]
    with tarfile.open(path, "r:") as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    key = members[0][0].name.split(".")[0]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            if member.name.startswith(f"{key}.") and member.name.endswith(".npy"):
                array, data = np.load(io.BytesIO(data)), io.BytesIO()
                if not empty and member.name.endswith("input_ids.npy"):
                    array[5] = token_id
                np.save(data, array[:0] if empty else array)
                data = data.getvalue()
            elif empty and member.name.startswith(f"{key}.") and member.name.endswith(".safetensors"):
                data = save({k: v[:0].contiguous() for k, v in load(data).items()})
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    entry["sha256"], entry["num_bytes"] = _sha256(path), path.stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return key


def test_a_sample_of_no_token_fails_naming_it_without_a_traceback(copy, capsys):
    """A forward of 0 tokens raised inside transformers (a traceback); now the sample is a named integrity problem
    and the other drawn samples are still checked."""
    sample_id = _rewrite_first_sample(copy, empty=True)
    assert main([str(copy), "--num-samples", str(NUM_ROWS), "--skip-hash"]) == 1
    out = capsys.readouterr().out
    assert f"sample {sample_id} holds no token" in out and "not found in the shards" not in out, out
    report = verify(copy, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
    assert {r.sample_id for r in report.results} == set(report.sample_ids) - {sample_id} and not report.failures
    assert len(report.integrity_problems) == 1 and not report.ok


def test_a_token_id_outside_the_vocabulary_fails_naming_it_without_a_traceback(copy, capsys):
    """A stored input id >= the model's vocab_size (1024 for the demo model; set here to 10**6) made the embedding
    raise IndexError; now the sample is a named integrity problem and the other drawn samples are still checked."""
    sample_id = _rewrite_first_sample(copy, empty=False, token_id=10 ** 6)
    assert main([str(copy), "--num-samples", str(NUM_ROWS), "--skip-hash"]) == 1
    out = capsys.readouterr().out
    assert f"sample {sample_id} holds token id 1000000, outside the model's vocabulary of 1024" in out, out
    report = verify(copy, num_samples=NUM_ROWS, check_shards=False, log=_quiet)
    assert {r.sample_id for r in report.results} == set(report.sample_ids) - {sample_id} and not report.failures
    assert {n.sample_id for n in report.noise} == set(report.sample_ids) - {sample_id}


def test_a_floor_that_is_not_finite_is_called_so_not_above_the_cap():
    """A NaN padded-batch reference (its floor) makes a layer above the tolerance inconclusive; the report said
    'above 0.5' of a NaN."""
    text = format_report(_report({"5": float("nan")}, {"5": 0.2}))
    assert "(noise not finite: not used)" in text and "above 0.5" not in text, text
    fail = next(line for line in text.splitlines() if line.startswith("FAIL"))
    assert fail.endswith("rounding noise at this depth is nan (padded batch vs alone, not finite: not used)"), fail


def test_a_folder_that_does_not_exist_is_named_as_such(tmp_path, capsys):
    """A mistyped output folder: one line saying there is no such folder (it read "the extraction has not
    finished", which sends a user to re-run an extraction), exit code 2."""
    assert main([str(tmp_path / "no-such-output")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: cannot verify: {tmp_path / 'no-such-output'}: no such folder"

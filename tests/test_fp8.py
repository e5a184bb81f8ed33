"""fp8 storage (`output.dtype: fp8_e4m3`): the per-token e4m3 round trip stays within its bound, the files are
about half of bf16, readers get bf16 back (or the raw bytes + scales), inspect/verify accept it, and the
speculators export writes its fp8 layout (one scale per token) within the stated re-quantization bound.

Three small extractions of the same recipe (float32, bfloat16 and fp8 storage, final layer before the norm) are
shared by the module: the float32 one is the truth the fp8 one is compared with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_prep.consume.reader import ShardDataset
from dflash_prep.target import fp8

BASE = ["data.max_samples=16", "data.max_length=256", "batching.max_tokens_per_batch=2048", "batching.num_workers=0",
        "layers.capture_final=before_norm", "output.max_shard_bytes=256KB"]
A, B = 2.0 ** -4, 2.0 ** -10  # e4m3: relative rounding of normal values, absolute (in units of the scale) below


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element bound of one e4m3 round trip (+ fp32 rounding slack)."""
    return A * x.abs() + B * scale + 1e-6 * x.abs() + 1e-30


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    from dflash_prep.commands.extract import run_extraction
    from dflash_prep.recipe.schema import load_recipe

    root = tmp_path_factory.mktemp("fp8")
    outs = {}
    for dtype in ("float32", "bfloat16", "fp8_e4m3"):
        outs[dtype] = root / dtype
        run_extraction(load_recipe(None, [f"output.dir={outs[dtype]}", f"output.dtype={dtype}", *BASE]))
    return outs


def _by_id(out: Path, **kw) -> dict[str, dict]:
    return {s["sample_id"]: s for s in ShardDataset(out, **kw)}


def test_quantize_rows_bound_and_edge_cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-6, 4, 64)[:, None]  # ten decades of row magnitudes
    x[3] = 0.0  # an all-zero row
    x[5, :500] = 1e-9  # a row whose small values fall below e4m3's normal range
    x[7, 0] = 1e4
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64,)
    back = fp8.dequantize(q, s[:, None])
    assert (back - x).abs().le(_bound(x, s[:, None])).all()
    assert (back - x).abs().max(dim=1).values.div(x.abs().amax(dim=1).clamp(min=1e-30)).max() <= fp8.FP8_REL_BOUND
    assert torch.equal(back[3], torch.zeros(512)) and s[3] == fp8.MIN_SCALE
    assert (q.float().abs().amax(dim=1)[torch.arange(64) != 3] == 448).all()  # each row's amax maps to 448
    # A non-finite row gets a non-finite scale (finite_rows finds it in a packed buffer).
    packed = torch.empty(2, fp8.packed_width(1, 4), dtype=torch.uint8)
    fp8.store_block(packed, 0, 1, torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, float("nan"), 0.0, 0.0]]))
    assert fp8.finite_rows(packed, 1).tolist() == [True, False]
    q2, s2 = fp8.unpack_rows(packed, 1)
    assert s2[0, 0] == pytest.approx(4 / 448, rel=1e-6)
    assert q2[0].float().tolist() == [112, 224, 320, 448]  # 3 * 448 / 4 = 336 is a tie between 320 and 352: even


def test_fp8_round_trip_is_within_the_e4m3_bound_per_token(outputs):
    truth = _by_id(outputs["float32"])
    raw = _by_id(outputs["fp8_e4m3"], fp8="raw")
    bf16 = _by_id(outputs["fp8_e4m3"])  # the default: dequantized to bf16
    m = json.loads((outputs["fp8_e4m3"] / "manifest.json").read_text())
    k, H = len(m["layer_ids"]), m["hidden_size"]
    assert m["dtype"] == "fp8_e4m3" and set(raw) == set(truth) and len(raw) == 16
    worst = 0.0
    for sid, r in raw.items():
        T = r["input_ids"].shape[0]
        assert r["hidden_states"].dtype == torch.float8_e4m3fn and r["hidden_states"].shape == (T, k * H)
        assert r["hidden_states_scales"].dtype == torch.float32 and r["hidden_states_scales"].shape == (T, k)
        assert r["final_hidden_states"].shape == (T, H) and r["final_hidden_states_scales"].shape == (T, 1)
        for name, blocks in (("hidden_states", k), ("final_hidden_states", 1)):
            x = truth[sid][name].view(T, blocks, H)
            s = r[f"{name}_scales"]
            back = fp8.dequantize(r[name], s).view(T, blocks, H)
            assert (back - x).abs().le(_bound(x, s[:, :, None])).all(), (sid, name)
            # The scale is the token's amax / 448 (per layer), from the states the float32 run stored.
            assert torch.allclose(s, x.abs().amax(dim=2) / 448, rtol=1e-6)
            worst = max(worst, float(((back - x).abs().amax(dim=2) / x.abs().amax(dim=2)).max()))
            # The default reader gives bf16: the same product, rounded once to bf16.
            assert bf16[sid][name].dtype == torch.bfloat16
            assert torch.equal(bf16[sid][name], back.view(T, -1).to(torch.bfloat16))
    assert 2.0 ** -8 < worst <= fp8.FP8_REL_BOUND  # fp8 error is real (above bf16's) and within e4m3's bound


def test_fp8_is_about_half_the_bytes_of_bf16(outputs):
    from dflash_prep.store.sizes import RecordSizer

    size = {d: json.loads((o / "manifest.json").read_text())["num_bytes"] for d, o in outputs.items()}
    assert 0.5 < size["fp8_e4m3"] / size["bfloat16"] < 0.6, size  # H=64: the scales and headers weigh a little
    assert size["bfloat16"] / size["float32"] < 0.55
    # At the 27B's shape (5 layers of 5120) the states alone are 0.5004x bf16.
    sizer = RecordSizer.__new__(RecordSizer)
    sizer.k, sizer.H, sizer.has_final = 5, 5120, False
    ratio = sizer.states_bytes_per_token("fp8_e4m3") / sizer.states_bytes_per_token("bfloat16")
    assert ratio == pytest.approx((5 * 5120 + 20) / (5 * 5120 * 2))


def test_plan_bytes_equal_the_fp8_and_float32_outputs(outputs):
    from dflash_prep.commands.plan import make_run_plan
    from dflash_prep.recipe.schema import load_recipe

    plan = make_run_plan(load_recipe(None, [f"output.dir={outputs['float32']}", *BASE]), tokens_per_second=1.0)
    for dtype, out in outputs.items():
        assert plan["disk"][dtype]["num_bytes"] == json.loads((out / "manifest.json").read_text())["num_bytes"]


def test_inspect_check_and_verify_accept_fp8(outputs, capsys):
    from dflash_prep.commands.inspect import check_output, describe
    from dflash_prep.commands.verify import verify

    out = outputs["fp8_e4m3"]
    assert check_output(out) == []
    m = json.loads((out / "manifest.json").read_text())
    k, H = len(m["layer_ids"]), m["hidden_size"]
    assert describe(out)["bytes_per_token"] == (k + 1) * H + 4 * (k + 1)
    report = verify(out, num_samples=3, seed=1, log=lambda *a: None)
    assert report.ok and report.tolerance == pytest.approx(fp8.FP8_REL_BOUND + 1e-3)
    worst = max(r.relative_error for r in report.results)
    assert 2.0 ** -8 < worst <= fp8.FP8_REL_BOUND + 1e-5, worst
    # Under the bf16 tolerance the same fp8 output would not pass: the fp8 tolerance is what lets it.
    assert not verify(out, num_samples=3, seed=1, tolerance=2.0 ** -8 + 1e-3, check_shards=False,
                      log=lambda *a: None).ok


def test_speculators_export_writes_its_fp8_layout(outputs, tmp_path):
    from dflash_prep.consume.export import ExportError, check_exportable, export

    src = outputs["fp8_e4m3"]
    m = json.loads((src / "manifest.json").read_text())
    k, H = len(m["layer_ids"]), m["hidden_size"]
    with pytest.raises(ExportError, match="--cast-to-bfloat16"):
        check_exportable(m, "specforge")
    check_exportable(m, "speculators", hidden_states_backend="fp8")  # its own fp8 layout: no cast needed
    export(src, "speculators", tmp_path / "spec", progress=False, hidden_states_backend="fp8")
    info = json.loads((tmp_path / "spec" / "dflash_prep_export.json").read_text())
    assert info["hidden_states_dtype"].startswith("float8_e4m3fn")
    truth = _by_id(outputs["float32"])
    raw = _by_id(src, fp8="raw")
    for i, sid in enumerate(info["sample_ids"]):
        f = load_file(str(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors"))
        T = truth[sid]["input_ids"].shape[0]
        assert f["hidden_states"].dtype == torch.float8_e4m3fn and f["hidden_states"].shape == (T, k + 1, H)
        assert f["hidden_states_scales"].dtype == torch.float32 and f["hidden_states_scales"].shape == (T, 1, 1)
        assert torch.equal(f["token_ids"], truth[sid]["input_ids"])
        got = f["hidden_states"].float() * f["hidden_states_scales"]  # speculators' dequantization
        x = torch.cat([truth[sid]["hidden_states"].view(T, k, H), truth[sid]["final_hidden_states"].view(T, 1, H)], 1)
        S = f["hidden_states_scales"]
        assert (got - x).abs().le(fp8.requantize_error_bound(x.abs(), S) + 1e-6 * x.abs()).all(), sid
        # One scale per token = the largest of the stored per-layer scales; that layer is copied exactly.
        stored_s = torch.cat([raw[sid]["hidden_states_scales"], raw[sid]["final_hidden_states_scales"]], 1)
        assert torch.allclose(S.view(T), stored_s.amax(dim=1), rtol=1e-6)
        top = stored_s.argmax(dim=1)
        stored = torch.cat([fp8.dequantize(raw[sid]["hidden_states"], raw[sid]["hidden_states_scales"]).view(T, k, H),
                            fp8.dequantize(raw[sid]["final_hidden_states"],
                                           raw[sid]["final_hidden_states_scales"]).view(T, 1, H)], 1)
        rows = torch.arange(T)
        assert torch.allclose(got[rows, top], stored[rows, top], rtol=1e-6, atol=0)
    # --cast-to-bfloat16 gives speculators' bf16 layout instead.
    export(src, "speculators", tmp_path / "spec-bf16", progress=False, cast_to_bfloat16=True)
    f = load_file(str(tmp_path / "spec-bf16" / "hidden_states" / "hs_0.safetensors"))
    assert f["hidden_states"].dtype == torch.bfloat16 and "hidden_states_scales" not in f


def test_capture_quantizes_on_the_device_side_buffer():
    """LayerCapture in fp8 mode: packed uint8 rows whose dequantized values match a float32 capture."""
    import numpy as np
    from conftest import build, tiny_llama_config

    from dflash_prep.plan.batches import SampleInfo, collate
    from dflash_prep.target.capture import LayerCapture

    model = build(tiny_llama_config())
    g = np.random.default_rng(0)
    samples = [SampleInfo(f"{i:010d}", i, None, g.integers(1, 1000, n).astype(np.int32), np.ones(n, np.uint8))
               for i, n in enumerate([7, 19, 12])]
    batch = collate(samples, 32, 0)
    tensors = {k: getattr(batch, k) for k in ("input_ids", "attention_mask", "position_ids", "flat_index")}
    with LayerCapture(model, [1, 3], capture_final="after_norm", storage_dtype=torch.float32) as cap:
        ref = cap.run(**tensors)
    with LayerCapture(model, [1, 3], capture_final="after_norm", storage_dtype=torch.float8_e4m3fn) as cap:
        got = cap.run(**tensors)
    N, H = 38, 64
    assert got.hidden_states_NK.dtype == torch.uint8 and got.hidden_states_NK.shape == (N, 2 * H + 8)
    assert got.final_hidden_states_NH.shape == (N, H + 4)
    q, s = fp8.unpack_rows(got.hidden_states_NK, 2)
    back = fp8.dequantize(q, s).view(N, 2, H)
    x = ref.hidden_states_NK.view(N, 2, H)
    assert (back - x).abs().le(_bound(x, s[:, :, None])).all()
    qf, sf = fp8.unpack_rows(got.final_hidden_states_NH, 1)
    assert (fp8.dequantize(qf, sf) - ref.final_hidden_states_NH).abs().le(
        _bound(ref.final_hidden_states_NH, sf)).all()


def test_fp8_goes_to_speculators_only_with_its_dequantizing_reader(outputs, tmp_path, capsys):
    """speculators' default reader returns the raw e4m3 codes (up to 448) without the scales: an fp8 export is
    refused unless `--hidden-states-backend fp8` (its reader that dequantizes) is passed, and that flag is written
    into the trainer config."""
    from dflash_prep.consume.export import main

    src = outputs["fp8_e4m3"]
    dest = tmp_path / "spec"
    assert main([str(src), "--to", "speculators", "--dest", str(dest), "--no-progress"]) == 2
    assert "--hidden-states-backend fp8" in capsys.readouterr().err and not dest.exists()
    assert main([str(src), "--to", "speculators", "--dest", str(dest), "--no-progress",
                 "--hidden-states-backend", "fp8"]) == 0
    info = json.loads((dest / "dflash_prep_export.json").read_text())
    assert info["trainer_config"]["--hidden-states-backend"] == "fp8"
    f = load_file(str(dest / "hidden_states" / "hs_0.safetensors"))
    assert f["hidden_states"].dtype == torch.float8_e4m3fn and "hidden_states_scales" in f
    assert main([str(src), "--to", "specforge", "--dest", str(tmp_path / "sf"), "--no-progress",
                 "--hidden-states-backend", "fp8", "--cast-to-bfloat16"]) == 2  # a speculators-only flag

"""`dflash-prep plan`: its figures are the extraction's (samples, skips, tokens, batches, shapes, padding, bytes,
shards), its byte model matches the libraries, the tokens/s default is the benchmark's headline, and the CLI.

One small extraction of the demo recipe (rows skipped for length, several shards) is shared by the module.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import save as safetensors_save

from dflash_prep.commands.bench_figures import bench_references
from dflash_prep.commands.plan import format_plan, length_histogram, main, make_run_plan, shard_sizes
from dflash_prep.recipe.schema import load_recipe
from dflash_prep.store.sizes import safetensors_num_bytes, states_tensors

BASE = ["data.max_samples=60", "data.max_length=384", "data.overlong=skip", "batching.max_tokens_per_batch=2048",
        "batching.num_workers=0", "output.max_shard_bytes=1MB"]


@pytest.fixture(scope="module")
def planned_and_run(tmp_path_factory):
    """(plan, manifest, summary) of the same recipe: planned first, then extracted."""
    from dflash_prep.commands.extract import run_extraction

    out = tmp_path_factory.mktemp("plan") / "out"
    recipe = load_recipe(None, [f"output.dir={out}", *BASE])
    plan = make_run_plan(recipe, tokens_per_second=1000.0)
    summary = run_extraction(recipe)
    manifest = json.loads((out / "manifest.json").read_text())
    return plan, manifest, {**summary, "out_dir": out}


def test_plan_figures_equal_what_the_extraction_reports(planned_and_run):
    plan, manifest, summary = planned_and_run
    assert plan["num_rows"] == manifest["num_rows"] == 60
    assert plan["skipped"] == manifest["skipped"] and plan["skipped"].get("longer_than_max_length", 0) > 0
    assert plan["num_skipped"] == manifest["num_skipped"]
    assert plan["num_samples"] == manifest["num_samples"] == summary["num_samples_written"]
    assert plan["num_tokens"] == manifest["num_tokens"] == summary["num_tokens_written"]
    assert plan["num_batches"] == summary["num_batches"] >= 3
    assert plan["num_shapes"] == summary["num_shapes_planned"]
    assert plan["padding_efficiency"] == pytest.approx(summary["padding_efficiency"], rel=1e-12)
    assert plan["layer_ids"] == manifest["layer_ids"] and plan["hidden_size"] == manifest["hidden_size"]
    # Bytes: the issue asks for 1%; the byte model is exact for a run with the same number of processes.
    assert abs(plan["num_bytes"] - manifest["num_bytes"]) <= 0.01 * manifest["num_bytes"]
    assert plan["num_bytes"] == manifest["num_bytes"]
    assert plan["disk"]["bfloat16"]["num_shards"] == len(manifest["shards"]) >= 3


def test_bytes_per_dtype_scale_with_the_element_size(planned_and_run):
    plan, manifest, _ = planned_and_run
    d = plan["disk"]
    k, H = len(manifest["layer_ids"]), manifest["hidden_size"]
    assert d["bfloat16"]["states_bytes_per_token"] == k * H * 2 == d["float16"]["states_bytes_per_token"]
    assert d["float32"]["states_bytes_per_token"] == k * H * 4
    assert d["fp8_e4m3"]["states_bytes_per_token"] == k * H + 4 * k
    assert d["bfloat16"]["num_bytes"] == d["float16"]["num_bytes"]
    assert d["fp8_e4m3"]["num_bytes"] < 0.6 * d["bfloat16"]["num_bytes"] < d["float32"]["num_bytes"] / 3


def test_wall_time_is_the_busiest_rank_at_the_given_rate(planned_and_run):
    plan, _, _ = planned_and_run
    wall = plan["wall"]
    assert plan["throughput"]["tokens_per_second"] == 1000.0 and wall["num_gpus"] == 1
    assert wall["seconds"] == pytest.approx(plan["num_tokens"] / 1000.0) and wall["warmup_seconds"] == 0


def test_two_gpus_split_the_tokens(planned_and_run):
    plan1, _, _ = planned_and_run
    recipe = load_recipe(None, ["output.dir=/nonexistent/never-written", *BASE])
    plan2 = make_run_plan(recipe, num_gpus=2, tokens_per_second=1000.0)
    ranks = plan2["ranks"]
    assert len(ranks) == 2 and sum(r["num_real_tokens"] for r in ranks) == plan1["num_tokens"]
    assert sum(r["num_batches"] for r in ranks) == plan1["num_batches"]
    assert plan2["wall"]["seconds"] == pytest.approx(max(r["num_real_tokens"] for r in ranks) / 1000.0)
    assert plan2["wall"]["seconds"] < plan1["wall"]["seconds"]
    # Two ranks each close their own last shard: a shard's worth of records can only move between files.
    assert abs(plan2["num_bytes"] - plan1["num_bytes"]) <= 2 * 10240 * len(ranks)


def test_replicas_of_several_gpus_split_the_plan_and_set_the_rate(planned_and_run):
    """model.gpus_per_replica 4: --num-gpus 4 is one tensor-parallel replica (the demo's Qwen3.5 has a plan), 4
    GPUs computing; --num-gpus 8 is 2 replicas (a layer split, one GPU computing each) sharing the plan as 2 GPUs
    of 1 would; GPU-hours count every GPU of a replica."""
    plan1, _, _ = planned_and_run
    base = ["output.dir=/nonexistent/never-written", *BASE, "model.gpus_per_replica=4"]
    tp = make_run_plan(load_recipe(None, base), num_gpus=4, tokens_per_second=1000.0, gpu=True)
    split = make_run_plan(load_recipe(None, base), num_gpus=8, tokens_per_second=1000.0, gpu=True)
    two = make_run_plan(load_recipe(None, ["output.dir=/nonexistent/never-written", *BASE]), num_gpus=2,
                        tokens_per_second=1000.0, gpu=True)
    assert tp["replicas"] == {"gpus_per_replica": 4, "num_replicas": 1, "parallelism": "tensor_parallel",
                              "computing_gpus": 4, "tokens_per_second_per_replica": 4000.0}
    assert split["replicas"] == {"gpus_per_replica": 4, "num_replicas": 2, "parallelism": "layer_split",
                                 "computing_gpus": 1, "tokens_per_second_per_replica": 1000.0}
    assert split["ranks"] == two["ranks"] and len(split["ranks"]) == 2 and len(tp["ranks"]) == 1
    assert tp["wall"]["seconds"] == pytest.approx(plan1["num_tokens"] / 4000.0)
    assert split["wall"]["seconds"] == pytest.approx(max(r["num_real_tokens"] for r in two["ranks"]) / 1000.0)
    assert split["wall"]["gpu_hours"] == pytest.approx(plan1["num_tokens"] / 1000.0 * 4 / 3600)
    assert "on 4 GPU(s) as 1 replica(s) of 4 GPUs (tensor_parallel: 4 x one GPU's rate" in format_plan(tp)
    assert "on 8 GPU(s) as 2 replica(s) of 4 GPUs (layer_split: one GPU computes at a time" in format_plan(split)
    with pytest.raises(ValueError, match=r"--num-gpus 6 does not divide into replicas of model.gpus_per_replica = 4"):
        make_run_plan(load_recipe(None, base), num_gpus=6, tokens_per_second=1000.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8_e4m3"])
@pytest.mark.parametrize("T,final", [(2, False), (9, True), (10, False), (1000, True)])
def test_safetensors_size_model_matches_the_library(dtype, T, final):
    k, H = 3, 64
    real = {}
    for name, code, shape in states_tensors(T, k, H, dtype, final):
        torch_dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}[code]
        real[name] = torch.zeros(shape, dtype=torch.float32).to(torch_dtype)
    assert safetensors_num_bytes(states_tensors(T, k, H, dtype, final)) == len(safetensors_save(real))


def test_shard_roll_replays_the_writer_lanes():
    # One lane: a shard closes after the batch that brings it to >= 9,000 bytes; + 1,024 end blocks, padded to
    # whole 10,240-byte records.
    assert shard_sizes([[6000], [3000], [6000], [3000]], 9000) == [10240, 10240]
    # Two lanes: batches 0 and 2 (12,000 bytes) in lane 0, batches 1 and 3 (6,000 bytes) in lane 1.
    assert shard_sizes([[6000], [3000], [6000], [3000]], 9000, num_lanes=2) == [20480, 10240]
    assert shard_sizes([[10240], [1024]], 1) == [20480, 10240]
    assert shard_sizes([[100]], 1, num_lanes=4) == [10240]  # lanes that got no batch write no shard


def test_length_histogram_counts_every_sample():
    lengths = [16, 17, 31, 32, 100, 2048, 2048]
    text = length_histogram(lengths, max_length=2048)
    rows = [line for line in text.splitlines() if re.match(r"\s*\d+-\d+\s", line)]
    counts = {line.split()[0]: int(line.split()[-3].replace(",", "")) for line in rows}
    assert counts == {"16-31": 3, "32-63": 1, "64-127": 1, "128-255": 0, "256-511": 0, "512-1023": 0,
                      "1024-2047": 0, "2048-4095": 2}
    assert "max 2,048" in text and "2 at data.max_length=2,048" in text


def _results_md_headlines() -> dict[str, int]:
    """The bold warm dflash-prep figures of bench/RESULTS.md, by section (27B first, then 8B)."""
    text = (REPO / "bench" / "RESULTS.md").read_text()
    found = re.findall(r"^\| real tokens/s, warm \|.*\*\*([\d,]+)\*\* \|$", text, flags=re.M)
    assert len(found) == 2, found
    return {"qwen3.6-27b": int(found[0].replace(",", "")), "llama3.1-8b": int(found[1].replace(",", ""))}


def test_default_tokens_per_second_is_the_benchmark_headline():
    """The headline is the default's figure on GPUs (`batching.packing: auto` packs there); padded batches keep
    their own figures (CPU planning, `batching.packing: false`)."""
    newest_first = sorted(bench_references(packed=True), key=lambda r: r["timestamp"])
    refs = {r["model"]: r for r in newest_first if r["compute_dtype"] == "bfloat16"}  # the newest of each model
    headline = _results_md_headlines()
    assert headline == {"qwen3.6-27b": 11415, "llama3.1-8b": 42049}
    for model, figure in headline.items():
        assert round(refs[model]["tokens_per_second"]) == figure
    padded = {r["model"]: round(r["tokens_per_second"]) for r in sorted(bench_references(packed=False),
                                                                         key=lambda r: r["timestamp"])
              if r["compute_dtype"] == "bfloat16"}
    assert padded == {"qwen3.6-27b": 9130, "llama3.1-8b": 41677, "qwen3.6-35b-a3b": 30456}


@pytest.mark.parametrize("config,layers,expected", [
    ("qwen3.6-27b.json", ["layers.preset=dflash", "layers.num_layers=5"], 9130),
    ("llama3.1-8b.json", ["layers.preset=eagle3"], 41677),
])
def test_plan_of_a_benchmarked_model_uses_its_figure(config, layers, expected, tmp_path):
    """The benchmark's own shapes (same layers run): the headline figure itself, and the wall time from it."""
    recipe = load_recipe(None, [f"output.dir={tmp_path}", "data.max_samples=20", f"model.config={REPO}/bench/configs/"
                                f"{config}", "model.dtype=bfloat16", *layers])
    padded = load_recipe(None, [f"output.dir={tmp_path}", "data.max_samples=20", f"model.config={REPO}/bench/configs/"
                                f"{config}", "model.dtype=bfloat16", *layers, "batching.packing=false"])
    # planned for the CPU (this machine): no figure, the benchmark's are of GPUs
    cpu = make_run_plan(recipe, num_gpus=1)
    assert cpu["device"]["type"] == "cpu" and cpu["throughput"]["tokens_per_second"] is None and cpu["wall"] is None
    assert "a CPU run: the benchmark's figures are of GPUs" in format_plan(cpu)
    plan = make_run_plan(padded, num_gpus=1, gpu=True)  # padded batches on a GPU: the padded runs' figure
    t = plan["throughput"]
    assert t["source"] == "same model" and round(t["tokens_per_second"]) == expected
    assert t["scaled_by_decoder_params"] == pytest.approx(1.0)
    w = plan["wall"]
    assert w["compute_seconds"] == pytest.approx(plan["num_tokens"] / t["tokens_per_second"])
    # + the first pinned host buffers: the reference's cold copies beyond its warm ones, read from its report
    modes = json.loads(Path(t["reference"]["file"]).read_text())["modes"]
    copies = [modes[m]["breakdown_seconds"]["copy_to_host_gpu"] for m in ("dflash_prep", "dflash_prep_warm")]
    assert w["warmup_seconds"] == pytest.approx(plan["ranks"][0]["num_shapes"] * t["seconds_per_new_shape"]
                                                + max(copies[0] - copies[1], 0))
    assert copies[0] > copies[1]
    # The same model capturing the final layer runs every decoder layer: fewer tokens/s, by the parameter ratio.
    more = make_run_plan(load_recipe(None, [f"output.dir={tmp_path}", "data.max_samples=20",
                                            f"model.config={REPO}/bench/configs/{config}", "model.dtype=bfloat16",
                                            *layers, "layers.capture_final=after_norm", "batching.packing=false"]),
                         num_gpus=1, gpu=True)
    assert more["decoder_params_run"] > plan["decoder_params_run"]
    assert more["throughput"]["tokens_per_second"] == pytest.approx(
        t["tokens_per_second"] * plan["decoder_params_run"] / more["decoder_params_run"])
    # Planned for GPUs (an H200's memory given): packed rows, so the packed runs' figure of the same model.
    gpu = make_run_plan(recipe, num_gpus=1, gpu_memory_bytes=141 * 10**9)
    assert gpu["packing"]["packed"] and gpu["throughput"]["source"] == "same model"
    packed_figure = {r["model"]: r["tokens_per_second"] for r in bench_references(packed=True)
                     if r["compute_dtype"] == "bfloat16"}[config.removesuffix(".json")]
    assert gpu["throughput"]["tokens_per_second"] == pytest.approx(packed_figure) and packed_figure != expected


def _report(model: str, model_type: str, hidden: int, layers: int, params: int, stamp: str, modes: dict) -> dict:
    return {"report_version": 1, "complete": True, "model": model, "timestamp": stamp,
            "settings": {"dtype": "bfloat16"}, "environment": {"gpu": "H200"},
            "model_info": {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
                           "decoder_params_needed": params}, "modes": modes}


def _warm(tok_s: float, kernels: list[str], overrides: list[str] | None = None) -> dict:
    return {"status": "ok", "tokens_per_second": tok_s, "padding_efficiency": 1.0, "variant_overrides": overrides,
            "summary": {"packing": {"packed": True}, "kernels": {"applied": kernels}}}


def test_plan_takes_the_same_models_run_with_its_kernels_and_else_a_model_of_its_kind(tmp_path):
    """References by hand: a Qwen3-8B-shaped report with an eager pass and a liger variant pass, a dense 8B of
    another family and an MoE whose active parameter count is nearer the planned model's than the dense one's."""
    from transformers import AutoConfig

    from dflash_prep.commands.plan import choose_reference

    liger = ["liger_rms_norm", "liger_swiglu", "liger_rope"]
    bench = tmp_path / "bench"
    bench.mkdir()
    reports = {
        "qwen3-8b-20270101-000000": _report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, "20270101-000000", {
            "dflash_prep_warm": _warm(30000.0, []),
            "dflash_prep_variant_warm": _warm(37000.0, liger, [f"model.kernels=[{','.join(liger)}]"])}),
        "other-20270101-000000": _report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, "20270102-000000", {
            "dflash_prep_variant_warm": _warm(99000.0, liger, ["batching.packing=false"])}),  # not a kernels-only A/B
        "llama-20270101-000000": _report("llama3.1-8b", "llama", 4096, 32, 6_300_000_000, "20270101-000000", {
            "dflash_prep_warm": _warm(41000.0, liger)}),
        "moe-20270101-000000": _report("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 6_600_000_000, "20270101-000000", {
            "dflash_prep_warm": _warm(39000.0, [])}),
    }
    for name, report in reports.items():
        (bench / f"{name}.json").write_text(json.dumps(report))
    refs = bench_references(bench, packed=True)
    assert sorted((r["model"], r["kernels"], r["tokens_per_second"]) for r in refs) == [
        ("llama3.1-8b", tuple(liger), 41000.0), ("qwen3-30b-a3b", (), 39000.0),
        ("qwen3-8b", (), 30000.0), ("qwen3-8b", tuple(liger), 37000.0)]
    qwen3 = AutoConfig.for_model("qwen3", hidden_size=4096, num_hidden_layers=36)
    ref, why = choose_reference(refs, qwen3, 6_500_000_000, "bfloat16", tuple(liger))
    assert why == "same model" and ref["tokens_per_second"] == 37000.0
    ref, why = choose_reference(refs, qwen3, 6_500_000_000, "bfloat16", ())
    assert why == "same model" and ref["tokens_per_second"] == 30000.0
    mistral = AutoConfig.for_model("mistral", hidden_size=4096, num_hidden_layers=32)  # dense, not benchmarked
    ref, why = choose_reference(refs, mistral, 6_600_000_000, "bfloat16", ())
    assert why == "nearest benchmarked model" and ref["model"] in ("qwen3-8b", "llama3.1-8b") and ref["kernels"] == ()
    hybrid_moe = AutoConfig.for_model("qwen3_5_moe_text")
    ref, why = choose_reference(refs, hybrid_moe, 6_600_000_000, "bfloat16", ())
    assert why.startswith("nearest benchmarked model of another kind (no moe hybrid model"), why
    assert ref["model"] == "qwen3-30b-a3b", "routed experts weigh more than the token mixer: the MoE, not a dense"
    # the size bound first: a model of the same kind 5x away gives way to one of another kind within 4x, and a
    # model whose kernels match gives way to a nearer one (the kernels break ties of size only)
    far_moe = {**next(r for r in refs if r["model"] == "qwen3-30b-a3b"), "decoder_params_needed": 33_000_000_000}
    others = [r for r in refs if r["model"] != "qwen3-30b-a3b"] + [far_moe]
    ref, why = choose_reference(others, AutoConfig.for_model("mixtral"), 6_600_000_000, "bfloat16", ())
    assert ref is not None and ref["model"] != "qwen3-30b-a3b" and "of another kind" in why, (ref, why)
    ref, why = choose_reference(refs, mistral, 20_000_000_000, "bfloat16", tuple(liger))
    assert ref is not None and why == "nearest benchmarked model", (ref, why)
    ref, why = choose_reference(refs, mistral, 60_000_000_000, "bfloat16", ())
    assert ref is None and "no benchmark within 4x" in why


def test_odd_benchmark_reports_are_left_out_or_read_for_what_they_say(tmp_path):
    """Reports written by hand or by another tool: fields of the wrong type leave the mode out (never a traceback
    from plan); unknown kernels are not taken for eager; a variant with no recorded overrides is not a kernels-only
    A/B; a report without a timestamp is the oldest; a model type transformers cannot build is of kind unknown."""
    from transformers import AutoConfig

    from dflash_prep.commands.plan import choose_reference

    bench = tmp_path / "bench"
    bench.mkdir()
    good = _report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, "20270101-000000", {
        "dflash_prep_warm": _warm(30000.0, [])})
    odd = {
        "no-time": {**_report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, None, {
            "dflash_prep_warm": _warm(1000.0, [])})},
        "bad-kernels": _report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, "20270103-000000", {
            "dflash_prep_warm": {**_warm(2000.0, []), "summary": {"packing": {"packed": True},
                                                                  "kernels": {"applied": 7}}},
            "dflash_prep_variant_warm": _warm(3000.0, [["x"]], [5])}),
        "no-overrides": _report("qwen3-8b", "qwen3", 4096, 36, 6_500_000_000, "20270104-000000", {
            "dflash_prep_variant_warm": _warm(4000.0, ["liger_rms_norm"], [])}),
        "strange-type": _report("strange", "gemma4_assistant", 4096, 36, 6_400_000_000, "20270105-000000", {
            "dflash_prep_warm": _warm(5000.0, []), "dflash_prep": [1]}),
        "not-a-mode": {**good, "modes": {"dflash_prep_warm": [1], "dflash_prep_variant_warm": "x"}},
    }
    (bench / "good-20270101-000000.json").write_text(json.dumps(good))
    for name, report in odd.items():
        (bench / f"{name}-20270101-000000.json").write_text(json.dumps(report))
    refs = bench_references(bench, packed=True)
    assert sorted(((r["model"], r["kernels"], r["tokens_per_second"]) for r in refs), key=repr) == [
        ("qwen3-8b", (), 30000.0), ("qwen3-8b", None, 2000.0), ("strange", (), 5000.0)], refs
    qwen3 = AutoConfig.for_model("qwen3", hidden_size=4096, num_hidden_layers=36)
    ref, why = choose_reference(refs, qwen3, 6_500_000_000, "bfloat16", ())
    assert why == "same model" and ref["tokens_per_second"] == 30000.0, "known eager kernels beat unknown ones"
    ref, why = choose_reference(refs, AutoConfig.for_model("mistral"), 6_400_000_000, "bfloat16", ())
    assert ref is not None and ref["model"] == "qwen3-8b", (ref, why)  # the odd type is of kind unknown


def test_a_moe_report_is_scaled_by_the_parameters_a_token_runs_through(tmp_path):
    """A benchmark report of the Qwen3-30B-A3B shape (bench/configs/qwen3-30b-a3b.json: 48 layers, hidden 2048,
    32 q / 4 kv heads of 128, 128 experts of width 768, 8 per token) planned again for the same layers: the same
    model's figure unscaled. Its per-token count (layers 0-45 for DFlash k=5: ids up to 45) is made by hand from the
    config; scaling by the weights the GPU holds (~11x more) would predict ~11x its tok/s."""
    H, heads, kv, D, E, k, I_e, layers = 2048, 32, 4, 128, 128, 8, 768, 46
    per_layer = H * heads * D + 2 * H * kv * D + heads * D * H + 2 * D + 2 * H + E * H + k * 3 * I_e * H
    held = per_layer + (E - k) * 3 * I_e * H
    report = {"report_version": 1, "complete": True, "model": "qwen3-30b-a3b", "timestamp": "20270101-000000",
              "settings": {"dtype": "bfloat16"}, "environment": {"gpu": "H200"},
              "model_info": {"model_type": "qwen3_moe", "hidden_size": H, "num_hidden_layers": 48,
                             "decoder_params_needed": layers * held, "decoder_params_active_needed": layers * per_layer},
              "modes": {"dflash_prep_warm": {"status": "ok", "tokens_per_second": 31360.0, "padding_efficiency": 1.0,
                                             "summary": {"packing": {"packed": True}}}}}
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "qwen3-30b-a3b-20270101-000000.json").write_text(json.dumps(report))
    recipe = load_recipe(None, [f"output.dir={tmp_path / 'out'}", "data.max_samples=20", "model.dtype=bfloat16",
                                f"model.config={REPO}/bench/configs/qwen3-30b-a3b.json", "layers.preset=dflash",
                                "layers.num_layers=5"])
    plan = make_run_plan(recipe, num_gpus=1, gpu_memory_bytes=141 * 10**9, bench_dir=tmp_path / "bench")
    t = plan["throughput"]
    assert plan["layer_ids"][-1] == layers - 1 and plan["decoder_params_run"] == layers * per_layer
    assert t["source"] == "same model" and t["scaled_by_decoder_params"] == pytest.approx(1.0)
    assert t["tokens_per_second"] == pytest.approx(31360.0)


def test_cli_prints_the_plan_and_its_json(capsys, planned_and_run):
    plan, _, _ = planned_and_run
    args = ["--set", "output.dir=/nonexistent/never-written"] + [a for kv in BASE for a in ("--set", kv)]
    assert main(args + ["--tokens-per-second", "1000", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("num_samples", "num_tokens", "num_batches", "num_shapes", "padding_efficiency", "num_bytes", "disk"):
        assert printed[key] == plan[key], key
    bytes_per_token = plan["disk"][plan["dtype"]]["bytes_per_token"]
    assert printed["wall"]["write_bytes_per_second_per_gpu"] == pytest.approx(1000 * bytes_per_token)
    from dflash_prep.commands.cli import main as cli_main

    assert cli_main(["plan", *args, "--num-gpus", "2", "--tokens-per-second", "500", "--gpu"]) == 0
    text = capsys.readouterr().out
    for expected in ("device      GPUs (--gpu)", "rows", "skipped (longer_than_max_length:", f"{plan['num_tokens']:,}",
                     "padding     efficiency", "fp8_e4m3", "500 real tok/s per GPU", "on 2 GPU(s)",
                     "length histogram", "p99"):
        assert expected in text, expected
    assert cli_main(["plan", *args, "--num-gpus", "2", "--tokens-per-second", "500", "--gpu", "--json"]) == 0
    on_gpus = json.loads(capsys.readouterr().out)  # the plan for GPUs (packed rows: other bytes per token)
    per_gpu = 500 * on_gpus["disk"][on_gpus["dtype"]]["bytes_per_token"]
    assert 1e3 <= per_gpu < 1e6  # a few hundred KB/s, said in KB/s (not "0.00 GB/s")
    assert f"writes      {per_gpu / 1e3:.2f} KB/s per GPU at that rate" in text
    # the same on this machine (no GPU): what it plans for is a CPU run, and says so
    assert cli_main(["plan", *args, "--num-gpus", "2", "--tokens-per-second", "500"]) == 0
    text = capsys.readouterr().out
    assert "device      CPU (this machine has no GPU; --gpu plans the GPU run)" in text
    assert "500 real tok/s per CPU process" in text and "on 2 CPU process(es)" in text and "GPU(s)" not in text
    assert main(["--set", "batching.max_batch_size=0"]) == 2  # a bad recipe: error naming the key, exit 2
    assert "batching.max_batch_size" in capsys.readouterr().err


def test_plan_names_the_kernels_the_gpu_run_applies_and_refuses_a_list_the_run_refuses(capsys, tmp_path):
    """The 8B shape planned for GPUs: `auto` is liger's three kernels on one GPU and none on a tensor-parallel
    replica (as the extraction chooses), a list that does not apply to the architecture is the extraction's own
    RecipeError (exit 2, one line), and a GPU memory that is not a finite positive size is refused."""
    base = ["--set", f"output.dir={tmp_path / 'out'}", "--set", "data.max_samples=20", "--set",
            f"model.config={REPO}/bench/configs/llama3.1-8b.json", "--set", "model.dtype=bfloat16",
            "--gpu-memory-gb", "141"]
    assert main(base + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kernels"] == ["liger_rms_norm", "liger_swiglu", "liger_rope"]
    assert main(base + ["--set", "model.gpus_per_replica=2", "--num-gpus", "2", "--json"]) == 0
    tp = json.loads(capsys.readouterr().out)
    assert tp["replicas"]["parallelism"] == "tensor_parallel" and tp["kernels"] == [], tp["replicas"]
    assert main(base + ["--set", "model.kernels=[fla_conv]"]) == 2
    err = capsys.readouterr().err
    assert "model.kernels" in err and "do not apply" in err and err.count("\n") == 1, err
    for bad in ("inf", "-5", "0"):
        assert main(base[:-2] + ["--gpu-memory-gb", bad]) == 2
        assert capsys.readouterr().err.startswith("error: --gpu-memory-gb must be a finite number > 0")


def test_auto_budget_is_sized_for_the_gpu_memory_given(capsys):
    args = ["--set", "output.dir=/nonexistent/never-written", *[a for kv in BASE for a in ("--set", kv)],
            "--set", "batching.max_tokens_per_batch=auto", "--tokens-per-second", "1000"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "budget      16,384 padded tokens per batch (max_tokens_per_batch: auto, no GPU: 16384; pass " \
           "--gpu-memory-gb" in text
    assert main(args + ["--gpu-memory-gb", "80", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["max_tokens_per_batch"] == 131072 and "GPU 80 GB" in printed["max_tokens_per_batch_auto"]
    assert printed["num_batches"] < make_run_plan(load_recipe(None, ["output.dir=/nonexistent/never-written",
                                                                     *BASE]))["num_batches"]


def test_no_benchmark_near_the_model_asks_for_a_figure(planned_and_run):
    plan = make_run_plan(load_recipe(None, ["output.dir=/nonexistent/never-written", *BASE]), gpu=True)
    assert plan["throughput"]["tokens_per_second"] is None and plan["wall"] is None
    assert "no benchmark within 4x" in plan["throughput"]["source"]


def test_unused_output_dir_is_not_created(planned_and_run, tmp_path):
    out = tmp_path / "never"
    make_run_plan(load_recipe(None, [f"output.dir={out}", *BASE]), tokens_per_second=1.0)
    assert not out.exists() and not Path("/nonexistent").exists()


def test_an_fp8_checkpoint_is_planned_at_the_measured_fp8_ratio(tmp_path):
    """A block-FP8 checkpoint of the 27B shape (its config with the format's `quantization_config`) is planned at the
    bf16 benchmark's figure times the newest committed FP8 / dequantized extraction ratio of the same rows (here
    30,000 / 40,000; an older folder's ratio and a pair of other row counts are passed over), and said; with
    `model.fp8_weights: dequantize` it runs bf16: the figure unscaled."""
    from test_fp8_weights import FP8_CONFIG

    bench = tmp_path / "bench"
    bench.mkdir()
    reference = REPO / "bench" / "results" / "qwen3.6-27b-20261130-224000.json"
    (bench / reference.name).write_text(reference.read_text())
    bf16_rate = json.loads(reference.read_text())["modes"]["dflash_prep_warm"]["tokens_per_second"]
    for folder, fp8, dequantized, tokens in (("targets-20270101", 20000.0, 40000.0, 1000),
                                             ("targets-20270102", 30000.0, 40000.0, 1000),
                                             ("targets-20270103", 10000.0, 40000.0, None)):
        (bench / folder).mkdir()
        for name, rate, n in (("fp8", fp8, 1000), ("dequantized", dequantized, tokens)):
            (bench / folder / f"extract-{name}.summary.json").write_text(
                json.dumps({"tokens_per_second": rate, "num_tokens_this_run": n}))
    config = json.loads((REPO / "bench" / "configs" / "qwen3.6-27b.json").read_text())
    (tmp_path / "fp8.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    base = [f"output.dir={tmp_path / 'out'}", "data.max_samples=20", "model.dtype=bfloat16",
            f"model.config={tmp_path / 'fp8.json'}", "layers.preset=dflash", "layers.num_layers=5"]
    plan = make_run_plan(load_recipe(None, base), num_gpus=1, gpu_memory_bytes=141 * 10**9, bench_dir=bench)
    t = plan["throughput"]
    assert t["source"] == "same model" and t["scaled_by_decoder_params"] == pytest.approx(1.0)
    assert t["fp8_scale"] == {"ratio": pytest.approx(0.75), "folder": "targets-20270102"}
    assert t["tokens_per_second"] == pytest.approx(bf16_rate * 0.75)
    assert "x0.75 for FP8 weights (FP8 / dequantized extraction of the same rows" in format_plan(plan)
    dequantized = make_run_plan(load_recipe(None, [*base, "model.fp8_weights=dequantize"]), num_gpus=1,
                                gpu_memory_bytes=141 * 10**9, bench_dir=bench)["throughput"]
    assert "fp8_scale" not in dequantized and dequantized["tokens_per_second"] == pytest.approx(bf16_rate)


def test_plan_of_a_finished_output_says_finished_only_for_its_own_job(planned_and_run, capsys):
    """The recipe that made a finished output: "finished: running this recipe again changes nothing". The same
    output.dir with another data selection (a job the extraction refuses): not called finished."""
    out = planned_and_run[2]["out_dir"]
    args = [a for kv in BASE for a in ("--set", kv)]
    assert main(["--set", f"output.dir={out}", *args, "--tokens-per-second", "1000"]) == 0
    assert f"{out} is finished: running this recipe again changes nothing" in capsys.readouterr().out
    other = [a for kv in BASE if not kv.startswith("data.max_samples") for a in ("--set", kv)]
    assert main(["--set", f"output.dir={out}", *other, "--set", "data.max_samples=30",
                 "--tokens-per-second", "1000"]) == 0
    text = capsys.readouterr().out
    assert "changes nothing" not in text and f"{out} holds a finished output of a recipe or inputs other" in text


@pytest.mark.parametrize("command", [["plan"], ["inspect", "OUT"]])
def test_a_report_whose_reader_stops_reading_exits_0_quietly(tmp_path, command):
    """`dflash-prep plan | head -2`: the pipe's reader gone before the report is written (its end closed here
    before the command prints) is no error of the command: exit code 0, no BrokenPipeError."""
    import os
    import subprocess
    import sys

    if "OUT" in command:  # a finished output to describe
        from dflash_prep.commands.extract import run_extraction
        from dflash_prep.recipe.schema import load_recipe

        out = tmp_path / "out"
        run_extraction(load_recipe(None, [f"output.dir={out}", "data.max_samples=4", "batching.num_workers=0"]))
        command = [c if c != "OUT" else str(out) for c in command]
    proc = subprocess.Popen([sys.executable, "-m", "dflash_prep.commands.cli", *command], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err[-3000:]
    assert "BrokenPipe" not in err and "Traceback" not in err, err[-3000:]

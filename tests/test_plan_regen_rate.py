"""`dflash-prep plan` times the regeneration: from `--generated-tokens-per-second`, else (engine transformers) from
the in-process engine's benchmark report (bench/regen_bench.py's `regen-bench.json`), labelled with its source.

The reports here are written by hand in the benchmark's layout (tests/test_regen_bench.py checks that the
benchmark's own output is read the same way); the demo's decoder parameters are counted with transformers directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_prep.commands.plan import main
from dflash_prep.commands.regen_rate import regen_bench_references

DEMO_REGEN = ["--set", "regenerate={}", "--set", "regenerate.max_tokens=8", "--set", "data.max_samples=6"]


def demo_decoder_params() -> tuple[str, int]:
    """The demo model's model_type and the parameters of its decoder layers, counted on a meta-device model."""
    import torch
    from conftest import DEMO
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(DEMO / "model_config.json")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config.model_type, sum(p.numel() for p in model.model.layers.parameters())


def write_report(folder: Path, models: dict, gpu: str | None = "NVIDIA H200", started: str = "2026-12-01T20:00:00"):
    folder.mkdir(parents=True, exist_ok=True)
    report = {"started": started, "environment": {"device": "cuda:0" if gpu else "cpu", "gpu": gpu},
              "models": models}
    (folder / "regen-bench.json").write_text(json.dumps(report))


def entry(model_type: str, decoder_params: int, cold: float, warm: float | None) -> dict:
    return {"status": "ok", "model_type": model_type, "decoder_params": decoder_params, "max_tokens": 256,
            "decode_path": f"{model_type}: static cache + CUDA graph", "prompts": {"prompt_tokens_mean": 432.0},
            "static": {"cold": {"generated_tokens_per_second": cold},
                       "warm": None if warm is None else {"generated_tokens_per_second": warm}}}


def plan_json(capsys, *argv: str) -> dict:
    assert main([*DEMO_REGEN, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["regenerate"]


def test_the_in_process_engine_is_timed_from_the_newest_benchmark_of_its_architecture(tmp_path, capsys):
    """Two GPU reports of the demo's architecture (the newer one wins, its warm pass), a CPU dry run (ignored) and
    another architecture: the rate is the warm figure x (report's parameters / the model's) x GPUs."""
    model_type, params = demo_decoder_params()
    write_report(tmp_path / "regen-old", {"demo-shape": entry(model_type, params, 100.0, 150.0)},
                 started="2026-11-01T10:00:00")
    write_report(tmp_path / "regen-new", {"demo-shape": entry(model_type, 2 * params, 800.0, 1000.0),
                                          "other": entry("llama", params, 5.0, 5.0)})
    write_report(tmp_path / "regen-dry", {"demo-shape": entry(model_type, params, 7.0, 7.0)}, gpu=None,
                 started="2026-12-02T10:00:00")
    r = plan_json(capsys, "--bench-results", str(tmp_path), "--num-gpus", "3")
    assert r["generated_tokens_per_second"] == pytest.approx(1000.0 * 2 * 3)
    assert r["seconds_at_most"] == pytest.approx(r["generated_tokens_at_most"] / (1000.0 * 2 * 3))
    assert r["rate_reference"]["file"].endswith("regen-new/regen-bench.json")
    for words in ("in-process engine's benchmark regen-new/regen-bench.json", "demo-shape shape",
                  "static decoder warm pass", "1,000 generated tok/s on one NVIDIA H200", "scaled x2.00",
                  "same architecture", "x 3 GPUs"):
        assert words in r["rate_source"]
    assert main([*DEMO_REGEN, "--bench-results", str(tmp_path), "--num-gpus", "3"]) == 0
    time_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("time"))
    assert "at 6,000 generated tok/s: the in-process engine's benchmark regen-new" in time_line


def test_a_given_rate_wins_and_without_a_report_there_is_no_figure(tmp_path, capsys):
    model_type, params = demo_decoder_params()
    write_report(tmp_path / "regen", {"demo-shape": entry(model_type, params, 800.0, None)})
    given = plan_json(capsys, "--bench-results", str(tmp_path), "--generated-tokens-per-second", "50")
    assert given["generated_tokens_per_second"] == 50 and given["rate_source"] == \
        "given with --generated-tokens-per-second"
    cold_only = plan_json(capsys, "--bench-results", str(tmp_path))
    assert cold_only["generated_tokens_per_second"] == pytest.approx(800.0)
    assert "static decoder cold pass" in cold_only["rate_source"]
    empty = plan_json(capsys, "--bench-results", str(tmp_path / "nothing"))
    assert empty["generated_tokens_per_second"] is None and empty["seconds_at_most"] is None
    assert "no GPU report of the in-process engine's benchmark" in empty["rate_source"]
    assert "--generated-tokens-per-second" in empty["rate_source"]
    served = plan_json(capsys, "--bench-results", str(tmp_path), "--set", "regenerate.engine=openai", "--set",
                       "regenerate.base_urls=[http://127.0.0.1:1/v1]")
    assert served["generated_tokens_per_second"] is None and "the servers'" in served["rate_source"]


def test_a_benchmark_far_from_the_model_in_parameters_gives_no_figure(tmp_path):
    from dflash_prep.commands.bench_figures import figures
    from dflash_prep.commands.regen_rate import regen_rate

    write_report(tmp_path / "regen", {"big": entry("llama", 8_000_000_000, 8000.0, 9000.0)})
    assert len(regen_bench_references(tmp_path)) == 1
    far = regen_rate("transformers", None, "qwen3_5_text", 1_000_000, 1, figures(tmp_path))
    assert far["generated_tokens_per_second"] is None and "within 4x" in far["source"]
    near = regen_rate("transformers", None, "qwen3_5_text", 4_000_000_000, 2, figures(tmp_path))
    assert near["generated_tokens_per_second"] == pytest.approx(9000.0 * 2 * 2)
    assert "nearest benchmarked model" in near["source"]


def test_a_report_of_several_decoder_settings_gives_the_pass_of_the_engines_defaults(tmp_path, capsys):
    """A report that timed the static decoder's settings one after another (bench/regen_bench.py's variants): the
    rate is the pass that ran the engine's defaults on CUDA (prefill auto, flex attention), not the report's first
    nor an sdpa pass; a newer report whose passes all ran other settings is passed over for an older one."""
    model_type, params = demo_decoder_params()

    def with_variants(first: str, passes: dict) -> dict:
        e = entry(model_type, params, 1.0, 2.0)  # the first pass's own figures: those of passes[first]
        e["static"] = {"cold": {"generated_tokens_per_second": passes[first][0]},
                       "warm": {"generated_tokens_per_second": passes[first][1]}}
        e["static_variants"] = {label: {"path": "...", "cold": {"generated_tokens_per_second": cold},
                                        "warm": {"generated_tokens_per_second": warm}}
                                for label, (cold, warm) in passes.items()}
        return e

    first = "prefill auto, span cost 8,192 keys, 8 key limits"
    write_report(tmp_path / "regen-ab", {"demo-shape": with_variants(first, {
        first: (600.0, 745.0), "prefill auto, span cost 8,192 keys, 1 key limit": (750.0, 762.0),
        "prefill auto, flex attention": (900.0, 950.0)})},  # flex: the engine's default decode kernel on CUDA
        started="2026-12-03T08:00:00")
    assert plan_json(capsys, "--bench-results", str(tmp_path))["generated_tokens_per_second"] == pytest.approx(950.0)
    first = "prefill packed, no row spans"
    write_report(tmp_path / "regen-other-settings", {"demo-shape": with_variants(first, {
        first: (300.0, 1090.0), "prefill padded, no row spans": (80.0, 777.0)})}, started="2026-12-03T09:00:00")
    r = plan_json(capsys, "--bench-results", str(tmp_path))
    assert r["generated_tokens_per_second"] == pytest.approx(950.0)
    assert r["rate_reference"]["file"].endswith("regen-ab/regen-bench.json")


def test_a_newer_report_without_a_warm_pass_is_passed_over_for_a_warm_one(tmp_path, capsys):
    """A newer report that ran the static decoder cold only (an exactness check's run: its first kernels' tuning in
    the figure) gives way to an older report's warm pass; a report of the default settings with the prefill
    labelled `packed` (what `auto` runs wherever packing applies) counts as the defaults' pass."""
    model_type, params = demo_decoder_params()
    older = entry(model_type, params, 400.0, 1200.0)
    older["static_variants"] = {
        "prefill packed, flex attention": {"path": "...", **older["static"]},
        "prefill padded, flex attention": {"path": "...",
                                                              "cold": {"generated_tokens_per_second": 90.0},
                                                              "warm": {"generated_tokens_per_second": 800.0}}}
    write_report(tmp_path / "regen-warm", {"demo-shape": older}, started="2026-12-03T07:00:00")
    write_report(tmp_path / "regen-check", {"demo-shape": entry(model_type, params, 370.0, None)},
                 started="2026-12-03T13:00:00")
    r = plan_json(capsys, "--bench-results", str(tmp_path))
    assert r["generated_tokens_per_second"] == pytest.approx(1200.0)
    assert r["rate_reference"]["file"].endswith("regen-warm/regen-bench.json")
    assert "static decoder warm pass" in r["rate_source"]


def test_a_hybrids_report_gives_its_sdpa_pass_where_auto_keeps_sdpa(tmp_path, capsys):
    """For a model with Gated DeltaNet layers `auto` decodes on sdpa: its report's sdpa pass (row spans, the default
    price and key limit) is the rate, not its flex pass; the report's `default_decode_kernel` says so, and a report
    without it is read from its decode path."""
    model_type, params = demo_decoder_params()
    passes = {"prefill auto, flex attention": (341.0, 1083.0),
              "prefill auto, span cost 8,192 keys, 1 key limit": (850.0, 1085.0)}
    e = entry(model_type, params, 341.0, 1083.0)
    e["decode_path"] = f"{model_type}: static cache + CUDA graph, ...; Gated DeltaNet decode on fla's kernel"
    e["static_variants"] = {label: {"path": "...", "cold": {"generated_tokens_per_second": cold},
                                    "warm": {"generated_tokens_per_second": warm}}
                            for label, (cold, warm) in passes.items()}
    write_report(tmp_path / "regen-hybrid", {"hybrid-shape": e})
    assert plan_json(capsys, "--bench-results", str(tmp_path))["generated_tokens_per_second"] == pytest.approx(1085.0)
    e["decode_path"], e["default_decode_kernel"] = f"{model_type}: static cache + CUDA graph", "flex"
    write_report(tmp_path / "regen-hybrid", {"hybrid-shape": e})
    assert plan_json(capsys, "--bench-results", str(tmp_path))["generated_tokens_per_second"] == pytest.approx(1083.0)

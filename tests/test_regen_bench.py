"""bench/regen_bench.py --dry-run: the regeneration benchmark on the tiny models, on the CPU, in seconds."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_the_dry_run_measures_both_decoders_on_both_tiny_models(tmp_path):
    spec = importlib.util.spec_from_file_location("regen_bench", REPO / "bench" / "regen_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regen_bench"] = module
    spec.loader.exec_module(module)
    report = module.main([str(tmp_path), "--dry-run"])
    assert json.loads((tmp_path / "regen-bench.json").read_text())["models"].keys() == {
        "tiny-qwen3.5-fp32", "tiny-llama", "tiny-qwen3.5"}
    text = (tmp_path / "regen-bench.md").read_text()
    assert "| tiny-qwen3.5 |" in text and "static cache, eager steps" in text
    for name, result in report["models"].items():
        assert result["status"] == "ok", result
        cold, generate = result["static"]["cold"], result["generate"]
        prompts = 8 if name.endswith("-fp32") else 12
        assert cold["generated_tokens"] == prompts * 8 and cold["rejected"] == 0  # EOS ignored: every token
        assert generate["generated_tokens"] == generate["requests"] * 8 and generate["rejected"] == 0
        assert cold["decode_steps"] == 7 * cold["batches"] and cold["graph_captures"] == 0  # CPU: no capture
        # float32 on the CPU: generate alone, generate batches and the static decoder write the same tokens, and
        # every teacher-forced step's logits equal a plain forward's to float32 rounding on all three paths
        check = result["check"]
        assert check["verdict"] == "exact" and check["greedy"]["prompts"] == 4
        assert check["greedy"]["static"]["agreement"] == check["greedy"]["generate_batched"]["agreement"] == 1.0
        for path in ("static_batched", "generate_batched", "generate_alone"):
            forced = check["teacher_forced"][path]
            assert forced["max_relative_error"] < 1e-5 and forced["argmax_flips"] == 0
        assert check["teacher_forced"]["static_batched"]["rows"] == 8
        assert result["same_text_static_vs_generate"] == result["same_text_compared"] == generate["requests"]
    profile = report["models"]["tiny-llama"]["decode_step_profile"]  # the eager step's ops, named
    assert profile["rows"] == 8 and profile["steps"] == 4 and any("mm" in op["name"] for op in profile["top"])
    # `plan` reads the benchmark's own report (a GPU run's: the dry run's device named a GPU here)
    from dflash_prep.commands.regen_rate import regen_bench_references

    written = json.loads((tmp_path / "regen-bench.json").read_text())
    written["environment"]["gpu"] = "NVIDIA H200"
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "regen-bench.json").write_text(json.dumps(written))
    refs = {r["model"]: r for r in regen_bench_references(tmp_path / "gpu")}
    assert refs.keys() == {"tiny-llama", "tiny-qwen3.5"}  # not the exactness-only slice
    assert refs["tiny-llama"]["model_type"] == "llama" and refs["tiny-qwen3.5"]["model_type"] == "qwen3_5_text"
    for name, ref in refs.items():
        warm = report["models"][name]["static"]["warm"]
        assert ref["pass"] == "warm" and ref["generated_tokens_per_second"] == warm["generated_tokens_per_second"]
        assert ref["decoder_params"] == report["models"][name]["decoder_params"] > 0


@pytest.mark.slow
def test_plan_reads_the_pass_of_the_engines_defaults_from_the_benchmarks_own_variants(tmp_path):
    """The benchmark timing the decoder's key limits as an A/B (`--key-limit-graphs 8,1`: the first pass 8 limits,
    the variant 1, the engine's default): `plan` takes the variant's figure, as the benchmark labelled it."""
    spec = importlib.util.spec_from_file_location("regen_bench", REPO / "bench" / "regen_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regen_bench"] = module
    spec.loader.exec_module(module)
    report = module.main([str(tmp_path), "--dry-run", "--models", "tiny-llama", "--key-limit-graphs", "8,1",
                          "--no-check"])
    variants = report["models"]["tiny-llama"]["static_variants"]
    assert len(variants) == 2
    [default] = [entry for label, entry in variants.items() if label.endswith(", 1 key limit")]
    from dflash_prep.commands.regen_rate import regen_bench_references

    written = json.loads((tmp_path / "regen-bench.json").read_text())
    written["environment"]["gpu"] = "NVIDIA H200"
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "regen-bench.json").write_text(json.dumps(written))
    [ref] = regen_bench_references(tmp_path / "gpu")
    assert ref["generated_tokens_per_second"] == default["warm"]["generated_tokens_per_second"]
    assert ref["generated_tokens_per_second"] != report["models"]["tiny-llama"]["static"]["warm"][
        "generated_tokens_per_second"]

"""bench/regen_bench.py --dry-run: the regeneration benchmark on the tiny models, on the CPU, in seconds."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_the_dry_run_measures_both_methods_on_both_tiny_models(tmp_path):
    spec = importlib.util.spec_from_file_location("regen_bench", REPO / "bench" / "regen_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regen_bench"] = module
    spec.loader.exec_module(module)
    report = module.main([str(tmp_path), "--dry-run"])
    assert json.loads((tmp_path / "regen-bench.json").read_text())["models"].keys() == {"tiny-llama", "tiny-qwen3.5"}
    assert "| tiny-qwen3.5 |" in (tmp_path / "regen-bench.md").read_text()
    for name, result in report["models"].items():
        assert result["status"] == "ok", result
        cold, base = result["engine"]["cold"], result["baseline"]
        assert cold["generated_tokens"] == 12 * 8 and cold["rejected"] == 0  # EOS ignored: every token generated
        assert base["requests"] >= 1 and base["generated_tokens"] == 8 * base["requests"]
        # float32 on the CPU: one prompt at a time gives the engine's texts (the two did the same work)
        assert base["same_text_as_engine"] == base["requests"]
        assert cold["generate_calls"] <= result["bucketed_batches"]

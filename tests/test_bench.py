"""bench/run_bench.py on the tiny models, on CPU, in seconds.

Runs the benchmark in-process on tiny-qwen3.5 (Gated DeltaNet hybrid) and tiny-llama with a handful of samples,
checks every field the report promises for all three modes, and that the three modes wrote the same samples
with the same states: per-sample (unbatched, full CausalLM, `output_hidden_states`) against dflash-prep
(hooks, planned padded batches, webdataset shards) is the project's core invariant.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
MODES = ("per_sample", "fixed_batch", "dflash_prep")


@pytest.fixture(scope="module")
def rb():
    """bench/run_bench.py as a module, loaded from its file as `python bench/run_bench.py` runs it."""
    spec = importlib.util.spec_from_file_location("run_bench", REPO / "bench" / "run_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_bench"] = module
    spec.loader.exec_module(module)
    return module


def _run(rb, tmp_path, monkeypatch, model: str, storage_dtype: str, extra: list[str] = ()) -> dict:
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    argv = ["--model", model, "--device", "cpu", "--num-samples", "12", "--max-length", "400",
            "--per-sample-max-samples", "7",  # per-sample: a prefix (N samples, before its time budget)
            "--fixed-batch-size", "4", "--fixed-batch-max-samples", "10",  # fixed-batch: 3 batches, 10 samples
            "--storage-dtype", storage_dtype, "--gemm-size", "128", "--check-samples", "0",
            "--results-dir", str(tmp_path / "results"), "--out-dir", str(tmp_path / "out"), "--keep-outputs",
            *extra]
    return rb.main(argv)


def _check_report(rb, report: dict, model: str) -> None:
    spec = rb.MODELS[model]
    lengths = rb.make_samples(12, 5.41, 0.9, 16, 400, report["model_info"]["vocab_size"], 0).lengths
    assert report["complete"] is True
    assert report["layer_ids"] == list(spec.layer_ids)
    assert report["settings"]["samples"]["num_tokens"] == int(lengths.sum())
    assert report["gemm"]["flops_per_second"] > 0
    expected_samples = {"per_sample": 7, "fixed_batch": 10, "dflash_prep": 12}
    for mode in MODES:
        m = report["modes"][mode]
        assert m["status"] == "ok", m
        n = expected_samples[mode]
        assert m["num_samples"] == n
        assert m["num_real_tokens"] == int(lengths[:n].sum())
        assert m["sample_ids_are_prefix"] is True
        assert m["stopped_by"] == ("tokens" if mode == "dflash_prep" else "samples")
        assert m["tokens_per_second"] > 0 and m["samples_per_second"] > 0
        assert m["mfu"] > 0 and m["mfu_needed_layers"] > 0
        assert 0 < m["padding_efficiency"] <= 1
        assert m["num_real_tokens"] <= m["num_padded_tokens"]
        assert m["num_shapes"] >= 1 and 1 <= m["first_shape_batches"] <= m["num_forwards"]
        assert m["first_shape_seconds"] >= 0
        assert "peak_gpu_memory_bytes" in m and m["peak_gpu_memory_bytes"] is None  # CPU run
        assert m["bytes_written"] > 0 and m["write_gb_per_second"] > 0
        assert m["decoder_params_executed"] > 0 and m["loop_seconds"] > 0
        assert m["breakdown_seconds"]
    assert report["modes"]["per_sample"]["padding_efficiency"] == 1.0
    assert report["modes"]["per_sample"]["num_forwards"] == 7
    assert report["modes"]["fixed_batch"]["num_forwards"] == 3  # 4 + 4 + 2
    # dflash-prep runs only the layers up to the deepest captured one; the baselines run them all
    info = report["model_info"]
    assert report["modes"]["dflash_prep"]["decoder_params_executed"] == info["decoder_params_needed"]
    assert report["modes"]["per_sample"]["decoder_params_executed"] == info["decoder_params_all_layers"]
    bd = report["modes"]["dflash_prep"]["breakdown_seconds"]
    for key in ("setup", "data_wait", "forward_gpu", "copy_to_host_gpu", "idle_gpu", "write", "writer_wait"):
        assert key in bd and bd[key] is not None
    for key in ("forward", "copy_to_host", "write"):
        assert key in report["modes"]["per_sample"]["breakdown_seconds"]
    # JSON + markdown named with model and timestamp
    json_path, md_path = Path(report["json_path"]), Path(report["markdown_path"])
    assert json_path.name == f"{model}-{report['timestamp']}.json" and json_path.exists()
    assert md_path.name == f"{model}-{report['timestamp']}.md" and md_path.exists()
    assert json.loads(json_path.read_text())["modes"]["dflash_prep"]["num_samples"] == 12
    assert "| **tokens/s** (real) |" in md_path.read_text()


def _check_outputs(rb, report: dict, tmp_path: Path, model: str, atol_rel: float) -> None:
    """Read every kept output back and compare the modes sample by sample."""
    c = report["consistency"]
    assert c["same_weights"], c["weights_checksums"]
    for pair in ("per_sample~fixed_batch", "per_sample~dflash_prep", "fixed_batch~dflash_prep"):
        v = c["pairs"][pair]
        assert v["input_ids_equal"] and v["shapes_equal"]
        assert v["samples_compared"] == (7 if pair.startswith("per_sample") else 10)
        assert v["max_rel_l2"] < atol_rel, (pair, v)

    (root,) = list((tmp_path / "out").glob(f"dflash-bench-{model}-*"))
    dirs = {"per_sample": root / "per_sample", "fixed_batch": root / "fixed_batch",
            "dflash_prep": root / "dflash_prep" / "extraction"}
    ids = {mode: rb.written_ids(mode, d) for mode, d in dirs.items()}
    all_ids = [f"{i:010d}" for i in range(12)]
    assert ids == {"per_sample": all_ids[:7], "fixed_batch": all_ids[:10], "dflash_prep": all_ids}
    states = {mode: rb.read_samples(mode, d, all_ids) for mode, d in dirs.items()}
    samples = rb.make_samples(12, 5.41, 0.9, 16, 400, report["model_info"]["vocab_size"], 0)
    k = len(report["layer_ids"])
    H = report["model_info"]["hidden_size"]
    for sid in all_ids[:7]:
        ref_ids, ref = states["per_sample"][sid]
        np.testing.assert_array_equal(ref_ids, samples.tokens[int(sid)])
        assert ref.shape == (len(ref_ids), k * H)
        for mode in ("fixed_batch", "dflash_prep"):
            ids_m, hs = states[mode][sid]
            np.testing.assert_array_equal(ids_m, ref_ids)
            assert hs.dtype == ref.dtype
            scale = ref.float().abs().max()
            torch.testing.assert_close(hs.float(), ref.float(), rtol=0, atol=float(atol_rel * scale))


@pytest.mark.slow
def test_bench_tiny_qwen35_fp32_storage(rb, tmp_path, monkeypatch):
    # fp32 compute and storage: padded batches of the GDN hybrid must match the unbatched run to fp32 noise
    report = _run(rb, tmp_path, monkeypatch, "tiny-qwen3.5", "float32",
                  ["--dflash-set", "batching.num_workers=0", "--dflash-set", "batching.length_multiple=16"])
    _check_report(rb, report, "tiny-qwen3.5")
    assert report["modes"]["dflash_prep"]["recipe_batching"]["length_multiple"] == 16
    _check_outputs(rb, report, tmp_path, "tiny-qwen3.5", atol_rel=1e-4)


@pytest.mark.slow
def test_bench_tiny_llama_bf16_storage(rb, tmp_path, monkeypatch):
    # bf16 storage (the default): modes may differ by one bf16 rounding step (2^-8 relative)
    report = _run(rb, tmp_path, monkeypatch, "tiny-llama", "bfloat16")
    _check_report(rb, report, "tiny-llama")
    _check_outputs(rb, report, tmp_path, "tiny-llama", atol_rel=1e-2)


def test_samples_are_deterministic_and_prefix_by_tokens(rb):
    a = rb.make_samples(50, 5.41, 0.9, 16, 4096, 1000, seed=3)
    b = rb.make_samples(50, 5.41, 0.9, 16, 4096, 1000, seed=3)
    assert np.array_equal(a.lengths, b.lengths) and all(np.array_equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert a.lengths.min() >= 16 and a.lengths.max() <= 4096
    assert all(len(t) == n and t.min() >= 1 and t.max() < 1000 for t, n in zip(a.tokens, a.lengths))
    n = a.prefix_by_tokens(5000)
    assert a.lengths[:n].sum() <= 5000 < a.lengths[: n + 1].sum()
    assert a.prefix_by_tokens(1) == 1  # at least one sample


def test_bad_modes_are_refused(rb, tmp_path):
    with pytest.raises(SystemExit):
        rb.main(["--model", "tiny-llama", "--modes", "per_sample,nope", "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="dflash_prep_variant repeats dflash_prep"):
        rb.main(["--model", "tiny-llama", "--modes", "dflash_prep_variant", "--variant-set", "seed=1",
                 "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--variant-set goes with"):
        rb.main(["--model", "tiny-llama", "--modes", "dflash_prep", "--variant-set", "seed=1",
                 "--results-dir", str(tmp_path)])


def _run_dflash_modes(rb, tmp_path, monkeypatch, model: str, modes: str, extra: list[str]) -> dict:
    """A CPU benchmark run of dflash-prep modes only, in seconds."""
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return rb.main(["--model", model, "--device", "cpu", "--modes", modes, "--dflash-set", "batching.num_workers=0",
                    "--gemm-size", "128", "--check-samples", "0", "--results-dir", str(tmp_path / "results"),
                    "--out-dir", str(tmp_path / "out"), *extra])


@pytest.mark.slow
def test_variant_mode_reruns_dflash_prep_with_other_settings_on_the_same_samples(rb, tmp_path, monkeypatch):
    report = _run_dflash_modes(rb, tmp_path, monkeypatch, "tiny-qwen3.5", "dflash_prep,dflash_prep_variant",
                               ["--num-samples", "10", "--max-length", "300", "--storage-dtype", "float32",
                                "--variant-set", "model.padding_mask=true",
                                "--variant-set", "output.num_writer_threads=1"])
    base, variant = report["modes"]["dflash_prep"], report["modes"]["dflash_prep_variant"]
    assert base["status"] == variant["status"] == "ok"
    assert variant["num_samples"] == base["num_samples"] == 10 and variant["stopped_by"] == "same samples as dflash_prep"
    assert variant["variant_overrides"] == ["model.padding_mask=true", "output.num_writer_threads=1"]
    assert variant["recipe_batching"]["num_writer_threads"] == 1 and base["recipe_batching"]["num_writer_threads"] == 4
    assert report["settings"]["variant_overrides"] == variant["variant_overrides"]
    pair = report["consistency"]["pairs"]["dflash_prep~dflash_prep_variant"]
    assert pair["samples_compared"] == 10 and pair["input_ids_equal"] and pair["max_rel_l2"] < 1e-5
    assert "dflash_prep_variant" in Path(report["markdown_path"]).read_text()


@pytest.mark.slow
def test_fresh_mode_reruns_dflash_prep_in_a_new_process_on_the_same_samples(rb, tmp_path, monkeypatch):
    report = _run_dflash_modes(rb, tmp_path, monkeypatch, "tiny-llama", "dflash_prep,dflash_prep_fresh",
                               ["--num-samples", "8", "--max-length", "200", "--storage-dtype", "float32"])
    base, fresh = report["modes"]["dflash_prep"], report["modes"]["dflash_prep_fresh"]
    assert base["status"] == fresh["status"] == "ok", fresh.get("error")
    assert fresh["num_samples"] == base["num_samples"] == 8 and fresh["stopped_by"] == "same samples as dflash_prep"
    assert fresh["num_padded_tokens"] == base["num_padded_tokens"]  # the same plan: same budget, same samples
    assert "fresh_process" in fresh and fresh["sample_ids_are_prefix"]
    pair = report["consistency"]["pairs"]["dflash_prep~dflash_prep_fresh"]
    assert pair["samples_compared"] == 8 and pair["input_ids_equal"] and pair["max_abs_diff"] == 0


@pytest.mark.slow
def test_fixed_batch_splits_a_batch_that_runs_out_of_memory(rb, tmp_path, monkeypatch):
    """A batch that raises OutOfMemoryError is split in halves and retried; nothing is lost or duplicated."""
    context = importlib.import_module("bench.context")  # the baselines build their model through Ctx.build_model
    original = context.load_model

    def load_model_that_ooms_above_two_rows(section, config, device):
        model = original(section, config, device)

        def hook(module, args, kwargs):
            if kwargs["input_ids"].shape[0] > 2:
                raise torch.OutOfMemoryError("simulated: batch larger than 2 rows")

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return model

    monkeypatch.setattr(context, "load_model", load_model_that_ooms_above_two_rows)
    monkeypatch.setenv("ACCELERATE_TORCH_DEVICE", "cpu")
    report = rb.main(["--model", "tiny-llama", "--device", "cpu", "--num-samples", "10", "--max-length", "300",
                      "--modes", "per_sample,fixed_batch", "--fixed-batch-size", "8", "--storage-dtype", "float32",
                      "--gemm-size", "64", "--check-samples", "0", "--results-dir", str(tmp_path / "r"),
                      "--out-dir", str(tmp_path / "o")])
    fb = report["modes"]["fixed_batch"]
    assert fb["status"] == "ok", fb
    # batch of 8 -> 4 + 4 -> 2 + 2 + 2 + 2 (3 splits); the last batch of 2 fits
    assert fb["oom_splits"] == 3 and fb["num_forwards"] == 5 and fb["num_samples"] == 10
    assert fb["sample_ids_are_prefix"] is True
    pair = report["consistency"]["pairs"]["per_sample~fixed_batch"]
    assert pair["samples_compared"] == 10 and pair["input_ids_equal"] and pair["max_rel_l2"] < 1e-4


def test_writer_bench_runs_and_reports_each_thread_count(tmp_path):
    spec = importlib.util.spec_from_file_location("writer_bench", REPO / "bench" / "writer_bench.py")
    writer_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer_bench)
    out = tmp_path / "w.json"
    assert writer_bench.main(["--dir", str(tmp_path), "--threads", "1,3", "--gb", "0.002", "--tokens", "10",
                              "--width", "64", "--batch-size", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    one, three = report["results"]
    assert (one["num_writer_threads"], three["num_writer_threads"]) == (1, 3)
    records = 0.002e9 // (4 * 10 * 64 * 2) * 4 * 10 * 64 * 2  # states bytes of the whole batches sent
    for r in (one, three):
        assert r["bytes"] > records and r["gb_per_second"] > 0
        assert r["gil_round_trip_us_idle"] > 0 and r["gil_round_trip_us_while_writing"] > 0
    assert (one["shards"], three["shards"]) == (1, 3)  # one open shard per thread, nothing rolled
    assert 0 < three["bytes"] - one["bytes"] <= 2 * 10240  # the same records; two more end-of-archive paddings
    assert list(tmp_path.iterdir()) == [out]  # its temporary folders are removed


@pytest.mark.slow
def test_profile_mode_reports_where_the_time_goes(rb, tmp_path, monkeypatch):
    report = _run_dflash_modes(rb, tmp_path, monkeypatch, "tiny-llama", "dflash_prep,dflash_prep_profile",
                               ["--num-samples", "8", "--max-length", "200"])
    mode = report["modes"]["dflash_prep_profile"]
    assert mode["status"] == "ok" and mode["num_samples"] == report["modes"]["dflash_prep"]["num_samples"]
    prof = mode["profile"]
    assert prof["device"] == "cpu" and prof["total_seconds"] > 0
    assert abs(sum(v["share"] for v in prof["categories"].values()) - 1) < 1e-9
    assert prof["categories"]["gemm"]["seconds"] > 0  # the linear layers of the decoder
    assert prof["top"] and prof["top"] == sorted(prof["top"], key=lambda k: -k["seconds"])
    assert "Where the time goes (dflash_prep_profile" in Path(report["markdown_path"]).read_text()
    assert rb.kernel_profile.__doc__
    with pytest.raises(SystemExit, match="dflash_prep_profile repeats dflash_prep"):
        rb.main(["--model", "tiny-llama", "--modes", "dflash_prep_profile", "--results-dir", str(tmp_path)])


@pytest.mark.parametrize("name, category", [
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gated_deltanet"),
    ("merge_16x16_to_64x64_inverse_kernel", "gated_deltanet"),
    ("gdn_gate_fwd_kernel", "gated_deltanet"),
    ("chunk_scaled_dot_kkt_fwd_kernel", "gated_deltanet"),
    ("causal_conv1d_fwd_kernel", "conv"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_cublas", "gemm"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTN", "gemm"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, cutlass::bfloat16_t>>",
     "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("layer_norm_gated_fwd_kernel", "norm"),
    ("Memcpy DtoH (Device -> Pinned)", "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>", "other"),
])
def test_kernel_categories_of_the_gpu_profile(rb, name, category):
    """Kernel names as CUDA reports them (cuBLAS, flash attention, flash-linear-attention's Triton kernels)."""
    assert next((c for c, pattern in rb.KERNEL_CATEGORIES if pattern.search(name)), "other") == category


@pytest.mark.slow
def test_command_line_writes_the_report_layout_of_the_committed_gpu_reports(tmp_path):
    """`python bench/run_bench.py` as the README runs it (a file, another working directory, no PYTHONPATH): its
    report has the keys, in order, of the newest committed GPU report of the same model (written on an H200)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ACCELERATE_TORCH_DEVICE="cpu", HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_bench.py"), "--model", "tiny-llama", "--device", "cpu",
         "--num-samples", "4", "--max-length", "64", "--modes", "per_sample,dflash_prep", "--gemm-size", "64",
         "--dflash-set", "batching.num_workers=0", "--results-dir", str(tmp_path / "r"), "--out-dir",
         str(tmp_path / "o")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "r").glob("tiny-llama-*.json")
    report = json.loads(path.read_text())
    reports = [json.loads(f.read_text()) for f in sorted((REPO / "bench" / "results").glob("llama3.1-8b-2*.json"))]
    committed = [r for r in reports if {"per_sample", "dflash_prep"} <= set(r["modes"])][-1]  # newest with both
    assert list(report) == list(committed)
    assert list(report["settings"]) == list(committed["settings"])
    for mode in ("per_sample", "dflash_prep"):
        assert report["modes"][mode]["status"] == "ok"
        assert list(report["modes"][mode]) == list(committed["modes"][mode]), mode
        # parts added since that GPU run (e.g. writer_drain) may follow; none dropped or reordered
        parts, committed_parts = list(report["modes"][mode]["breakdown_seconds"]), \
            list(committed["modes"][mode]["breakdown_seconds"])
        assert [p for p in parts if p in committed_parts] == committed_parts
    assert list(report["consistency"]["pairs"]) == ["per_sample~dflash_prep"]
    assert "| **tokens/s** (real) |" in path.with_suffix(".md").read_text()


@pytest.mark.slow
def test_a_scenario_round_limits_logs_and_records_every_step(tmp_path, monkeypatch, capsys):
    """bench/device_round.py's Round: a step's output goes to its log and its outcome to steps.jsonl; a failing step
    does not stop the next; a step past its limit is stopped with the processes it started, also one in a session
    of its own (as launched ranks are); a step with too little time left is skipped; the round says it is not ok."""
    import json
    import time

    from bench import device_round as bench_round
    from bench import scenarios

    monkeypatch.setattr(bench_round, "MIN_STEP_SECONDS", 1)
    monkeypatch.setattr(bench_round, "KILL_GRACE_SECONDS", 1)
    monkeypatch.setenv("WHEEL_DIR", str(tmp_path / "no-wheels"))  # a GPU machine's wheels are not this test's
    pid_file = tmp_path / "grandchild.pid"
    spawn = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(120)'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(120)")

    def fake(r):
        r.step("prints", 30, r.python("-c", "print('12,345 tok/s')"))
        r.step("fails", 30, r.python("-c", "import sys; sys.exit(3)"))
        r.step("hangs", 3, r.python("-c", spawn, pid_file))
        r.deadline = time.monotonic() - r.t0  # nothing left for the last one
        r.step("too-late", 30, r.python("-c", "print('never')"))

    sc = bench_round.Scenario("fake", 1, "a test scenario", fake)
    monkeypatch.setitem(scenarios.SCENARIOS, "fake", sc)
    results = tmp_path / "results"
    assert scenarios.main(["run", "fake", str(results)]) == 1
    steps = {s["name"]: s for s in map(json.loads, (results / "steps.jsonl").read_text().splitlines())}
    assert {n: s["status"] for n, s in steps.items()} == {"prints": "ok", "fails": "failed", "hangs": "timeout",
                                                          "too-late": "skipped"}
    assert steps["fails"]["exit_code"] == 3 and steps["hangs"]["seconds"] < 15
    assert (results / "logs" / "prints.log").read_text() == "12,345 tok/s\n"
    grandchild = int(pid_file.read_text())
    for _ in range(50):
        try:  # gone, or a zombie; a process can go between a look at /proc and the read (ESRCH, ENOENT)
            if " Z " in open(f"/proc/{grandchild}/stat").read():
                break
        except OSError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the step's process in a session of its own outlived its timeout")
    out = capsys.readouterr().out
    assert "12,345 tok/s" in out and "not ok: fails, hangs, too-late" in out


def test_every_scenario_is_listed_with_its_options(capsys):
    from bench import scenarios

    assert scenarios.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("smoke", "bench", "kernels", "packing", "balance", "replica", "round", "levers", "long", "profile",
                 "faults", "storage"):
        assert out.count(f"\n{name} ") + out.startswith(f"{name} ") == 1, name
    assert "--set alt_wheels=" in out and "--set run_8b=1" in out

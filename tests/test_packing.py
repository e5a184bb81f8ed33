"""Packed rows (batching.packing, dflash_prep/target/packing.py): the plan, the choice, the invariant (a packed sample's
states equal its states run alone through plain transformers), end to end, OOM splits and resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import (REPO, build, cpu_2proc_config, demo_overrides, raw_records, tiny_llama_config,
                      tiny_qwen35_config)

from dflash_prep.commands.extract import EXIT_STOPPED, main
from dflash_prep.consume.reader import ShardDataset
from dflash_prep.faults import ENV_VAR
from dflash_prep.plan.batches import SampleInfo, collate_packed
from dflash_prep.plan.planner import packed_row_lengths, plan_packed_rows, plan_stats, split_across_ranks
from dflash_prep.recipe.schema import RecipeError, load_recipe
from dflash_prep.target.capture import LayerCapture
from dflash_prep.target.layers import find_decoder
from dflash_prep.target.packing import replay_stored_layout, select_packing, use_packed_attention

if str(REPO) not in sys.path:  # bench/ is a folder of the checkout, not part of the installed package
    sys.path.insert(0, str(REPO))
from bench.samples import make_samples  # noqa: E402

ARCHS = {"llama": tiny_llama_config, "qwen3_5_hybrid": tiny_qwen35_config}
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV.pop(ENV_VAR, None)


# ------------------------------------------------------------------------------------------------ planner
def _lognormal_lengths(n: int) -> list[int]:
    return make_samples(n, 5.41, 0.9, 16, 4096, 1000, seed=0).lengths.tolist()  # the benchmark's lengths


@pytest.mark.parametrize("budget", [16384, 65536])
def test_packed_plan_fills_rows_keeps_every_sample_once_and_has_few_shapes(budget):
    lengths = _lognormal_lengths(6000)
    plan = plan_packed_rows(lengths, max_tokens_per_batch=budget, length_multiple=64)
    placed = [i for p in plan for i in p.sample_indices]
    assert sorted(placed) == list(range(len(lengths)))
    for p in plan:
        assert p.packed and p.shape == (1, p.padded_length)
        assert p.num_real_tokens == sum(lengths[i] for i in p.sample_indices) <= p.padded_length <= budget
    stats = plan_stats(plan)
    assert stats["padding_efficiency"] >= 0.98, stats
    assert stats["num_shapes"] <= len(packed_row_lengths(budget, 64)) == 5
    assert stats["num_padded_tokens"] == sum(p.padded_length for p in plan)
    assert [p.padded_length for p in plan] == sorted((p.padded_length for p in plan), reverse=True)
    assert plan == plan_packed_rows(lengths, max_tokens_per_batch=budget, length_multiple=64)  # deterministic
    shares = split_across_ranks(plan, 3)
    assert sorted(b.batch_id for s in shares for b in s) == list(range(len(plan)))


def test_packed_plan_gives_an_over_long_sample_a_row_of_its_own():
    plan = plan_packed_rows([100, 5000, 30, 4096], max_tokens_per_batch=4096, length_multiple=64)
    by_sample = {i: p for p in plan for i in p.sample_indices}
    assert by_sample[1].sample_indices == (1,) and by_sample[1].padded_length == 5056  # 5000 rounded up to 64
    assert by_sample[3].sample_indices == (3,) and by_sample[3].padded_length == 4096  # exactly fills a row
    assert by_sample[0] is by_sample[2] and by_sample[0].padded_length == 512  # 130 tokens: the 1/8 row
    with pytest.raises(ValueError):
        plan_packed_rows([3, 0], max_tokens_per_batch=64, length_multiple=16)


def test_row_lengths_never_exceed_the_budget():
    assert packed_row_lengths(16384, 64) == (2048, 4096, 8192, 12288, 16384)
    assert packed_row_lengths(1000, 64) == (128, 256, 512, 768, 1000)


def test_packed_rows_hold_at_most_the_row_budget(tmp_path):
    from dflash_prep.plan.planner import make_plan
    from dflash_prep.recipe.schema import RecipeError, load_recipe

    g = np.random.default_rng(3)
    lengths = [int(x) for x in np.clip(g.lognormal(5.4, 0.9, 3000), 16, 4096)]  # ~1M tokens
    for row, budget, want in (("auto", 131072, 32768), ("auto", 16384, 16384), (65536, 131072, 65536),
                              (65536, 8192, 8192)):
        recipe = load_recipe(None, demo_overrides(tmp_path / "o", **{"batching.max_tokens_per_batch": budget,
                                                                     "batching.max_tokens_per_row": row}))
        plan = make_plan(lengths, recipe, packed=True)
        assert max(p.padded_length for p in plan) == want  # rows filled to the row budget, never above it
        assert sum(p.num_real_tokens for p in plan) == sum(lengths)
        assert sum(p.num_real_tokens for p in plan) / sum(p.padded_length for p in plan) >= 0.98
    for bad in (0, "big", True):
        with pytest.raises(RecipeError, match="batching.max_tokens_per_row"):
            load_recipe(None, demo_overrides(tmp_path / "o", **{"batching.max_tokens_per_row": bad}))
    for bad in (0, 1, "maybe"):  # 0 and 1 would read as false/true in a tuple test: refused, not taken as auto
        with pytest.raises(RecipeError, match="batching.packing"):
            load_recipe(None, demo_overrides(tmp_path / "o", **{"batching.packing": bad}))


# ------------------------------------------------------------------------------------------------ choice
def test_packing_choice_by_device_architecture_and_kernels():
    llama, qwen = tiny_llama_config(), tiny_qwen35_config()
    assert not select_packing("auto", llama, "cpu", ()).packed  # CPU default: padded batches
    assert select_packing(True, llama, "cpu", ()).packed
    assert select_packing(True, qwen, "cpu", ()).packed  # Gated DeltaNet per segment on the CPU
    auto = select_packing("auto", llama, "cuda", ())  # exact and measured faster on a GPU: packed rows
    assert auto.packed and "faster" in auto.reason
    for not_flash in ("float32", "float16x"):  # attention would run per sample: padded batches
        assert not select_packing("auto", llama, "cuda", (), compute_dtype=not_flash).packed
    assert select_packing("auto", llama, "cuda", (), compute_dtype="float16").packed
    assert not select_packing("auto", llama, "cuda", (), several_gpus=True).packed
    assert select_packing(True, llama, "cuda", (), compute_dtype="float32").packed  # asked for: packed anyway
    assert select_packing(True, llama, "cuda", ()).packed
    assert not select_packing(False, llama, "cuda", ()).packed
    auto = select_packing("auto", qwen, "cuda", (), assume_fla=True)  # no fla_conv: the torch conv would leak
    assert not auto.packed and "fla_conv" in auto.reason
    assert select_packing("auto", qwen, "cuda", ("fla_conv",), assume_fla=True).packed
    assert select_packing(True, qwen, "cuda", ("fla_conv",), assume_fla=True).packed
    # asked for without fla_conv: exact with each Gated DeltaNet module run once per sample (auto: padded)
    assert select_packing(True, qwen, "cuda", (), assume_fla=True).packed
    import importlib.util

    from dflash_prep.target.mixers import fla_chunk_in_use

    if importlib.util.find_spec("fla") is None:  # transformers' torch fallback ignores cu_seqlens: per sample
        assert fla_chunk_in_use("transformers.models.qwen3_5.modeling_qwen3_5") is False
        auto = select_packing("auto", qwen, "cuda", ("fla_conv",))
        assert not auto.packed and "chunk kernel is not in use" in auto.reason
    from transformers import GPT2Config

    with pytest.raises(RecipeError, match="batching.packing.*GPT2Block.*gpt2"):  # a block of its own kind
        select_packing(True, GPT2Config(), "cpu", ())
    assert not select_packing("auto", GPT2Config(), "cuda", ()).packed


def test_a_resume_replays_the_stored_layout_or_refuses_it():
    llama = tiny_llama_config()
    padded = select_packing(False, llama, "cpu", ())
    assert replay_stored_layout(padded, True, llama, "cpu", ()).packed  # a packed plan runs packed where exact
    assert not replay_stored_layout(select_packing(True, llama, "cpu", ()), False, llama, "cpu", ()).packed
    from transformers import GPT2Config

    with pytest.raises(RecipeError, match="plan.json"):
        replay_stored_layout(select_packing(False, GPT2Config(), "cpu", ()), True, GPT2Config(), "cpu", ())


# ------------------------------------------------------------------------------------------- invariant
def _samples(lengths, vocab=1000, seed=0):
    g = np.random.default_rng(seed)
    return [SampleInfo(f"{i:010d}", i, None, g.integers(1, vocab, n).astype(np.int32), np.ones(n, np.uint8))
            for i, n in enumerate(lengths)]


def _alone(model, sample):
    """Plain transformers, the sample alone: hidden_states[i + 1] is after-layer id i, [-1] after the norm."""
    with torch.inference_mode():
        return find_decoder(model)(input_ids=torch.from_numpy(sample.input_ids.astype(np.int64))[None],
                                   use_cache=False, output_hidden_states=True).hidden_states


def _rel(got, ref) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("capture_final", ["none", "after_norm"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_row_states_equal_each_sample_run_alone(arch, capture_final):
    model = build(ARCHS[arch]())
    layer_ids = [0, 2, 4] if capture_final == "none" else [1, 3]
    H = model.config.get_text_config().hidden_size
    lengths = [1, 70, 17, 3, 64, 2, 40, 128]
    samples = _samples(lengths)
    refs = [_alone(model, s) for s in samples]  # before the model is switched to packed rows
    rows = [(list(range(7)), 224), ([7], 128)]  # mixed lengths with tail padding; one sample filling its row
    use_packed_attention(model, "cpu")
    with LayerCapture(model, layer_ids, capture_final=capture_final, storage_dtype=torch.float32) as cap:
        for indices, row_length in rows:
            batch = collate_packed([samples[i] for i in indices], row_length, 0, 0)
            assert batch.input_ids.shape == (1, row_length) and batch.cu_seqlens.dtype == torch.int32
            out = cap.run(**batch.tensors_on(torch.device("cpu")))
            start = 0
            for i in indices:
                n = lengths[i]
                for slot, layer in enumerate(layer_ids):
                    got = out.hidden_states_NK[start:start + n, slot * H:(slot + 1) * H]
                    assert _rel(got, refs[i][layer + 1][0]) <= 1e-5, (arch, i, layer)
                if capture_final == "after_norm":
                    assert _rel(out.final_hidden_states_NH[start:start + n], refs[i][-1][0]) <= 1e-5, (arch, i)
                start += n
            assert start == out.hidden_states_NK.shape[0]


def test_packed_collate_layout():
    samples = _samples([3, 1, 4])
    batch = collate_packed(samples, 12, 7, 5)
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 8, 12] and batch.max_length == 4
    assert batch.input_ids[0, 8:].tolist() == [7] * 4 and batch.flat_index.tolist() == list(range(8))
    assert batch.attention_mask is None and batch.num_padded_tokens == 12 and batch.num_real_tokens == 8
    assert collate_packed(samples, 8, 7).cu_seqlens.tolist() == [0, 3, 4, 8]  # no tail segment
    with pytest.raises(ValueError):
        collate_packed(samples, 7, 0)


# ------------------------------------------------------------------------------------------ end to end
SETTINGS = {"data.max_samples": 160, "batching.max_tokens_per_batch": 4096, "output.max_shard_bytes": "1MB"}


def _argv(out: Path, **extra) -> list[str]:
    return [a for kv in demo_overrides(out, **{**SETTINGS, **extra}) for a in ("--set", kv)]


def _by_id(out: Path) -> dict[str, dict]:
    return {s["sample_id"]: s for s in ShardDataset(out)}


def _assert_same_samples(got: dict, want: dict, rtol: float = 2 ** -7):
    """Same samples and tokens; states equal up to one bf16 rounding step of the stored values."""
    assert set(got) == set(want)
    for key, s in got.items():
        assert torch.equal(s["input_ids"], want[key]["input_ids"])
        assert torch.equal(s["loss_mask"], want[key]["loss_mask"])
        a, b = s["hidden_states"].float(), want[key]["hidden_states"].float()
        assert ((a - b).abs().max() / b.abs().max()).item() <= rtol, key


@pytest.fixture(scope="module")
def padded_and_packed(tmp_path_factory):
    """The README's extract command on the tiny recipe: padded (the CPU default), and packed with a DataLoader
    worker, each in its own process."""
    root = tmp_path_factory.mktemp("packing")
    outs = {}
    for name, extra in (("padded", {}), ("packed", {"batching.packing": "true", "batching.num_workers": 1})):
        outs[name] = root / name
        proc = subprocess.run([sys.executable, "extract.py", *_argv(outs[name], **extra)], cwd=REPO, env=ENV,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return outs


@pytest.mark.slow
def test_packed_extraction_equals_the_padded_one(padded_and_packed):
    packed, padded = padded_and_packed["packed"], padded_and_packed["padded"]
    _assert_same_samples(_by_id(packed), _by_id(padded))
    summary = json.loads((packed / "summary.json").read_text())
    manifest = json.loads((packed / "manifest.json").read_text())
    plan = json.loads((packed / "plan.json").read_text())
    assert summary["packing"] == manifest["packing"] == {"requested": True, "packed": True,
                                                         "reason": "batching.packing: true"}
    assert plan["packed"] is True and all(T <= 4096 for T, _ in plan["batches"])
    padded_summary = json.loads((padded / "summary.json").read_text())
    assert padded_summary["packing"]["packed"] is False
    assert summary["padding_efficiency"] > padded_summary["padding_efficiency"]
    assert summary["ranks"][0]["packed"] is True and summary["ranks"][0]["num_shapes"] <= 5


@pytest.mark.slow
def test_plan_command_reports_the_packed_rows(padded_and_packed, tmp_path):
    from dflash_prep.commands.plan import format_plan, make_run_plan
    from dflash_prep.recipe.schema import load_recipe

    recipe = load_recipe(None, demo_overrides(tmp_path / "o", **SETTINGS, **{"batching.packing": "true"}))
    p = make_run_plan(recipe, bench_dir=None)
    stored = json.loads((padded_and_packed["packed"] / "plan.json").read_text())["batches"]
    assert p["num_batches"] == len(stored) and p["packing"]["packed"]
    assert sum(p["shapes"].values()) == len(stored) and all(k.startswith("1x") for k in p["shapes"])
    summary = json.loads((padded_and_packed["packed"] / "summary.json").read_text())
    assert p["padding_efficiency"] == summary["padding_efficiency"]
    assert "packed rows" in format_plan(p)
    assert p["max_tokens_per_row"] == 4096 and "packed rows of at most 4,096 tokens" in format_plan(p)
    assert p["stored_plan"] is None and "resume" not in format_plan(p)
    # planned into the existing packed output, with other batching: the stored plan is what a resume runs
    other = load_recipe(None, [f"output.dir={padded_and_packed['packed']}"] + demo_overrides(
        tmp_path / "o", **SETTINGS, **{"batching.packing": "false"})[1:])
    text = format_plan(make_run_plan(other, bench_dir=None))
    assert f"{padded_and_packed['packed']} is finished: running this recipe again changes nothing" in text
    unfinished = tmp_path / "unfinished"  # the same plan.json, no manifest yet: what a resume runs
    unfinished.mkdir()
    (unfinished / "plan.json").write_text((padded_and_packed["packed"] / "plan.json").read_text())
    other = load_recipe(None, [f"output.dir={unfinished}"] + demo_overrides(tmp_path / "o", **SETTINGS)[1:])
    text = format_plan(make_run_plan(other, bench_dir=None))
    assert f"holds {len(stored):,} packed rows: a resume runs those, not the plan below" in text
    edited = tmp_path / "edited"  # a stored plan a resume would refuse (a sample twice): plan says so, and why
    edited.mkdir()
    plan_json = json.loads((padded_and_packed["packed"] / "plan.json").read_text())
    plan_json["batches"][0][1].append(plan_json["batches"][-1][1][0])
    (edited / "plan.json").write_text(json.dumps(plan_json))
    other = load_recipe(None, [f"output.dir={edited}"] + demo_overrides(tmp_path / "o", **SETTINGS)[1:])
    assert "a resume refuses it: " in format_plan(make_run_plan(other, bench_dir=None))
    # planned for GPUs from this CPU machine: `true` resolves as the GPU run would (the [gpu] extra installed);
    # `auto` plans packed rows there in bf16 (what the GPU run does), padded batches in fp32 and on this CPU
    gpu = make_run_plan(recipe, bench_dir=None, gpu_memory_bytes=141 * 10**9)
    assert gpu["packing"] == {"requested": True, "packed": True, "reason": "batching.packing: true"}
    assert gpu["num_batches"] == len(stored)
    for dtype, packed_on_gpus in (("bfloat16", True), ("float32", False)):
        recipe = load_recipe(None, demo_overrides(tmp_path / "o", **SETTINGS, **{"model.dtype": dtype}))
        assert make_run_plan(recipe, bench_dir=None, gpu_memory_bytes=141 * 10**9)["packing"]["packed"] is \
            packed_on_gpus
        assert not make_run_plan(recipe, bench_dir=None)["packing"]["packed"]
    cpu = make_run_plan(recipe, bench_dir=None)
    assert not cpu["packing"]["packed"] and any(not k.startswith("1x") for k in cpu["shapes"])


@pytest.mark.slow
def test_packed_oom_splits_the_row_by_samples(padded_and_packed, tmp_path, monkeypatch, capsys):
    packed = padded_and_packed["packed"]
    plan = json.loads((packed / "plan.json").read_text())["batches"]
    first = next(b for b, (_, rows) in enumerate(plan) if len(rows) >= 4)
    # One row: its whole forward runs out of memory once, and one of its samples does not fit even alone. (Within
    # one row, so the test does not depend on the order the rank runs its rows in.)
    victim = f"{plan[first][1][-1]:010d}"
    monkeypatch.setenv(ENV_VAR, json.dumps({"oom_batches": [first], "oom_samples": [victim]}))
    out = tmp_path / "out"
    assert main(_argv(out, **{"batching.packing": "true", "batching.num_workers": 0,
                              "output.max_failed_samples": 1})) == 0
    err = capsys.readouterr().err
    assert f"batch {first}: out of memory on a packed row" in err
    assert f"sample {victim}" in err and "does not fit in memory even alone" in err
    report = json.loads((out / "summary.json").read_text())
    (rank,) = report["ranks"]
    assert 0 < rank["oom_packed_token_cap"] < 4096  # a token cap learned for later rows
    want = _by_id(packed)
    del want[victim]
    _assert_same_samples(_by_id(out), want)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_failed"] == 1 and summary["num_oom"] >= 2


@pytest.mark.slow
def test_a_resume_without_packing_finishes_a_packed_plan(padded_and_packed, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv(ENV_VAR, json.dumps({"enospc_shard": 1}))  # stops the packed run after shard 0 committed
    assert main(_argv(out, **{"batching.packing": "true", "batching.num_workers": 0})) == EXIT_STOPPED
    monkeypatch.delenv(ENV_VAR)
    capsys.readouterr()
    # packing: auto (padded on the CPU), and another row budget: the stored plan runs, and the saved recipe says so
    assert main(_argv(out, **{"batching.num_workers": 0, "batching.max_tokens_per_row": 1024})) == 0
    assert "the stored plan has packed rows: resuming with them" in capsys.readouterr().err
    saved = load_recipe(out / "recipe.resolved.yaml").batching
    assert (saved.packing, saved.max_tokens_per_row, saved.num_workers) == (True, "auto", 0)
    _assert_same_samples(_by_id(out), _by_id(padded_and_packed["packed"]), rtol=0)
    assert json.loads((out / "summary.json").read_text())["packing"]["packed"] is True
    assert raw_records(out).keys() == raw_records(padded_and_packed["packed"]).keys()


@pytest.mark.slow
def test_benchmark_runs_dflash_prep_with_packed_rows(tmp_path):
    """bench/run_bench.py's dflash_prep mode with packed rows (forced here: `auto` packs on GPUs only) and the
    padded A/B as its variant; the report says which ran, with each one's padding efficiency and shapes."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ACCELERATE_TORCH_DEVICE="cpu", HF_DATASETS_CACHE=str(tmp_path / "hf-cache"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_bench.py"), "--model", "tiny-llama", "--device", "cpu",
         "--num-samples", "24", "--max-length", "128", "--length-mu", "3.5",
         "--modes", "dflash_prep,dflash_prep_variant",
         "--gemm-size", "64", "--dflash-set", "batching.num_workers=0", "--dflash-set", "batching.packing=true",
         "--dflash-set", "batching.max_tokens_per_batch=512", "--variant-set", "batching.packing=false",
         "--results-dir", str(tmp_path / "r"), "--out-dir", str(tmp_path / "o")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "r").glob("tiny-llama-*.json")
    modes = json.loads(path.read_text())["modes"]
    packed, padded = modes["dflash_prep"], modes["dflash_prep_variant"]
    assert packed["status"] == padded["status"] == "ok"
    assert packed["summary"]["packing"]["packed"] and not padded["summary"]["packing"]["packed"]
    assert all(s[0] == 1 for s in packed["shapes"]) and packed["num_samples"] == padded["num_samples"]
    assert packed["padding_efficiency"] > padded["padding_efficiency"]
    assert "| batches (batching.packing) |" in path.with_suffix(".md").read_text()


@pytest.mark.slow
def test_packed_nonfinite_states_fail_only_their_sample(padded_and_packed, tmp_path, monkeypatch):
    """The per-sample NaN/Inf flags find the sample of each token in a packed row (its segment); fp8 storage."""
    plan = json.loads((padded_and_packed["packed"] / "plan.json").read_text())["batches"]
    victim = f"{plan[0][1][2]:010d}"  # the third sample of the first row: neither its first nor its last
    monkeypatch.setenv(ENV_VAR, json.dumps({"nan_samples": [victim]}))
    out = tmp_path / "out"
    assert main(_argv(out, **{"batching.packing": "true", "batching.num_workers": 0, "output.dtype": "fp8_e4m3",
                              "output.max_failed_samples": 1})) == 0
    failed = [json.loads(line) for line in (out / "failed.jsonl").read_text().splitlines()]
    assert [(f["sample_id"], f["reason"]) for f in failed] == [(victim, "non_finite_hidden_states")]
    got = _by_id(out)
    want = _by_id(padded_and_packed["packed"])
    assert set(got) == set(want) - {victim}
    for key, s in got.items():  # fp8: within e4m3's rounding (2^-4 of the token's max) of the bf16 states
        a, b = s["hidden_states"].float(), want[key]["hidden_states"].float()
        assert ((a - b).abs().max() / b.abs().max()).item() <= 2 ** -4 + 2 ** -7, key


def test_forced_packing_where_not_exact_is_refused_with_one_line(tmp_path, capsys):
    from transformers import GPT2Config

    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps(GPT2Config(n_layer=8, n_embd=32, n_head=2, vocab_size=1000, bos_token_id=0,
                                            eos_token_id=0).to_dict()))
    out = tmp_path / "out"
    code = main(_argv(out, **{"model.config": str(config), "batching.packing": "true",
                              "batching.num_workers": 0, "data.max_length": 1024}))  # GPT-2's context: 1,024
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[")]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: recipe key `batching.packing` = true"), err
    assert "gpt2" in err[0] and not (out / "plan.json").exists()


@pytest.mark.slow
def test_two_processes_split_the_packed_rows(padded_and_packed, tmp_path):
    """`accelerate launch` with 2 processes (gloo on CPU): the packed plan's rows split over both ranks, each sample
    written once, with the bytes of the 1-process packed run (same global plan, same rows)."""
    out = tmp_path / "two"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           cpu_2proc_config(), "extract.py",
                           *_argv(out, **{"batching.packing": "true", "batching.num_workers": 0})],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert {Path(s["path"]).parent.name for s in manifest["shards"]} == {"rank-00000", "rank-00001"}
    assert manifest["packing"]["packed"]
    two, one = raw_records(out), raw_records(padded_and_packed["packed"])  # raw_records: no id twice
    assert set(two) == set(one)
    assert all(two[k]["hidden_states.safetensors"] == one[k]["hidden_states.safetensors"] for k in one)


@pytest.mark.slow
def test_samples_longer_than_the_budget_get_rows_of_their_own(padded_and_packed, tmp_path):
    out = tmp_path / "out"
    assert main(_argv(out, **{"batching.packing": "true", "batching.num_workers": 0, "data.max_samples": 40,
                              "batching.max_tokens_per_batch": 512})) == 0
    plan = json.loads((out / "plan.json").read_text())["batches"]
    lengths = {int(sid): len(s["input_ids"]) for sid, s in _by_id(out).items()}  # id = the kept row's index
    alone = [(T, rows) for T, rows in plan if len(rows) == 1 and T > 512]
    assert alone and all(T >= lengths[rows[0]] > 512 for T, rows in alone)
    assert all(T <= 512 for T, rows in plan if len(rows) > 1)
    got, want = _by_id(out), _by_id(padded_and_packed["packed"])
    _assert_same_samples(got, {k: want[k] for k in got})

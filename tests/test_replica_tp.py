"""A tensor-parallel replica of 2 processes, run for real on the CPU (gloo; transformers' DTensor tensor
parallelism runs there): the states written equal each sample run alone through plain transformers on one
device, with random weights drawn per module (rebuilt here by the documented rule, not by the code under test);
only the replica's first process writes; a stop signal to one process, a fatal NaN seen only by the writer and an
OOM split are agreed by both processes (no hang: every run is under a timeout), and a resume after the stop
completes the output byte for byte."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cpu_2proc_config, max_abs_diff_to_alone, tiny_llama_config
from test_extract import read_records
from torch import nn

from dflash_prep.target.layers import find_decoder
from dflash_prep.target.norms import randomize_norm_gains

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DFLASH_PREP_CPU_REPLICAS": "1"}
ENV.pop("DFLASH_PREP_FAULTS", None)
NUM_SAMPLES = 48
SEED = 0


def common(config_file: Path) -> list[str]:
    sets = [f"model.config={config_file}", "model.gpus_per_replica=2", f"data.max_samples={NUM_SAMPLES}",
            "output.dtype=float32", "batching.max_tokens_per_batch=2048", "batching.num_workers=0",
            "layers.capture_final=after_norm", "output.max_shard_bytes=200KB"]
    return [a for s in sets for a in ("--set", s)]


def launch(out: Path, config_file: Path, faults: dict | None = None, extra: tuple = ()) -> subprocess.CompletedProcess:
    env = dict(ENV, DFLASH_PREP_FAULTS=json.dumps(faults)) if faults else ENV
    cmd = [sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--config_file",
           cpu_2proc_config(), "extract.py", "--set", f"output.dir={out}",
           *common(config_file), *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def reference_model(seed: int) -> nn.Module:
    """The documented draw of a replica's random weights, written out here: for each module holding parameters, in
    module order, fresh parameters, torch.manual_seed(first 8 bytes of sha256("seed:module name"), little endian,
    >> 1), transformers' `_init_weights(module)`; then the norm gains."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.float32, attn_implementation="sdpa")
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        for param_name, param in own:
            module._parameters[param_name] = nn.Parameter(torch.empty_like(param), requires_grad=False)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        model._init_weights(module)
    randomize_norm_gains(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def tp_out(tmp_path_factory, llama_config_file) -> Path:
    out = tmp_path_factory.mktemp("tp") / "out"
    proc = launch(out, llama_config_file)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_tensor_parallel_replica_writes_what_each_sample_gets_alone(tp_out):
    summary = json.loads((tp_out / "summary.json").read_text())
    assert summary["replicas"] == {"gpus_per_replica": 2, "parallelism": "tensor_parallel", "num_replicas": 1,
                                   "processes_per_replica": 2}
    manifest = json.loads((tp_out / "manifest.json").read_text())
    assert {Path(s["path"]).parent.name for s in manifest["shards"]} == {"rank-00000"}  # one writer
    records = read_records(tp_out)  # asserts no sample twice
    assert len(records) == NUM_SAMPLES
    decoder = find_decoder(reference_model(SEED))
    worst = max_abs_diff_to_alone(decoder, records, manifest["layer_ids"], 64)
    assert worst <= 1e-5, f"max abs diff {worst}"


@pytest.mark.slow
def test_verify_rebuilds_a_tensor_parallel_replicas_weights(tp_out):
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(tp_out), "--num-samples", "6"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "verify: OK: 6 sample(s)" in proc.stdout


def verify_launched(out: Path, num_processes: int, *extra: str) -> subprocess.CompletedProcess:
    """`dflash-prep launch ... -m dflash_prep.commands.cli verify OUT` as a user runs it for a tensor-parallel output."""
    cmd = [sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--config_file",
           cpu_2proc_config(), "--num_processes", str(num_processes), "-m",
           "dflash_prep.commands.cli", "verify", str(out), "--num-samples", "6", *extra]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_verify_launched_as_the_replica_computes_its_reference_tensor_parallel(tp_out):
    proc = verify_launched(tp_out, 2, "--json")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)  # one report: the replica's other process prints nothing
    assert report["ok"] and report["reference"] == "tensor parallel over 2 processes"
    assert len(report["results"]) == 6 * (len(report["worst_by_layer"]))
    # fp32, the same sharded computation as the extraction: only batching differs
    assert max(w["relative_error"] for w in report["worst_by_layer"].values()) < 1e-4
    assert report["integrity_problems"] == []
    # the padded-batch reference ran on the replica too (every process, the same forwards): fp32, right padding
    floors = report["noise_floor"]["by_layer"]
    assert set(floors) == set(report["worst_by_layer"]) and all(f["num_samples"] == 6 for f in floors.values())
    assert max(f["relative_error"] for f in floors.values()) < 1e-4
    one = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "verify", str(tp_out), "--num-samples", "6",
                          "--json"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert json.loads(one.stdout)["reference"] == "one device"
    # a corrupted shard is found by the main process, after the forwards: exit code 1, named once
    bad = tp_out.parent / "corrupt"
    shutil.copytree(tp_out, bad)
    shard = sorted(bad.rglob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[-2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = verify_launched(bad, 2)
    assert proc.returncode == 1 and proc.stdout.count("FAIL ") == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert shard.name in proc.stdout and "1 integrity problem(s)" in proc.stdout


@pytest.mark.slow
def test_verify_launched_as_several_replicas_is_refused(tp_out):
    proc = verify_launched(tp_out, 4)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot verify" in proc.stderr and "one replica per run" in proc.stderr


@pytest.mark.slow
def test_a_stop_signal_to_one_process_stops_the_replica_and_a_resume_completes_it(tp_out, llama_config_file,
                                                                                    tmp_path):
    """SIGTERM to the replica's second process (not the writer) after its 3rd batch: both stop at that batch,
    the writer commits what it captured, exit code 1; the re-run finishes the rest: the same records, same bytes."""
    out = tmp_path / "out"
    stopped = launch(out, llama_config_file, faults={"sigterm_after_batches": 3, "sigterm_process": 1})
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "stopped on the stop of another process of its replica" in (out / "logs" / "rank-00000.log").read_text()
    assert "stopped on SIGTERM" in (out / "logs" / "rank-00001.log").read_text()
    assert not (out / "manifest.json").exists()
    committed = sum(len(line.splitlines()) for line in [(out / "index" / "rank-00000.jsonl").read_text()])
    assert committed >= 1  # the 3 batches captured before the stop were committed
    resumed = launch(out, llama_config_file)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_records(tp_out), read_records(out)
    assert set(a) == set(b) and all(a[k]["raw"] == b[k]["raw"] for k in a)


@pytest.mark.slow
def test_a_fatal_nan_seen_by_the_writer_stops_the_other_process(tp_out, llama_config_file, tmp_path):
    out = tmp_path / "out"
    first_id = sorted(read_records(tp_out))[5]
    proc = launch(out, llama_config_file, faults={"nan_samples": [first_id]},
                  extra=("--set", "output.nan_policy=fatal"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "non-finite" in (out / "logs" / "rank-00000.log").read_text().lower()
    assert "another process of its replica failed" in (out / "logs" / "rank-00001.log").read_text()


@pytest.mark.parametrize("faults", [
    {"oom_batches": "SEVERAL"},  # before the forward, on both processes (as shards of equal size do)
    {"oom_after_forward_batches": "SEVERAL", "oom_process": 1},  # after it, on the non-writer only
])
@pytest.mark.slow
def test_an_oom_split_is_agreed_by_the_replica(tp_out, llama_config_file, tmp_path, faults):
    """The first two batches of several samples run out of memory: both processes split them the same way (also
    when only one process ran out of memory: without the agreement the other would run the next batch's
    collectives against its halves), and the output equals the run without OOMs."""
    out = tmp_path / "out"
    plan = json.loads((tp_out / "plan.json").read_text())["batches"]  # [padded length, [sample indexes]] each
    several = [i for i, (_, samples) in enumerate(plan) if len(samples) > 1][:2]
    assert len(several) == 2
    proc = launch(out, llama_config_file, faults={k: several if v == "SEVERAL" else v for k, v in faults.items()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ranks"][0]["num_oom"] == 2  # the writer's count: agreed, also where it did not run out
    a, b = read_records(tp_out), read_records(out)
    assert set(a) == set(b) and all(a[k]["raw"] == b[k]["raw"] for k in a)


@pytest.mark.slow
def test_the_gpu_replica_check_runs_every_step_on_a_cpu(tmp_path):
    """`python -m bench run replica --dry-run-cpu`: every step of the 2-GPU check (tiny configs, CPU processes)
    succeeds and the report holds the figures the GPU run prints."""
    results, work = tmp_path / "results", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench", "run", "replica", str(results), "--dry-run-cpu"], cwd=REPO,
                          env=dict(ENV, WORK_DIR=str(work)), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((results / "replica.json").read_text())
    assert {name: s["status"] for name, s in report["steps"].items()} == {
        name: "ok" for name in ("data", "gemm", "70b-tp", "verify-70b-tp", "verify-70b-tp-one-process", "8b-warmup",
                                "8b-1gpu", "8b-2gpu")}
    assert report["70b-tp"]["replicas"]["parallelism"] == "tensor_parallel" and report["70b-tp"]["verify"] == "ok"
    assert report["70b-tp"]["verify_one_process"] == "ok"
    assert "(tensor parallel over 2 processes)" in (results / "logs" / "verify-70b-tp.log").read_text()
    assert report["70b-tp"]["mfu_over_all_gpus"] > 0 and report["8b_per_gpu_ratio"] > 0
    assert report["8b_1gpu"]["num_tokens"] == report["8b_2gpu"]["num_tokens"]  # the same data
    assert report["8b_2gpu"]["replicas"]["num_replicas"] == 2
    report_log = (results / "logs" / "report.log").read_text()
    assert "per-GPU ratio" in report_log and "MFU over 2 GPUs" in report_log
    assert not list(work.glob("out-*"))  # big outputs deleted once their summaries are kept


AGREEMENT_SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
from dflash_prep.errors import ExtractionError
from dflash_prep.target.replica import ReplicaAgreement

dist.init_process_group("gloo")
rank = dist.get_rank()
tp = dist.distributed_c10d._get_default_group()
agreement = ReplicaAgreement(dist.new_group([0, 1], backend="gloo"), tp)
verdicts = []
dist.all_reduce(torch.ones(2), group=tp)                   # one collective each: in step
verdicts.append(agreement.agree_attempt(oom=rank == 1))     # process 1 ran out of memory after it: both split
verdicts.append(agreement.agree_attempt(oom=False))         # nobody did
verdicts.append(agreement.agree(rank == 0, False))          # a stop asked of process 0 only
if rank == 0:
    dist.all_reduce(torch.ones(2), group=tp, async_op=True)  # issued by process 0 alone (its peer ran out before)
try:
    agreement.agree_attempt(oom=rank == 1)
    verdicts.append("went on")
except ExtractionError as e:
    verdicts.append("stopped: " + str(e).split(":")[0])
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump(verdicts, f)
os._exit(0)  # process 0's lone collective never completes
'''


@pytest.mark.slow
def test_the_agreement_of_a_replicas_processes(tmp_path):
    """ReplicaAgreement over 2 real gloo processes: an OOM of one is a split for both when their collectives are in
    step, a stop of one a stop for both, and an OOM between collectives the peer went past stops both."""
    script = tmp_path / "agree.py"
    script.write_text(AGREEMENT_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(tmp_path / "verdicts")], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stop = ("stopped: out of memory inside a tensor-parallel forward on some process of the replica, between "
            "collectives the others went past (1 vs 2 issued)")
    for rank in (0, 1):
        assert json.loads((tmp_path / f"verdicts.{rank}").read_text()) == [True, False, [True, False], stop]


@pytest.mark.slow
def test_several_tensor_parallel_replicas_are_refused_before_any_weights_load(llama_config_file, tmp_path):
    """4 CPU processes as 2 tensor-parallel replicas of 2: one line naming the key and the ways out, exit code 2."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "dflash_prep.commands.cli", "launch", "--config_file",
                           cpu_2proc_config(), "--num_processes", "4", "extract.py",
                           "--set", f"output.dir={out}", *common(llama_config_file)],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # Every process prints the line; with 4 processes writing one stderr, pieces of other output can land inside
    # a line, so the message's parts are looked for in the whole stream.
    assert any(line.startswith("error: recipe key `model.gpus_per_replica` = 2:") for line in proc.stderr.splitlines())
    for part in ("tensor parallelism runs one replica per run, this launch makes 2",
                 "use gpus_per_replica = the run's 4 GPUs (one node)",
                 "model.replica_parallelism: layer_split and --num_processes GPUs / 2 per node"):
        assert part in proc.stderr, part
    assert not (out / "plan.json").exists()

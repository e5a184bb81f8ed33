"""GPU check of the failure paths that the CPU tests can only inject: a real CUDA out-of-memory error and the
non-finite check on the device. Not run by CI; needs one GPU (datasets and webdataset importable).

    python3 bench/gpu_faults.py [--out /tmp/gpu_faults] [--fractions 0.0006]

1. reference: the demo recipe in bf16 on the GPU, large batches (max_tokens_per_batch 65536), no memory cap;
2. for each fraction F: the same run in a process whose caching allocator is capped at F of the GPU's memory
   (torch.cuda.set_per_process_memory_fraction), so the large batches really run out of memory: the run must
   finish, every planned sample must be written or recorded as failed (out_of_memory), `inspect --check` must
   pass, and the written states must equal the reference's up to bf16 batch-composition noise;
3. a NaN injected (DFLASH_PREP_FAULTS) into one sample, with bf16 and fp8_e4m3 storage: that sample is recorded
   as failed (non_finite_hidden_states) through the device-side check, the others are written.
Prints one JSON line per stage and exits non-zero on the first violated expectation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--set", "model.dtype=bfloat16", "--set", "data.max_samples=300", "--set", "batching.num_workers=0",
          "--set", "batching.max_tokens_per_batch=65536", "--set", "batching.max_batch_size=256",
          "--set", "output.max_failed_samples=null", "--set", "output.overwrite=true"]


def run(out: Path, extra: list[str], fraction: float | None = None, faults: dict | None = None) -> tuple[int, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("DFLASH_PREP_FAULTS", None)
    if faults:
        env["DFLASH_PREP_FAULTS"] = json.dumps(faults)
    cap = (f"import torch; torch.cuda.set_per_process_memory_fraction({fraction}); " if fraction else "")
    code = f"import sys; {cap}from dflash_prep.commands.extract import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run([sys.executable, "-c", code, "--set", f"output.dir={out}", *COMMON, *extra], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stderr


def states(out: Path) -> dict:
    from safetensors.torch import load

    manifest = json.loads((out / "manifest.json").read_text())
    found = {}
    for shard in manifest["shards"]:
        with tarfile.open(out / shard["path"]) as tar:
            for info in tar:
                key, member = info.name.split(".", 1)
                if member == "hidden_states.safetensors":
                    t = load(tar.extractfile(info).read())
                    hs = t["hidden_states"]
                    if "hidden_states_scales" in t:  # fp8: dequantize
                        from dflash_prep.target.fp8 import dequantize
                        hs = dequantize(hs, t["hidden_states_scales"])
                    found[key] = hs.float()
    return found


def check(cond: bool, what: str) -> None:
    if not cond:
        print(json.dumps({"FAILED": what}), flush=True)
        sys.exit(1)


def main() -> int:
    sys.path.insert(0, str(REPO))
    from dflash_prep.commands.inspect import check_output

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/gpu_faults")
    p.add_argument("--fractions", default="0.0006")  # the demo peaks at ~180 MB; 0.0006 of an H200 is ~86 MB
    args = p.parse_args()
    root = Path(args.out)

    rc, err = run(root / "reference", [])
    check(rc == 0, f"reference run failed: {err[-2000:]}")
    ref = states(root / "reference")
    ref_summary = json.loads((root / "reference" / "summary.json").read_text())
    print(json.dumps({"stage": "reference", "samples": len(ref), "batches": ref_summary["num_batches"],
                      "peak_gpu_memory_bytes": ref_summary["ranks"][0]["peak_gpu_memory_bytes"]}), flush=True)

    for fraction in [float(f) for f in args.fractions.split(",") if f]:
        out = root / f"capped-{fraction}"
        rc, err = run(out, [], fraction=fraction)
        check(rc == 0, f"capped run ({fraction}) did not finish: {err[-3000:]}")
        summary = json.loads((out / "summary.json").read_text())
        manifest = json.loads((out / "manifest.json").read_text())
        got = states(out)
        failed = [json.loads(line) for line in (out / "failed.jsonl").read_text().splitlines()]
        check(set(got) | {f["sample_id"] for f in failed} == set(ref), "samples lost or invented")
        check(all(f["reason"] == "out_of_memory" for f in failed), "unexpected failure reason")
        check(check_output(out) == [], "inspect --check failed")
        worst = max(((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-6)).item() for k in got)
        check(worst < 0.1, f"states differ from the reference by {worst}")
        rank = summary["ranks"][0]
        print(json.dumps({"stage": f"oom cap {fraction}", "num_oom": rank["num_oom"],
                          "num_split_batches": rank["num_split_batches"], "oom_batch_caps": rank["oom_batch_caps"],
                          "written": manifest["num_samples"], "failed": manifest["failed"],
                          "worst_rel_diff_vs_reference": worst,
                          "peak_gpu_memory_bytes": rank["peak_gpu_memory_bytes"],
                          "oom_log_lines": [line for line in err.splitlines() if "memory" in line][:6]}), flush=True)
        check(rank["num_oom"] > 0, f"the cap {fraction} caused no OOM: lower it")

    bad = sorted(ref)[7]
    for dtype in ("bfloat16", "fp8_e4m3"):
        out = root / f"nan-{dtype}"
        rc, err = run(out, ["--set", f"output.dtype={dtype}"], faults={"nan_samples": [bad]})
        check(rc == 0, f"nan run ({dtype}) failed: {err[-3000:]}")
        manifest = json.loads((out / "manifest.json").read_text())
        got = states(out)
        check(manifest["failed"] == {"non_finite_hidden_states": 1} and bad not in got and
              set(got) == set(ref) - {bad}, f"nan sample not failed as expected: {manifest['failed']}")
        check(check_output(out) == [], "inspect --check failed")
        print(json.dumps({"stage": f"nan {dtype}", "failed": manifest["failed"], "written": len(got)}), flush=True)
    print(json.dumps({"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

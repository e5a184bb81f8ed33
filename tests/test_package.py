"""The package as a user installs it (a wheel, not the checkout), and what the extraction answers before its heavy
imports (torch, transformers, datasets, accelerate): a recipe typo, and an output already finished."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEMO_ROWS = REPO / "dflash_prep" / "demo" / "tiny-demo" / "data" / "conversations.jsonl"
HEAVY = ("torch", "transformers", "datasets", "accelerate")

# Runs `dflash_prep.commands.cli.main(ARGS)` in a fresh interpreter; prints the exit code and which heavy modules
# were imported by then.
PROBE = """
import json, sys
from dflash_prep.commands.cli import main
code = main(json.loads(sys.argv[1]))
print(json.dumps([code, sorted(m for m in {heavy!r} if m in sys.modules)]))
""".format(heavy=HEAVY)


def probe(args: list[str], cwd: Path = REPO) -> tuple[int, list[str], str]:
    """(exit code, heavy modules imported, stderr) of `dflash-prep ARGS` run in a process of its own."""
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=cwd, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    code, heavy = json.loads(out.stdout.strip().splitlines()[-1])
    return code, heavy, out.stderr


def test_a_recipe_typo_is_answered_before_any_heavy_import():
    for args in (["extract", "--set", "model.bogus=1"],
                 ["launch", "-m", "dflash_prep.commands.extract", "--set", "model.bogus=1"],
                 ["launch", "extract.py", "--set", "batching.max_batch_size=0"]):
        code, heavy, err = probe(args)
        assert (code, heavy) == (2, []), (args, err)
        assert err.count("error: recipe key `") == 1, err


def test_a_launch_of_another_script_named_extract_is_not_checked_as_ours(tmp_path):
    """`dflash-prep launch` reads the arguments of OUR extraction only: a user's own extract.py takes others."""
    from dflash_prep.commands.launch import extraction_script_args

    theirs = tmp_path / "extract.py"
    theirs.write_text("import sys\nprint(sys.argv)\n")
    assert extraction_script_args([str(theirs), "--lr", "3"]) is None
    ours = ["--num_processes", "2", str(REPO / "extract.py"), "--set", "a=1"]
    assert extraction_script_args(ours) == ["--set", "a=1"]
    assert extraction_script_args(["-m", "dflash_prep.commands.extract", "--recipe", "r"]) == ["--recipe", "r"]


def test_the_stamp_of_inputs_covers_local_files_and_gives_up_on_hub_ones():
    from dflash_prep.recipe.fingerprints import inputs_stamp
    from dflash_prep.recipe.schema import load_recipe

    stamp = inputs_stamp(load_recipe(None))
    names = {Path(p).name for p in stamp["files"]}
    assert {"model_config.json", "tokenizer.json", "conversations.jsonl", "edge_cases.jsonl"} <= names
    assert inputs_stamp(load_recipe(None, ["data.format=hub", "data.path=org/chat"])) is None
    assert inputs_stamp(load_recipe(None, ["model.config=null", "model.name_or_path=org/model"])) is None


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished output of 24 demo rows (a data file of its own) and the arguments that made it."""
    root = tmp_path_factory.mktemp("finished")
    rows = root / "rows.jsonl"
    rows.write_text("".join(DEMO_ROWS.read_text().splitlines(keepends=True)[:24]))
    args = ["--set", f"data.path={rows}", "--set", f"output.dir={root / 'out'}", "--set", "batching.num_workers=0"]
    code, _, err = probe(["extract", *args])
    assert code == 0, err
    return root, args


@pytest.mark.slow
def test_a_finished_output_is_answered_before_any_heavy_import(finished):
    root, args = finished
    manifest = root / "out" / "manifest.json"
    before = manifest.stat().st_mtime_ns
    for command in (["extract"], ["launch", "-m", "dflash_prep.commands.extract"]):
        code, heavy, err = probe([*command, *args])
        assert (code, heavy) == (0, []), err
        assert "already finished and its inputs are unchanged" in err
    assert manifest.stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_written_input_goes_the_full_way_and_a_changed_one_is_refused(finished):
    """The stamp is never taken as the content: a data file written again (same bytes) is tokenized and checked
    (the job is found finished), one with other rows is refused as a different job."""
    root, args = finished
    rows = root / "rows.jsonl"
    text = rows.read_text()
    rows.write_text(text)  # same bytes, a new modification time
    code, heavy, err = probe(["extract", *args])
    assert code == 0 and "torch" in heavy, err
    assert "the output was already finished: manifest and summary left as they are" in err
    rows.write_text("".join(text.splitlines(keepends=True)[1:]) + text.splitlines(keepends=True)[0])  # reordered
    code, heavy, err = probe(["extract", *args])
    assert code == 2 and f"data files differ: {rows}: its bytes changed" in err, err
    rows.write_text(text)


@pytest.mark.slow
def test_the_wheel_ships_the_demo_and_runs_the_quick_start_from_an_empty_folder(tmp_path):
    """`pip install .` as a wheel into a fresh virtual environment, then the README's quick start from an empty
    folder; then the same package installed another way (editable, from a checkout): the finished output stays
    finished and verifies, and a run stopped half way resumes after its data folder moved. The environment's
    other packages (torch, transformers, ...) are those of this one (a path entry: no download); the package itself
    comes from the wheel alone, then from the checkout (no PYTHONPATH)."""
    source, dist, venv, work = (tmp_path / n for n in ("source", "dist", "venv", "work"))
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:  # build from a copy: a build writes build/ and *.egg-info into its source folder
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(dist), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("dflash_prep-*.whl"))
    shipped = set(zipfile.ZipFile(wheel).namelist())
    for asset in ("tiny-demo.yaml", "tiny-demo/model_config.json", "tiny-demo/tokenizer/tokenizer.json",
                  "tiny-demo/tokenizer/tokenizer_config.json", "tiny-demo/data/conversations.jsonl"):
        assert f"dflash_prep/demo/{asset}" in shipped, asset
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # pip of this environment installs into the new one (before the line below: it sees no other dflash-prep)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "_this_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=600)

    where = run("python", "-c", "import dflash_prep; print(dflash_prep.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr
    version = run("dflash-prep", "--version")
    assert version.returncode == 0 and version.stdout.strip() == "dflash-prep 0.1.0", version.stderr
    quick = run("dflash-prep", "launch", "-m", "dflash_prep.commands.extract", "--set", "data.max_samples=40")
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert (work / "out" / "tiny-demo" / "manifest.json").is_file()
    check = run("dflash-prep", "inspect", "out/tiny-demo", "--check")
    assert check.returncode == 0 and "check: OK" in check.stdout, check.stdout + check.stderr
    plan = run("dflash-prep", "plan", "--set", "data.max_samples=40")
    assert plan.returncode == 0 and "tokens" in plan.stdout, plan.stderr[-2000:]

    # A user's own data folder: a run stopped half way (SIGTERM after 2 batches: exit code 1, resumable)
    data = work / "data"
    data.mkdir()
    (data / "rows.jsonl").write_text("".join(DEMO_ROWS.read_text().splitlines(keepends=True)[:24]))
    mine = ["--set", "output.dir=out/mine", "--set", "batching.max_tokens_per_batch=2048"]
    stopped = subprocess.run(["dflash-prep", "extract", "--set", "data.path=data/rows.jsonl", *mine], cwd=work,
                             env={**env, "DFLASH_PREP_FAULTS": json.dumps({"sigterm_after_batches": 2})},
                             capture_output=True, text=True, timeout=600)
    assert stopped.returncode == 1 and not (work / "out" / "mine" / "manifest.json").exists(), stopped.stderr[-3000:]

    # The README's next step, another install of the same package: the editable one of a checkout
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", "--no-build-isolation", "-e", str(source)], check=True,
                   capture_output=True, timeout=300)
    where = run("python", "-c", "import dflash_prep; print(dflash_prep.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(source), where.stdout + where.stderr
    again = run("dflash-prep", "launch", "-m", "dflash_prep.commands.extract", "--set", "data.max_samples=40")
    assert again.returncode == 0 and "already finished" in again.stderr, again.stderr[-3000:]
    verify = run("dflash-prep", "verify", "out/tiny-demo", "--num-samples", "2")
    assert verify.returncode == 0 and "verify: OK" in verify.stdout, verify.stdout[-2000:] + verify.stderr[-2000:]

    # ... and the data folder moved: the stopped run resumes from it (its committed shards kept)
    data.rename(work / "moved")
    resumed = run("dflash-prep", "extract", "--set", "data.path=moved/rows.jsonl", *mine)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "committed before" in resumed.stderr, resumed.stderr[-3000:]
    assert json.loads((work / "out" / "mine" / "manifest.json").read_text())["num_samples"] == 24

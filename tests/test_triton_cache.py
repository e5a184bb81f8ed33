"""Triton's disk cache (compiled kernels and autotuning results) shared across processes and runs: set from
`model.triton_cache_dir` before Triton is imported, never over a user's own setting (kernels.configure_triton_cache).
Triton itself is never imported here (CPU machine)."""

from __future__ import annotations

import sys

import pytest

from dflash_prep.recipe.schema import load_recipe
from dflash_prep.target.kernels import configure_triton_cache


def test_the_recipe_sets_the_cache_dir_and_autotuning_when_the_user_did_not(tmp_path):
    env: dict = {}
    record = configure_triton_cache(str(tmp_path / "triton"), env)
    assert env == {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}
    assert (tmp_path / "triton").is_dir()
    assert record == {"dir": str(tmp_path / "triton"), "autotuning": True, "source": "recipe"}


def test_a_users_own_setting_always_wins(tmp_path):
    env = {"TRITON_CACHE_DIR": "/somewhere/else", "TRITON_CACHE_AUTOTUNING": "0"}
    record = configure_triton_cache(str(tmp_path / "triton"), env)
    assert env == {"TRITON_CACHE_DIR": "/somewhere/else", "TRITON_CACHE_AUTOTUNING": "0"}
    assert record == {"dir": "/somewhere/else", "autotuning": False, "source": "environment"}
    assert not (tmp_path / "triton").exists()


def test_null_leaves_tritons_defaults(tmp_path):
    env: dict = {}
    assert configure_triton_cache(None, env) == {"dir": None, "autotuning": False, "source": "triton default"}
    assert env == {}


def test_the_default_is_under_the_users_cache_and_not_part_of_the_jobs_identity(tmp_path):
    default = load_recipe(None, [])
    assert default.model.triton_cache_dir == "~/.cache/dflash-prep/triton"
    other = load_recipe(None, [f"model.triton_cache_dir={tmp_path}"])
    assert other.fingerprint() == default.fingerprint()
    assert load_recipe(None, ["model.triton_cache_dir=null"]).model.triton_cache_dir is None


@pytest.mark.slow
def test_a_cpu_run_sets_nothing_and_imports_no_triton(tmp_path, monkeypatch):
    from dflash_prep.commands.extract import run_extraction

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    # PyPI's CUDA build of torch imports triton itself, on a CPU machine too: what matters is that the run does not
    theirs = "triton" in sys.modules
    summary = run_extraction(load_recipe(None, [f"output.dir={tmp_path / 'out'}", "data.max_samples=8",
                                                "batching.num_workers=0"]))
    assert summary["triton_cache"] is None
    import os

    assert "TRITON_CACHE_DIR" not in os.environ and ("triton" not in sys.modules or theirs)
    assert not any(m.split(".")[0] in ("fla", "liger_kernel") for m in sys.modules)

"""The public API: `from dflash_prep import ShardDataset, ...` gives what the modules define, loads nothing heavy
until a name is used, and the module paths of earlier versions still import, with a DeprecationWarning."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
from conftest import REPO

import dflash_prep

HEAVY = ("torch", "transformers", "datasets", "accelerate", "webdataset")


def fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_plain_import_loads_nothing_heavy_and_lists_the_public_names():
    loaded = json.loads(fresh(f"import sys, json, dflash_prep; dflash_prep.__all__; dir(dflash_prep); "
                              f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"))
    assert loaded == []


def test_each_public_name_is_the_object_its_module_defines():
    from dflash_prep.consume import collator, export, reader, shard_format, vocab
    from dflash_prep.recipe import schema
    from dflash_prep.store import manifest
    from dflash_prep.target import fp8

    expected = {"ShardDataset": reader.ShardDataset, "DFlashCollator": collator.DFlashCollator,
                "ShardFormatError": shard_format.ShardFormatError, "read_manifest": manifest.read_manifest,
                "load_recipe": schema.load_recipe, "export": export.export, "draft_vocab": vocab.draft_vocab,
                "read_token_freq": vocab.read_token_freq, "dequantize_fp8": fp8.dequantize}
    assert set(dflash_prep.__all__) == {"__version__", *expected}
    for name, value in expected.items():
        assert getattr(dflash_prep, name) is value, name
    scope: dict = {}
    exec("from dflash_prep import ShardDataset, DFlashCollator, load_recipe", scope)
    assert scope["ShardDataset"] is reader.ShardDataset
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        dflash_prep.nothing_here  # noqa: B018


def test_the_public_docstring_names_every_public_name():
    for name in dflash_prep.__all__[1:]:
        assert f"\n    {name} " in dflash_prep.__doc__, name


@pytest.mark.parametrize("old,new", sorted(dflash_prep._MOVED.items()))
def test_an_earlier_module_path_is_the_new_module_with_a_deprecation_warning(old, new):
    code = (f"import warnings, importlib\n"
            f"with warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({new!r})\n"
            f"assert old is new, (old, new)\n"
            f"(w,) = [w for w in caught if issubclass(w.category, DeprecationWarning) and {old!r} in str(w.message)]\n"
            f"assert {new!r} in str(w.message), w.message\n"
            f"print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_warning_points_at_the_user_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import warnings\nwarnings.simplefilter('always')\n"
                      "from dflash_prep.reader import ShardDataset, DFlashCollator\n")
    out = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{script}:3: DeprecationWarning: dflash_prep.reader is deprecated" in out.stderr, out.stderr


def test_the_earlier_reader_path_keeps_its_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from dflash_prep.reader import DFlashCollator, ShardDataset
    assert (ShardDataset, DFlashCollator) == (dflash_prep.ShardDataset, dflash_prep.DFlashCollator)

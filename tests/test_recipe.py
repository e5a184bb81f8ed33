"""Recipes: every shipped one validates; bad keys and values fail naming the key; overrides work."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from dflash_prep.recipe.schema import DEFAULT_RECIPE, RecipeError, load_recipe, recipe_from_dict

RECIPES = sorted((REPO / "recipes").glob("*.yaml")) + [DEFAULT_RECIPE]  # the demo ships inside the package


def test_there_are_recipes_for_the_demo_and_the_real_targets():
    assert DEFAULT_RECIPE.is_file() and DEFAULT_RECIPE.is_relative_to(REPO / "dflash_prep")
    assert len({p.name for p in RECIPES}) >= 3


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_validates(path):
    recipe = load_recipe(path)
    assert recipe.output.max_shard_bytes > 0
    budget = recipe.batching.max_tokens_per_batch
    assert budget == "auto" or budget >= recipe.data.max_length
    # the resolved recipe round-trips through YAML
    again = recipe_from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe


def test_real_target_recipes_ask_for_the_documented_layers():
    dflash = load_recipe(REPO / "recipes" / "qwen3.6-27b-dflash.yaml")
    assert dflash.layers.preset == "explicit" and dflash.layers.ids == [1, 16, 31, 46, 61]
    eagle = load_recipe(REPO / "recipes" / "llama3.1-8b-eagle3.yaml")
    assert eagle.layers.preset == "eagle3"


def test_demo_recipe_resolves_paths_against_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(None)
    assert Path(recipe.model.config).is_file()
    assert len(glob.glob(recipe.data.path)) == 2  # a glob, resolved against the recipe's folder
    assert recipe.output.dir == str(tmp_path / "out" / "tiny-demo")  # output goes to the cwd


def test_set_overrides_any_key_with_yaml_values(tmp_path):
    recipe = load_recipe(None, [f"output.dir={tmp_path}/x", "batching.max_batch_size=7", "layers.preset=explicit",
                                "layers.ids=[0, 2]", "output.max_shard_bytes=2MB", "data.max_samples=5"])
    assert recipe.output.dir == str(tmp_path / "x")
    assert recipe.batching.max_batch_size == 7
    assert recipe.layers.ids == [0, 2]
    assert recipe.output.max_shard_bytes == 2_000_000
    assert recipe.data.max_samples == 5


@pytest.mark.parametrize("override, key", [
    ("batching.max_tokens_per_batch=-5", "batching.max_tokens_per_batch"),
    ("batching.max_batch_size=big", "batching.max_batch_size"),
    ("batching.length_growth=1.0", "batching.length_growth"),
    ("output.dtype=int8", "output.dtype"),
    ("output.max_shard_bytes=lots", "output.max_shard_bytes"),
    ("data.overlong=wrap", "data.overlong"),
    ("data.max_samples=0", "data.max_samples"),
    ("layers.preset=medusa", "layers.preset"),
    ("layers.capture_final=yes", "layers.capture_final"),
    ("layers.ids=[1,2]", "layers.ids"),  # ids without preset explicit
    ("model.dtype=float64", "model.dtype"),
    ("batching.max_tokens=5", "batching.max_tokens"),  # unknown key
    ("outputs.dir=x", "outputs"),  # unknown section
    ("data.format=csv", "data.format"),  # unknown data format
    ("batching.max_batch_size=-1", "batching.max_batch_size"),
    ("output.nan_policy=ignore", "output.nan_policy"),
    ("output.max_failed_samples=-1", "output.max_failed_samples"),
    ("output.lease_seconds=inf", "output.lease_seconds"),  # a lease held for good: never taken over
    ("output.lease_seconds=1e9", "output.lease_seconds"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(RecipeError) as e:
        load_recipe(None, [override])
    assert f"`{key}`" in str(e.value)


def test_explicit_ids_must_be_ascending_and_model_source_exactly_one():
    with pytest.raises(RecipeError, match="`layers.ids`"):
        load_recipe(None, ["layers.preset=explicit", "layers.ids=[3, 1]"])
    with pytest.raises(RecipeError, match="`model.name_or_path`"):
        load_recipe(None, ["model.name_or_path=org/model"])  # both config and name_or_path set
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(None, ["output.dir"])
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("/nonexistent/recipe.yaml")


def test_fingerprint_ignores_where_and_how_but_not_what():
    a = load_recipe(None)
    assert a.fingerprint() == load_recipe(None, ["output.dir=/elsewhere", "batching.max_batch_size=3"]).fingerprint()
    assert a.fingerprint() != load_recipe(None, ["output.dtype=float32"]).fingerprint()
    assert a.fingerprint() != load_recipe(None, ["data.max_length=512"]).fingerprint()


@pytest.mark.parametrize("override, key, fix", [
    ("layers.ids=[1, 40]", "layers.ids", "after-layer ids are 0..6"),  # out of range: needs the model config
    # id L-1 (the 8-layer demo's last layer) is not HF hidden_states[8] (after the norm): capture_final stores it
    ("layers.ids=[1, 7]", "layers.ids", "`layers.capture_final: before_norm`"),
    ("data.path=/nonexistent/chat.jsonl", "data.path", "no such file or folder"),
    ("data.path=nonexistent/chat.jsonl", "data.path", "no such file or folder"),  # not taken for a hub id
    ("model.config=/nonexistent/config.json", "model.config", "no such file or folder (/nonexistent/config.json)"),
    ("model.tokenizer=/nonexistent/tokenizer", "model.tokenizer", "no such file or folder (/nonexistent/tokenizer)"),
])
def test_bad_recipe_fails_before_the_model_loads_naming_the_key(tmp_path, capsys, override, key, fix):
    """Errors that need the model config or the file system come from `run_extraction`, still before any
    weights load and before anything is written to the output: the folder the refused run made for its logs is
    gone again (so the corrected command starts clean)."""
    from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main

    out = tmp_path / "out"
    extra = ["layers.preset=explicit"] if key == "layers.ids" else []
    argv = [a for kv in [f"output.dir={out}", "data.max_samples=8", *extra, override] for a in ("--set", kv)]
    assert main(argv) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert f"error: recipe key `{key}`" in err and fix in err
    assert "model loaded" not in err and "data:" not in err  # nothing loaded, nothing tokenized
    assert not out.exists()  # no folder, no run_state.json to block the fixed command


def test_model_fingerprint_depends_on_the_config_not_on_where_it_was_read(tmp_path):
    import json
    import shutil

    from dflash_prep.target.model import load_config, model_fingerprint

    here = load_recipe(None)
    moved = tmp_path / "model_config.json"
    shutil.copy(here.model.config, moved)
    there = load_recipe(None, [f"model.config={moved}"])
    assert model_fingerprint(there.model, load_config(there.model)) == model_fingerprint(here.model, load_config(here.model))

    changed = json.loads(moved.read_text())
    changed["rms_norm_eps"] = 1e-5 if changed.get("rms_norm_eps") != 1e-5 else 1e-6
    moved.write_text(json.dumps(changed))
    assert model_fingerprint(there.model, load_config(there.model)) != model_fingerprint(here.model, load_config(here.model))


def test_a_malformed_recipe_file_is_one_line_naming_it(tmp_path, capsys):
    from dflash_prep.commands.extract import main

    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  config: x\n data: [\n")
    assert main(["--recipe", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: recipe {path}: not valid YAML at line 3, column 2 (expected <block end>, but " \
                          f"found '<block mapping start>')"


def test_a_model_config_value_transformers_rejects_names_the_key(tmp_path, capsys):
    from dflash_prep.commands.extract import main

    config = json.loads((REPO / "dflash_prep" / "demo" / "tiny-demo" / "model_config.json").read_text())
    config["hidden_size"] = "big"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["--set", f"model.config={path}", "--set", f"output.dir={tmp_path / 'out'}"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"`model.config` = '{path}'" in errors[0] and "hidden_size" in errors[0]


def test_a_set_value_that_is_not_yaml_is_a_plain_string_checked_by_its_key():
    """An inline Jinja template needs no YAML quoting, and a broken value is one line naming the key (exit 2),
    not a YAML traceback."""
    template = '{% for m in messages %}{{ m["content"] }}{% endfor %}'
    assert load_recipe(None, [f"data.chat_template={template}"]).data.chat_template == template
    assert load_recipe(None, ["data.chat_template={{ messages }}"]).data.chat_template == "{{ messages }}"
    with pytest.raises(RecipeError, match=r"`data\.max_samples` = '\[1'"):
        load_recipe(None, ["data.max_samples=[1"])


def test_an_output_dir_that_is_a_file_is_refused_naming_the_key(tmp_path):
    from dflash_prep.commands.job import refuse_unsafe_output_dir

    path = tmp_path / "a-file"
    path.write_text("x")
    with pytest.raises(RecipeError, match=r"`output\.dir`.*is a file"):
        refuse_unsafe_output_dir(load_recipe(None, [f"output.dir={path}"]))


def test_too_many_dflash_layers_name_the_key_and_the_real_maximum():
    """8 decoder layers: the DFlash rule spreads ids over 1..L-3 = 1..5, so at most 5 layers (by hand)."""
    from dflash_prep.target.layers import resolve_layer_ids

    recipe = load_recipe(None, ["layers.num_layers=6"])
    with pytest.raises(RecipeError, match=r"`layers\.num_layers` = 6: .*at most 5 for this model"):
        resolve_layer_ids(recipe.layers, 8)
    assert resolve_layer_ids(load_recipe(None, ["layers.num_layers=5"]).layers, 8) == [1, 2, 3, 4, 5]


def test_an_output_dir_that_cannot_be_created_is_a_refusal_not_a_resumable_stop(tmp_path, capsys):
    from dflash_prep.commands.extract import EXIT_BAD_RECIPE, main

    (tmp_path / "a-file").write_text("x")
    assert main(["--set", f"output.dir={tmp_path / 'a-file' / 'out'}"]) == EXIT_BAD_RECIPE
    err = capsys.readouterr().err
    assert "`output.dir`" in err and "cannot create it" in err and "Traceback" not in err


def test_regeneration_defaults_to_every_turn():
    """`regenerate.turns` defaults to `all`, what the measured figures favour (multi-turn regenerated data: 0.405
    full-block accuracy against 0.374 for last turns, docs/ON_POLICY.md)."""
    recipe = load_recipe(None, ["regenerate.engine=transformers"])
    assert recipe.regenerate.turns == "all"
    assert "turns: all" in (REPO / "recipes" / "qwen3-8b-regenerate-dflash.yaml").read_text()

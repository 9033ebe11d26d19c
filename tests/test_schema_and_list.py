"""The recipe's JSON Schema (editors) and `areal list` of one component, with types as a user writes them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema():
    from arealcli.schema.json_schema import recipe_json_schema

    return recipe_json_schema()


def test_committed_schema_is_current():
    # a fresh process: only the built-ins (other tests register plugins in this one)
    out = subprocess.run([sys.executable, "-m", "arealcli.main", "schema"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    fresh = json.loads(out.stdout)
    assert json.loads((REPO / "recipe.schema.json").read_text()) == fresh, (
        "run: areal schema > recipe.schema.json"
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate_against_the_schema(recipe, schema):
    jsonschema = pytest.importorskip("jsonschema")
    text = recipe.read_text()
    assert "# yaml-language-server: $schema=../recipe.schema.json" in text
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(yaml.safe_load(text)))
    assert not errors, [e.message for e in errors]


def test_schema_types_args_by_type_(schema):
    jsonschema = pytest.importorskip("jsonschema")
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    recipe["models"]["actor"]["backend"]["args"]["optimizer"]["lrr"] = 1  # hf args know no lrr
    assert list(validator.iter_errors(recipe))
    recipe["models"]["actor"]["backend"]["args"]["optimizer"].pop("lrr")
    recipe["models"]["actor"]["backend"]["type_"] = "hff"
    assert list(validator.iter_errors(recipe))


def test_list_one_component_expands_nested_settings(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = cli("list", "ppo_actor", "--json")
    assert result.exit_code == 0, result.output
    (actor,) = json.loads(result.stdout)["interfaces"]
    rows = {a["name"]: a for a in actor["args"]}
    assert rows["generation.n"]["type"] == "int" and rows["generation.n"]["default"] == "1"
    assert rows["eps_clip_higher"]["type"] == "float | None"
    assert rows["aggregation"]["type"] == "'token-mean' | 'seq-mean-token-mean' | 'seq-mean-token-sum-norm'"
    assert rows["generation"]["default"] == "(its settings below)"
    result = cli("list", "hf")
    assert result.exit_code == 0 and "optimizer.lr_scheduler" in result.stdout.replace("\n", "")
    result = cli("list", "ppo_actr")
    assert result.exit_code == 2 and "did you mean 'ppo_actor'" in result.stderr


def test_flags_show_as_flags(cli):
    help_text = cli("train", "--help").stdout
    for flag in ("--resume", "--overwrite"):
        line = next(x for x in help_text.splitlines() if flag in x)
        assert "<bool>" not in line, line


def test_init_copies_a_shipped_recipe_that_runs_from_anywhere(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("init", "mine", "--from", "quickstart")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "mine.yaml").read_text()
    assert "experiment: mine" in text and str(REPO / "data" / "max3" / "train.jsonl") in text
    assert text.splitlines()[0].startswith("# Quickstart")  # the comments come along
    checked = cli("check", tmp_path / "mine.yaml")
    assert checked.exit_code == 0 and "warning" not in checked.stderr  # every path resolves from here
    again = cli("init", "mine")
    assert again.exit_code == 2 and "already exists" in again.stderr
    assert cli("init", "x", "--from", "nope").exit_code == 2

"""`areal check`: every mistake at once with file:line, overrides, YAML errors, registries, no torch."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import REPO

from arealcli.schema.registry import INTERFACES, Entry, Registry, RegistryError, register_interface

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

# Each mistake is marked `# E:<name>` on the line an error must point at.
FIVE_MISTAKES = """\
experiment: five-mistakes
tokenizer: {kind: char}
models:
  actor:
    config: {hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1}
    backend:
      type_: hff                      # E:backend
      args: {device: cpu}
dataset:
  type_: prompt_answer
  args:
    path: train.jsonl
    max_length: lots                  # E:arg
  batch_size: 4
dataflow:
  calls:
    - name: sft
      model: actr                     # E:model
      interface: {type_: sft}
      type: train_step
      inputs:
        - packed_input_ids
        - prompt_maks                 # E:input
trainer:
  max_stepz: 3                        # E:key
"""


def marked_lines(text: str) -> dict[str, int]:
    return {
        m.group(1): i for i, line in enumerate(text.splitlines(), 1) if (m := re.search(r"# E:(\w+)", line))
    }


def problem_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r"^\S+:\d+:\d+: ", line)]


def test_five_mistakes_five_located_errors(ws, cli):
    recipe = ws.text("five.yaml", FIVE_MISTAKES)
    result = cli("check", recipe)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = problem_lines(result.stderr)
    assert len(lines) == 5, result.stderr
    assert "5 problem(s)" in result.stderr
    where = marked_lines(FIVE_MISTAKES)

    def line_for(fragment: str) -> str:
        (found,) = [line for line in lines if fragment in line]
        return found

    expected = {
        "key": ("trainer.max_stepz:", ["unknown key", "did you mean 'max_steps'"]),
        "backend": ("models.actor.backend.type_:", ["unknown backend 'hff'", "did you mean 'hf'"]),
        "arg": ("dataset.args.max_length:", ["integer", "(got 'lots')"]),
        "model": ("dataflow.calls.0.model:", ["no such model", "did you mean 'actor'"]),
        "input": ("dataflow.calls.0.inputs.1:", ["'prompt_maks'", "did you mean 'prompt_mask'"]),
    }
    for mark, (fragment, must_contain) in expected.items():
        line = line_for(fragment)
        assert line.startswith(f"{recipe}:{where[mark]}:"), (mark, line)
        for text in must_contain:
            assert text in line, (mark, line)
    # Sorted by position in the file.
    assert [int(line[len(str(recipe)) + 1 :].split(":")[0]) for line in lines] == sorted(where.values())


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_pass_check(recipe, cli):
    result = cli("check", recipe)
    assert result.exit_code == 0, result.output
    assert "ok" in result.stdout


def test_shipped_recipes_start_with_a_comment():
    for recipe in RECIPES:
        first = recipe.read_text().splitlines()[0]
        assert first.startswith("#"), f"{recipe.name} should start with a comment: purpose + command"


def test_check_and_list_do_not_import_torch():
    code = textwrap.dedent(
        f"""
        import json, sys
        from typer.testing import CliRunner
        from arealcli.main import app
        runner = CliRunner()
        for recipe in {[str(p) for p in RECIPES]!r}:
            r = runner.invoke(app, ["check", recipe])
            assert r.exit_code == 0, r.output
            r = runner.invoke(app, ["check", recipe, "--print"])
            assert r.exit_code == 0, r.output
        r = runner.invoke(app, ["list", "--json"])
        assert r.exit_code == 0, r.output
        json.loads(r.stdout)
        r = runner.invoke(app, ["list"])
        assert r.exit_code == 0, r.output
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("HEAVY", heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


# --------------------------------------------------------------------------- overrides


def test_overrides_change_the_resolved_recipe(ws, cli):
    recipe = ws.recipe()
    result = cli(
        "check",
        recipe,
        "--print",
        "trainer.max_steps=7",
        "dataflow.calls.0.mb_spec.max_tokens_per_mb=64",
        "models.default.backend.args.optimizer.lr=0.5",
        f"dataset.args.path={ws.root / ('a-long-directory-name' * 6) / 'train.jsonl'}",
    )
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)  # --print is valid YAML, even with long values
    assert resolved["trainer"]["max_steps"] == 7
    assert resolved["dataflow"]["calls"][0]["mb_spec"] == {"n_mbs": 2, "max_tokens_per_mb": 64}
    assert resolved["models"]["default"]["backend"]["args"]["optimizer"]["lr"] == 0.5
    assert resolved["dataset"]["args"]["path"].endswith("a-long-directory-name/train.jsonl")
    # Defaults are resolved too.
    assert resolved["dataflow"]["calls"][0]["interface"]["args"] == {
        "token_normalize_scope": "global",
        "lr_scale": 1.0,
    }
    assert resolved["models"]["default"]["backend"]["args"]["dtype"] == "float32"


def test_bad_override_key_is_reported_at_the_override(ws, cli):
    recipe = ws.recipe()
    result = cli("check", recipe, "trainer.max_stepz=3")
    assert result.exit_code == 2
    (line,) = [line for line in result.stderr.splitlines() if "max_stepz" in line]
    assert "<override trainer.max_stepz=3>" in line
    assert "did you mean 'max_steps'" in line


def test_bad_override_value_is_reported_at_the_override(ws, cli):
    result = cli("check", ws.recipe(), "dataset.batch_size=-1")
    assert result.exit_code == 2
    assert "<override dataset.batch_size=-1>: dataset.batch_size:" in result.stderr
    assert "greater than 0" in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataflow.calls.3.name=x", "index 3 out of range"),
        ("seed.value=1", "cannot set seed.value"),
        ("seed.a.b=1", "seed is not a mapping or list"),
        ("trainer", "expected key.path=value"),
        ("trainer..max_steps=1", "empty key"),
    ],
)
def test_malformed_override_paths(ws, cli, override, message):
    result = cli("check", ws.recipe(), override)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- YAML and file errors


def test_yaml_syntax_error_reports_file_line(ws, cli):
    text = "experiment: x\nmodels:\n  a: {config: {}\ndataset: 3\n"
    recipe = ws.text("broken.yaml", text)
    result = cli("check", recipe)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    m = re.search(rf"{re.escape(str(recipe))}:(\d+):(\d+): YAML syntax error", result.stderr)
    assert m, result.stderr
    assert int(m.group(1)) in (3, 4)  # the unclosed flow mapping, or where the parser noticed it


@pytest.mark.parametrize(
    "text",
    ["experiment: x\nseed: 1\n  tokenizer: {kind: char}\n", "experiment: x\nmodels:\n\tx: 1\n"],
    ids=["indentation", "tab"],
)
def test_yaml_errors_on_line_3(ws, cli, text):
    recipe = ws.text("indent.yaml", text)
    result = cli("check", recipe)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert f"{recipe}:3:" in result.stderr and "YAML syntax error" in result.stderr


def test_missing_file_and_non_mapping(ws, cli):
    result = cli("check", ws.root / "nope.yaml")
    assert result.exit_code == 2
    assert "no such recipe file" in result.stderr
    result = cli("check", ws.text("list.yaml", "- a\n- b\n"))
    assert result.exit_code == 2
    assert "must be a mapping" in result.stderr


def test_missing_required_fields_are_all_reported(ws, cli):
    result = cli("check", ws.text("empty.yaml", "experiment: e\n"))
    assert result.exit_code == 2
    for key in ("models", "dataset", "dataflow"):
        assert f": {key}: required field is missing" in result.stderr


def test_graph_errors(ws, cli):
    recipe = ws.recipe(
        dataflow={
            "calls": [
                {
                    "name": "sft",
                    "model": "default",
                    "interface": {"type_": "sft"},
                    "type": "generate",
                    "inputs": ["packed_input_ids", "later_key"],
                },
                {
                    "name": "sft",
                    "model": "default",
                    "interface": {"type_": "sft"},
                    "type": "train_step",
                    "outputs": ["later_key"],
                },
            ]
        },
        trainer={"eval_every_n_steps": 2},
    )
    result = cli("check", recipe)
    assert result.exit_code == 2
    err = result.stderr
    assert "does not implement 'generate'" in err
    assert "duplicate call name" in err
    assert "'later_key' is produced by 'sft', which runs after" in err
    assert "evaluation needs an `eval_dataset`" in err


# --------------------------------------------------------------------------- registries


class _A:
    """A."""


class _B:
    """B."""


def test_duplicate_registration_names_both_classes():
    reg = Registry("interface")
    reg.add(Entry("thing", _A, type(None), "", "tests"))
    reg.add(Entry("thing", _A, type(None), "", "tests"))  # the same class again is fine
    with pytest.raises(RegistryError) as e:
        reg.add(Entry("thing", _B, type(None), "", "tests"))
    msg = str(e.value)
    assert "'thing' is registered twice" in msg
    assert f"{__name__}:_A" in msg and f"{__name__}:_B" in msg


def test_duplicate_of_a_builtin_names_both():
    INTERFACES.names()  # make sure the built-ins are loaded
    with pytest.raises(RegistryError) as e:
        register_interface("sft", _B)
    msg = str(e.value)
    assert "arealcli.runtime.interfaces.sft:SFTInterface" in msg and f"{__name__}:_B" in msg
    assert INTERFACES.get("sft").target != _B


def test_unknown_name_lists_the_available_ones():
    with pytest.raises(RegistryError) as e:
        INTERFACES.get("sfft")
    msg = str(e.value)
    assert "unknown interface 'sfft'" in msg
    assert "did you mean 'sft'" in msg
    assert "available:" in msg and "sft" in msg.split("available:")[1]


def test_unknown_plugin_import_is_a_located_error(ws, cli):
    recipe = ws.recipe(imports=["no_such_plugin_module_xyz"])
    result = cli("check", recipe)
    assert result.exit_code == 2
    assert "imports.0: cannot import 'no_such_plugin_module_xyz'" in result.stderr


def test_list_json_describes_builtins(cli):
    import json

    result = cli("list", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    sft = {e["name"]: e for e in payload["interfaces"]}["sft"]
    assert sft["call_types"] == ["train_step"]
    assert [a["name"] for a in sft["args"]] == ["token_normalize_scope", "lr_scale"]
    hf = {e["name"]: e for e in payload["backends"]}["hf"]
    assert {"device", "dtype", "optimizer"} <= {a["name"] for a in hf["args"]}
    ds = {e["name"]: e for e in payload["datasets"]}["prompt_answer"]
    assert "packed_input_ids" in ds["keys"]
    builtins = [e for e in payload["interfaces"] + payload["backends"] if e["origin"] == "builtin"]
    assert all(a["description"] for e in builtins for a in e["args"])
    only = json.loads(cli("list", "backends", "--json").stdout)
    assert list(only) == ["backends"]


def test_paths_are_relative_to_where_given(ws, cli, monkeypatch):
    monkeypatch.chdir(ws.root)
    ws.text("five.yaml", FIVE_MISTAKES)
    result = cli("check", "five.yaml")
    assert result.exit_code == 2
    assert all(line.startswith("five.yaml:") for line in problem_lines(result.stderr))

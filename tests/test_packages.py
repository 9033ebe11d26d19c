"""`areal check` names the optional packages a recipe needs and lacks, with the command that installs them,
before a run directory exists."""

from __future__ import annotations

import sys

import yaml
from conftest import REPO

from arealcli.schema.checks import packages


def _quickstart_server(ws, backend: dict) -> str:
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-async.yaml").read_text())
    recipe["dataset"]["args"]["path"] = str(REPO / "data" / "max3" / "train.jsonl")
    recipe["eval_dataset"]["args"]["path"] = str(REPO / "data" / "max3" / "test.jsonl")
    recipe["models"]["actor_gen"]["backend"] = backend
    recipe["rollout"] = None
    return ws.text("q.yaml", yaml.safe_dump(recipe, sort_keys=False))


def test_missing_wandb_is_said_with_the_install_command(ws, cli, monkeypatch):
    real = packages.installed
    monkeypatch.setattr(packages, "installed", lambda m: m != "wandb" and real(m))  # as if not installed
    recipe = ws.recipe(trainer={"total_train_epochs": 1, "wandb": {"project": "p"}})
    result = cli("check", recipe)
    assert result.exit_code == 2
    assert "trainer.wandb needs the wandb package, which is not installed: pip install 'arealcli[wandb]'" in (
        result.stderr
    )
    assert f"{recipe.name}:" in result.stderr  # file:line of the key


def test_launched_servers_need_their_package_in_their_interpreter(ws, cli):
    launched = {"type_": "vllm", "args": {"launch": True, "python_executable": "/no/such/python"}}
    result = cli("check", _quickstart_server(ws, launched))
    assert result.exit_code == 2
    assert "launch: true: the interpreter '/no/such/python' is not found" in result.stderr

    sglang = {"type_": "sglang", "args": {"launch": "sglang", "python": sys.executable}}
    if not packages.installed("sglang"):
        result = cli("check", _quickstart_server(ws, sglang))
        assert result.exit_code == 2
        assert f"launch: sglang: {sys.executable!r} has no sglang package" in result.stderr


def test_installed_in_asks_the_interpreter_itself():
    assert packages.installed_in(sys.executable, "yaml") is None
    assert "has no no_such_module_x package" in packages.installed_in(sys.executable, "no_such_module_x")

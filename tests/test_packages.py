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


def test_checkpoint_state_is_not_loaded_with_an_unsafe_torch(tmp_path, monkeypatch):
    """Before torch 2.10 the weights_only loader is not safe: no checkpoint state is loaded at all."""
    import pytest
    import torch

    from arealcli.errors import UserError
    from arealcli.runtime.models.weights import load_plain

    path = tmp_path / "state.pt"
    torch.save({"step": 3}, path)
    assert load_plain(path) == {"step": 3}
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")  # as if an old torch were installed
    with pytest.raises(
        UserError, match=r"torch 2\.5\.1\+cpu: its weights_only loader is not safe before 2\.10"
    ):
        load_plain(path)


def test_datasets_before_4_is_refused(ws, monkeypatch):
    """datasets < 4 runs code shipped with a dataset (loading scripts): refused with the fix."""
    import datasets
    import pytest

    from arealcli.runtime.data.datasets import DataError, _load_dataset

    data = ws.text("rows.json", '[{"prompt": "a", "answer": "b"}]')
    monkeypatch.setattr(datasets, "__version__", "3.6.0")

    class Args:
        split, subset, limit = "train", None, None

    with pytest.raises(DataError, match=r"needs datasets >= 4 \(found 3\.6\.0"):
        _load_dataset(str(data), data, Args)

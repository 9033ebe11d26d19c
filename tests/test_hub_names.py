"""Models by Hub name through the local Hugging Face cache (no network), and paths given on the command
line resolved against the shell's directory."""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY_ARCH, sft_recipe, tiny_module


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, char_tok):
    """HF_HOME with `tiny-org/tiny-qwen` cached the way huggingface_hub lays it out."""
    home = tmp_path / "hf-home"
    repo = home / "hub" / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / "0123abcd"
    tiny_module(char_tok, seed=5).save_pretrained(snapshot)
    char_tok.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


def hub_recipe(ws, name: str):
    recipe = sft_recipe(trainer={"max_steps": 2, "tensorboard": False})
    recipe["models"]["default"] = {
        "path": name,
        "backend": recipe["models"]["default"]["backend"],
    }
    del recipe["tokenizer"]  # the model's own
    import yaml

    return ws.text("hub.yaml", yaml.safe_dump(recipe))


def test_a_cached_hub_name_checks_and_trains(ws, cli, hub_cache):
    recipe = hub_recipe(ws, "tiny-org/tiny-qwen")
    checked = cli("check", recipe)
    assert checked.exit_code == 0 and "warning" not in checked.stderr, checked.output
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


def test_a_missing_hub_name_names_both_places(ws, cli, hub_cache):
    recipe = hub_recipe(ws, "tiny-org/not-there")
    checked = cli("check", recipe)
    assert checked.exit_code == 0
    assert f"model directory {ws.root / 'tiny-org' / 'not-there'} does not exist" in checked.stderr
    assert "nor 'tiny-org/not-there' in the Hugging Face cache" in checked.stderr
    trained = cli("train", recipe, "-o", ws.root / "run")
    assert trained.exit_code == 2 and "Hugging Face cache" in trained.stderr


def test_override_paths_are_relative_to_the_shell(ws, cli, tmp_path, monkeypatch):
    shell = tmp_path / "elsewhere"
    shell.mkdir()
    (shell / "mine.jsonl").write_text((ws.root / "train.jsonl").read_text())
    monkeypatch.chdir(shell)
    recipe = ws.recipe()  # its folder has train.jsonl, not mine.jsonl
    result = cli("check", recipe, "dataset.args.path=mine.jsonl", "--print")
    assert result.exit_code == 0 and "warning" not in result.stderr, result.output
    assert f"path: {shell / 'mine.jsonl'}" in result.stdout
    # written in the recipe file, the same name means the recipe's folder
    recipe = ws.recipe(dataset={"args": {"path": "mine.jsonl"}})
    assert "does not exist" in cli("check", recipe).stderr


def test_tiny_arch_is_what_the_cache_holds(hub_cache):
    config = json.loads((hub_cache / "config.json").read_text())
    assert config["hidden_size"] == TINY_ARCH["hidden_size"]

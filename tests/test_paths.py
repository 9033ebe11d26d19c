"""Missing local files: `areal check` warns (the recipe may be for another machine), `areal train` refuses."""

from __future__ import annotations


def test_missing_data_file_is_a_warning_for_check_and_an_error_for_train(ws, cli):
    recipe = ws.recipe(dataset={"args": {"path": "nope.jsonl"}})
    checked = cli("check", recipe)
    assert checked.exit_code == 0
    assert "warning" in checked.stderr and "dataset.args.path: data file" in checked.stderr
    trained = cli("train", recipe, "-o", ws.root / "run")
    assert trained.exit_code == 2
    assert f"{recipe}:" in trained.stderr and "nope.jsonl does not exist" in trained.stderr
    assert not (ws.root / "run").exists()  # nothing was started or written

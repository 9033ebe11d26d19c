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


def test_data_folder_needs_data_files_in_it_or_one_level_down(ws, cli):
    (ws.root / "empty" / "sub" / "deeper").mkdir(parents=True)
    (ws.root / "empty" / "notes.txt").write_text("x")
    (ws.root / "empty" / ".hidden.jsonl").write_text("{}\n")
    (ws.root / "hub" / "data").mkdir(parents=True)
    (ws.root / "hub" / "data" / "train-00000.parquet").write_bytes(b"")
    result = cli("check", ws.recipe(dataset={"args": {"path": "empty"}}))
    assert result.exit_code == 2
    assert f"data folder {ws.root / 'empty'} holds no data files (.jsonl, .json, .parquet" in result.stderr
    result = cli("check", ws.recipe(dataset={"args": {"path": "hub"}}))
    assert "holds no data files" not in result.stderr

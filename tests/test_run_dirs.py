"""Run directories: `--overwrite` removes only what `areal train` created; bad output paths exit 2; a
failed start leaves nothing that blocks the rerun; a diverging run stops at the first non-finite loss."""

from __future__ import annotations

import re

from arealcli.runtime.run.session import RUN_MARKER


def test_overwrite_never_removes_a_directory_it_did_not_create(ws, cli, monkeypatch):
    mine = ws.root / "my-results"
    mine.mkdir()
    (mine / "precious.txt").write_text("results")
    recipe = ws.recipe(trainer={"max_steps": 1})
    for args in (["-o", mine, "--overwrite"], ["-o", mine], ["-o", mine, "--resume"]):
        result = cli("train", recipe, *args)
        assert result.exit_code == 2, result.output
        assert (mine / "precious.txt").read_text() == "results"
    assert "was not created by `areal train`" in cli("train", recipe, "-o", mine, "--overwrite").stderr
    # `experiment` cannot point anywhere else: one path component only
    monkeypatch.chdir(ws.root)
    for name in (str(mine), "../my-results", "..", "."):
        result = cli("train", recipe, f"experiment={name}", "--overwrite")
        assert result.exit_code == 2 and "experiment: not a name" in result.stderr
    assert (mine / "precious.txt").exists()


def test_overwrite_refuses_the_current_directory_even_if_marked(ws, cli, monkeypatch):
    here = ws.root / "here"
    here.mkdir()
    (here / RUN_MARKER).write_text("")
    (here / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.chdir(here)
    result = cli("train", ws.recipe(trainer={"max_steps": 1}), "-o", ".", "--overwrite")
    assert result.exit_code == 2 and "will not remove" in result.stderr
    assert (here / "metrics.jsonl").exists()


def test_output_dir_that_is_a_file_or_below_one(ws, cli):
    recipe = ws.recipe(trainer={"max_steps": 1})
    (ws.root / "afile").write_text("x")
    result = cli("train", recipe, "-o", ws.root / "afile")
    assert result.exit_code == 2 and "is a file" in result.stderr
    result = cli("train", recipe, "-o", ws.root / "afile" / "run")
    assert result.exit_code == 2 and "cannot use" in result.stderr and "Traceback" not in result.output
    assert (ws.root / "afile").read_text() == "x"


def test_a_failed_start_does_not_block_the_rerun(ws, cli):
    run = ws.root / "run"
    (ws.root / "bad.jsonl").write_text('{"prompt": null, "answer": "x"}\n')
    recipe = ws.recipe(dataset={"args": {"path": "bad.jsonl"}}, trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 2 and "bad.jsonl:1:" in result.stderr
    assert not (run / "recipe.yaml").exists()
    result = cli("train", ws.recipe(trainer={"max_steps": 1}), "-o", run)  # no --overwrite needed
    assert result.exit_code == 0, result.output
    assert (run / "recipe.yaml").exists() and (run / RUN_MARKER).exists()


def test_non_finite_loss_stops_training(ws, cli):
    # a learning rate that is finite but absurd: the weights blow up within a few steps
    recipe = ws.recipe(
        models={"default": {"backend": {"args": {"optimizer": {"lr": 1.0e30, "gradient_clipping": None}}}}},
        trainer={"max_steps": 20},
    )
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2, result.output
    assert re.search(r"step \d+: sft/(loss|grad_norm) = (nan|inf)", result.stderr), result.stderr
    assert "training stopped (no checkpoint was written)" in result.stderr
    assert "Traceback" not in result.output
    logged = (ws.root / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(logged) < 20  # it did not go on to the end


def test_a_dry_run_refuses_what_the_run_refuses_and_writes_nothing(ws, cli, monkeypatch):
    """`--dry-run` is the run-directory policy itself, told not to write: the same refusals, the same
    exit code, and nothing created, removed or recorded."""
    recipe = ws.recipe(trainer={"max_steps": 1})
    mine = ws.root / "my-results"
    mine.mkdir()
    (mine / "precious.txt").write_text("results")
    here = ws.root / "here"
    here.mkdir()
    (here / RUN_MARKER).write_text("")
    (here / "metrics.jsonl").write_text('{"step": 1}\n')
    (ws.root / "afile").write_text("x")
    refusals = [
        (["-o", mine, "--overwrite"], "was not created by `areal train`"),
        (["-o", ws.root / "afile"], "is a file"),
        (["-o", ws.root / "new", "--resume"], "no checkpoints to resume from"),
        (["-o", here, "--resume", "--overwrite"], "exclude each other"),
        (["-o", here], "already exists"),
    ]
    for args, said in refusals:
        for dry in ([], ["--dry-run"]):
            result = cli("train", recipe, *args, *dry)
            assert result.exit_code == 2 and said in result.stderr, (args, dry, result.output)
    monkeypatch.chdir(here)
    result = cli("train", recipe, "-o", ".", "--overwrite", "--dry-run")
    assert result.exit_code == 2 and "will not remove" in result.stderr
    result = cli("train", recipe, "-o", here, "--overwrite", "--dry-run")
    assert result.exit_code == 2 and "will not remove" in result.stderr
    monkeypatch.chdir(ws.root)
    result = cli("train", recipe, "-o", here, "--overwrite", "--dry-run")
    assert result.exit_code == 0 and f"dry run: would replace {here} and train" in result.stdout
    result = cli("train", recipe, "-o", ws.root / "fresh", "--dry-run")
    assert result.exit_code == 0 and "dry run: would create" in result.stdout
    assert (mine / "precious.txt").read_text() == "results" and (here / "metrics.jsonl").exists()
    assert not (ws.root / "new").exists() and not (ws.root / "fresh").exists()
    assert sorted(p.name for p in here.iterdir()) == sorted([RUN_MARKER, "metrics.jsonl"])

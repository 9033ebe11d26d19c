"""Training end to end on a tiny model: learning, exact resume, run directories, plugins, checkpoints."""

from __future__ import annotations

import functools
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from arealcli.runtime.run import checkpoint as ckpt
from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import validate
from tests.conftest import train_until_crash
from tests.test_reward_model import reward_model_recipe

EVAL = {"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 16}


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, step: int, model: str = "default") -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / ckpt.step_dir_name(step) / model / "model.safetensors"))


def train_ok(cli, *args):
    result = cli("train", *args)
    assert result.exit_code == 0, result.output
    return result


# --------------------------------------------------------------------------- learning


def test_sft_loss_and_eval_nll_fall(ws, cli):
    recipe = ws.recipe(
        models={
            "default": {"backend": {"args": {"optimizer": {"lr": 2e-2, "warmup_steps_proportion": 0.1}}}}
        },
        eval_dataset=EVAL,
        trainer={"total_train_epochs": 8, "eval_every_n_steps": 40, "eval_at_start": True},
    )
    run = ws.root / "run"
    train_ok(cli, recipe, "-o", run)
    rows = metrics(run)
    losses = [r["sft/loss"] for r in rows if "sft/loss" in r]
    assert len(losses) == 40
    assert all(map(torch.isfinite, torch.tensor(losses)))
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.5 * first, (first, last)
    evals = [r["eval/nll"] for r in rows if "eval/nll" in r]
    assert len(evals) == 2 and evals[1] < 0.6 * evals[0], evals
    assert rows[0]["step"] == 0 and "sft/loss" not in rows[0]  # eval_at_start


# --------------------------------------------------------------------------- resume


# The trained model, its loss, and how its recipe is made (dpo: the frozen reference is built again
# from the actor's initial weights on resume).
RESUMED = {
    "sft": ("default", "sft/loss", lambda ws: ws.recipe),
    "dpo": ("actor", "dpo/loss", lambda ws: ws.dpo),
    "reward_model": ("default", "reward_train/loss", lambda ws: functools.partial(reward_model_recipe, ws)),
}


@pytest.mark.parametrize("algo", list(RESUMED))
def test_resume_is_exact(ws, cli, algo):
    # Shuffled data, warmup + cosine LR, AdamW state and two micro-batches: resume must restore them all.
    model, loss, make = RESUMED[algo]
    recipe = make(ws)(trainer={"total_train_epochs": 2, "max_steps": 6, "save_every_n_steps": 3})
    full, crashed = ws.root / "full", ws.root / "crashed"
    train_ok(cli, recipe, "-o", full)

    train_until_crash(
        recipe, crashed, step=4
    )  # the same run, killed during step 4 (after the step-3 checkpoint)
    assert ckpt.latest_checkpoint(crashed / "checkpoints").name == "step_00000003"

    result = train_ok(cli, recipe, "-o", crashed, "--resume")
    assert "resuming" in result.stdout and "(step 3)" in result.stdout

    a, b = weights(full, 6, model), weights(crashed, 6, model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # And the run did move: step 3 and step 6 differ, and every logged loss matches.
    assert any(not torch.equal(a[k], weights(full, 3, model)[k]) for k in a)
    full_loss = {r["step"]: r[loss] for r in metrics(full)}
    resumed_loss = {r["step"]: r[loss] for r in metrics(crashed)}  # step 4 is logged twice
    assert full_loss == resumed_loss
    opt_a = torch.load(full / f"checkpoints/step_00000006/{model}/engine_state.pt", weights_only=True)
    opt_b = torch.load(crashed / f"checkpoints/step_00000006/{model}/engine_state.pt", weights_only=True)
    for sa, sb in zip(
        opt_a["optimizer"]["state"].values(), opt_b["optimizer"]["state"].values(), strict=True
    ):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_resume_without_checkpoints_and_conflicting_flags(ws, cli):
    recipe = ws.recipe(trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", ws.root / "none", "--resume")
    assert result.exit_code == 2 and "no checkpoints to resume from" in result.stderr
    result = cli("train", recipe, "-o", ws.root / "none", "--resume", "--overwrite")
    assert result.exit_code == 2 and "exclude each other" in result.stderr


# --------------------------------------------------------------------------- run directory


def test_refuses_to_overwrite_a_run_directory(ws, cli):
    recipe = ws.recipe(trainer={"max_steps": 2})
    run = ws.root / "run"
    train_ok(cli, recipe, "-o", run)
    (run / "notes.txt").write_text("mine")
    result = cli("train", recipe, "-o", run)
    assert result.exit_code == 2
    assert (
        "already exists" in result.stderr and "--overwrite" in result.stderr and "--resume" in result.stderr
    )
    assert (run / "notes.txt").exists()
    train_ok(cli, recipe, "-o", run, "--overwrite")  # a directory `areal train` made: replaced
    assert not (run / "notes.txt").exists()
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_default_run_directory_comes_from_the_recipe(ws, cli, monkeypatch):
    monkeypatch.chdir(ws.root)
    recipe = ws.recipe(experiment="named", trainer={"max_steps": 1})
    train_ok(cli, recipe)
    assert (ws.root / "runs" / "named" / "checkpoints" / "step_00000001").is_dir()
    recipe = ws.recipe(output_dir=str(ws.root / "elsewhere"), trainer={"max_steps": 1})
    train_ok(cli, recipe)
    assert (ws.root / "elsewhere" / "metrics.jsonl").exists()


def test_resolved_recipe_and_metrics_rows(ws, cli, monkeypatch):
    recipe = ws.recipe(trainer={"max_steps": 5, "log_every_n_steps": 2})
    run = ws.root / "run"
    seen = []
    train = Trainer.train

    def spy(self):
        seen.append((self.run_dir / "recipe.yaml").exists())  # written before step 0
        return train(self)

    monkeypatch.setattr(Trainer, "train", spy)
    train_ok(cli, recipe, "-o", run, "seed=11")
    assert seen == [True]

    printed = cli("check", recipe, "seed=11", "--print")
    assert printed.exit_code == 0
    written = yaml.safe_load((run / "recipe.yaml").read_text())
    expected = yaml.safe_load(printed.stdout)
    expected["dataset"]["args"]["path"] = str(ws.root / "train.jsonl")  # local paths saved absolute
    assert written == expected
    assert written["seed"] == 11 and written["trainer"]["max_steps"] == 5
    # The written recipe is itself a valid recipe.
    assert validate(load_recipe_source(run / "recipe.yaml")).seed == 11

    rows = metrics(run)
    assert [r["step"] for r in rows] == [2, 4, 5]  # every 2 steps, and the last one
    for r in rows:
        assert {"sft/loss", "sft/grad_norm", "sft/lr", "sft/n_tokens", "epoch", "timing/step_s"} <= set(r)


# --------------------------------------------------------------------------- checkpoints


def test_leftover_tmp_checkpoint_is_ignored_by_resume(ws, cli):
    recipe = ws.recipe(
        trainer={"total_train_epochs": 3, "save_every_n_steps": 1, "keep_last_n_checkpoints": 2}
    )
    run = ws.root / "run"
    train_ok(cli, recipe, "-o", run, "trainer.max_steps=3")
    root = run / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000003"]  # pruned
    assert (root / "LATEST").read_text().strip() == "step_00000003"
    # A crash in the middle of writing step 4 leaves a half-written temporary directory...
    half = root / ".tmp-step_00000004"
    (half / "default").mkdir(parents=True)
    (half / "trainer_state.pt").write_bytes(b"not a checkpoint")
    # ...and a step directory without trainer state (not complete) must not be picked either.
    (root / "step_00000009").mkdir()
    (root / "LATEST").unlink()

    result = train_ok(cli, recipe, "-o", run, "--resume", "trainer.max_steps=4")
    assert "(step 3)" in result.stdout
    assert not half.exists()
    assert (root / "LATEST").read_text().strip() == "step_00000004"


def test_write_checkpoint_is_atomic(tmp_path):
    root = tmp_path / "checkpoints"

    def good(d: Path):
        (d / "trainer_state.pt").write_text("ok")

    ckpt.write_checkpoint(root, 1, good, keep_last=3)

    def dies(d: Path):
        (d / "trainer_state.pt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        ckpt.write_checkpoint(root, 2, dies, keep_last=3)
    assert not (root / "step_00000002").exists()
    assert (root / "LATEST").read_text().strip() == "step_00000001"
    assert ckpt.latest_checkpoint(root) == root / "step_00000001"
    assert not list(root.glob(".tmp-*"))  # cleaned up by the next resume


# --------------------------------------------------------------------------- plugins

PLUGIN = '''
"""A user's own interface, registered from outside the package."""
from pydantic import Field

from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
from arealcli.runtime.registry import register_interface
from arealcli.schema.base import StrictModel


class ScaledSFTArgs(StrictModel):
    loss_scale: float = Field(1.0, gt=0, description="Multiply the SFT loss by this.")
    tag: str = Field("plain", description="A label copied into the stats.")


class ScaledSFT(ModelInterface):
    """SFT with a scaled loss (a test plugin)."""

    Args = ScaledSFTArgs

    def train_step(self, model, data, mb_spec):
        def loss_fn(logits, mb):
            loss, stats = sft_loss(logits, mb)
            return loss * self.args.loss_scale, stats

        stats = model.module.train_batch(
            data, mb_spec, loss_fn, num_answer_tokens, version_steps=model.version.global_step
        )
        stats["scale"] = self.args.loss_scale
        model.inc_version()
        return stats


register_interface("my_sft", ScaledSFT)
'''

PLUGIN_MODULE = "arealcli_test_plugin_sft"


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / f"{PLUGIN_MODULE}.py").write_text(textwrap.dedent(PLUGIN))
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


def plugin_recipe(ws, **args):
    call = {
        "name": "mine",
        "model": "default",
        "interface": {"type_": "my_sft", "args": args},
        "type": "train_step",
        "inputs": ["packed_input_ids", "prompt_mask"],
    }
    return ws.recipe(imports=[PLUGIN_MODULE], dataflow={"calls": [call]}, trainer={"max_steps": 3})


def test_plugin_interface_checks_lists_and_trains(ws, cli, plugin_dir):
    recipe = plugin_recipe(ws, loss_scale=2.0)
    result = cli("check", recipe)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("ok") and "mine" in result.stdout

    listed = cli("list", "interfaces", "--import", PLUGIN_MODULE, "--json")
    assert listed.exit_code == 0, listed.output
    mine = {e["name"]: e for e in json.loads(listed.stdout)["interfaces"]}["my_sft"]
    assert mine["call_types"] == ["train_step"]
    assert mine["origin"] == PLUGIN_MODULE
    assert mine["description"] == "SFT with a scaled loss (a test plugin)."
    assert [(a["name"], a["default"]) for a in mine["args"]] == [("loss_scale", "1.0"), ("tag", '"plain"')]

    run = ws.root / "run"
    train_ok(cli, recipe, "-o", run)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["mine/scale"] == 2.0 and r["mine/loss"] > 0 for r in rows)
    written = yaml.safe_load((run / "recipe.yaml").read_text())
    assert written["dataflow"]["calls"][0]["interface"]["args"] == {"loss_scale": 2.0, "tag": "plain"}


def test_plugin_interface_args_are_validated(ws, cli, plugin_dir):
    recipe = plugin_recipe(ws, loss_scal=2.0, tag=["not", "a", "string"])
    result = cli("check", recipe)
    assert result.exit_code == 2
    err = result.stderr
    assert "dataflow.calls.0.interface.args.loss_scal: unknown key; did you mean 'loss_scale'?" in err
    assert "dataflow.calls.0.interface.args.tag:" in err
    text = recipe.read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "loss_scal" in t)
    assert f"{recipe}:{line}:" in err

    generate = ws.recipe(
        imports=[PLUGIN_MODULE],
        dataflow={
            "calls": [{"name": "g", "model": "default", "interface": {"type_": "my_sft"}, "type": "generate"}]
        },
    )
    result = cli("check", generate)
    assert result.exit_code == 2
    assert "interface 'my_sft' does not implement 'generate'; it implements train_step" in result.stderr


# --------------------------------------------------------------------------- safe resume


def test_resume_refuses_a_different_recipe_and_records_allowed_changes(ws, cli, monkeypatch):
    recipe = ws.recipe(trainer={"max_steps": 4, "save_every_n_steps": 2})
    run = ws.root / "run"

    train_until_crash(recipe, run, step=3)
    saved = (run / "recipe.yaml").read_text()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]

    # another learning rate, another seed: refused, listed, nothing touched
    result = cli(
        "train", recipe, "-o", run, "--resume", "models.default.backend.args.optimizer.lr=0.5", "seed=4"
    )
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "models.default.backend.args.optimizer.lr: 0.01 -> 0.5" in err and "seed: 3 -> 4" in err
    assert (run / "recipe.yaml").read_text() == saved

    # a longer run from another folder: allowed, recorded; the saved recipe.yaml is kept as it was
    monkeypatch.chdir(ws.root.parent)
    result = cli("train", run / "recipe.yaml", "-o", run, "--resume", "trainer.max_steps=6")
    assert result.exit_code == 0, result.output
    assert "resuming with a changed setting: trainer.max_steps: 4 -> 6" in " ".join(result.stderr.split())
    assert (run / "recipe.yaml").read_text() == saved
    (history,) = (run / "recipe-history").iterdir()
    assert "trainer.max_steps: 4 -> 6" in history.read_text()
    # the row of step 3 from the interrupted attempt is not duplicated
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]

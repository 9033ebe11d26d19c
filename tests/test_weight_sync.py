"""`weights_from`: a model that follows a trained model's weights — checked by `areal check`, kept in sync
by the trainer (in-process hf follower), and end to end with generation servers (quickstart-server)."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
import yaml

from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate
from tests.conftest import REPO, TINY_ARCH, sft_recipe, train_until_crash


def grpo_recipe(ws, follower: dict | None = None, extra_models: dict | None = None, **update) -> Path:
    """GRPO on the toy data: one SFT warm-up step, then RL; `actor_gen` generates when given."""
    recipe = sft_recipe()
    recipe["experiment"] = "tiny-grpo"
    actor = {
        "config": TINY_ARCH,
        "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 1e-2}}},
    }
    recipe["models"] = {"actor": actor, **({"actor_gen": follower} if follower is not None else {})}
    recipe["models"].update(extra_models or {})
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": 1,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
        "reward": {"reward_fn": "exact_match"},
    }
    recipe["trainer"] = {"max_steps": 3, "tensorboard": False, "samples_every_n_steps": 1}
    recipe.update(update)
    return ws.text("grpo.yaml", yaml.safe_dump(recipe, sort_keys=False))


def problems(path: Path) -> list[str]:
    with pytest.raises(RecipeInvalid) as e:
        validate(load_recipe_source(path))
    return e.value.lines()


def test_weights_from_must_name_a_trained_model(ws):
    calls = validate(load_recipe_source(grpo_recipe(ws, {"init_from": "actor", "weights_from": "actor"})))
    assert {c.name: c.model for c in calls.dataflow.calls}["actor_gen"] == "actor_gen"  # generates there

    (line,) = problems(grpo_recipe(ws, {"init_from": "actor", "weights_from": "actr"}))
    assert "models.actor_gen.weights_from: no such model; did you mean 'actor'?" in line
    (line,) = problems(grpo_recipe(ws, {"init_from": "actor", "weights_from": "actor_gen"}))
    assert "cannot follow its own weights" in line
    ref = {"ref": {"init_from": "actor"}}  # used for inference only
    (line,) = problems(grpo_recipe(ws, {"init_from": "actor", "weights_from": "ref"}, extra_models=ref))
    assert "model 'ref' is not trained by any call" in line and "name a trained model (actor)" in line


def test_hf_follower_tracks_the_actor(ws):
    path = grpo_recipe(ws, {"init_from": "actor", "weights_from": "actor", "backend": {"type_": "hf"}})
    run = ws.root / "run"
    trainer = Trainer(validate(load_recipe_source(path)), path.parent, run)
    try:
        trainer.setup()
        trainer.train()
        actor, gen = trainer.models["actor"], trainer.models["actor_gen"]
        for (name, p), q in zip(
            actor.module.module.named_parameters(), gen.module.module.parameters(), strict=True
        ):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        assert actor.version.global_step == gen.version.global_step == 3
    finally:
        trainer.close()
    versions = sorted(p.name for p in (run / "weights" / "actor").iterdir())
    assert versions == ["v2", "v3"]  # the newest two exports
    rows = [json.loads(x) for x in (run / "samples" / "step_00000002.jsonl").read_text().splitlines()]
    assert {r["version"] for r in rows} == {1}  # generated after the warm-up step, by version 1
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["actor_train/version_lag"] == 0 and "timing/weight_sync_actor_s" in last


def test_quickstart_server_end_to_end(cli, tmp_path):
    """The shipped server recipe: an `areal serve` process generates, the actor trains and its weights
    go to the server after every step; the server's log-probs then equal the trainer's (ratio 1)."""
    run = tmp_path / "run"
    result = cli(
        "train",
        REPO / "recipes" / "quickstart-server.yaml",
        "trainer.max_steps=4",
        "dataflow.sft_warmup_steps=2",
        "trainer.samples_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.log_every_n_steps=1",
        "dataflow.actor.n_minibatches=1",  # one update per step: it starts exactly on-policy
        "-o",
        run,
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (run / "samples" / "step_00000004.jsonl").read_text().splitlines()]
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart-server.yaml").read_text())
    n = recipe["dataflow"]["actor"]["generation"]["n"]
    assert len(rows) == recipe["dataset"]["batch_size"] * n and {r["version"] for r in rows} == {3}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [m for m in metrics if "actor_train/ratio_max" in m]
    assert len(rl) == 2 and all(m["actor_train/version_lag"] == 0 for m in rl)
    # behaviour log-probs came from the server; the trainer recomputes the same ones
    assert all(abs(m["actor_train/ratio_max"] - 1) < 1e-3 and m["actor_train/approx_kl"] < 1e-6 for m in rl)
    log = (run / "servers" / "actor_gen-0.log").read_text()
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", log).group(1))
    with pytest.raises(OSError):  # the server was stopped with the run
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_resume_after_running_past_the_checkpoint_keeps_the_new_export(ws):
    """Interrupted two or more steps after its last checkpoint, a run leaves newer weight exports behind;
    the resumed run's first export (older than those) must survive the pruning that follows it."""
    follower = {"init_from": "actor", "weights_from": "actor", "backend": {"type_": "hf"}}
    path = grpo_recipe(ws, follower, trainer={"max_steps": 9, "save_every_n_steps": 3, "tensorboard": False})
    run = ws.root / "run"

    train_until_crash(path, run, step=8)
    assert sorted(p.name for p in (run / "weights" / "actor").iterdir()) == ["v7", "v8"]

    resumed = Trainer(validate(load_recipe_source(path)), path.parent, run, resume=True)
    try:
        resumed.setup()  # resumes at step 6: exports v6; v7 and v8 are leftovers of the crashed run
        assert sorted(p.name for p in (run / "weights" / "actor").iterdir()) == ["v6"]
        resumed.train()
    finally:
        resumed.close()
    assert resumed.global_step == 9
    assert sorted(p.name for p in (run / "weights" / "actor").iterdir()) == ["v8", "v9"]


def test_a_follower_keeps_the_weights_of_its_last_step_and_resumes_with_them(ws):
    """`follow_until: 2`: the reference follows the actor through the 2-step SFT warm-up, then keeps those
    weights (the KL's anchor) while RL trains the actor on; checkpoints save it, and a run resumed after
    the warm-up ends with the same reference and actor as an uninterrupted one."""
    ref = {"ref": {"init_from": "actor", "weights_from": "actor", "follow_until": 2}}
    trainer_args = {
        "max_steps": 5,
        "save_every_n_steps": 1,
        "keep_last_n_checkpoints": 5,
        "tensorboard": False,
    }
    dataflow = {
        "preset": "grpo",
        "sft_warmup_steps": 2,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}, "shaping": {"kl_ctl": 0.1}},
        "reward": {"reward_fn": "exact_match"},
    }
    path = grpo_recipe(ws, extra_models=ref, trainer=trainer_args, dataflow=dataflow)

    def weights(folder: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(folder / "model.safetensors")

    def train(run_dir: Path, resume: bool = False) -> Trainer:
        trainer = Trainer(validate(load_recipe_source(path)), path.parent, run_dir, resume=resume)
        try:
            trainer.setup()
            trainer.train()
        finally:
            trainer.close()
        return trainer

    run = ws.root / "run"
    train(run)
    ckpt = run / "checkpoints"
    warm = weights(ckpt / "step_00000002" / "actor")
    for step in (2, 3, 5):
        kept = weights(ckpt / f"step_{step:08d}" / "ref")
        assert all(torch.equal(kept[k], warm[k]) for k in warm), step
    assert not all(torch.equal(weights(ckpt / "step_00000005" / "actor")[k], warm[k]) for k in warm)
    kl = [json.loads(x).get("actor_train/kl_ref") for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(v is not None and v > 0 for v in kl)  # the actor moved away from the kept weights

    resumed_run = ws.root / "resumed"
    train_until_crash(path, resumed_run, step=4)
    resumed = train(resumed_run, resume=True)
    assert resumed.resumed_from is not None and resumed.resumed_from.name in (
        "step_00000003",
        "step_00000004",
    )
    for name in ("actor", "ref"):
        a = weights(ckpt / "step_00000005" / name)
        b = weights(resumed_run / "checkpoints" / "step_00000005" / name)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_follow_until_needs_a_source_and_a_model_held_in_the_training_process(ws):
    (line,) = problems(grpo_recipe(ws, extra_models={"ref": {"init_from": "actor", "follow_until": 2}}))
    assert "follow_until needs weights_from" in line
    kept = {"init_from": "actor", "weights_from": "actor", "follow_until": 2, "backend": {"type_": "local"}}
    (line,) = problems(grpo_recipe(ws, kept))
    assert "models.actor_gen.backend.type_" in line and "keeps 'actor'" in line and "run it on hf" in line

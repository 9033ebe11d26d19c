"""OpenEnv environments as a rollout workflow (`openenv`): the echo environment `openenv init` writes (as
its authors publish it) stepped by a model, its rewards and errors; `areal check` on the workflow's
server; the OpenEnv quickstart's reward rises (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import REPO, tiny_module, train_asynchronously

pytest.importorskip("openenv", reason="openenv-core is not installed (see .ci/run)")


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> Path:
    """The echo environment of `openenv init` (openenv-core's own template), in a folder on sys.path."""
    root = tmp_path_factory.mktemp("openenv")
    result = subprocess.run(
        [str(Path(sys.executable).with_name("openenv")), "init", "echo_env"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (root / "echo_env" / "server" / "app.py").is_file()
    return root


def engine_for(char_tok):
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import HFBackendArgs

    model = HFBackend(HFBackendArgs(device="cpu")).initialize(
        Model("actor", tiny_module(char_tok, seed=0), char_tok), FinetuneSpec(1, 1, 1, 1)
    )
    return model.module


def test_the_echo_environment_as_published_scores_episodes(echo_env, char_tok, monkeypatch):
    """Started with the run from `echo_env.server.app:app`, one session at a time (the template allows
    one): every step's reward is the environment's (0.1 per character echoed), summed per episode, and
    each observation comes back rendered in the prompt of the next turn."""
    from arealcli.runtime.agents.openenv import OpenEnvWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import OpenEnvArgs

    monkeypatch.syspath_prepend(str(echo_env))
    args = OpenEnvArgs(
        app="echo_env.server.app:app",
        action_field="message",
        observation_template="[{echoed_message}]",
        max_turns=2,
        sessions=1,
    )
    workflow = OpenEnvWorkflow(args)
    try:
        prompts = [char_tok(p, add_special_tokens=False)["input_ids"] for p in ("hi", "max(1,2,3)=", "x")]
        torch.manual_seed(0)
        g = GenerationHyperparameters(max_new_tokens=6, min_new_tokens=6, temperature=1.0)
        episodes = workflow.run(engine_for(char_tok), char_tok, prompts, g)
    finally:
        workflow.close()
    assert workflow.server is None
    for ep in episodes:
        assert char_tok.decode(ep.prompt) == "[Echo Env environment ready!]"  # the reset observation
        assert ep.metrics == {"steps": 2.0, "errors": 0.0} and ep.turns == 2
        mine = [t for t, m in zip(ep.tokens, ep.mask, strict=True) if m]
        first, second = char_tok.decode(mine[:6]), char_tok.decode(mine[6:])
        shown = char_tok.decode([t for t, m in zip(ep.tokens, ep.mask, strict=True) if not m])
        assert shown == f"[{first.strip()}]"  # the echo, between the two turns
        assert ep.reward == pytest.approx(0.1 * (len(first.strip()) + len(second.strip())))


def test_a_refused_action_ends_the_episode_and_counts(echo_env, char_tok, monkeypatch):
    from arealcli.runtime.agents.openenv import OpenEnvWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import OpenEnvArgs

    monkeypatch.syspath_prepend(str(echo_env))
    workflow = OpenEnvWorkflow(
        OpenEnvArgs(app="echo_env.server.app:app", action_field="nope", max_turns=3, sessions=1)
    )
    try:
        g = GenerationHyperparameters(max_new_tokens=3, temperature=1.0)
        (ep,) = workflow.run(
            engine_for(char_tok), char_tok, [char_tok("a", add_special_tokens=False)["input_ids"]], g
        )
    finally:
        workflow.close()
    assert ep.metrics == {"steps": 1.0, "errors": 1.0} and ep.reward == 0.0 and ep.turns == 1


def test_a_running_server_given_by_url(echo_env, char_tok, monkeypatch):
    """`url:` connects to a server that runs already (started here as a user would); the workflow leaves
    it running when it closes, and episodes reuse their sessions across calls."""
    from arealcli.runtime.agents.openenv import EnvServer, OpenEnvWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import OpenEnvArgs

    monkeypatch.syspath_prepend(str(echo_env))
    server = EnvServer("echo_env.server.app:app", 60)
    try:
        workflow = OpenEnvWorkflow(OpenEnvArgs(url=server.url, action_field="message", sessions=1))
        g = GenerationHyperparameters(max_new_tokens=4, min_new_tokens=4, temperature=1.0)
        prompt = [char_tok("hi", add_special_tokens=False)["input_ids"]]
        for _ in range(2):  # the second call resets the session the first one used
            (ep,) = workflow.run(engine_for(char_tok), char_tok, prompt, g)
            text = char_tok.decode([t for t, m in zip(ep.tokens, ep.mask, strict=True) if m])
            assert ep.reward == pytest.approx(0.1 * len(text.strip())) and ep.metrics["errors"] == 0
        assert workflow.pool is not None and len(workflow.pool.idle) == 1
        workflow.close()
        assert server.alive  # not the workflow's to stop
    finally:
        server.stop()


def test_check_names_what_is_wrong_with_the_environment(tmp_path, cli, monkeypatch):
    recipe = yaml.safe_load((REPO / "recipes" / "openenv-quickstart.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(REPO / "data" / "max3" / Path(recipe[key]["args"]["path"]).name)
    args = recipe["dataflow"]["actor"]["workflow"]["args"]
    path = tmp_path / "r.yaml"

    def check(**change):
        args.update(change)
        path.write_text(yaml.safe_dump(recipe))
        return cli("check", path)

    result = check(app="no_such_env.server.app:app")
    assert result.exit_code == 2
    assert "cannot import no_such_env.server.app" in result.stderr
    result = check(app=None, url=None)
    assert result.exit_code == 2 and "url (running) or app" in result.stderr
    result = check(app="max3_env.server.app")
    assert result.exit_code == 2 and "module:attribute" in result.stderr
    result = check(app="max3_env.server.app:app", reset_args={"task": "{question}"})
    assert result.exit_code == 2 and "reset_args.task names ['question']: only {prompt}" in result.stderr
    # the shipped recipe: its environment is found beside it; a copy made elsewhere finds it there too
    assert cli("check", REPO / "recipes" / "openenv-quickstart.yaml").exit_code == 0
    monkeypatch.chdir(tmp_path)
    assert cli("init", "my-env", "--from", "openenv-quickstart").exit_code == 0
    result = cli("check", tmp_path / "my-env.yaml")
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_the_openenv_quickstart_reward_rises(tmp_path, cli, monkeypatch):
    from tests.test_quickstart import train

    run = tmp_path / "run"
    train("openenv-quickstart.yaml", run, "trainer.max_steps=120", "trainer.eval_every_n_steps=60")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["actor_gen/env/reward"] for r in rows if "actor_gen/env/reward" in r]
    steps = [r["actor_gen/env/steps"] for r in rows if "actor_gen/env/steps" in r]
    print(f"openenv-quickstart: env reward {rewards}, steps per episode {steps}")
    assert len(rewards) == 6
    assert sum(rewards[-2:]) / 2 >= rewards[0] + 0.1, rewards  # the environment's reward rises
    assert sum(steps[-2:]) / 2 < steps[0]  # more answers right at the first attempt

    # `areal eval RUN` from another folder starts the environment from the run's recipe.yaml (app_dir)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval.json"
    result = cli("eval", run, "--n", 1, "-o", out)
    assert result.exit_code == 0, result.output
    final = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]
    assert abs(json.loads(out.read_text())["metrics"]["greedy_accuracy"] - final) <= 0.02


@pytest.mark.slow
def test_the_openenv_workflow_runs_asynchronously(tmp_path):
    """The quickstart with generation on a `local` generator running up to 2 steps ahead (decoupled
    PPO): episodes are generated on a rollout thread, the environment server lives through the run,
    and the reward rises."""
    recipe = yaml.safe_load((REPO / "recipes" / "openenv-quickstart.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["path"] = str(REPO / "data" / "max3" / Path(recipe[key]["args"]["path"]).name)
    recipe["dataflow"]["actor"]["workflow"]["args"]["app_dir"] = str(REPO / "recipes")
    recipe["trainer"].update(max_steps=100, eval_every_n_steps=100)
    rows = train_asynchronously(recipe, tmp_path)
    rewards = [r["actor_gen/env/reward"] for r in rows if "actor_gen/env/reward" in r]
    print(f"openenv async: env reward {rewards}")
    assert len(rewards) >= 3 and sum(rewards[-2:]) / 2 > rewards[0], rewards
    lag = [r["actor_train/version_lag_max"] for r in rows if "actor_train/version_lag_max" in r]
    assert lag and max(lag) <= 2  # no sample more than max_staleness policy versions behind

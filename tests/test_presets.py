"""Dataflow presets expand to the full graph, keep error positions, and validate like written graphs."""

from __future__ import annotations

import yaml

from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate
from tests.conftest import REPO


def _calls(path, *overrides):
    from arealcli.schema.source import apply_overrides

    return validate(apply_overrides(load_recipe_source(path), list(overrides))).dataflow.calls


def test_grpo_preset_graph():
    calls = _calls(REPO / "recipes" / "quickstart.yaml")
    assert [c.name for c in calls] == ["sft_warmup", "actor_gen", "reward", "returns", "actor_train"]
    warm, gen, reward, returns, train = calls
    assert returns.model is None and set(returns.outputs) <= set(train.inputs)
    assert warm.end_step == gen.start_step == train.start_step > 0
    assert reward.model is None and reward.interface.type_ == "reward"
    assert set(gen.outputs) <= set(train.inputs)


def test_ppo_preset_adds_critic_and_reference(tmp_path):
    recipe = yaml.safe_load((REPO / "recipes" / "ppo-quickstart.yaml").read_text())
    recipe["models"]["ref"] = {"init_from": "actor"}
    recipe["dataset"]["args"]["path"] = str(REPO / "data" / "max3" / "train.jsonl")
    recipe["eval_dataset"]["args"]["path"] = str(REPO / "data" / "max3" / "test.jsonl")
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    calls = {c.name: c for c in _calls(path)}
    assert list(calls) == [
        "sft_warmup",
        "actor_gen",
        "reward",
        "ref_logprobs",
        "values",
        "returns",
        "actor_train",
        "critic_train",
    ]
    # rewards -> advantages and returns once: the actor and the critic get the same ones
    assert {"advantages", "returns", "kl_coef"} <= set(calls["actor_train"].inputs)
    assert {"advantages", "returns", "kl_coef"} <= set(calls["critic_train"].inputs)
    # the critic's targets keep the critic's own lambda
    assert calls["returns"].interface.args.returns_lambda == recipe["dataflow"]["critic"].get(
        "gae_lambda", 0.95
    )
    assert calls["ref_logprobs"].output_key_remap == {"packed_logprobs": "packed_ref_logprobs"}
    assert {"values", "packed_ref_logprobs"} <= set(calls["actor_train"].inputs)


def test_preset_args_errors_point_at_the_preset_lines(tmp_path):
    text = (REPO / "recipes" / "quickstart.yaml").read_text()
    text = text.replace("    eps_clip: 0.2", "    eps_clipp: 0.2")
    path = tmp_path / "q.yaml"
    path.write_text(text.replace("../data", str(REPO / "data")))
    try:
        validate(load_recipe_source(path))
    except RecipeInvalid as e:
        lines = e.lines()
    else:
        raise AssertionError("expected a problem")
    line_no = next(i for i, line in enumerate(text.splitlines(), 1) if "eps_clipp" in line)
    # The generate and train calls share the actor args: said once, under the path the user wrote.
    (line,) = lines
    assert f":{line_no}:" in line and "dataflow.actor.eps_clipp: unknown key" in line
    assert "did you mean 'eps_clip'" in line


def test_minibatch_divisibility_is_checked():
    try:
        _calls(REPO / "recipes" / "quickstart.yaml", "dataflow.actor.n_minibatches=3")
    except RecipeInvalid as e:
        assert "do not split into 3 equal minibatches" in str(e)
    else:
        raise AssertionError("expected a problem")


def test_group_normalization_needs_groups():
    try:
        _calls(REPO / "recipes" / "quickstart.yaml", "dataflow.actor.generation.n=1")
    except RecipeInvalid as e:
        assert "adv_norm=group needs generation.n >= 2" in str(e)
    else:
        raise AssertionError("expected a problem")


def test_a_written_graph_without_returns_is_refused(tmp_path):
    """The actor's update reads the returns call's advantages: a graph without that call is an error of
    `areal check`, not a crash at the first RL step."""
    recipe = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())
    calls = [c.model_dump(mode="json") for c in _calls(REPO / "recipes" / "quickstart.yaml")]
    calls = [c for c in calls if c["name"] != "returns"]
    train = next(c for c in calls if c["name"] == "actor_train")
    train["inputs"] = [
        k for k in train["inputs"] if k not in ("advantages", "returns", "seq_scores", "kl_coef")
    ]
    recipe["dataflow"] = {"calls": calls}
    path = tmp_path / "written.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        validate(load_recipe_source(path))
    except RecipeInvalid as e:
        messages = [p.message for p in e.problems]
    else:
        raise AssertionError("a train_step without the returns keys passed the checks")
    assert any(
        "interface 'ppo_actor' trains on advantages, kl_coef, returns, seq_scores" in m and "`returns`" in m
        for m in messages
    ), messages


def test_proximal_logprobs_call_only_when_recomputed():
    def names(method: str) -> list[str]:
        recipe = REPO / "recipes" / "quickstart-async.yaml"
        return [c.name for c in _calls(recipe, f"dataflow.actor.prox_logp_method={method}")]

    assert "prox_logprobs" in names("recompute") and "prox_logprobs" in names("metrics")
    assert "prox_logprobs" not in names("loglinear") and "prox_logprobs" not in names("rollout")


def test_held_out_prompts_are_scored_by_the_training_reward(tmp_path):
    calls = {
        c.name: c
        for c in _calls(REPO / "recipes" / "quickstart.yaml", "dataflow.reward.reward_fn=exact_match")
    }
    assert calls["actor_train"].interface.args.eval_reward_fn == "exact_match"
    said = _calls(
        REPO / "recipes" / "quickstart.yaml",
        "dataflow.reward.reward_fn=exact_match",
        "dataflow.actor.eval_reward_fn=math",
    )
    assert {c.name: c for c in said}["actor_train"].interface.args.eval_reward_fn == "math"

"""The JSON Schema of a recipe, for editors (completion, hover docs, red squiggles) and other tools.

`areal schema > recipe.schema.json` writes it. Every `{type_, args}` is typed by its `type_`: the args
of each registered backend, interface and dataset (plugins imported with `--import` included) follow
their own argument model. `dataflow` is either the written-out `calls` or a named preset block.
Shipped recipes point at the repository's copy with a modeline:

    # yaml-language-server: $schema=../recipe.schema.json
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from arealcli.schema.base import Name, StrictModel
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import (
    JudgeSettings,
    PPOActorArgs,
    PPOCriticArgs,
    RemoteLogprobsArgs,
    RemoteRewardArgs,
    RewardArgs,
    RewardShaping,
)
from arealcli.schema.presets import PRESETS
from arealcli.schema.recipe import DataflowSpec, DatasetSpec, Recipe
from arealcli.schema.registry import BACKENDS, DATASETS, INTERFACES, Registry

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"


class ModelReward(StrictModel):
    """A preset's reward scored by a trained reward model of the recipe (interface rm_reward)."""

    model: Name = Field(description="The reward model (a model of the recipe, `value_head: true`, `path:`).")


class JudgeReward(JudgeSettings):
    """A preset's reward given by a judge model asked about each sample (interface judge_reward)."""

    judge: str = Field(
        description="The judge: a model of the recipe, or the base URL of an OpenAI-compatible server."
    )


class EnvironmentReward(StrictModel):
    """A preset's reward given by the environment of the actor's workflow (interface env_reward)."""

    environment: Literal[True] = Field(description="true: the rewards the environment gave the episodes.")


class PresetDataflow(StrictModel):
    """A dataflow written as a named preset (see `areal check --print` for the calls it expands to)."""

    preset: str = Field(description="sft, grpo, ppo or distill.", json_schema_extra={"enum": list(PRESETS)})
    actor: PPOActorArgs | None = Field(None, description="ppo_actor args (grpo, ppo, distill).")
    critic: PPOCriticArgs | None = Field(None, description="ppo_critic args (ppo).")
    reward: RewardArgs | ModelReward | RemoteRewardArgs | JudgeReward | EnvironmentReward | None = Field(
        None,
        description="reward interface args, {model: NAME}: a trained reward model scores each sample, "
        "{url: ...}: a reward service does (remote_reward), {judge: NAME or URL, template, parse}: a "
        "judge model asked about each sample (judge_reward), or {environment: true}: the actor's "
        "workflow's environment scores (env_reward).",
    )
    shaping: RewardShaping | None = Field(None, description="Reward shaping + KL for the actor and critic.")
    mb_spec: MicroBatchSpec | None = Field(None, description="Micro-batch split of every call.")
    teacher: RemoteLogprobsArgs | None = Field(
        None, description="distill: a teacher served elsewhere ({url: ...}), instead of models.teacher."
    )
    topk: int | None = Field(
        None, ge=1, description="distill: the exact KL over the teacher's top-k tokens (distill_topk)."
    )
    sft_warmup_steps: int = Field(0, ge=0, description="SFT steps on the dataset's answers before RL.")
    model: Name = Field("default", description="The trained model (sft).")


def _components(registry: Registry) -> list[tuple[str, type[BaseModel], str]]:
    return [(e.name, e.args_model, e.description) for e in registry.entries()]


def _one_of_components(d: dict[str, Any], comps: list[tuple[str, type[BaseModel], str]], ref: Any) -> None:
    """A `{type_, args}` definition: `type_` names a component, and `args` is that component's model."""
    d["properties"]["type_"] = {
        **d["properties"]["type_"],
        "enum": [name for name, _, _ in comps],
    }
    d["properties"]["args"] = {
        "type": "object",
        "description": d["properties"]["args"].get("description", ""),
    }
    d["allOf"] = [
        {
            "if": {"properties": {"type_": {"const": name}}, "required": ["type_"]},
            "then": {"properties": {"args": {**ref(model), "description": doc}}},
        }
        for name, model, doc in comps
    ]


def recipe_json_schema() -> dict[str, Any]:
    kinds = {
        "ModelBackendAbstraction": _components(BACKENDS),
        "ModelInterfaceAbstraction": _components(INTERFACES),
        "DatasetSpec": _components(DATASETS),
    }
    args_models = {m for comps in kinds.values() for _, m, _ in comps}
    models: list[type[BaseModel]] = [
        Recipe,
        DataflowSpec,
        DatasetSpec,
        PresetDataflow,
        *sorted(args_models, key=lambda m: m.__name__),
    ]
    keys, top = models_json_schema([(m, "validation") for m in models], ref_template="#/$defs/{model}")
    defs = top["$defs"]

    def ref(model: type[BaseModel]) -> dict[str, str]:
        return keys[(model, "validation")]

    for def_name, comps in kinds.items():
        _one_of_components(defs[def_name], comps, ref)
    recipe = defs["Recipe"]
    recipe["properties"]["dataflow"] = {
        "description": recipe["properties"]["dataflow"].get("description", ""),
        "anyOf": [ref(DataflowSpec), ref(PresetDataflow)],
    }
    return {"$schema": SCHEMA_URI, "title": "arealcli recipe", **ref(Recipe), "$defs": defs}

"""Named dataflow presets: a short `dataflow:` section that expands to the full graph of calls.

    dataflow:
      preset: grpo               # sft | grpo | ppo
      actor: {...}               # ppo_actor args (generation, clipping, normalization, ...)
      critic: {...}              # ppo_critic args (ppo only)
      reward: {reward_fn: math}  # reward interface args
      shaping: {...}             # reward shaping + KL, given to both actor and critic
      mb_spec: {...}             # micro-batch split of every call
      sft_warmup_steps: 0        # SFT on the actor's dataset answers before RL starts

Models are taken by name: `actor` (trained), `ref` (optional: enables the reference KL), `critic`
(ppo), `actor_gen` (optional: generates instead of `actor`, e.g. on SGLang servers or the `local`
backend with `weights_from: actor`). With `actor: {use_decoupled_loss: true}` an `actor_prox` call
recomputes the log-probs with the current policy before the update (decoupled PPO). Expansion works on raw recipe data, before validation, and keeps source
positions so that an error in `actor:` points at that line.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import Field, NonNegativeInt, ValidationError, field_validator

from arealcli.schema.base import Name, StrictModel
from arealcli.schema.registry import suggest
from arealcli.schema.source import Located, Path_

PRESETS = ("sft", "grpo", "ppo")
# Preset keys each preset ignores: giving one is a mistake worth saying.
UNUSED = {
    "sft": ("actor", "critic", "reward", "shaping", "sft_warmup_steps"),
    "grpo": ("critic", "model"),
    "ppo": ("model",),
}

# `version` (meta): the policy version that generated each sample (it lags when generation servers do)
GEN_OUT = ["packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask", "version", "version_last"]


def _call(name, model, type_, args, call_type, inputs, outputs, mb_spec, **extra) -> dict[str, Any]:
    call = {
        "name": name,
        "model": model,
        "interface": {"type_": type_, "args": copy.deepcopy(args)},
        "type": call_type,
        "inputs": inputs,
        "outputs": outputs,
    }
    if mb_spec is not None:
        call["mb_spec"] = copy.deepcopy(mb_spec)
    call.update(extra)
    return call


RETURNS_OUT = ["advantages", "returns", "seq_scores", "kl_coef"]
# `returns` args taken from the actor's block (and the critic's lambda for ppo's returns)
RETURNS_FROM_ACTOR = ("shaping", "gae_lambda", "adaptive_kl_target", "adaptive_kl_horizon")


def returns_args(actor: dict[str, Any], critic: dict[str, Any], preset: str) -> dict[str, Any]:
    args = {k: actor[k] for k in RETURNS_FROM_ACTOR if k in actor}
    generation = actor.get("generation")
    if isinstance(generation, dict) and "max_new_tokens" in generation:
        args["max_new_tokens"] = generation["max_new_tokens"]
    elif generation is None or isinstance(generation, dict):
        args["max_new_tokens"] = 16  # GenerationHyperparameters' default
    if preset == "ppo":
        args["returns_lambda"] = critic.get("gae_lambda", 0.95)  # PPOCriticArgs' default
    return args


def expand(df: dict[str, Any], models: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Calls of a preset, and for each call index the preset key its interface args came from."""
    preset = df["preset"]
    mb = df.get("mb_spec")
    if preset == "sft":
        model = df.get("model", "default")
        return [_call("sft", model, "sft", {}, "train_step", ["packed_input_ids", "prompt_mask"], [], mb)], {}
    shaping = df.get("shaping") or {}
    actor = {**(df.get("actor") or {}), **({"shaping": shaping} if shaping else {})}
    if preset == "grpo":
        actor.setdefault("adv_norm", "group")
    calls: list[dict[str, Any]] = []
    origin: dict[int, str] = {}
    warmup = df.get("sft_warmup_steps") or 0
    if warmup:
        calls.append(
            _call(
                "sft_warmup",
                "actor",
                "sft",
                {},
                "train_step",
                ["packed_input_ids", "prompt_mask"],
                [],
                mb,
                end_step=warmup,
            )
        )
    rl = {"start_step": warmup} if warmup else {}
    origin[len(calls)] = "actor"
    gen_model = "actor_gen" if "actor_gen" in models else "actor"  # e.g. generation servers of the actor
    # episodes (a workflow): `loss_mask` marks the model's own tokens for the reward (its final answer),
    # the returns and the updates (tool output never trains)
    episode = ["loss_mask"] if actor.get("workflow") is not None else []
    calls.append(
        _call(
            "actor_gen", gen_model, "ppo_actor", actor, "generate", ["packed_prompts"], GEN_OUT + episode, mb,
            **rl,
        )
    )  # fmt: skip
    origin[len(calls)] = "reward"
    calls.append(
        _call(
            "reward",
            None,
            "reward",
            df.get("reward") or {},
            "inference",
            ["packed_input_ids", "prompt_mask", "answers", *episode],
            ["rewards"],
            mb,
            **rl,
        )
    )
    train_inputs = [
        "packed_input_ids",
        "prompt_mask",
        "packed_logprobs",
        "seq_no_eos_mask",
        "rewards",
        "version",
        "version_last",
        *episode,
    ]
    if "ref" in models:
        origin[len(calls)] = "actor"
        calls.append(
            _call(
                "ref_inf",
                "ref",
                "ppo_actor",
                actor,
                "inference",
                ["packed_input_ids"],
                ["packed_ref_logprobs"],
                mb,
                output_key_remap={"packed_logprobs": "packed_ref_logprobs"},
                **rl,
            )
        )
        train_inputs.append("packed_ref_logprobs")
    if actor.get("use_decoupled_loss") is True:  # proximal log-probs: the current policy, before the update
        origin[len(calls)] = "actor"
        calls.append(
            _call(
                "actor_prox",
                "actor",
                "ppo_actor",
                actor,
                "inference",
                ["packed_input_ids"],
                ["packed_prox_logprobs"],
                mb,
                output_key_remap={"packed_logprobs": "packed_prox_logprobs"},
                **rl,
            )
        )
        train_inputs.append("packed_prox_logprobs")
    critic = {**(df.get("critic") or {}), **({"shaping": shaping} if shaping else {})}
    returns_inputs = [
        "packed_input_ids",
        "prompt_mask",
        "packed_logprobs",
        "seq_no_eos_mask",
        "rewards",
        *episode,
    ]
    if "ref" in models:
        returns_inputs.append("packed_ref_logprobs")
    if preset == "ppo":
        origin[len(calls)] = "critic"
        calls.append(
            _call(
                "critic_inf",
                "critic",
                "ppo_critic",
                critic,
                "inference",
                ["packed_input_ids"],
                ["values"],
                mb,
                **rl,
            )
        )
        train_inputs.append("values")
        returns_inputs.append("values")
    # rewards -> advantages and returns, once, for the actor and the critic (one KL controller)
    calls.append(
        _call(
            "returns", None, "returns", returns_args(actor, critic, preset), "inference",
            returns_inputs, RETURNS_OUT, mb, **rl,
        )
    )  # fmt: skip
    train_inputs += RETURNS_OUT
    origin[len(calls)] = "actor"
    calls.append(_call("actor_train", "actor", "ppo_actor", actor, "train_step", train_inputs, [], mb, **rl))
    if preset == "ppo":
        origin[len(calls)] = "critic"
        calls.append(
            _call("critic_train", "critic", "ppo_critic", critic, "train_step", train_inputs, [], mb, **rl)
        )
    return calls, origin


class PresetSpec(StrictModel):
    """A `dataflow:` written as a named preset; its blocks are the interfaces' args (checked there)."""

    preset: str = Field(description="sft, grpo or ppo.")
    actor: dict[str, Any] | None = Field(None, description="ppo_actor args.")
    critic: dict[str, Any] | None = Field(None, description="ppo_critic args (ppo).")
    reward: dict[str, Any] | None = Field(None, description="reward interface args.")
    shaping: dict[str, Any] | None = Field(None, description="Reward shaping + KL for actor and critic.")
    mb_spec: dict[str, Any] | None = Field(None, description="Micro-batch split of every call.")
    sft_warmup_steps: NonNegativeInt = Field(0, le=1 << 30, description="SFT steps before RL.")
    model: Name = Field("default", description="The trained model (sft).")

    @field_validator("preset")
    @classmethod
    def _known(cls, preset: str) -> str:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}{suggest(preset, list(PRESETS))}")
        return preset


def expand_in_place(src: Located) -> list[tuple[Path_, str]]:
    """Replace a preset `dataflow` by its calls in `src.data`; returns (path, message) problems.

    The generated calls' paths are aliased to the preset keys they came from, so an error in the
    actor's args reads `dataflow.actor.eps_clipp` at that line, once.
    """
    df = src.data.get("dataflow")
    if not isinstance(df, dict) or "preset" not in df:
        return []
    if df.get("calls") is not None:
        return [
            (
                ("dataflow", "calls"),
                "give either `preset` or `calls`, not both (see `areal check --print` for a preset's calls)",
            )
        ]
    try:
        spec = PresetSpec.model_validate(df)
    except ValidationError as e:
        return [
            (("dataflow", *loc), message)
            for loc, message in ((p.path, p.message) for p in _problems(e, PresetSpec))
        ]
    unused = [k for k in UNUSED[spec.preset] if df.get(k) is not None]
    if unused:
        return [(("dataflow", k), f"the {spec.preset} preset does not use `{k}`") for k in unused]
    models = src.data.get("models") if isinstance(src.data.get("models"), dict) else {}
    calls, origin = expand(spec.model_dump(exclude_none=True), models)
    if "loss_mask" in _dataset_keys(src.data.get("dataset")):  # chat data: the loss on assistant tokens
        for call in calls:
            if call["interface"]["type_"] == "sft":
                call["inputs"].append("loss_mask")
    for i, call in enumerate(calls):
        here = ("dataflow", "calls", i)
        src.aliases[here] = ("dataflow", f"preset[{spec.preset}]", call["name"])
        if "mb_spec" in df:
            src.aliases[here + ("mb_spec",)] = ("dataflow", "mb_spec")
        if i in origin:
            src.aliases[here + ("interface", "args")] = ("dataflow", origin[i])
            if origin[i] in ("actor", "critic") and "shaping" in df:
                src.aliases[here + ("interface", "args", "shaping")] = ("dataflow", "shaping")
        if call["name"] == "returns":  # its args came from the actor's block (and the critic's lambda)
            args = here + ("interface", "args")
            for key in RETURNS_FROM_ACTOR:
                src.aliases[args + (key,)] = ("dataflow", "actor", key)
            src.aliases[args + ("max_new_tokens",)] = ("dataflow", "actor", "generation", "max_new_tokens")
            src.aliases[args + ("returns_lambda",)] = ("dataflow", "critic", "gae_lambda")
            if "shaping" in df:
                src.aliases[args + ("shaping",)] = ("dataflow", "shaping")
        if call.get("end_step") is not None or call.get("start_step"):
            src.aliases[here + ("end_step",)] = src.aliases[here + ("start_step",)] = (
                "dataflow",
                "sft_warmup_steps",
            )
    src.data["dataflow"] = {"calls": calls}
    return []


def _dataset_keys(raw: Any) -> frozenset[str]:
    from arealcli.schema.registry import DATASETS

    kind = raw.get("type_") if isinstance(raw, dict) else None
    return DATASETS.get(kind).data_keys if isinstance(kind, str) and kind in DATASETS else frozenset()


def _problems(err: ValidationError, model):
    from arealcli.schema.validate import problems_from_validation_error

    return problems_from_validation_error(err, model)

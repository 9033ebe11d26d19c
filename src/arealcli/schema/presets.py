"""Named dataflow presets: a short `dataflow:` section that expands to the full graph of calls.

    dataflow:
      preset: grpo               # sft | grpo | ppo | distill
      actor: {...}               # ppo_actor args (generation, clipping, normalization, ...)
      critic: {...}              # ppo_critic args (ppo only)
      reward: {reward_fn: math}  # reward interface args; {model: NAME}: a trained reward model scores;
                                 # {url: http://...}: a reward service scores (remote_reward);
                                 # {judge: NAME|URL, template, parse}: a judge model (judge_reward);
                                 # {environment: true}: the workflow's environment scored (env_reward)
      shaping: {...}             # reward shaping + KL (the returns call's; the actor's loss reads kl_in_reward)
      mb_spec: {...}             # micro-batch split of every call
      sft_warmup_steps: 0        # SFT on the actor's dataset answers before RL starts

Models are taken by name: `actor` (trained), `ref` (optional: enables the reference KL), `critic`
(ppo), `actor_gen` (optional: generates instead of `actor`, e.g. on SGLang servers or the `local`
backend with `weights_from: actor`), `teacher` (distill: scores every token of the actor's samples). The calls are named for what they do: `actor_gen` (samples),
`reward` (scores), `ref_logprobs`, `prox_logprobs` (decoupled PPO: the current policy's log-probs
before the update), `values` (the critic's), `returns` (rewards -> advantages and returns, once, with
the one KL controller), `actor_train`, `critic_train`. Expansion works on raw recipe data, before
validation, and keeps source positions so that an error in `actor:` points at that line.
"""

from __future__ import annotations

import copy
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, NonNegativeInt, ValidationError, field_validator

from arealcli.schema.base import Name, StrictModel
from arealcli.schema.components.engine import GenerationHyperparameters
from arealcli.schema.components.interfaces import RETURNS_OUTPUTS, TOPK_IDS, TOPK_LOGPROBS, PPOCriticArgs
from arealcli.schema.problems import problems_from_validation_error
from arealcli.schema.registry import dataset_keys, suggest
from arealcli.schema.source import Located, Path_, mapping_at

# Preset keys each preset ignores: giving one is a mistake worth saying.
UNUSED = {
    "sft": ("actor", "critic", "reward", "shaping", "sft_warmup_steps", "teacher", "topk"),
    "grpo": ("critic", "model", "teacher", "topk"),
    "ppo": ("model", "teacher", "topk"),
    "distill": ("critic", "model"),
}
# The models a preset takes by name.
MODEL_NAMES = ("actor", "ref", "critic", "actor_gen", "teacher")
# On-policy distillation's returns: the per-token reward is -(log pi(a_t) - log teacher(a_t)) (the k1
# estimate of the reverse KL, coefficient 1, in the reward), not discounted: each token's advantage is
# its own (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025, on-policy distillation).
DISTILL_SHAPING = {"kl_ctl": 1.0, "kl_in_reward": True, "discount": 0.0}

SFT_INPUTS = ("packed_input_ids", "prompt_mask")
# `version` (meta): the policy version that generated each sample (it lags when generation servers do)
GEN_OUT = ["packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask", "version", "version_last"]
RETURNS_INPUTS = ("packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask", "rewards")
TRAIN_INPUTS = (*RETURNS_INPUTS, "version", "version_last")
RETURNS_OUT = list(RETURNS_OUTPUTS)
# `returns` args taken from the actor's block (and the critic's lambda for ppo's returns)
RETURNS_FROM_ACTOR = ("shaping", "gae_lambda", "adaptive_kl_target", "adaptive_kl_horizon")


def _call(
    name: str,
    model: str | None,
    type_: str,
    args: dict[str, Any],
    call_type: str,
    inputs: list[str],
    outputs: list[str],
    mb_spec: Any = None,
    **extra: Any,
) -> dict[str, Any]:
    call: dict[str, Any] = {
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


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


def returns_args(actor: dict[str, Any], critic: dict[str, Any] | None) -> dict[str, Any]:
    """The `returns` call's args: from the actor's block, and the critic's GAE lambda when there is one."""
    args = {k: actor[k] for k in RETURNS_FROM_ACTOR if k in actor}
    generation = actor.get("generation")
    if isinstance(generation, dict) and "max_new_tokens" in generation:
        args["max_new_tokens"] = generation["max_new_tokens"]
    elif generation is None or isinstance(generation, dict):
        args["max_new_tokens"] = _default(GenerationHyperparameters, "max_new_tokens")
    if critic is not None:
        args["returns_lambda"] = critic.get("gae_lambda", _default(PPOCriticArgs, "gae_lambda"))
    return args


Calls = tuple[list[dict[str, Any]], dict[int, str]]  # the calls, and per call index its args' preset key


def _sft_call(name: str, model: str, mb_spec: Any, **extra: Any) -> dict[str, Any]:
    return _call(name, model, "sft", {}, "train_step", [*SFT_INPUTS], [], mb_spec, **extra)


@dataclass
class _RL:
    """The calls of an RL preset as they are built: each stage adds its calls and the keys they feed."""

    df: dict[str, Any]
    models: dict[str, Any]
    actor: dict[str, Any]
    critic: dict[str, Any] | None  # ppo only
    warmup: int  # SFT steps before RL starts
    episode: list[str]  # `loss_mask` with a workflow
    distill: bool  # the teacher's log-probs stand where the reference's would; a task reward is optional
    train_inputs: list[str]
    returns_inputs: list[str]
    calls: list[dict[str, Any]] = field(default_factory=list)
    origin: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls, df: dict[str, Any], models: dict[str, Any], adv_norm: str | None, critic: bool, distill: bool
    ) -> _RL:
        shaping = {"shaping": df["shaping"]} if df.get("shaping") else {}
        actor = {**(df.get("actor") or {}), **shaping}
        if distill:  # the reverse KL to the teacher is the reward; the recipe may weigh it (kl_ctl)
            given = actor.get("shaping")
            actor["shaping"] = {**DISTILL_SHAPING, **(given if isinstance(given, dict) else {})}
        if adv_norm is not None:
            actor.setdefault("adv_norm", adv_norm)
        reward = df.get("reward")
        reward_fn = reward.get("reward_fn") if isinstance(reward, dict) else None
        if isinstance(reward_fn, str):  # held-out prompts are scored by the training reward unless said
            actor.setdefault("eval_reward_fn", reward_fn)
        # episodes (a workflow): `loss_mask` marks the model's own tokens for the reward (its final answer),
        # the returns and the updates (tool output never trains)
        episode = ["loss_mask"] if actor.get("workflow") is not None else []
        if isinstance(reward, dict) and reward.get("environment"):  # the workflow's environment scores
            episode.append("env_rewards")
        return cls(
            df,
            models,
            actor,
            critic=dict(df.get("critic") or {}) if critic else None,
            warmup=df.get("sft_warmup_steps") or 0,
            episode=episode,
            distill=distill,
            train_inputs=[*_no_rewards(TRAIN_INPUTS, distill and not df.get("reward")), *episode],
            returns_inputs=[*_no_rewards(RETURNS_INPUTS, distill and not df.get("reward")), *episode],
        )

    def add(self, origin: str | None, call: dict[str, Any]) -> None:
        """Append a call (made by `_call`) that runs once the SFT warmup is over, with the preset's
        micro-batch spec; `origin`: the preset key of its args."""
        if origin is not None:
            self.origin[len(self.calls)] = origin
        if self.df.get("mb_spec") is not None:
            call["mb_spec"] = copy.deepcopy(self.df["mb_spec"])
        if self.warmup:
            call["start_step"] = self.warmup
        self.calls.append(call)


def _no_rewards(keys: tuple[str, ...], drop: bool) -> list[str]:
    return [k for k in keys if not (drop and k == "rewards")]


def _warmup(g: _RL) -> None:
    if g.warmup:
        g.calls.append(_sft_call("sft_warmup", "actor", g.df.get("mb_spec"), end_step=g.warmup))


def _generate(g: _RL) -> None:
    model = "actor_gen" if "actor_gen" in g.models else "actor"  # e.g. generation servers of the actor
    outputs = GEN_OUT + g.episode
    workflow = g.actor.get("workflow")
    tasks = isinstance(workflow, dict) and workflow.get("type_") == "verifiers"  # it runs each row's task
    inputs = ["packed_prompts", "task"] if tasks else ["packed_prompts"]
    g.add("actor", _call("actor_gen", model, "ppo_actor", g.actor, "generate", inputs, outputs))


def _reward(g: _RL) -> None:
    """The rule reward (`reward: {reward_fn: math}`), a trained reward model of the recipe scoring
    each sample (`reward: {model: NAME}`: interface rm_reward on that model), a reward service
    (`{url: ...}`: remote_reward) or a judge (`{judge: NAME or URL, template, parse}`: judge_reward).
    Distillation scores with the teacher alone unless a reward is given."""
    if g.distill and not g.df.get("reward"):
        return
    args = dict(g.df.get("reward") or {})
    model = args.pop("model", None)
    if args.pop("environment", None):  # the episodes' rewards, as the environment gave them
        g.add("reward", _call("reward", None, "env_reward", args, "inference", ["env_rewards"], ["rewards"]))
        return
    if "judge" in args:  # a judge: a model of the recipe, or an OpenAI-compatible server's URL
        judge = args.pop("judge")
        is_url = isinstance(judge, str) and judge.startswith(("http://", "https://"))
        if is_url:
            args["url"] = judge
        answers = ["answers"] if "answer" in _template_fields(args.get("template")) else []
        inputs = ["packed_input_ids", "prompt_mask", *answers, *g.episode]
        call = _call(
            "reward", None if is_url else judge, "judge_reward", args, "inference", inputs, ["rewards"]
        )
        g.add("reward", call)
        return
    if "url" in args:  # a reward service (interface remote_reward)
        inputs = ["packed_input_ids", "prompt_mask", "answers", *g.episode]
        g.add("reward", _call("reward", None, "remote_reward", args, "inference", inputs, ["rewards"]))
        return
    if model is not None:
        inputs = ["packed_input_ids", "prompt_mask", *g.episode]
        g.add("reward", _call("reward", model, "rm_reward", args, "inference", inputs, ["rewards"]))
        return
    inputs = ["packed_input_ids", "prompt_mask", "answers", *g.episode]
    g.add("reward", _call("reward", None, "reward", args, "inference", inputs, ["rewards"]))


def _template_fields(template: Any) -> set[str]:
    """The format fields of a judge's template (none when it is not one: its args check says so)."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except (TypeError, ValueError):
        return set()


def _logprobs(g: _RL, name: str, model: str, key: str) -> None:
    """An inference call of the actor's interface that keeps its log-probs as `key`, for the update."""
    inputs, remap = ["packed_input_ids"], {"packed_logprobs": key}
    call = _call(name, model, "ppo_actor", g.actor, "inference", inputs, [key], output_key_remap=remap)
    g.add("actor", call)
    g.train_inputs.append(key)


def _reference(g: _RL) -> None:
    """The reference's log-probs for the KL; distillation's teacher stands in the same place (its
    log-probs of the actor's samples, the KL's other side)."""
    if g.distill and g.df.get("teacher"):  # served elsewhere: its log-probs asked over HTTP
        remap = {"packed_logprobs": "packed_ref_logprobs"}
        call = _call(
            "teacher_logprobs",
            None,
            "remote_logprobs",
            g.df["teacher"],
            "inference",
            ["packed_input_ids"],
            ["packed_ref_logprobs"],
            output_key_remap=remap,
        )
        g.add("teacher", call)
        g.train_inputs.append("packed_ref_logprobs")
        g.returns_inputs.append("packed_ref_logprobs")
    elif g.distill:
        _logprobs(g, "teacher_logprobs", "teacher", "packed_ref_logprobs")
        g.returns_inputs.append("packed_ref_logprobs")
    elif "ref" in g.models:
        _logprobs(g, "ref_logprobs", "ref", "packed_ref_logprobs")
        g.returns_inputs.append("packed_ref_logprobs")


def _proximal(g: _RL) -> None:
    """Decoupled PPO: the proximal log-probs, of the current policy before the update (a forward pass
    unless `prox_logp_method` approximates them)."""
    method = g.actor.get("prox_logp_method", "recompute")
    if g.actor.get("use_decoupled_loss") is True and method in ("recompute", "metrics"):
        _logprobs(g, "prox_logprobs", "actor", "packed_prox_logprobs")


def _values(g: _RL) -> None:
    if g.critic is not None:
        inputs, outputs = ["packed_input_ids"], ["values"]
        g.add("critic", _call("values", "critic", "ppo_critic", g.critic, "inference", inputs, outputs))
        g.train_inputs.append("values")
        g.returns_inputs.append("values")


def _returns(g: _RL) -> None:
    """Rewards -> advantages and returns, once, for the actor and the critic (one KL controller)."""
    args = returns_args(g.actor, g.critic)
    g.add(None, _call("returns", None, "returns", args, "inference", g.returns_inputs, RETURNS_OUT))
    g.train_inputs += RETURNS_OUT


def _train(g: _RL) -> None:
    g.add("actor", _call("actor_train", "actor", "ppo_actor", g.actor, "train_step", g.train_inputs, []))
    if g.critic is not None:
        call = _call("critic_train", "critic", "ppo_critic", g.critic, "train_step", g.train_inputs, [])
        g.add("critic", call)


_RL_STAGES = (_warmup, _generate, _reward, _reference, _proximal, _values, _returns, _train)


def _rl(
    df: dict[str, Any], models: dict[str, Any], adv_norm: str | None, critic: bool, distill: bool = False
) -> Calls:
    g = _RL.of(df, models, adv_norm, critic, distill)
    for stage in _RL_STAGES:
        stage(g)
    return g.calls, g.origin


def _sft(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """One SFT call on `model`."""
    return [_sft_call("sft", df.get("model", "default"), df.get("mb_spec"))], {}


def _grpo(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """GRPO: group-normalized advantages, no critic."""
    return _rl(df, models, adv_norm="group", critic=False)


def _ppo(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """PPO: a critic's values for the returns, and its own update."""
    return _rl(df, models, adv_norm=None, critic=True)


def _distill(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """On-policy distillation: the actor samples, the teacher scores every token of the samples, and the
    per-token reverse KL (optionally with a task reward) is the advantage, normalized over the batch.
    With `topk`: the teacher's top-k tokens at each position, and a supervised KL loss toward them."""
    if df.get("topk") is not None:
        return _distill_topk(df, models)
    return _rl(df, models, adv_norm="batch", critic=False, distill=True)


def _distill_topk(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """actor_gen -> teacher_topk (distill_topk inference on the teacher) -> actor_train (distill_topk)."""
    g = _RL.of(df, models, adv_norm=None, critic=False, distill=True)
    g.actor.pop("shaping", None)  # no returns: the loss is the KL itself
    args = {**g.actor, "topk": df["topk"]}
    _warmup(g)
    _generate(g)
    topk = [TOPK_IDS, TOPK_LOGPROBS]
    g.add(
        "teacher",
        _call("teacher_topk", "teacher", "distill_topk", args, "inference", ["packed_input_ids"], topk),
    )
    inputs = ["packed_input_ids", "prompt_mask", *topk, *g.episode]
    g.add("actor", _call("actor_train", "actor", "distill_topk", args, "train_step", inputs, []))
    return g.calls, g.origin


EXPANDERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], Calls]] = {
    "sft": _sft,
    "grpo": _grpo,
    "ppo": _ppo,
    "distill": _distill,
}
PRESETS = tuple(EXPANDERS)


def expand(df: dict[str, Any], models: dict[str, Any]) -> Calls:
    """Calls of a preset, and for each call index the preset key its interface args came from."""
    return EXPANDERS[df["preset"]](df, models)


class PresetSpec(StrictModel):
    """A `dataflow:` written as a named preset; its blocks are the interfaces' args (checked there)."""

    preset: str = Field(description="sft, grpo, ppo or distill.")
    actor: dict[str, Any] | None = Field(None, description="ppo_actor args.")
    critic: dict[str, Any] | None = Field(None, description="ppo_critic args (ppo).")
    reward: dict[str, Any] | None = Field(
        None,
        description="reward interface args ({reward_fn: NAME}), {model: NAME}: a trained reward model of "
        "the recipe scores each sample (interface rm_reward), {url: ...}: a reward service "
        "(interface remote_reward), {judge: NAME or URL, template: ..., parse: ...}: a judge model "
        "asked about each sample (interface judge_reward), or {environment: true}: the rewards the "
        "actor's workflow's environment gave (interface env_reward).",
    )
    shaping: dict[str, Any] | None = Field(
        None, description="Reward shaping + KL (the returns call's, computed once for actor and critic)."
    )
    mb_spec: dict[str, Any] | None = Field(None, description="Micro-batch split of every call.")
    teacher: dict[str, Any] | None = Field(
        None,
        description="distill: a teacher served elsewhere, {url: ...} (interface remote_logprobs), instead of "
        "a `teacher` model of the recipe.",
    )
    topk: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="distill: train on the exact KL over the teacher's topk most likely tokens at each "
        "position (interface distill_topk) instead of the sampled token's estimate with PPO.",
    )
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
    spec, problems = _read(df)
    if spec is None:
        return problems
    models = mapping_at(src.data, "models")
    if spec.preset == "distill":
        problems = _distill_problems(spec, models)
        if problems:
            return problems
    calls, origin = expand(spec.model_dump(exclude_none=True), models)
    if "loss_mask" in (
        dataset_keys(src.data.get("dataset")) or ()
    ):  # chat data: the loss on assistant tokens
        for call in calls:
            if call["interface"]["type_"] == "sft":
                call["inputs"].append("loss_mask")
    for i, call in enumerate(calls):
        _alias(src, df, spec.preset, ("dataflow", "calls", i), call, origin.get(i))
    src.data["dataflow"] = {"calls": calls}
    return []


def _read(df: dict[str, Any]) -> tuple[PresetSpec | None, list[tuple[Path_, str]]]:
    """The preset's spec, or None and the problems that stop its expansion."""
    if df.get("calls") is not None:
        return None, [
            (
                ("dataflow", "calls"),
                "give either `preset` or `calls`, not both (see `areal check --print` for a preset's calls)",
            )
        ]
    try:
        spec = PresetSpec.model_validate(df)
    except ValidationError as e:
        return None, [
            (("dataflow", *p.path), p.message) for p in problems_from_validation_error(e, PresetSpec)
        ]
    unused = [k for k in UNUSED[spec.preset] if df.get(k) is not None]
    if unused:
        return None, [(("dataflow", k), f"the {spec.preset} preset does not use `{k}`") for k in unused]
    return spec, []


def _distill_problems(spec: PresetSpec, models: dict[str, Any]) -> list[tuple[Path_, str]]:
    """Distillation needs its teacher, has no reference besides it, and drops uniform groups only by a
    task reward."""
    problems: list[tuple[Path_, str]] = []
    served = spec.teacher is not None
    if isinstance(models, dict) and "teacher" not in models and not served:
        problems.append(
            (
                ("models",),
                "the distill preset needs a model named `teacher` (it scores the actor's samples, e.g. "
                "`teacher: {path: runs/quickstart/checkpoints/step_00000250/actor}`), or a served one: "
                "`dataflow: {teacher: {url: http://HOST:PORT}}`",
            )
        )
    if isinstance(models, dict) and "teacher" in models and served:
        problems.append(
            (
                ("dataflow", "teacher"),
                "the teacher is either a model of the recipe (models.teacher) or served (dataflow.teacher), "
                "not both",
            )
        )
    if spec.topk is not None:
        for key, why in (
            ("reward", "a task reward"),
            ("teacher", "a served teacher"),
            ("shaping", "shaping"),
        ):
            if getattr(spec, key) is not None:
                problems.append(
                    (
                        ("dataflow", key),
                        f"topk distillation trains on the KL to the teacher's top-k tokens alone: {why} "
                        "does not enter it (drop `topk` for the sampled-token KL with PPO, which takes it)",
                    )
                )
    temperature = _temperature(spec.actor)
    if served and temperature != 1.0:
        problems.append(
            (
                ("dataflow", "actor", "generation", "temperature"),
                f"a served teacher gives its log-probs at temperature 1, and the actor samples at {temperature}: "
                "the KL would compare two different temperatures (sample at 1, or run the teacher as a model "
                "of the recipe)",
            )
        )
    if isinstance(models, dict) and "ref" in models:
        problems.append(
            (
                ("models", "ref"),
                "the distill preset takes no `ref`: the teacher is the KL's other side (drop `ref`)",
            )
        )
    actor = spec.actor or {}
    if actor.get("dynamic_sampling") and not spec.reward:
        problems.append(
            (
                ("dataflow", "actor", "dynamic_sampling"),
                "dynamic_sampling drops groups whose rewards are all equal, and distill has no reward "
                "unless `reward:` gives one",
            )
        )
    return problems


def _temperature(actor: dict[str, Any] | None) -> Any:
    generation = (actor or {}).get("generation")
    return generation.get("temperature", 1.0) if isinstance(generation, dict) else 1.0


def _alias(
    src: Located, df: dict[str, Any], preset: str, here: Path_, call: dict[str, Any], origin: str | None
) -> None:
    """Point what is said of a generated call at the preset key it came from."""
    src.aliases[here] = ("dataflow", f"preset[{preset}]", call["name"])
    if "mb_spec" in df:
        src.aliases[here + ("mb_spec",)] = ("dataflow", "mb_spec")
    if origin is not None:
        src.aliases[here + ("interface", "args")] = ("dataflow", origin)
        if origin == "actor" and "shaping" in df:
            src.aliases[here + ("interface", "args", "shaping")] = ("dataflow", "shaping")
    if call["name"] == "returns":  # its args came from the actor's block (and the critic's lambda)
        _alias_returns(src, df, here + ("interface", "args"))
    if call.get("end_step") is not None or call.get("start_step"):
        src.aliases[here + ("end_step",)] = src.aliases[here + ("start_step",)] = (
            "dataflow",
            "sft_warmup_steps",
        )


def _alias_returns(src: Located, df: dict[str, Any], args: Path_) -> None:
    for key in RETURNS_FROM_ACTOR:
        src.aliases[args + (key,)] = ("dataflow", "actor", key)
    src.aliases[args + ("max_new_tokens",)] = ("dataflow", "actor", "generation", "max_new_tokens")
    src.aliases[args + ("returns_lambda",)] = ("dataflow", "critic", "gae_lambda")
    if "shaping" in df:
        src.aliases[args + ("shaping",)] = ("dataflow", "shaping")

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
(ppo), `actor_gen` (optional: generates instead of `actor`, e.g. on SGLang servers with
`weights_from: actor`). Expansion works on raw recipe data, before validation, and keeps source
positions so that an error in `actor:` points at that line.
"""

from __future__ import annotations

import copy
from typing import Any

from arealcli.schema.source import Located

PRESETS = ("sft", "grpo", "ppo")
PRESET_KEYS = {"preset", "actor", "critic", "reward", "shaping", "mb_spec", "sft_warmup_steps", "model"}

# `version` (meta): the policy version that generated each sample (it lags when generation servers do)
GEN_OUT = ["packed_input_ids", "prompt_mask", "packed_logprobs", "seq_no_eos_mask", "version"]


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
    calls.append(
        _call("actor_gen", gen_model, "ppo_actor", actor, "generate", ["packed_prompts"], GEN_OUT, mb, **rl)
    )
    origin[len(calls)] = "reward"
    calls.append(
        _call(
            "reward",
            None,
            "reward",
            df.get("reward") or {},
            "inference",
            ["packed_input_ids", "prompt_mask", "answers"],
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
    critic = {**(df.get("critic") or {}), **({"shaping": shaping} if shaping else {})}
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
    origin[len(calls)] = "actor"
    calls.append(_call("actor_train", "actor", "ppo_actor", actor, "train_step", train_inputs, [], mb, **rl))
    if preset == "ppo":
        origin[len(calls)] = "critic"
        calls.append(
            _call("critic_train", "critic", "ppo_critic", critic, "train_step", train_inputs, [], mb, **rl)
        )
    return calls, origin


def expand_in_place(src: Located) -> list[str]:
    """Replace a preset `dataflow` by its calls in `src.data`; returns error messages (unknown preset...)."""
    df = src.data.get("dataflow")
    if not isinstance(df, dict) or "preset" not in df:
        return []
    preset = df.get("preset")
    if preset not in PRESETS:
        return [f"unknown preset {preset!r}; available: {', '.join(PRESETS)}"]
    if df.get("calls"):
        return ["give either `preset` or `calls`, not both (see `areal check --print` for a preset's calls)"]
    unknown = sorted(set(df) - PRESET_KEYS)
    if unknown:
        return [f"unknown preset key(s) {unknown}; preset keys: {', '.join(sorted(PRESET_KEYS))}"]
    models = src.data.get("models") if isinstance(src.data.get("models"), dict) else {}
    calls, origin = expand(df, models)
    here = src.positions.get(("dataflow",), (1, 1))
    for i in range(len(calls)):
        src.positions[("dataflow", "calls", i)] = here
        if i in origin:
            key = ("dataflow", origin[i])
            src.positions[("dataflow", "calls", i, "interface", "args")] = src.positions.get(key, here)
            for path, pos in list(src.positions.items()):
                if path[: len(key)] == key and len(path) > len(key):
                    src.positions[("dataflow", "calls", i, "interface", "args", *path[len(key) :])] = pos
            if origin[i] in ("actor", "critic") and ("dataflow", "shaping") in src.positions:
                for path, pos in list(src.positions.items()):
                    if path[:2] == ("dataflow", "shaping"):
                        src.positions[("dataflow", "calls", i, "interface", "args", *path[1:])] = pos
    src.data["dataflow"] = {"calls": calls}
    return []

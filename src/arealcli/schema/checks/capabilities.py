"""Backend capabilities: every call's model runs on a backend that can do the call; every follower can
load new weights in place."""

from __future__ import annotations

from arealcli.schema.checks.context import Graph, call_path
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import ModelSpec
from arealcli.schema.registry import BACKENDS, INTERFACES, NEEDED_CAPABILITY

_CAN = {"train": "train", "forward": "run forward passes (log-probs, values)", "generate": "generate"}


def capabilities_of(spec: ModelSpec) -> frozenset[str] | None:
    """What a model's backend can do; None when the backend is unknown (reported by the args pass)."""
    if spec.base_of is not None:  # a view of another model's base weights
        return frozenset({"forward", "generate"})
    entry = BACKENDS.find(spec.backend.type_)
    return None if entry is None else entry.capabilities


def check_call_capabilities(g: Graph) -> list[Problem]:
    problems = []
    for i, call in enumerate(g.calls):
        spec = g.spec_of(call)
        caps = capabilities_of(spec) if spec is not None else None
        entry = INTERFACES.find(call.interface.type_)
        generates = entry is not None and entry.generates and call.type == "inference"  # a judge
        need = "generate" if generates else NEEDED_CAPABILITY[call.type]
        if spec is None or caps is None or need in caps:
            continue
        fix = (
            "train a model on hf, fsdp or megatron and let this one follow it (`weights_from`)"
            if need == "train"
            else "run the call on a model with an in-process backend (hf, fsdp, megatron)"
            if need == "forward"
            else "run it on a model whose backend generates"
        )
        message = (
            f"call {call.name!r} is a{' generating' if generates else ''} {call.type} on model {call.model!r}, whose backend "
            f"{spec.backend.type_!r} cannot {_CAN[need]} (it can: {', '.join(sorted(caps))}); {fix}"
        )
        problems.append(Problem(call_path(i, "type"), message, call.type))
    return problems


def check_followers_load_weights(g: Graph) -> list[Problem]:
    problems = []
    for name, spec in g.models.items():
        caps = capabilities_of(spec)
        if spec.weights_from is None or caps is None or "update_weights" in caps:
            continue
        message = (
            f"model {name!r} follows {spec.weights_from!r} (`weights_from`) but its backend "
            f"{spec.backend.type_!r} cannot load new weights in place; use hf, local, sglang or vllm"
        )
        problems.append(Problem(("models", name, "backend", "type_"), message, spec.backend.type_))
    return problems


def check_kept_followers(g: Graph) -> list[Problem]:
    """A follower that keeps a step's weights (`follow_until`) is saved in checkpoints, so it is held in
    the training process and loads weights in place."""
    problems = []
    for name, spec in g.models.items():
        caps = capabilities_of(spec)
        if spec.follow_until is None or caps is None or {"train", "update_weights"} <= caps:
            continue
        message = (
            f"model {name!r} keeps {spec.weights_from!r}'s weights of step {spec.follow_until} (`follow_until`), "
            f"which checkpoints save, but its backend {spec.backend.type_!r} does not hold them in this "
            "process and loads weights in place; run it on hf or megatron"
        )
        problems.append(Problem(("models", name, "backend", "type_"), message, spec.backend.type_))
    return problems

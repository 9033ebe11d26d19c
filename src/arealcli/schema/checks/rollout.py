"""Asynchronous rollout: a generation model that follows a trained one on an inference backend, and
rollout-side calls that need nothing from the training side."""

from __future__ import annotations

from arealcli.schema.checks.capabilities import capabilities_of
from arealcli.schema.checks.context import Graph, call_path
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import CallSpec, ModelSpec, on_rollout_side

_FIX = (
    ". Add a model `actor_gen: {init_from: actor, weights_from: actor, backend: {type_: local}}`"
    " (or sglang / vllm); the presets generate on it"
)


def check_rollout(g: Graph) -> list[Problem]:
    if g.data.get("rollout") is None:
        return []
    generators = [c for c in g.calls if c.type == "generate"]
    if not generators:
        return [
            Problem(
                ("rollout",), "a rollout section needs a generate call (the rollout side has nothing to do)"
            )
        ]
    problems = [p for c in generators for p in _generation_model(g, c)]
    return problems + _rollout_inputs(g)


def _generation_model(g: Graph, call: CallSpec) -> list[Problem]:
    """A generate call runs on an untrained model that follows a trained one, on an inference backend."""
    spec = g.spec_of(call)
    if spec is None:
        return []  # a missing model is reported where the call names it
    why = _not_a_generation_model(g, call.model, spec)
    if why is None:
        return []
    message = (
        f"asynchronous rollout generates on a generation model: call {call.name!r} runs on "
        f"{call.model!r}, which {why}{_FIX}"
    )
    return [Problem(("rollout",), message)]


def _not_a_generation_model(g: Graph, name: str | None, spec: ModelSpec) -> str | None:
    if name in g.trained:
        return "is trained itself"
    if spec.weights_from is None:
        return "follows no trained model (`weights_from`)"
    if "train" in (capabilities_of(spec) or frozenset()):
        return f"runs on the training backend {spec.backend.type_!r}"
    return None


def _rollout_inputs(g: Graph) -> list[Problem]:
    """Rollout-side calls run ahead of training: their inputs come from the dataset or the rollout side."""
    if g.dataset_keys is None:
        return []
    produced = {c.name: set(c.outputs) for c in g.calls if on_rollout_side(c)}
    problems = []
    for i, c in enumerate(g.calls):
        if not on_rollout_side(c):
            continue
        for j, key in enumerate(c.inputs):
            if key not in g.dataset_keys and not any(key in v for v in produced.values()):
                message = (
                    f"call {c.name!r} runs on the rollout side (ahead of training) but needs {key!r}, "
                    "which only the training side produces"
                )
                problems.append(Problem(call_path(i, "inputs", j), message, key))
    return problems

"""LoRA: not on a value-head model; `base_of` names a LoRA model and is only used for inference."""

from __future__ import annotations

from arealcli.schema.checks.context import Graph
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import ModelSpec
from arealcli.schema.registry import suggest


def check_lora(g: Graph) -> list[Problem]:
    lora = {n for n in g.models if getattr(g.typed.get(("models", n, "backend")), "lora", None) is not None}
    problems = []
    for name, spec in g.models.items():
        if name in lora and spec.value_head:
            problems.append(
                Problem(
                    ("models", name, "backend", "args", "lora"),
                    "LoRA on a value-head model (a critic) is not supported",
                )
            )
        if spec.base_of is not None:
            problems += _base_of(g, lora, name, spec, spec.base_of)
    return problems


def _base_of(g: Graph, lora: set[str], name: str, spec: ModelSpec, base_of: str) -> list[Problem]:
    """A `base_of` model (`spec.base_of`): a view of a LoRA model's base weights, for inference only."""
    where = ("models", name, "base_of")
    problems = []
    if base_of not in g.models:
        problems.append(Problem(where, f"no such model{suggest(base_of, list(g.models))}", base_of))
    elif base_of not in lora:
        message = f"model {base_of!r} has no LoRA adapters (backend args `lora:`), so it has no separate base"
        problems.append(Problem(where, message, base_of))
    if name in g.trained or spec.weights_from is not None:
        message = "a base_of model shares another model's weights: it cannot be trained or follow weights"
        problems.append(Problem(where, message))
    return problems

"""`Graph`: what the dataflow checks read of a recipe (its calls, its models, the dataset's keys)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from arealcli.schema.checks.args import Typed
from arealcli.schema.recipe import CallSpec, DataflowSpec, ModelSpec
from arealcli.schema.registry import dataset_keys
from arealcli.schema.source import Path_, mapping_at


@dataclass(frozen=True)
class Graph:
    """The parts of a recipe that are themselves valid, for the cross-reference checks."""

    data: dict[str, Any]  # the raw recipe (a preset expanded)
    typed: Typed  # the validated args of every `{type_, args}`, by path
    calls: list[CallSpec]
    names: list[str]  # every model name written, its spec valid or not
    models: dict[str, ModelSpec]  # the models whose spec is valid
    trained: set[str]  # models some train_step call trains
    dataset_keys: frozenset[str] | None  # None: the dataset's type is unknown

    def spec_of(self, call: CallSpec) -> ModelSpec | None:
        return self.models.get(call.model) if call.model is not None else None


def graph_of(data: dict[str, Any], typed: Typed) -> Graph | None:
    """The graph of a raw recipe; None when its calls are invalid (reported by the structural pass)."""
    try:
        calls = DataflowSpec.model_validate(data.get("dataflow")).calls
    except ValidationError:
        return None
    raw_models = mapping_at(data, "models")
    models: dict[str, ModelSpec] = {}
    for name, raw in raw_models.items():
        try:
            models[name] = ModelSpec.model_validate(raw)
        except ValidationError:
            pass
    trained = {c.model for c in calls if c.type == "train_step" and c.model is not None}
    return Graph(data, typed, calls, list(raw_models), models, trained, dataset_keys(data.get("dataset")))


def call_path(i: int, *rest: str | int) -> Path_:
    return ("dataflow", "calls", i, *rest)

"""Component args: every `{type_, args}` of a recipe validated against its component's own args model."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from arealcli.schema.problems import Problem, problems_from_validation_error
from arealcli.schema.registry import BACKENDS, DATASETS, INTERFACES, Registry, RegistryError
from arealcli.schema.source import Path_

Typed = dict[Path_, BaseModel]  # path of a `{type_, args}` -> its validated, typed args


def find_abstractions(data: dict[str, Any]) -> list[tuple[Path_, Registry, Any]]:
    """(path, registry, raw value) of every `{type_, args}` in the raw recipe data."""
    found: list[tuple[Path_, Registry, Any]] = []
    models = data.get("models")
    if isinstance(models, dict):
        for name, spec in models.items():
            if isinstance(spec, dict):
                if spec.get("backend") is None:
                    spec["backend"] = {"type_": "hf"}  # the default, resolved like a written one
                found.append((("models", name, "backend"), BACKENDS, spec["backend"]))
    for key in ("dataset", "eval_dataset"):
        if isinstance(data.get(key), dict):
            found.append(((key,), DATASETS, data[key]))
    calls = (data.get("dataflow") or {}).get("calls") if isinstance(data.get("dataflow"), dict) else None
    if isinstance(calls, list):
        for i, call in enumerate(calls):
            if isinstance(call, dict) and "interface" in call:
                found.append((("dataflow", "calls", i, "interface"), INTERFACES, call["interface"]))
    return found


def check_args(path: Path_, registry: Registry, raw: Any, typed: Typed) -> list[Problem]:
    """The args of the `{type_, args}` at `path`, strictly validated; the typed args go to `typed`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type_"), str):
        return []  # the structural pass reports it
    try:
        entry = registry.get(raw["type_"])
    except RegistryError as e:
        return [Problem(path + ("type_",), str(e))]
    args = raw.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return []  # the structural pass reports it
    try:
        # strict: the same rules as the recipe's own models (no coercion), for plugins' Args too
        typed[path] = entry.args_model.model_validate(args, strict=True)
    except ValidationError as e:
        return problems_from_validation_error(e, entry.args_model, path + ("args",))
    return []

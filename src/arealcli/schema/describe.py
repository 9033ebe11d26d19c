"""What `areal list` and the reference docs show of a component or a recipe section: one row per
argument (nested settings expanded as `parent.child`), types as a recipe writes them (`float | None`,
`list[str]`, `'constant' | 'linear'`), defaults as YAML values (`readable`)."""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from arealcli.schema.registry import Entry

KINDS = (
    "interfaces",
    "backends",
    "datasets",
    "rewards",
    "workflows",
    "tools",
    "policy_losses",
    "advantages",
    "kl_estimators",
    "preference_losses",
)
# algorithm variants: the interface key that picks one by name (ppo_actor's, dpo's)
PICKED_BY = {
    "policy_losses": "policy_loss",
    "advantages": "adv_norm",
    "kl_estimators": "kl_estimator",
    "preference_losses": "loss (dpo)",
}


def singular(kind: str) -> str:
    """`policy_losses` -> `policy_loss`, `rewards` -> `reward`."""
    return kind[:-2] if kind.endswith("sses") else kind[:-1]


SECTIONS = (
    "recipe",
    "models",
    "tokenizer",
    "dataset",
    "eval_dataset",
    "dataflow",
    "trainer",
    "rollout",
    "cluster",
)


def type_name(annotation: Any) -> str:
    """A type as a user writes it in a recipe."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(dict.fromkeys(type_name(a) for a in args))  # two settings models: one "mapping"
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple, set, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "mapping"  # its keys are listed below it
    return getattr(annotation, "__name__", str(annotation))


def readable(default: str) -> str:
    """A default as a recipe writes it (YAML): `null`, `math`, `''`, `[]`, `{n: 1}`."""
    if default.startswith("("):
        return default
    value = json.loads(default)
    if isinstance(value, str):
        return value if value and value.strip() == value and value[0] not in "[{'\"" else repr(value)
    return _flow(value)


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return str(value) if not isinstance(value, str) else (value or "''")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    if field.default is not PydanticUndefined:
        value = field.default.model_dump() if isinstance(field.default, BaseModel) else field.default
        return json.dumps(value)
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value)
    return "(default)"


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The settings models a field holds: itself, or each member of a union (`A | B | None`)."""
    candidates = [annotation, *typing.get_args(annotation)]
    return [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]


def describe_args(model: type[BaseModel], prefix: str = "", expand: bool = False) -> list[dict[str, str]]:
    """One row per argument; with `expand`, nested settings as `parent.child` rows too."""
    rows = []
    for name, f in model.model_fields.items():
        nested = _nested_models(f.annotation)
        default = _default(f)
        if expand and nested and default.startswith("{"):
            default = "(its settings below)"
        rows.append(
            {
                "name": prefix + name,
                "type": type_name(f.annotation),
                "default": default,
                "description": f.description or "",
            }
        )
        seen: set[str] = set()
        for model_ in nested if expand else []:  # a union's members may share keys: each row once
            for row in describe_args(model_, f"{prefix}{name}.", expand=True):
                if row["name"] not in seen:
                    seen.add(row["name"])
                    rows.append(row)
    return rows


def entry_payload(kind: str, e: Entry, expand: bool = False) -> dict[str, Any]:
    return {
        "name": e.name,
        "kind": singular(kind),
        "description": e.description.strip().splitlines()[0] if e.description else "",
        "origin": e.origin,
        **({"call_types": sorted(e.call_types)} if kind == "interfaces" else {}),
        **({"capabilities": sorted(e.capabilities)} if kind == "backends" else {}),
        **({"keys": sorted(e.data_keys)} if kind == "datasets" else {}),
        "args": describe_args(e.args_model, expand=expand),
    }


def entry_extras(kind: str, e: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """What a listed component is besides its arguments, as (label, values): the calls an interface
    implements, what a backend's engine can do, the keys a dataset gives, the key that picks a variant."""
    out = [
        (label, list(e[key]))
        for label, key in (("calls", "call_types"), ("can", "capabilities"), ("keys", "keys"))
        if key in e
    ]
    if kind in PICKED_BY:
        out.append(("picked by", [PICKED_BY[kind]]))  # the ppo_actor key that names it
    return out


def section_rows(name: str) -> list[dict[str, str]]:
    """The keys of a recipe section, as an override writes them (`trainer.max_steps`)."""
    from arealcli.schema.json_schema import PresetDataflow
    from arealcli.schema.recipe import (
        CallSpec,
        ClusterSpec,
        DatasetSpec,
        ModelSpec,
        Recipe,
        RolloutSpec,
        TokenizerSpec,
        TrainerSpec,
    )

    if name == "recipe":
        return describe_args(Recipe)
    if name == "models":
        return describe_args(ModelSpec, "models.NAME.", expand=True)
    if name == "dataflow":  # a preset's blocks typed by their interfaces' args, or the calls written out
        calls = {
            "name": "dataflow.calls",
            "type": "list[mapping]",
            "default": "(instead of preset)",
            "description": "The dataflow written out: one mapping per call, in order (keys below).",
        }
        return [
            *describe_args(PresetDataflow, "dataflow.", expand=True),
            calls,
            *describe_args(CallSpec, "dataflow.calls.N.", expand=True),
        ]
    models: dict[str, type[BaseModel]] = {
        "tokenizer": TokenizerSpec,
        "dataset": DatasetSpec,
        "eval_dataset": DatasetSpec,
        "trainer": TrainerSpec,
        "rollout": RolloutSpec,
        "cluster": ClusterSpec,
    }
    return describe_args(models[name], f"{name}.", expand=True)

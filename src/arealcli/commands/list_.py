"""`areal list [KIND|SECTION|NAME]`: what is registered, with each one's arguments, and the keys of
every recipe section.

Every argument is listed with its nested settings expanded (`generation.n`, `optimizer.lr_scheduler`,
...); types print as a recipe writes them (`float | None`, `list[str]`, `'constant' | 'linear'`),
defaults as YAML values. In a terminal: tables. Piped or with `--plain`: one key per line, `key  type
default  description`, never wrapped, so `areal list ppo_actor | grep generation.temperature` finds it.
A recipe section (`areal list trainer`) lists its keys as an override writes them (`trainer.max_steps`).
"""

from __future__ import annotations

import json
import types
import typing

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from rich.padding import Padding
from rich.text import Text

from arealcli.commands.common import console, fail
from arealcli.schema.registry import ALL, RegistryError, import_plugins, suggest

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
)
# algorithm variants: the ppo_actor key that picks one by name
PICKED_BY = {"policy_losses": "policy_loss", "advantages": "adv_norm", "kl_estimators": "kl_estimator"}


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


def type_name(annotation) -> str:
    """A type as a user writes it in a recipe."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
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


def _flow(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return str(value) if not isinstance(value, str) else (value or "''")


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    if field.default is not PydanticUndefined:
        value = field.default.model_dump() if isinstance(field.default, BaseModel) else field.default
        return json.dumps(value)
    if field.default_factory is not None:
        value = field.default_factory()
        return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value)
    return "(default)"


def _nested_model(annotation) -> type[BaseModel] | None:
    candidates = [annotation, *typing.get_args(annotation)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, BaseModel):
            return c
    return None


def describe_args(model: type[BaseModel], prefix: str = "", expand: bool = False) -> list[dict]:
    """One row per argument; with `expand`, nested settings as `parent.child` rows too."""
    rows = []
    for name, f in model.model_fields.items():
        nested = _nested_model(f.annotation)
        default = _default(f)
        if expand and nested is not None and default.startswith("{"):
            default = "(its settings below)"
        rows.append(
            {
                "name": prefix + name,
                "type": type_name(f.annotation),
                "default": default,
                "description": f.description or "",
            }
        )
        if expand and nested is not None:
            rows.extend(describe_args(nested, f"{prefix}{name}.", expand=True))
    return rows


def _entry_payload(kind: str, e, expand: bool = False) -> dict:
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


def section_rows(name: str) -> list[dict]:
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


def list_(
    what: str = typer.Argument(
        "all",
        metavar="WHAT",
        help=f"A kind ({', '.join(KINDS)}), a recipe section ({', '.join(SECTIONS)}), all, or one "
        "component's name.",
    ),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output.", metavar=""),
    plain: bool = typer.Option(
        False, "--plain", help="One key per line (the default when piped).", metavar=""
    ),
    imports: list[str] = typer.Option(
        None, "--import", metavar="MODULE", help="Also import these plugin modules."
    ),
) -> None:
    """Registered components with their arguments, and the keys of the recipe's sections.

    Examples:
    areal list
    areal list ppo_actor
    areal list trainer --plain
    areal list rewards --json
    """
    try:
        errors = import_plugins(imports or [])
        if what in SECTIONS:
            payload: dict = {"sections": [{"name": what, "args": section_rows(what)}]}
        elif what in ("all", *KINDS):
            kinds = list(KINDS) if what == "all" else [what]
            payload = {k: [_entry_payload(k, e, expand=True) for e in ALL[k].entries()] for k in kinds}
        else:
            found = [(k, ALL[k].get(what)) for k in KINDS if what in ALL[k]]
            if not found:
                names = [n for k in KINDS for n in ALL[k].names()] + ["all", *KINDS, *SECTIONS]
                raise fail([f"nothing registered as {what!r}{suggest(what, names)}"])
            payload = {k: [_entry_payload(k, e, expand=True)] for k, e in found}
    except RegistryError as e:
        raise fail([str(e)]) from None
    if errors:
        raise fail(errors)
    if json_:
        print(json.dumps(payload, indent=2))
        return
    show = _plain if plain or not console.is_terminal else _table
    for kind, entries in payload.items():
        for entry in entries:
            show(kind, entry)
    if not plain and console.is_terminal and what in ("all", *KINDS):
        console.print(Text("areal list NAME shows one component; --plain one key per line", style="dim"))


def _about(kind: str, e: dict) -> str:
    if kind == "sections":
        return f"{e['name']} (recipe section): its keys as an override writes them"
    extra = "".join(
        f"; {label}: {', '.join(e[key])}"
        for label, key in (("calls", "call_types"), ("can", "capabilities"), ("keys", "keys"))
        if key in e
    )
    picked = f"; picked with {PICKED_BY[kind]}: {e['name']}" if kind in PICKED_BY else ""
    return f"{e['name']} ({singular(kind)}, {e['origin']}): {e['description'].rstrip('.')}{extra}{picked}"


def _plain(kind: str, e: dict) -> None:
    """A header line, then one line per key: `key  type  default  description`, columns aligned."""
    print(f"# {_about(kind, e)}")
    rows = [(a["name"], a["type"], readable(a["default"]), a["description"]) for a in e["args"]]
    if not rows and kind not in PICKED_BY:
        print("(no arguments)")
    widths = [min(32, max((len(r[i]) for r in rows), default=0)) for i in range(3)]
    for r in rows:
        print("  ".join(f"{c:<{w}}" for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    print()


def _table(kind: str, e: dict) -> None:
    """For a terminal of any width: `key  type = default` in color, the description wrapped below."""
    console.print(Text.assemble((e["name"], "bold cyan"), f"  {_about(kind, e)[len(e['name']) + 1 :]}"))
    if not e["args"] and kind not in PICKED_BY:
        console.print(Text("  no arguments", style="dim"))
    for a in e["args"]:
        console.print(
            Text.assemble("  ", (a["name"], "green"), f"  {a['type']} = ", (readable(a["default"]), "bold"))
        )
        if a["description"]:
            console.print(Padding(Text(a["description"], style="dim"), (0, 0, 0, 6)))
    console.print()

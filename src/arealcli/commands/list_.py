"""`areal list [interfaces|backends|datasets|rewards|NAME]`: what is registered, with each one's arguments.

`areal list NAME` shows one component with its nested settings expanded (`generation.n`,
`optimizer.lr_scheduler`, ...). Types print as a recipe writes them: `float | None`, `list[str]`,
`'constant' | 'linear' | 'cosine'`.
"""

from __future__ import annotations

import json
import types
import typing

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from rich.table import Table
from rich.text import Text

from arealcli.commands.common import console, fail
from arealcli.schema.registry import ALL, RegistryError, import_plugins, suggest

KINDS = ("interfaces", "backends", "datasets", "rewards", "workflows", "tools")


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
    return getattr(annotation, "__name__", str(annotation))


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
        "kind": kind[:-1],
        "description": e.description.strip().splitlines()[0] if e.description else "",
        "origin": e.origin,
        **({"call_types": sorted(e.call_types)} if kind == "interfaces" else {}),
        **({"capabilities": sorted(e.capabilities)} if kind == "backends" else {}),
        **({"keys": sorted(e.data_keys)} if kind == "datasets" else {}),
        "args": describe_args(e.args_model, expand=expand),
    }


def list_(
    what: str = typer.Argument(
        "all", help="interfaces, backends, datasets, rewards, workflows, tools, all, or one component's name."
    ),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output.", metavar=""),
    imports: list[str] = typer.Option(None, "--import", help="Also import these plugin modules."),
) -> None:
    """Registered interfaces, backends, datasets and rewards, with their arguments."""
    try:
        errors = import_plugins(imports or [])
        if what in ("all", *KINDS):
            kinds = list(KINDS) if what == "all" else [what]
            payload = {k: [_entry_payload(k, e) for e in ALL[k].entries()] for k in kinds}
            one = None
        else:
            found = [(k, ALL[k].get(what)) for k in KINDS if what in ALL[k]]
            if not found:
                names = [n for k in KINDS for n in ALL[k].names()] + ["all", *KINDS]
                raise fail([f"nothing registered as {what!r}{suggest(what, names)}"])
            payload = {k: [_entry_payload(k, e, expand=True)] for k, e in found}
            one = found
    except RegistryError as e:
        raise fail([str(e)]) from None
    if errors:
        raise fail(errors)
    if json_:
        print(json.dumps(payload, indent=2))
        return
    if one is not None:
        for kind, entries in payload.items():
            for entry in entries:
                _show_one(kind, entry)
        return
    for k, entries in payload.items():
        table = Table(title=k, show_lines=True, title_justify="left")
        table.add_column("name", style="bold cyan")
        table.add_column("what")
        table.add_column("arguments")
        for entry in entries:
            what_text = Text(entry["description"])
            for label, key in (("calls", "call_types"), ("can", "capabilities"), ("keys", "keys")):
                if key in entry:
                    what_text.append(f"\n{label}: {', '.join(entry[key])}", style="dim")
            args = Text()
            for i, a in enumerate(entry["args"]):
                args.append(("\n" if i else "") + a["name"], style="green")
                args.append(f": {a['type']} = {a['default']}  ")
                args.append(a["description"], style="dim")
            table.add_row(entry["name"], what_text, args if entry["args"] else Text("none", style="dim"))
        console.print(table)
    console.print(Text("areal list NAME shows one component with its nested settings", style="dim"))


def _show_one(kind: str, e: dict) -> None:
    console.print(Text.assemble((e["name"], "bold cyan"), f"  ({kind[:-1]}, {e['origin']})"))
    console.print(Text(e["description"]))
    for label, key in (("calls", "call_types"), ("can", "capabilities"), ("keys", "keys")):
        if key in e:
            console.print(Text(f"{label}: {', '.join(e[key])}", style="dim"))
    table = Table(show_lines=False, box=None, pad_edge=False)
    for col in ("argument", "type", "default", "description"):
        table.add_column(col, style="green" if col == "argument" else None, overflow="fold")
    for a in e["args"]:
        table.add_row(a["name"], a["type"], a["default"], a["description"])
    console.print(table)

"""`areal list [interfaces|backends|datasets|rewards]`: what is registered, with each one's arguments."""

from __future__ import annotations

import json
import typing
from enum import Enum

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from rich.table import Table

from arealcli.commands.common import console, fail
from arealcli.schema.registry import ALL, RegistryError, import_plugins


class Kind(str, Enum):
    all = "all"
    interfaces = "interfaces"
    backends = "backends"
    datasets = "datasets"
    rewards = "rewards"


def _type_name(annotation) -> str:
    text = (
        repr(annotation)
        if typing.get_origin(annotation)
        else getattr(annotation, "__name__", repr(annotation))
    )
    return text.replace("typing.", "").replace("NoneType", "None")


def describe_args(model: type[BaseModel]) -> list[dict]:
    rows = []
    for name, f in model.model_fields.items():
        if f.is_required():
            default = "(required)"
        elif f.default is not PydanticUndefined:
            default = json.dumps(f.default.model_dump() if isinstance(f.default, BaseModel) else f.default)
        else:
            default = "(default)"
        rows.append(
            {
                "name": name,
                "type": _type_name(f.annotation),
                "default": default,
                "description": f.description or "",
            }
        )
    return rows


def list_(
    kind: Kind = typer.Argument(Kind.all, help="What to list."),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output."),
    imports: list[str] = typer.Option(None, "--import", help="Also import these plugin modules."),
) -> None:
    """Registered interfaces, backends, datasets and rewards, with their arguments."""
    try:
        errors = import_plugins(imports or [])
        kinds = [k.value for k in Kind if k is not Kind.all] if kind is Kind.all else [kind.value]
        payload = {
            k: [
                {
                    "name": e.name,
                    "description": e.description.strip().splitlines()[0] if e.description else "",
                    "origin": e.origin,
                    **({"call_types": sorted(e.call_types)} if k == "interfaces" else {}),
                    **({"keys": sorted(e.data_keys)} if k == "datasets" else {}),
                    "args": describe_args(e.args_model),
                }
                for e in ALL[k].entries()
            ]
            for k in kinds
        }
    except RegistryError as e:
        raise fail([str(e)]) from None
    if errors:
        raise fail(errors)
    if json_:
        print(json.dumps(payload, indent=2))
        return
    for k, entries in payload.items():
        table = Table(title=k, show_lines=True, title_justify="left")
        table.add_column("name", style="bold cyan")
        table.add_column("what")
        table.add_column("arguments")
        for e in entries:
            what = e["description"]
            if "call_types" in e:
                what += f"\n[dim]calls: {', '.join(e['call_types'])}[/]"
            if "keys" in e:
                what += f"\n[dim]keys: {', '.join(e['keys'])}[/]"
            args = "\n".join(
                f"[green]{a['name']}[/]: {a['type']} = {a['default']}  [dim]{a['description']}[/]"
                for a in e["args"]
            )
            table.add_row(e["name"], what, args or "[dim]none[/]")
        console.print(table)

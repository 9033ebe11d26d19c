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

import typer
from rich.padding import Padding
from rich.text import Text

from arealcli.commands.common import console, fail
from arealcli.schema.describe import (
    KINDS,
    PICKED_BY,
    SECTIONS,
    entry_extras,
    entry_payload,
    readable,
    section_rows,
    singular,
)
from arealcli.schema.registry import ALL, RegistryError, import_plugins, suggest


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
            payload = {k: [entry_payload(k, e, expand=True) for e in ALL[k].entries()] for k in kinds}
        else:
            found = [(k, ALL[k].get(what)) for k in KINDS if what in ALL[k]]
            if not found:
                names = [n for k in KINDS for n in ALL[k].names()] + ["all", *KINDS, *SECTIONS]
                raise fail([f"nothing registered as {what!r}{suggest(what, names)}"])
            payload = {k: [entry_payload(k, e, expand=True)] for k, e in found}
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
    extra = "".join(f"; {label}: {', '.join(values)}" for label, values in entry_extras(kind, e))
    return f"{e['name']} ({singular(kind)}, {e['origin']}): {e['description'].rstrip('.')}{extra}"


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

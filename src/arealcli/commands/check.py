"""`areal check RECIPE [key.path=value ...]`: validate without importing torch."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from arealcli.commands.common import console, err_console, load_recipe
from arealcli.schema.paths import missing_paths
from arealcli.schema.plan import plan_lines


def check(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key.path=value overrides."),
    print_: bool = typer.Option(False, "--print", help="Print the fully resolved recipe."),
) -> None:
    """Validate a recipe: every error at once, with file:line:col."""
    resolved, src = load_recipe(recipe, overrides or [])
    for where, message in missing_paths(resolved, recipe.resolve().parent):
        err_console.print(
            f"[yellow]warning:[/] {src.where(where)}: {'.'.join(map(str, where))}: {message}", highlight=False
        )
    if print_:
        console.print(
            yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False),
            end="",
            markup=False,
            highlight=False,
            soft_wrap=True,  # never fold long values: the output must stay valid YAML
        )
        return
    console.print(
        f"[green]ok[/] {recipe}: {len(resolved.models)} model(s), {len(resolved.dataflow.calls)} call(s)"
    )
    console.print("[bold]dataflow[/]", highlight=False)
    for c in resolved.dataflow.calls:
        when = (
            f" [dim]steps {c.start_step}..{c.end_step - 1 if c.end_step else 'end'}[/]"
            if c.start_step or c.end_step
            else ""
        )
        console.print(
            f"  {c.name}: {c.interface.type_}.{c.type} on {c.model or '(no model)'}{when}\n"
            f"      {', '.join(c.inputs) or '-'} -> {', '.join(c.outputs) or '(trains)'}",
            highlight=False,
        )
    console.print("[bold]batch plan[/]", highlight=False)
    for line in plan_lines(resolved):
        console.print(f"  {line}", highlight=False, markup=False)

"""`areal check RECIPE [key.path=value ...]`: validate without importing torch."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from arealcli.commands.common import console, load_recipe


def check(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key.path=value overrides."),
    print_: bool = typer.Option(False, "--print", help="Print the fully resolved recipe."),
) -> None:
    """Validate a recipe: every error at once, with file:line:col."""
    resolved, _ = load_recipe(recipe, overrides or [])
    if print_:
        console.print(
            yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False),
            end="",
            markup=False,
            highlight=False,
        )
        return
    calls = " -> ".join(f"{c.name}({c.type} on {c.model or '-'})" for c in resolved.dataflow.calls)
    console.print(f"[green]ok[/] {recipe}: {len(resolved.models)} model(s); dataflow: {calls}")

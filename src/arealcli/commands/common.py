"""What every command shares: consoles, and loading a recipe or exiting 2 with every problem."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from arealcli.schema.recipe import Recipe
from arealcli.schema.registry import RegistryError
from arealcli.schema.source import Located, RecipeSourceError, apply_overrides, load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate

console = Console()
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(lines: list[str], title: str = "error") -> typer.Exit:
    for line in lines:
        err_console.print(f"[bold red]{title}:[/] {line}" if title else line, markup=True)
    return typer.Exit(2)


def load_recipe(file: Path, overrides: list[str]) -> tuple[Recipe, Located]:
    """The validated recipe, or exit 2 after printing every problem as file:line:col: path: message."""
    try:
        src = apply_overrides(load_recipe_source(file), overrides)
        return validate(src), src
    except RecipeSourceError as e:
        raise fail(e.messages) from None
    except RecipeInvalid as e:
        err_console.print(f"[bold red]{len(e.problems)} problem(s) in {file}:[/]")
        raise fail([_escape(line) for line in e.lines()], title="") from None
    except RegistryError as e:
        raise fail([str(e)]) from None


def _escape(text: str) -> str:
    return text.replace("[", r"\[")

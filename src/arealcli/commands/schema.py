"""`areal schema [--import my_pkg.plugin]`: the JSON Schema of a recipe, for editors."""

from __future__ import annotations

import json

import typer

from arealcli.commands.common import fail
from arealcli.schema.registry import RegistryError, import_plugins


def schema(
    imports: list[str] = typer.Option(
        None, "--import", metavar="MODULE", help="Also include these plugin modules' components."
    ),
) -> None:
    """Print the recipe's JSON Schema (every registered component's args typed by its type_).

    Start a recipe with `# yaml-language-server: $schema=recipe.schema.json` for completion and
    checks in editors.

    Examples:
    areal schema > recipe.schema.json
    areal schema --import examples.calculator_agent > recipe.schema.json
    """
    try:
        errors = import_plugins(imports or [])
    except RegistryError as e:
        raise fail([str(e)]) from None
    if errors:
        raise fail(errors)
    from arealcli.schema.json_schema import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=1))

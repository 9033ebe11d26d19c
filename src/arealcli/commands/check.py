"""`areal check RECIPE [key.path=value ...]`: validate without importing torch."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml
from rich.text import Text

from arealcli.commands.common import (
    console,
    fail,
    load_recipe,
    overrides_argument,
    recipe_argument,
    say_error,
)
from arealcli.runtime.agents.reachable import workflow_problems
from arealcli.runtime.data.images import image_problems
from arealcli.runtime.data.verifiers_configs import verifiers_problems
from arealcli.schema.paths import path_problems


def check(
    recipe: Path = recipe_argument(),
    overrides: list[str] = overrides_argument(),
    print_: bool = typer.Option(False, "--print", help="Print the fully resolved recipe.", metavar=""),
) -> None:
    """Validate a recipe without importing torch: every error at once, with file:line:col.

    Examples:
      areal check recipes/quickstart.yaml
      areal check recipes/quickstart.yaml dataflow.actor.generation.n=8
      areal check recipes/quickstart.yaml dataflow.mb_spec.n_mbs=2
      areal check recipes/sft-quickstart.yaml --print
    """
    resolved, src = load_recipe(recipe, overrides or [])
    problems = path_problems(resolved, recipe.resolve().parent)
    for p in (p for p in problems if p.missing):  # may exist where the recipe will run
        say_error(f"{src.where(p.where)}: {'.'.join(map(str, p.where))}: {p.message}", title="warning")
    errors = [
        f"{src.where(p.where)}: {'.'.join(map(str, p.where))}: {p.message}" for p in problems if not p.missing
    ]
    errors += image_problems(resolved, recipe.resolve().parent)
    errors += workflow_problems(resolved)
    errors += verifiers_problems(resolved)
    if errors:
        raise fail(errors)
    if print_:
        console.print(
            yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False),
            end="",
            markup=False,
            soft_wrap=True,  # never fold long values: the output must stay valid YAML
        )
        return
    out = Text.assemble(
        ("ok", "green"), f" {recipe}: {len(resolved.models)} model(s), {len(resolved.dataflow.calls)} call(s)"
    )
    console.print(out)
    console.print(Text("dataflow", style="bold"))
    for c in resolved.dataflow.calls:
        when = (
            f" steps {c.start_step}..{c.end_step - 1 if c.end_step else 'end'}"
            if c.start_step or c.end_step
            else ""
        )
        console.print(
            Text.assemble(
                f"  {c.name}: {c.interface.type_}.{c.type} on {c.model or '(no model)'}",
                (when, "dim"),
                f"\n      {', '.join(c.inputs) or '-'} -> {', '.join(c.outputs) or '(trains)'}",
            )
        )
    console.print(Text("batch plan", style="bold"))
    for line in _plan(resolved):
        console.print(Text(f"  {line}"))
    console.print(Text("placement", style="bold"))
    for line in _placement(resolved):
        console.print(Text(f"  {line}"))


def _plan(resolved) -> list[str]:
    from arealcli.schema.plan import plan_lines

    return plan_lines(resolved)


def _placement(resolved) -> list[str]:
    from arealcli.schema.plan import placement_lines

    return placement_lines(resolved)

"""Validate a recipe completely: structure, every component's own args, and the dataflow graph.

All problems are collected (never only the first) as `Problem`s carrying the path into the recipe; the
checks themselves live in `arealcli.schema.checks`, run in the order listed here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from arealcli.schema import plan, presets
from arealcli.schema.checks.args import Typed, check_args, find_abstractions
from arealcli.schema.checks.calls import check_calls, check_inputs
from arealcli.schema.checks.capabilities import (
    check_call_capabilities,
    check_followers_load_weights,
    check_kept_followers,
)
from arealcli.schema.checks.cluster import check_cluster
from arealcli.schema.checks.context import graph_of
from arealcli.schema.checks.lora import check_lora
from arealcli.schema.checks.models import (
    check_init_from,
    check_trained_heads,
    check_unused_models,
    check_value_heads,
    check_weights_from,
)
from arealcli.schema.checks.packages import check_packages
from arealcli.schema.checks.placement import check_placement
from arealcli.schema.checks.recipe import (
    check_chat_workflows,
    check_eval_dataset,
    check_imports,
    check_pair_data,
)
from arealcli.schema.checks.rollout import check_rollout
from arealcli.schema.paths import REPO_ID
from arealcli.schema.problems import Problem, RecipeInvalid, problems_from_validation_error
from arealcli.schema.recipe import Recipe
from arealcli.schema.source import Located, Path_

__all__ = [
    "Problem",
    "RecipeInvalid",
    "RecipeUnusable",
    "load_valid_recipe",
    "plugin_paths",
    "problems_from_validation_error",
    "validate",
]


class RecipeUnusable(Exception):
    """A recipe that cannot be read or is not valid: every problem as a line (`file:line:col: path:
    message`), and a heading when they are a list of problems."""

    def __init__(self, lines: list[str], heading: str | None = None):
        super().__init__("\n".join(([heading] if heading else []) + lines))
        self.lines, self.heading = lines, heading


def load_valid_recipe(file: Path, overrides: list[str] | None = None) -> tuple[Recipe, Located]:
    """Read `file`, apply `key.path=value` overrides and validate: the recipe and its located source,
    or RecipeUnusable (unreadable, invalid, or a plugin that fails to import)."""
    from arealcli.schema.registry import RegistryError
    from arealcli.schema.source import RecipeSourceError, apply_overrides, load_recipe_source

    try:
        src = apply_overrides(load_recipe_source(file), overrides or [])
        return validate(src), src
    except RecipeSourceError as e:
        raise RecipeUnusable(e.messages) from None
    except RecipeInvalid as e:
        lines = e.lines()
        raise RecipeUnusable(lines, f"{len(lines)} problem(s) in {file}:") from None
    except RegistryError as e:
        raise RecipeUnusable([str(e)]) from None


# Cross-references, checked on whichever parts of the recipe are themselves valid, in this order.
GRAPH_CHECKS = (
    check_calls,
    check_inputs,
    check_init_from,
    check_unused_models,
    check_weights_from,
    check_value_heads,
    check_trained_heads,
    check_lora,
    check_call_capabilities,
    check_followers_load_weights,
    check_kept_followers,
    check_rollout,
    check_placement,
    check_cluster,
    check_eval_dataset,
    check_pair_data,
    check_packages,
)


def check_graph(data: dict[str, Any], typed: Typed) -> list[Problem]:
    g = graph_of(data, typed)
    return [] if g is None else [p for check in GRAPH_CHECKS for p in check(g)]


def validate(src: Located) -> Recipe:
    """Validate and resolve a located recipe; raises RecipeInvalid listing every problem.

    The returned recipe is fully typed: every `args` is its component's own argument model.
    """
    data = src.data
    plugin_paths(Path(src.file).resolve().parent)
    problems: list[Problem] = check_imports(data.get("imports"))
    preset_problems = [Problem(path, msg) for path, msg in presets.expand_in_place(src)]
    typed: Typed = {}
    abstractions = find_abstractions(data)
    for path, registry, raw in abstractions:
        problems.extend(check_args(path, registry, raw, typed))
    recipe, structural = _structure(data)
    problems.extend(structural)
    if recipe is not None and len(typed) == len(abstractions):
        problems.extend(_resolve(recipe, typed, src))
    problems.extend(check_graph(data, typed))
    if preset_problems:  # the dataflow was not expanded: what else is said of it is noise
        problems = preset_problems + [p for p in problems if p.path[:1] != ("dataflow",)]
    if problems:
        problems.sort(key=lambda p: _line_of(src, src.display_path(p.path)))
        raise RecipeInvalid(problems, src)
    assert recipe is not None
    return recipe


def _structure(data: dict[str, Any]) -> tuple[Recipe | None, list[Problem]]:
    """The recipe model (its args still raw), or the structural problems."""
    try:
        return Recipe.model_validate(data), []
    except ValidationError as e:
        return None, problems_from_validation_error(e, Recipe)


def _resolve(recipe: Recipe, typed: Typed, src: Located) -> list[Problem]:
    """Put the typed args in place, resolve paths given on the command line; the checks of a typed recipe."""
    for path in typed:
        _at(recipe, path).args = typed[path]
    _paths_from_the_shell(recipe, src)
    problems = [Problem(path, msg) for path, msg in plan.plan_problems(recipe)]
    return problems + check_chat_workflows(recipe)


def _at(recipe: Recipe, path: Path_) -> Any:
    """The object at `path` of a validated recipe (an `Abstraction`)."""
    node: Any = recipe
    for part in path:
        if isinstance(part, str) and not isinstance(node, dict | list):
            node = getattr(node, part)
        else:
            node = node[part]
    return node


def plugin_paths(recipe_dir: Path) -> None:
    """`imports:` finds modules in the current directory and beside the recipe (as `python -m` would
    find the first): both go on sys.path, after what is there."""
    for folder in (Path.cwd(), recipe_dir):
        entry = str(folder)
        if entry not in sys.path and folder.is_dir():
            sys.path.append(entry)


def _paths_from_the_shell(recipe: Recipe, src: Located) -> None:
    """A relative path given on the command line (`models.actor.path=ckpt/x`) means the shell's current
    directory, not the recipe's folder: make it absolute (a Hub name that is no local path stays)."""

    def overridden(path: Path_) -> bool:
        return any(tuple(path[:n]) in src.overridden for n in range(1, len(path) + 1))

    def fix(owner: Any, attr: str, path: Path_) -> None:
        value = getattr(owner, attr, None)
        if not isinstance(value, str) or not overridden(path) or value.startswith(("~", "/")):
            return  # (`~user` paths are expanded, and checked, where they are used)
        here = Path.cwd() / value
        if here.exists() or not REPO_ID.match(value):
            setattr(owner, attr, str(here))

    for name, spec in recipe.models.items():
        fix(spec, "path", ("models", name, "path"))
    if recipe.tokenizer is not None:
        fix(recipe.tokenizer, "path", ("tokenizer", "path"))
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key)
        if spec is not None:
            fix(spec.args, "path", (key, "args", "path"))


def _line_of(src: Located, path: Path_) -> tuple[int, int]:
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in src.positions:
            return src.positions[tuple(path[:n])]
    return (0, 0)

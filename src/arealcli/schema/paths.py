"""Local files a recipe needs (model directories, tokenizers, data files), checked before anything starts.

`areal check` reports missing ones as warnings (a recipe may be checked on a laptop for a cluster);
`areal train` refuses to start without them.
"""

from __future__ import annotations

from pathlib import Path

from arealcli.schema.recipe import Recipe
from arealcli.schema.source import Path_


def resolve(path: str, recipe_dir: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else recipe_dir / p


def missing_paths(recipe: Recipe, recipe_dir: Path) -> list[tuple[Path_, str]]:
    """(recipe path, message) for every local file or directory the recipe names that does not exist."""
    wanted: list[tuple[Path_, str, str]] = []
    for name, m in recipe.models.items():
        if m.path:
            wanted.append((("models", name, "path"), m.path, "model directory"))
    if recipe.tokenizer is not None and recipe.tokenizer.path:
        wanted.append((("tokenizer", "path"), recipe.tokenizer.path, "tokenizer directory"))
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key)
        if spec is not None and isinstance(spec.args.get("path"), str):
            wanted.append(((key, "args", "path"), spec.args["path"], "data file"))
    out = []
    for where, path, what in wanted:
        full = resolve(path, recipe_dir)
        if not full.exists():
            out.append((where, f"{what} {full} does not exist"))
    return out

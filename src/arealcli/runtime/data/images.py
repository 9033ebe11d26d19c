"""A recipe's images checked before anything starts (`areal check`, `areal train`), without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arealcli.errors import DataError
from arealcli.runtime import vision
from arealcli.runtime.data.jsonl import read_jsonl

MAX_IMAGE_PROBLEMS = 20


def image_problems(recipe, recipe_dir: Path) -> list[str]:
    """What `areal check` and `areal train` refuse before anything starts, read without torch: a model that
    reads images on a backend that cannot give it the dataset's images, and each row of a local JSONL dataset whose
    images will not do (missing or unreadable files, unsupported formats, marks that do not match, or any
    image when no model reads images), with file:line."""
    from arealcli.schema.paths import resolve
    from arealcli.schema.registry import BACKENDS

    seeing = vision.vision_models(recipe, recipe_dir)
    out: list[str] = []
    any_images = False
    seen: set[Path] = set()
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key)
        args: Any = spec.args if spec is not None else None
        if not hasattr(args, "image_key") or not str(args.path).endswith(".jsonl"):
            continue
        try:
            path = resolve(args.path, recipe_dir)
            rows, _ = read_jsonl(path) if path.is_file() and path not in seen else ([], [])
        except (ValueError, DataError):
            continue  # path_problems and the dataset itself name these
        seen.add(path)
        text_key = args.messages_key or args.prompt_key
        rows = [(line, row) for line, row in rows[: args.limit] if isinstance(row, dict)]
        with_images = [line for line, row in rows if vision.row_images(row, args.image_key, text_key)]
        any_images = any_images or bool(with_images)
        if with_images and not seeing:  # one error, not one per row
            out.append(
                f"{path}:{with_images[0]}: {len(with_images)} row(s) have images ({args.image_key!r} or "
                f"image_url parts) but {vision.NO_VISION_MODEL}"
            )
            continue
        for line, row in rows:
            problem = vision.image_problem(row, args.image_key, text_key, path.parent, bool(seeing))
            if problem:
                out.append(f"{path}:{line}: {problem}")
    for name in seeing if any_images else []:  # images to give: every model that reads them must get them
        backend = recipe.models[name].backend.type_
        entry = BACKENDS.find(backend)
        if recipe.models[name].base_of is None and entry is not None and "images" not in entry.capabilities:
            able = ", ".join(e.name for e in BACKENDS.entries() if "images" in e.capabilities)
            out.insert(
                0,
                f"models.{name}.backend.type_: model {name!r} reads images, but backend {backend!r} cannot "
                f"give it images; use {able}",
            )
    if len(out) > MAX_IMAGE_PROBLEMS:
        more = len(out) - MAX_IMAGE_PROBLEMS
        out = [*out[:MAX_IMAGE_PROBLEMS], f"... and {more} more rows with image problems"]
    return out

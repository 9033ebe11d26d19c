"""Images in data rows (a field, or OpenAI `image_url` parts of chat messages) and their checks: by the
datasets, and before anything starts (`areal check`, `areal train`), without torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arealcli.errors import DataError
from arealcli.runtime import vision
from arealcli.runtime.data.jsonl import read_jsonl
from arealcli.runtime.wire.openai import ProtocolError, content_parts

NO_VISION_MODEL = (
    "no model of the run reads images (a vision-language model: family qwen2_vl, or a Qwen2-VL folder)"
)


def message_parts(messages: list[Any]) -> tuple[list[dict], list[str]]:
    """Chat messages whose content may be OpenAI parts as text messages, each image a `vision.IMAGE_MARK`
    where it was, and the images' URLs (a data: URL or a path relative to the data file) in order.
    ProtocolError for a part that is not text or image_url (`parts_problem` says so first)."""
    out, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        text, urls = content_parts(content, f"message {i} content part", vision.IMAGE_MARK)
        out.append({**m, "content": text})
        images += urls
    return out, images


def parts_problem(content: list[Any]) -> str | None:
    """Why a data row message's content parts will not do, or None: a part that is not text or image_url,
    or an image at a web URL (nothing is fetched)."""
    try:
        _, urls = content_parts(content, "content part", vision.IMAGE_MARK)
    except ProtocolError as e:
        return str(e)
    if any(url.startswith(("http://", "https://")) for url in urls):
        return "images are not fetched from the web; download them and give paths"
    return None


def row_images(row: dict, key: str, text_key: str) -> list[Any]:
    """A data row's images in order: those in image_url parts of its chat messages (`text_key`), then
    those under `key`."""
    text = row.get(text_key)
    in_parts = message_parts(text)[1] if isinstance(text, list) else []
    return in_parts + vision.images_in(row.get(key))


def image_problem(row: dict, key: str, text_key: str, base_dir: Path, reads_images: bool) -> str | None:
    """Why a data row's images cannot be used, or None: an image that does not open, `IMAGE_MARK`s in the
    prompt (`text_key`) that do not match the images, or any image at all when no model of the run reads
    images. The row's messages were checked (`parts_problem`) before."""
    text = row.get(text_key)
    images = row_images(row, key, text_key)
    if isinstance(text, list):  # chat messages: their image_url parts are marks in the text
        text = "".join(m["content"] for m in message_parts(text)[0] if isinstance(m.get("content"), str))
    if images and not reads_images:
        return f"the row has an image ({key!r} or image_url parts) but {NO_VISION_MODEL}"
    marks = text.count(vision.IMAGE_MARK) if isinstance(text, str) else 0
    if marks and marks != len(images):
        return f"{text_key!r} has {marks} {vision.IMAGE_MARK} mark(s) for {len(images)} image(s) in {key!r}"
    for image in images:
        try:
            vision.open_image(image, base_dir)
        except DataError as e:
            return f"{key!r}: {e}"
    return None


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
        # rows whose messages the dataset refuses are its to name
        rows = [(n, r) for n, r in rows if not _bad_messages(r.get(text_key))]
        with_images = [line for line, row in rows if row_images(row, args.image_key, text_key)]
        any_images = any_images or bool(with_images)
        if with_images and not seeing:  # one error, not one per row
            out.append(
                f"{path}:{with_images[0]}: {len(with_images)} row(s) have images ({args.image_key!r} or "
                f"image_url parts) but {NO_VISION_MODEL}"
            )
            continue
        for line, row in rows:
            problem = image_problem(row, args.image_key, text_key, path.parent, bool(seeing))
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


def _bad_messages(messages: Any) -> bool:
    """Chat messages with content parts the dataset refuses (a text prompt is not messages)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and parts_problem(m["content"])
        for m in messages
    )

"""Load a recipe from YAML keeping where each value came from, and apply `key.path=value` overrides.

A `Located` recipe is plain data (dicts, lists, scalars) plus a map from a path such as
`("dataflow", "calls", 0, "mb_spec")` to the `(line, column)` of that value in the file, so that every
validation error can be printed as `file:line:col: path: message`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


@dataclass
class Located:
    data: dict[str, Any]
    file: str
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    # Paths set from the command line: path -> the override text, used instead of a file position.
    overridden: dict[Path_, str] = field(default_factory=dict)

    def where(self, path: Path_) -> str:
        """`file:line:col` of the deepest known ancestor of `path` (or the override that set it)."""
        for n in range(len(path), -1, -1):
            prefix = tuple(path[:n])
            if prefix in self.overridden:
                return f"<override {self.overridden[prefix]}>"
            if prefix in self.positions:
                line, col = self.positions[prefix]
                return f"{self.file}:{line}:{col}"
        return f"{self.file}:1:1"


class RecipeSourceError(Exception):
    """The recipe cannot even be read (missing file, YAML syntax, bad override)."""

    def __init__(self, messages: list[str]):
        super().__init__("\n".join(messages))
        self.messages = messages


def _construct(node: yaml.Node, path: Path_, positions: dict[Path_, tuple[int, int]]) -> Any:
    positions[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = str(_scalar(key_node))
            out[key] = _construct(value_node, path + (key,), positions)
            # The key's own position is more useful than the value's for "unknown key" errors.
            positions[path + (key,)] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_construct(item, path + (i,), positions) for i, item in enumerate(node.value)]
    return _scalar(node)


def _scalar(node: yaml.Node) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def load_recipe_source(file: str | Path) -> Located:
    file = Path(file)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise RecipeSourceError([f"{file}: no such recipe file"]) from None
    except OSError as e:
        raise RecipeSourceError([f"{file}: cannot read: {e.strerror}"]) from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeSourceError([f"{where}: YAML syntax error: {problem}"]) from None
    positions: dict[Path_, tuple[int, int]] = {}
    data = _construct(root, (), positions) if root is not None else {}
    if not isinstance(data, dict):
        raise RecipeSourceError([f"{file}:1:1: a recipe must be a mapping of keys to values"])
    return Located(data=data, file=str(file), positions=positions)


def parse_override(text: str) -> tuple[Path_, Any]:
    """`dataflow.calls.0.mb_spec.n_mbs=2` -> (("dataflow", "calls", 0, "mb_spec", "n_mbs"), 2)."""
    if "=" not in text:
        raise RecipeSourceError([f"override {text!r}: expected key.path=value"])
    key, _, raw = text.partition("=")
    if not key or any(not part for part in key.split(".")):
        raise RecipeSourceError([f"override {text!r}: empty key in {key!r}"])
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    path = tuple(int(p) if p.isdigit() else p for p in key.split("."))
    return path, value


def apply_overrides(src: Located, overrides: list[str]) -> Located:
    """Set each `key.path=value` in the recipe, creating missing mappings along the way."""
    errors = []
    for text in overrides:
        try:
            path, value = parse_override(text)
        except RecipeSourceError as e:
            errors.extend(e.messages)
            continue
        node: Any = src.data
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list) and isinstance(part, int):
                if part >= len(node):
                    errors.append(f"override {text!r}: index {part} out of range at {_dotted(path[:depth])}")
                    break
                node = node[part]
            elif isinstance(node, dict):
                node = node.setdefault(str(part), {})
            else:
                errors.append(f"override {text!r}: {_dotted(path[:depth])} is not a mapping or list")
                break
        else:
            last = path[-1]
            if isinstance(node, list) and isinstance(last, int) and last < len(node):
                node[last] = value
            elif isinstance(node, dict):
                node[str(last)] = value
            else:
                errors.append(f"override {text!r}: cannot set {_dotted(path)}")
                continue
            src.overridden[tuple(str(p) if not isinstance(p, int) else p for p in path)] = text
    if errors:
        raise RecipeSourceError(errors)
    return src


def _dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path) or "<root>"

"""Load a recipe from YAML keeping where each value came from, and apply `key.path=value` overrides.

A `Located` recipe is plain data (dicts, lists, scalars) plus a map from a path such as
`("dataflow", "calls", 0, "mb_spec")` to the `(line, column)` of that value in the file, so that every
validation error can be printed as `file:line:col: path: message`.

The loader accepts plain data only: mappings with scalar keys (each key once), lists, and strings,
integers, floats, booleans and nulls. Other tags (`!!binary`, `!!python/...`, `!custom`) are errors and
never run anything. Floats follow YAML 1.2 as well (`1e-3` is a number, not a string). Nesting depth,
the size of the data after alias expansion, and the file size are capped, so a hostile file (a
"billion laughs" alias bomb, 10,000 nested brackets) is refused quickly instead of hanging.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

Path_ = tuple[str | int, ...]

MAX_FILE_BYTES = 1 << 20  # recipes are a few KB
MAX_DEPTH = 64  # nesting of mappings and lists
MAX_NODES = 100_000  # values after alias expansion
MAX_INT = 2**53  # beyond this no setting is sane (and floats lose integers)

_TAG = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {f"{_TAG}{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")}


@dataclass
class Located:
    data: dict[str, Any]
    file: str
    positions: dict[Path_, tuple[int, int]] = field(default_factory=dict)
    # Paths set from the command line: path -> the override text, used instead of a file position.
    overridden: dict[Path_, str] = field(default_factory=dict)
    # Generated paths (a preset's calls) -> the path the user wrote (e.g. `dataflow.actor`), for messages.
    aliases: dict[Path_, Path_] = field(default_factory=dict)

    def where(self, path: Path_) -> str:
        """`file:line:col` of the deepest known ancestor of `path` (or the override that set it)."""
        path = self.display_path(path)
        for n in range(len(path), -1, -1):
            prefix = tuple(path[:n])
            if prefix in self.overridden:
                return f"<override {self.overridden[prefix]}>"
            if prefix in self.positions:
                line, col = self.positions[prefix]
                return f"{self.file}:{line}:{col}"
        return f"{self.file}:1:1"

    def display_path(self, path: Path_) -> Path_:
        """The path as the user wrote it (a preset's generated calls map back to the preset's keys)."""
        for n in range(len(path), 0, -1):
            alias = self.aliases.get(tuple(path[:n]))
            if alias is not None:
                return alias + tuple(path[n:])
        return tuple(path)


class RecipeSourceError(Exception):
    """The recipe cannot even be read (missing file, YAML syntax, bad override)."""

    def __init__(self, messages: list[str]):
        super().__init__("\n".join(messages))
        self.messages = messages


class _TooDeep(Exception):
    def __init__(self, mark: yaml.Mark) -> None:
        self.mark = mark


def _loader_class() -> type[yaml.SafeLoader]:
    """SafeLoader + YAML 1.2 floats (`1e-3`), no implicit timestamps (dates stay strings), a depth cap."""

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    # types-PyYAML leaves Parser.peek_event unannotated
                    raise _TooDeep(self.peek_event().start_mark)  # type: ignore[no-untyped-call]
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag != f"{_TAG}timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    float12 = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
    Loader.add_implicit_resolver(f"{_TAG}float", float12, list("-+0123456789"))
    return Loader


_Loader = _loader_class()


class _Builder:
    """Nodes -> plain data, recording positions and collecting every problem (not only the first)."""

    def __init__(self, file: str, positions: dict[Path_, tuple[int, int]]):
        self.file, self.positions = file, positions
        self.problems: list[str] = []
        self.nodes = 0
        self._constructor = yaml.SafeLoader("")

    def _problem(self, node: yaml.Node, message: str) -> None:
        self.problems.append(
            f"{self.file}:{node.start_mark.line + 1}:{node.start_mark.column + 1}: {message}"
        )

    def build(self, node: yaml.Node, path: Path_, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES or depth > 4 * MAX_DEPTH:
            mark = node.start_mark
            raise RecipeSourceError(
                [
                    f"{self.file}:{mark.line + 1}:{mark.column + 1}: the recipe expands to more than {MAX_NODES} "
                    f"values (or nests deeper than {4 * MAX_DEPTH}) through YAML aliases; recipes are small, "
                    "so this is refused"
                ]
            )
        self.positions.setdefault(path, (node.start_mark.line + 1, node.start_mark.column + 1))
        if not isinstance(node, yaml.ScalarNode) and node.tag not in (f"{_TAG}map", f"{_TAG}seq"):
            self._problem(node, f"the YAML tag {node.tag!r} is not allowed in a recipe (plain values only)")
            return None
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            return [self.build(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        return self.scalar(node)

    def _mapping(self, node: yaml.MappingNode, path: Path_, depth: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        first_line: dict[str, int] = {}
        merged: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == f"{_TAG}merge":  # `<<: *defaults` — keys written here win
                sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in sources:
                    value = self.build(source, path, depth + 1)
                    if not isinstance(value, dict):
                        self._problem(source, "a merge key `<<` takes a mapping (or a list of mappings)")
                        continue
                    for k, v in value.items():
                        merged.setdefault(k, v)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self._problem(key_node, "a key must be a plain name, not a list or mapping")
                continue
            if key_node.tag not in _ALLOWED_TAGS:
                self.scalar(key_node)  # reports the tag
                continue
            key = str(key_node.value)  # a key is its text: `on:` or `1:` are names, not a bool or a number
            line = key_node.start_mark.line + 1
            if key in first_line:
                self._problem(key_node, f"duplicate key {key!r} (first given on line {first_line[key]})")
                continue
            first_line[key] = line
            out[key] = self.build(value_node, path + (key,), depth + 1)
            # The key's own position is more useful than the value's for "unknown key" errors.
            self.positions[path + (key,)] = (line, key_node.start_mark.column + 1)
        for k, v in merged.items():
            out.setdefault(k, v)
        return out

    def scalar(self, node: yaml.Node) -> Any:
        if node.tag == f"{_TAG}merge":  # `<<` as a value is just text
            return node.value
        if node.tag not in _ALLOWED_TAGS:
            self._problem(node, f"the YAML tag {node.tag!r} is not allowed in a recipe (plain values only)")
            return None
        try:
            value = self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError) as e:
            kind = node.tag.removeprefix(_TAG)
            self._problem(node, f"{node.value!r} is not a valid {kind} ({_first_line(e)})")
            return None
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            self._problem(node, f"the integer {node.value} is out of range (at most 2**53 in magnitude)")
            return None
        if isinstance(value, float) and not math.isfinite(value):
            self._problem(node, f"{node.value!r} is not a finite number; recipes take finite numbers only")
            return None
        return value


def _first_line(e: BaseException) -> str:
    text = str(getattr(e, "problem", None) or e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _decode(raw: bytes, file: Path) -> str:
    """UTF-8 text (a BOM is dropped); otherwise an error naming the line and column of the bad byte."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise RecipeSourceError([f"{file}:1:1: the recipe is UTF-16 encoded; save it as UTF-8"])
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        start = raw[: e.start]
        line = start.count(b"\n") + 1
        col = e.start - (start.rfind(b"\n") + 1) + 1
        raise RecipeSourceError(
            [
                f"{file}:{line}:{col}: the recipe is not valid UTF-8 (byte 0x{raw[e.start]:02x}); save it as UTF-8"
            ]
        ) from None


# What YAML forbids in a stream: C0 controls but tab, newline and carriage return; DEL; C1 controls but
# NEL; surrogates; U+FFFE and U+FFFF.
_NON_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _control(char: str) -> str:
    return f"control character U+{ord(char):04X} is not allowed in a recipe"


def _check_printable(text: str, file: str) -> None:
    """Every control character YAML refuses, as `file:line:col` (not the YAML reader's traceback)."""
    problems: list[str] = []
    for m in _NON_PRINTABLE.finditer(text):
        if len(problems) == 10:
            problems.append(f"{file}: (more control characters not listed)")
            break
        before = text[: m.start()]
        line, col = before.count("\n") + 1, m.start() - (before.rfind("\n") + 1) + 1
        what = "a NUL byte; is it a binary file?" if m.group() == "\x00" else _control(m.group())
        problems.append(f"{file}:{line}:{col}: {what}")
    if problems:
        raise RecipeSourceError(problems)


def parse_yaml(text: str, file: str, positions: dict[Path_, tuple[int, int]] | None = None) -> Any:
    """YAML text -> plain data; every problem as `file:line:col: message` in one RecipeSourceError."""
    positions = {} if positions is None else positions
    _check_printable(text, file)
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
    except _TooDeep as e:
        raise RecipeSourceError(
            [f"{file}:{e.mark.line + 1}:{e.mark.column + 1}: nested more than {MAX_DEPTH} levels deep"]
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else file
        problem = getattr(e, "problem", None) or str(e)
        raise RecipeSourceError([f"{where}: YAML syntax error: {problem}"]) from None
    except RecursionError:  # belt and braces: the depth cap comes first
        raise RecipeSourceError([f"{file}: nested too deeply"]) from None
    finally:
        loader.dispose()
    if root is None:
        return None
    builder = _Builder(file, positions)
    data = builder.build(root, ())
    if builder.problems:
        raise RecipeSourceError(builder.problems)
    return data


def load_recipe_source(file: str | Path) -> Located:
    file = Path(file)
    try:
        if file.is_dir():
            raise RecipeSourceError([f"{file}: is a directory; give a recipe YAML file"])
        with open(file, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise RecipeSourceError([f"{file}: no such recipe file"]) from None
    except OSError as e:
        raise RecipeSourceError([f"{file}: cannot read: {e.strerror or e}"]) from None
    except ValueError as e:  # e.g. a NUL byte in the name
        raise RecipeSourceError([f"{file!s}: not a usable file name ({e})"]) from None
    if len(raw) > MAX_FILE_BYTES:
        raise RecipeSourceError([f"{file}: larger than {MAX_FILE_BYTES // 1024} KB; is this a recipe?"])
    positions: dict[Path_, tuple[int, int]] = {}
    data = parse_yaml(_decode(raw, file), str(file), positions)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeSourceError([f"{file}:1:1: a recipe must be a mapping of keys to values"])
    return Located(data=data, file=str(file), positions=positions)


_KEY_PART = re.compile(r"^[A-Za-z0-9_\-]+$")


def parse_override(text: str) -> tuple[Path_, Any]:
    """`dataflow.calls.0.mb_spec.n_mbs=2` -> (("dataflow", "calls", 0, "mb_spec", "n_mbs"), 2)."""
    if "=" not in text:
        raise RecipeSourceError([f"override {text!r}: expected key.path=value"])
    bad_char = _NON_PRINTABLE.search(text)
    if bad_char:
        raise RecipeSourceError([f"override {text!r}:{bad_char.start() + 1}: {_control(bad_char.group())}"])
    key, _, raw = text.partition("=")
    if not key or any(not part for part in key.split(".")):
        raise RecipeSourceError([f"override {text!r}: empty key in {key!r}"])
    bad = [p for p in key.split(".") if not _KEY_PART.match(p)]
    if bad:
        raise RecipeSourceError(
            [f"override {text!r}: {bad[0]!r} is not a key name (letters, digits, _ and -)"]
        )
    if raw.strip() == "":
        raise RecipeSourceError(
            [
                f"override {text!r}: no value after '='; write {key}=null to unset it, or {key}='' for an empty text"
            ]
        )
    try:
        value = parse_yaml(raw, f"<override {text}>")
    except RecipeSourceError as e:
        # Plain text that is not valid YAML on its own (e.g. `a: b` inside) is taken as a string, but a
        # tag, a duplicate key or a bad number inside a value is still an error.
        if any("syntax error" not in m for m in e.messages):
            raise
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
        preset = _preset_calls(src.data, path, text)
        if preset:
            errors.append(preset)
            continue
        node: Any = src.data
        for depth, part in enumerate(path[:-1]):
            if isinstance(node, list) and isinstance(part, int):
                if part >= len(node):
                    errors.append(f"override {text!r}: index {part} out of range at {_dotted(path[:depth])}")
                    break
                node = node[part]
            elif isinstance(node, dict):
                child = node.setdefault(str(part), {})
                if child is None:  # `key: null` in the file (or `key:`): a mapping can grow there
                    child = node[str(part)] = {}
                node = child
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


def _preset_calls(data: dict[str, Any], path: Path_, text: str) -> str | None:
    """`dataflow.calls.N...` on a recipe whose dataflow is a preset: there are no calls to set yet."""
    dataflow = data.get("dataflow")
    if path[:2] != ("dataflow", "calls") or not isinstance(dataflow, dict) or "calls" in dataflow:
        return None
    if "preset" not in dataflow:
        return None
    rest, value = path[3:], text.partition("=")[2]
    instead = (
        f"write dataflow.mb_spec.{_dotted(rest[1:])}={value} (every call's micro-batches)"
        if rest[:1] == ("mb_spec",) and len(rest) > 1
        else "set the preset's blocks instead: dataflow.actor.*, dataflow.reward.*, dataflow.critic.*, "
        "dataflow.shaping.*, dataflow.mb_spec.* (areal list dataflow)"
    )
    return (
        f"override {text!r}: this recipe's dataflow is the preset {dataflow['preset']!r}, whose calls "
        f"exist only once it is expanded; {instead}, or write the calls out (areal check --print shows them)"
    )


def mapping_at(data: dict[str, Any], key: str) -> dict[str, Any]:
    """`data[key]` when it is a mapping, else an empty one (a wrong value is reported elsewhere)."""
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path) or "<root>"

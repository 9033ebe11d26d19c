"""What is wrong with a recipe: `Problem` (a path into it and a message), `RecipeInvalid`, and pydantic
errors turned into Problems.

Every check returns a list of Problems (never raises on the first), so the command layer can print each
one as `file:line:col: path: message (got value)`.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from arealcli.schema.registry import suggest
from arealcli.schema.source import Located, Path_

MISSING = object()  # a Problem without a value to show


@dataclass
class Problem:
    path: Path_
    message: str
    value: Any = MISSING

    def format(self, src: Located) -> str:
        dotted = ".".join(str(p) for p in src.display_path(self.path)) or "<recipe>"
        got = "" if self.value is MISSING else f" (got {_short(self.value)})"
        return f"{src.where(self.path)}: {dotted}: {self.message}{got}"


class RecipeInvalid(Exception):
    def __init__(self, problems: list[Problem], src: Located):
        self.problems, self.src = problems, src
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per problem; a problem seen through several generated calls is said once."""
        return list(dict.fromkeys(p.format(self.src) for p in self.problems))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes / containers an annotation may hold (Optional, unions, list, dict)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [x for arg in typing.get_args(annotation) for x in _unwrap(arg)]
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return [annotation]


def _field_annotation(current: Any, part: Any) -> Any:
    """The annotation one step down from `current` (a model's field, a list's or dict's values)."""
    for candidate in _unwrap(current):
        origin = typing.get_origin(candidate)
        if isinstance(candidate, type) and issubclass(candidate, BaseModel) and isinstance(part, str):
            field = candidate.model_fields.get(part)
            if field is not None:
                return field.annotation
        elif origin in (list, dict) and typing.get_args(candidate):
            return typing.get_args(candidate)[-1]
    return None


def _model_at(model: type[BaseModel], loc: Path_) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc` (to suggest valid keys)."""
    current: Any = model
    for part in loc:
        current = _field_annotation(current, part)
        if current is None:
            return None
    for candidate in _unwrap(current):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def problems_from_validation_error(
    err: ValidationError, model: type[BaseModel], prefix: Path_ = ()
) -> list[Problem]:
    return [_problem(e, model, prefix) for e in err.errors()]


def _problem(e: Any, model: type[BaseModel], prefix: Path_) -> Problem:
    """One pydantic error as a Problem: an unknown key with the valid ones, a missing field with its doc."""
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    if e["type"] == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        options = list(owner.model_fields) if owner else []
        return Problem(prefix + loc, f"unknown key{suggest(str(loc[-1]), options)}")
    if e["type"] == "missing":
        message = "required field is missing"
        owner = _model_at(model, loc)
        field_doc = owner.__doc__.strip().splitlines()[0] if owner and owner.__doc__ else ""
        if field_doc and owner is not None and owner is not model:
            message += f" ({field_doc})"
        return Problem(prefix + loc, message)
    message = e["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return Problem(prefix + loc, message + _quoted_hint(e), e.get("input", MISSING))


QUOTED = {
    "int_type": re.compile(r"[+-]?\d+"),
    "float_type": re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?"),
    "bool_type": re.compile(r"true|false"),
}


def _quoted_hint(e: Any) -> str:
    """A number (or boolean) written in quotes is text, and values are not coerced: say to drop the
    quotes, which is what was meant almost always."""
    pattern, value = QUOTED.get(e["type"]), e.get("input")
    if pattern is None or not isinstance(value, str) or not pattern.fullmatch(value.strip()):
        return ""
    return f"; in quotes it is text: write {value.strip()} without the quotes"

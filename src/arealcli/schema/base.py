"""The strict base model every recipe section derives from, and the `{type_, args}` abstraction."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo must never be silently ignored), and nothing is coerced.

    Strict types: `true` is not a number, `"3"` is not an integer, `1.5` is not an integer; numbers
    must be finite (`inf`/`nan` are refused); an empty text is never a valid name, path or value.
    """

    model_config = ConfigDict(
        extra="forbid",
        validate_default=True,
        use_attribute_docstrings=False,
        strict=True,
        allow_inf_nan=False,
        str_min_length=1,
    )


NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}$")


def _valid_name(name: str) -> str:
    """Letters, digits, `_`, `.`, `-` (not first), at most 100: safe as a directory name and a metric key."""
    if NAME_PATTERN.match(name):
        return name
    odd = [c for c in name if not (c.isascii() and (c.isalnum() or c in "_.-"))]
    shown = ", ".join(repr(c) for c in dict.fromkeys(odd))
    why = f"it contains {shown}" if odd else "it starts with '.' or '-'" if len(name) <= 100 else "too long"
    raise ValueError(f"not a name ({why}); use letters, digits, '_', '.' and '-', at most 100 characters")


# Names of models, calls and experiments: they become directory names and appear in metric keys.
Name = Annotated[str, AfterValidator(_valid_name)]


class Abstraction(StrictModel):
    """Which registered thing to build, with which arguments.

    `args` is written as a mapping; validation (`schema.validate`) checks it against the registered
    class's own argument model and replaces it by that typed object, so at the point of use it is
    never a dict.
    """

    type_: str = Field(description="Registered name of the component (see `areal list`).")
    args: Any = Field(default_factory=dict, description="Arguments of that component (a mapping).")

    @field_validator("args", mode="before")
    @classmethod
    def _mapping(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict | BaseModel):
            raise ValueError("`args` must be a mapping of argument names to values")
        return value


class ModelInterfaceAbstraction(Abstraction):
    """A registered model interface (algorithm) and its arguments."""


class ModelBackendAbstraction(Abstraction):
    """A registered model backend and its arguments."""


class NoArgs(StrictModel):
    """A component without arguments."""

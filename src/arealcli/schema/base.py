"""The strict base model every recipe section derives from, and the `{type_, args}` abstraction."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """Unknown keys are errors (a typo must never be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=False)


class Abstraction(StrictModel):
    """Which registered thing to build, with which arguments.

    `args` is checked against the registered class's own argument model after this model validates
    (see `schema.validate`), so at the point of use it is always that typed model, never a dict.
    """

    type_: str = Field(description="Registered name of the component (see `areal list`).")
    args: dict[str, Any] = Field(default_factory=dict, description="Arguments of that component.")


class ModelInterfaceAbstraction(Abstraction):
    """A registered model interface (algorithm) and its arguments."""


class ModelBackendAbstraction(Abstraction):
    """A registered model backend and its arguments."""


class NoArgs(StrictModel):
    """A component without arguments."""

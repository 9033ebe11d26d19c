"""Registration and construction of interfaces, backends and datasets.

The registries themselves live in `arealcli.schema.registry` (so `areal check` can validate arguments
without importing torch); this module adds the runtime side: building instances from recipe specs.
"""

from __future__ import annotations

from typing import Any

from arealcli.schema.base import Abstraction
from arealcli.schema.registry import (
    BACKENDS,
    DATASETS,
    INTERFACES,
    REWARDS,
    WORKFLOWS,
    register_backend,
    register_dataset,
    register_interface,
    register_reward,
)

__all__ = [
    "register_interface",
    "register_backend",
    "register_dataset",
    "register_reward",
    "make_interface",
    "make_backend",
    "make_dataset",
    "get_reward",
    "reward_is_binary",
    "make_workflow",
]


def _typed_args(entry, spec: Abstraction):
    args = spec.args
    return args if isinstance(args, entry.args_model) else entry.args_model.model_validate(args or {})


def make_interface(spec: Abstraction):
    entry = INTERFACES.get(spec.type_)
    cls, args = entry.load(), _typed_args(entry, spec)
    if getattr(entry.args_model, "__dataclass_interface__", False):  # AReaL's style: fields are the args
        interface = cls(**{name: getattr(args, name) for name in entry.args_model.model_fields})
        interface.args = args
        return interface
    return cls(args)


def make_backend(spec: Abstraction):
    entry = BACKENDS.get(spec.type_)
    return entry.load()(_typed_args(entry, spec))


def make_dataset(spec: Abstraction, tokenizer, base_dir: str = ".") -> Any:
    entry = DATASETS.get(spec.type_)
    return entry.load()(_typed_args(entry, spec), tokenizer, base_dir)


def make_workflow(spec: Abstraction):
    entry = WORKFLOWS.get(spec.type_)
    return entry.load()(_typed_args(entry, spec))


def get_reward(name: str):
    return REWARDS.get(name).load()


def reward_is_binary(name: str) -> bool:
    """Does the reward score every response 0 or 1 (so a mean of it is an accuracy)? (An environment's
    reward, `environment`, is not known to be.)"""
    from arealcli.schema.components.interfaces import ENVIRONMENT

    return name != ENVIRONMENT and REWARDS.get(name).binary

"""The model interface contract: the computations an algorithm needs, independent of the backend."""

from __future__ import annotations

import os
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec


class ModelInterface:
    """Base class; a subclass overrides the calls it implements and sets `Args` (a pydantic model).

    A training interface implements `train_step` and `save`; an inference interface `inference`; a
    generation interface `generate`. Interfaces call `model.inc_version()` at the end of `train_step`.
    """

    Args: type = type(None)
    needs_model: bool = True

    def __init__(self, args: Any):
        self.args = args

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} does not implement train_step")

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        raise NotImplementedError(f"{type(self).__name__} does not implement inference")

    def generate(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        raise NotImplementedError(f"{type(self).__name__} does not implement generate")

    def save(self, model: Model, save_dir: str) -> None:
        """Export the model (HF format by default)."""
        model.module.save_to_hf(model.tokenizer, save_dir)

    def evaluate(self, model: Model, loader) -> dict[str, float]:
        """Metrics on held-out batches; default: nothing."""
        return {}

    def state_dict(self) -> dict[str, Any] | None:
        """Interface state a resume restores (e.g. a KL controller); default: none."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (called only when it returned something)."""


def key_from_env(env: str | None, who: str) -> str | None:
    """The key in the environment variable `env` (None without one); a named but unset one is an error."""
    key = os.environ.get(env) if env else None
    if env and not key:
        raise UserError(f"{who}: the environment variable {env} (api_key_env) is not set")
    return key

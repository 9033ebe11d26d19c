"""The backend contract: a registered backend turns a model into an engine.

Two kinds of engine (runtime/engines): a training engine (`TrainEngine`: train_batch, forward,
eval_batch, generate, save_to_hf) for the models that learn, and an inference engine
(`InferenceEngine`: generation by prompt group, asynchronous, following another model's weights) for
generation copies. A backend declares what its engine can do in `capabilities`; `areal check` refuses
a call its model's backend cannot run before anything starts.
"""

from __future__ import annotations

from typing import Any

from arealcli.runtime.model import FinetuneSpec, Model
from arealcli.schema.registry import BACKEND_CAPABILITIES


class ModelBackend:
    """Turns `model.module` into an engine. Subclasses define `Args`, `capabilities` and `_initialize`.

    capabilities: "train" (train_step calls), "forward" (inference calls: log-probs, values),
    "generate" (generate calls), "update_weights" (`weights_from`: follow a trained model).
    """

    Args: type = type(None)
    capabilities: frozenset[str] = frozenset(BACKEND_CAPABILITIES)

    def __init__(self, args: Any):
        self.args = args

    def initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        model = self._initialize(model, spec)
        model.backend = self
        return model

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        raise NotImplementedError

    def save(self, model: Model, save_dir: str) -> None:
        """Backend state needed to resume (optimizer, scheduler); weights go through save_to_hf."""

    def load(self, model: Model, load_dir: str) -> None:
        """Restore what `save` wrote."""

    def update_weights(self, model: Model, path: str, version: int) -> None:
        """Replace the model's weights by the HF export at `path` (policy `version`); models whose weights
        follow another (`weights_from`) get this after every step that trained their source."""
        raise NotImplementedError(f"backend {type(self).__name__} declares update_weights but lacks it")

    def destroy(self, model: Model) -> None:
        """Release resources (processes, servers, GPU memory)."""

"""The backend contract: a registered backend turns a model into an engine.

Two kinds of engine (runtime/engines): a training engine (`TrainEngine`: train_batch, forward,
eval_batch, generate, save_to_hf) for the models that learn, and an inference engine
(`InferenceEngine`: generation by prompt group, asynchronous, following another model's weights) for
generation copies. A backend declares what its engine can do in `capabilities`; `areal check` refuses
a call its model's backend cannot run before anything starts.
"""

from __future__ import annotations

from typing import Any

from arealcli.runtime.engines.base import Engine
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.schema.registry import TEXT_CAPABILITIES


class ModelBackend:
    """Turns `model.module` into an engine. Subclasses define `Args`, `capabilities` and `_initialize`.

    capabilities: "train" (train_step calls), "forward" (inference calls: log-probs, values),
    "generate" (generate calls), "update_weights" (`weights_from`: follow a trained model), "images"
    (a vision-language model gets its images: training and generating).
    """

    Args: type = type(None)
    capabilities: frozenset[str] = TEXT_CAPABILITIES
    # True: `_initialize` takes the torch module, when it needs one, from `model.initial_module()` (built
    # from `model.source` on demand; `model.module` is None unless another model is initialized from this
    # one, which needs it built anyway), so the trainer builds none for a server-backed model.
    builds_weights: bool = False
    # As a follower (`weights_from`) in the training process: True when its engine copies a source's
    # tensors in memory (`update_weights_in_memory`) instead of loading an HF export from disk, and
    # `applies_adapters` when it takes a LoRA source's adapters apart (sent alone after the first update).
    weights_in_memory: bool = False
    applies_adapters: bool = False
    # As a follower: the LoRA config of the model it follows, when that model trains LoRA adapters (set by
    # the trainer before `initialize`: a server that takes adapters alone is started for them)
    source_lora: Any = None

    def __init__(self, args: Any):
        self.args = args

    @property
    def resumes_weights(self) -> bool:
        """True: on resume, `load` restores the trained weights itself (LoRA adapters over a rebuilt base);
        otherwise the trainer loads the checkpoint's HF export into the module before `_initialize`.
        A subclass overrides it with a property or a plain class attribute."""
        return False

    def initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        model = self._initialize(model, spec)
        model.backend = self
        return model

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        raise NotImplementedError

    # The engine owns its state: these hand over to it (a plugin engine that is not one of ours may
    # lack them, and then has nothing to save, load or release).

    def save(self, model: Model, save_dir: str) -> None:
        """Engine state needed to resume (optimizer, adapters); weights go through save_to_hf."""
        if isinstance(model.module, Engine):
            model.module.save_state(save_dir)

    def load(self, model: Model, load_dir: str) -> None:
        """Restore what `save` wrote."""
        if isinstance(model.module, Engine):
            model.module.load_state(load_dir)

    def update_weights(self, model: Model, path: str, version: int) -> None:
        """Replace the model's weights by the HF export at `path` (policy `version`)."""
        if not isinstance(model.module, Engine):
            raise NotImplementedError(f"backend {type(self).__name__} declares update_weights but lacks it")
        model.module.update_weights(path, version)

    def update_weights_in_memory(self, model: Model, weights: Any, version: int) -> None:
        """Copy another model's weights (`models.weights.WeightsInMemory`) into this one's."""
        model.module.update_weights_in_memory(weights, version)

    def destroy(self, model: Model) -> None:
        """Release resources (processes, servers, GPU memory); safe to call twice."""
        if isinstance(model.module, Engine):
            model.module.destroy()


def source_lora(recipe: Any, name: str) -> Any:
    """The LoRA config of the model `name` follows (`weights_from`), when that one trains adapters."""
    source = recipe.models[name].weights_from
    return getattr(recipe.models[source].backend.args, "lora", None) if source is not None else None

"""The backend and engine contracts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from arealcli.runtime.data import SequenceSample
from arealcli.runtime.model import FinetuneSpec, Model
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec

# loss_fn(outputs, mb) -> (scalar loss, {stat: scalar tensor}); outputs are packed logits (tokens, vocab)
# or values (tokens,) for value-head models.
LossFn = Callable[[torch.Tensor, SequenceSample], tuple[torch.Tensor, dict[str, torch.Tensor]]]
LossWeightFn = Callable[[SequenceSample], float]


class GenerationOutput(Protocol):
    output_ids: list[list[int]]  # generated tokens per sample (prompt excluded, EOS included if any)
    logprobs: list[list[float]]  # log-prob of each generated token under the sampling distribution
    no_eos: list[bool]  # True where generation stopped at max_new_tokens


class PipelinableEngine(Protocol):
    """What every backend turns a model into: train, evaluate, run forward, generate."""

    def train_batch(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        version_steps: int,
        token_normalize_scope: str = "global",
        lr_scale: float = 1.0,
    ) -> dict[str, float]:
        """One optimizer step over `input_`; the LR is the backend schedule at `version_steps` x lr_scale."""
        ...

    def eval_batch(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, loss_fn: LossFn
    ) -> dict[str, float]: ...

    def forward(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        post_hook: Callable[[torch.Tensor, SequenceSample], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any: ...

    def generate(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        tokenizer: Any,
        gconfig: GenerationHyperparameters,
    ) -> GenerationOutput: ...

    def save_to_hf(self, tokenizer: Any, save_dir: str) -> None: ...


class ModelBackend:
    """Turns `model.module` into a PipelinableEngine. Subclasses define `Args` and `_initialize`."""

    Args: type = type(None)

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
        raise NotImplementedError(
            f"backend {type(self).__name__} cannot load new weights in place, so its model cannot use "
            "`weights_from`; use the hf or sglang backend for that model"
        )

    def destroy(self, model: Model) -> None:
        """Release resources (processes, servers, GPU memory)."""

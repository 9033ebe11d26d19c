"""What every engine owns, whatever it runs: its state for resume, new weights, its resources.

A backend builds an engine (`ModelBackend._initialize` sets `model.module` to it); from then on the
engine is the object: the backend's `save`, `load`, `update_weights` and `destroy` hand over to these.
Nothing outside a backend reaches into an engine's torch module; what callers need of it is here.
"""

from __future__ import annotations

import contextlib
from typing import Any


class Engine:
    """Defaults fit an engine with nothing to save and nothing to release."""

    def save_state(self, save_dir: str) -> None:
        """What resume needs besides the exported weights (optimizer, adapters), into `save_dir`."""

    def load_state(self, load_dir: str) -> None:
        """Restore what `save_state` wrote."""

    def update_weights(self, path: str, version: int) -> None:
        """Replace the weights by the HF export at `path` (policy `version`): models whose weights follow
        another (`weights_from`) get this after every step that trained their source."""
        raise NotImplementedError(f"{type(self).__name__} cannot load new weights in place")

    def weights_in_memory(self, adapters_apart: bool = False) -> Any:
        """This engine's weights for a follower in the same process (`models.weights.WeightsInMemory`),
        or None where they are not whole in this process (sharded, on a server): then they go through an
        HF export on disk."""
        return None

    def update_weights_in_memory(self, weights: Any, version: int) -> None:
        """Copy a `WeightsInMemory` of another model into this one's weights (policy `version`)."""
        raise NotImplementedError(f"{type(self).__name__} takes new weights from disk only")

    def destroy(self) -> None:
        """Release processes, servers, threads and device memory."""

    def parameter_counts(self) -> tuple[int, int] | None:
        """(trained, total) parameters held in this process, or None (weights elsewhere: a server)."""
        return None

    def flop_shape(self) -> Any:
        """The `models.flops.FlopShape` of the model this process computes with, or None (weights
        elsewhere, or a module whose shape is unknown): what its FLOPs are counted from."""
        return None

    def adapters_off(self) -> contextlib.AbstractContextManager[Any]:
        """Within it, the engine runs its base weights (LoRA adapters switched off)."""
        raise NotImplementedError(f"{type(self).__name__} has no adapters to switch off")

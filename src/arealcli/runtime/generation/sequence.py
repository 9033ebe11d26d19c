"""One sample to generate, as the scheduler queues it and the running batch decodes it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arealcli.runtime.wire.sglang import Sampling


@dataclass
class Sequence:
    """One sample to generate: a prompt's j-th of n."""

    rid: str
    prompt: list[int]
    sampling: Sampling
    max_new_tokens: int  # the request's, clipped to the context length
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    weight_version: str = ""
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[], object] | None = None  # called (from the scheduler's thread) once done
    queued_at: float = 0.0  # time.monotonic() when submitted
    top_n: int = 0  # also record the top_n most likely tokens at every generated position (in `top`)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # (token, log-prob), best first
    cancelled: bool = False  # set by Scheduler.abort: the sample ends at the next step
    adapter: str | None = None  # the served LoRA adapter it is generated with (None: the base weights)
    images: Any = None  # (pixel_values, image_grid_thw) of the images whose placeholders `prompt` holds

    @property
    def finished_as(self) -> dict[str, Any]:
        """`finish` of a sequence done without an error (every sequence is completed or failed)."""
        assert self.finish is not None, f"sequence {self.rid} is not done, or failed: {self.error}"
        return self.finish

    def complete(self, finish: dict[str, Any], ids=(), logprobs=(), version: str = "") -> None:
        self.output_ids, self.logprobs = list(ids), list(logprobs)
        self.finish, self.weight_version = finish, version
        self._done()

    def fail(self, error: str) -> None:
        self.error = error
        self._done()

    def _done(self) -> None:
        self.done.set()
        if self.on_done is not None:
            self.on_done()

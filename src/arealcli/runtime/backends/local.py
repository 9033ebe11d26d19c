"""The `local` backend: generation in this process, on a thread of its own, for a model that follows
another's weights (`weights_from: actor`).

It is the engine behind `areal serve` without HTTP: the same batching loop (`Scheduler`: groups that
arrive together run as one generate call) and the same model runner, over a copy of the model held in
this process. A weight update aborts the samples in flight; they are continued on the new weights
(`GroupGenerator`) and record both versions. With `rollout: {max_staleness: K}` the rollout producer
generates on it while the trainer trains; without, `generate` calls wait for their samples.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.engines.inference import (
    EventLoopThread,
    GenerationServerError,
    GroupGenerator,
    InferenceEngine,
)
from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.scheduler import Scheduler, Sequence
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.wire.sglang import Completion, ProtocolError, parse_sampling
from arealcli.schema.components.backends import LocalBackendArgs


class LocalGenerator(GroupGenerator):
    """Requests go straight to the batching loop (no HTTP); several groups' first requests together."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler

    async def request(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Completion]:
        (out,) = await self.request_many([(prompt, params, n)])
        return out

    async def request_many(
        self, groups: list[tuple[list[int], dict[str, Any], int]]
    ) -> list[list[Completion]]:
        per_group: list[list[Sequence]] = []
        for prompt, params, n in groups:
            try:
                sampling = parse_sampling({**params, "n": n})
            except ProtocolError as e:
                raise GenerationServerError(f"bad sampling params: {e}") from None
            room = self.runner.context_length - len(prompt)
            if room <= 0:
                raise GenerationServerError(
                    f"a prompt of {len(prompt)} tokens leaves no room in the model's context "
                    f"({self.runner.context_length} tokens)"
                )
            max_new = min(sampling.max_new_tokens, room)
            per_group.append([Sequence(str(j), list(prompt), sampling, max_new) for j in range(n)])
        loop = asyncio.get_running_loop()
        waits = []
        for s in (s for group in per_group for s in group):
            done = loop.create_future()
            s.on_done = lambda done=done: _resolve_from_thread(loop, done)
            waits.append(done)
        self.scheduler.submit([s for group in per_group for s in group])  # one batch where they fit
        await asyncio.gather(*waits)
        errors = [s.error for group in per_group for s in group if s.error]
        if errors:
            raise GenerationServerError(f"local generation failed: {errors[0]}")
        return [
            [
                Completion(s.output_ids, s.logprobs, s.finished_as["type"], s.finished_as, s.weight_version)
                for s in group
            ]
            for group in per_group
        ]


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _resolve_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
    """From the batching thread: wake the waiting request (nobody waits once the loop is closed)."""
    try:
        loop.call_soon_threadsafe(_resolve, future)
    except RuntimeError:  # the loop was closed at shutdown
        pass


class LocalEngine(InferenceEngine):
    def __init__(self, generator: LocalGenerator, loop: EventLoopThread, name: str, version: int):
        super().__init__(generator, loop, name, version)
        self.scheduler = generator.scheduler

    async def _update_weights(self, path: str, version: int) -> None:
        # off the event loop: the update waits for the running batch to stop (its samples are aborted)
        ok, message = await asyncio.to_thread(self.scheduler.update_weights, path, str(version), True)
        if not ok:
            raise GenerationServerError(message)

    def destroy(self) -> None:
        self.scheduler.stop()  # aborts what runs: the batch ends at its next decoding step
        self.scheduler.join(timeout=10)
        self.loop.close()

    close = destroy


class LocalBackend(ModelBackend):
    """Generation in this process on a thread of its own, following another model's weights."""

    Args = LocalBackendArgs
    capabilities = frozenset({"generate", "update_weights"})

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: LocalBackendArgs = self.args
        runner = ModelRunner.in_memory(model.module, model.tokenizer, model.name, a.device, a.dtype)

        def thread_setup() -> None:  # torch's thread count is per calling thread
            if a.num_threads:
                torch.set_num_threads(a.num_threads)

        scheduler = Scheduler(
            runner,
            a.batch_window_ms / 1000,
            a.max_batch_size,
            weight_version=str(model.version.global_step),
            on_thread_start=thread_setup,
        )
        scheduler.start()
        model.module = LocalEngine(
            LocalGenerator(runner, scheduler), EventLoopThread(), model.name, model.version.global_step
        )
        model.device, model.dtype = runner.device, runner.dtype
        return model

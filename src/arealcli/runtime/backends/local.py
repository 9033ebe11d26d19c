"""The `local` backend: generation in this process, on a thread of its own, for a model that follows
another's weights (`weights_from: actor`).

It is the engine behind `areal serve` without HTTP: the same batching loop (`Scheduler`: groups that
arrive together run as one generate call) and the same model runner, over a copy of the model held in
this process. A weight update aborts the samples in flight; they are continued on the new weights
(`GroupGenerator`) and record both versions. With `rollout: {max_staleness: K}` the rollout producer
generates on it while the trainer trains; without, `generate` calls wait for their samples.

New weights come from the trained model in memory: its tensors are copied into this copy's (no files);
a LoRA model's adapters are set up here at the first update and from then on only they are copied.
With `cpus`, the generation thread runs on those cores, and so do the torch threads it starts (see
runtime/run/threads.py for what a placement inside one process does not separate).
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import torch

from arealcli.errors import UserError
from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.engines.inference import (
    IMAGES_PARAM,
    EventLoopThread,
    GenerationServerError,
    GroupGenerator,
    InferenceEngine,
)
from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.scheduler import Scheduler, Sequence
from arealcli.runtime.models.flops import FlopShape, shape_of
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.models.weights import WeightsInMemory
from arealcli.runtime.wire.sglang import Completion, ProtocolError, parse_sampling
from arealcli.schema.checks.placement import compact
from arealcli.schema.components.backends import LocalBackendArgs


class LocalRunner(ModelRunner):
    """The model runner of the `local` backend: new weights from an HF export or from memory."""

    def load_weights(self, source: str | WeightsInMemory, root: str | None = None) -> None:  # type: ignore[override]
        if isinstance(source, str):
            super().load_weights(source, root)
        else:
            copy_in(self, source)


def copy_in(runner: ModelRunner, weights: WeightsInMemory) -> None:
    """Copy `weights` into the runner's module (cast to its dtype and device); LoRA adapters are added
    to the module at their first arrival (B = 0 until copied: the same function). Every name and shape
    is checked before anything is copied: a mismatch leaves the weights as they were."""
    module = runner.module
    if weights.adapters and not any(".lora_" in k for k in module.state_dict()):
        import copy

        from peft import inject_adapter_in_model

        config = copy.deepcopy(weights.lora_config)  # the trained model's own stays untouched
        inject_adapter_in_model(config, module, adapter_name="default")
        module.to(device=runner.device, dtype=runner.dtype).eval()
    own = module.state_dict()
    pairs = []
    for name, value in {**(weights.full or {}), **(weights.adapters or {})}.items():
        key = name if name in own else _base_layer_name(name)
        if key not in own or own[key].shape != value.shape:
            got = (
                "no such weight"
                if key not in own
                else f"shape {tuple(value.shape)} != {tuple(own[key].shape)}"
            )
            raise ValueError(f"new weights do not fit the generation model: {name}: {got}")
        pairs.append((own[key], value))
    if weights.full is not None:
        given = {k if k in own else _base_layer_name(k) for k in weights.full}
        missing = [
            k for k in own if k not in given and ".lora_" not in k and not k.endswith("lm_head.weight")
        ]
        if missing:
            raise ValueError(f"new weights do not fit the generation model: missing {missing[:5]}")
    copied: set[int] = set()  # a tied output layer is the embeddings' storage: copied once
    with torch.no_grad():
        for target, value in pairs:
            if target.data_ptr() not in copied and target.data_ptr() != value.data_ptr():
                target.copy_(value)
                copied.add(target.data_ptr())


def _base_layer_name(name: str) -> str:
    """`x.q_proj.weight` -> `x.q_proj.base_layer.weight`: the base weight of a layer adapters wrap."""
    stem, _, leaf = name.rpartition(".")
    return f"{stem}.base_layer.{leaf}"


class LocalGenerator(GroupGenerator):
    """Requests go straight to the batching loop (no HTTP); several groups' first requests together."""

    reads_images = True

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
            images = params.get(IMAGES_PARAM)
            params = {k: v for k, v in params.items() if k != IMAGES_PARAM}
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
            per_group.append(
                [Sequence(str(j), list(prompt), sampling, max_new, images=images) for j in range(n)]
            )
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

    async def _update_weights(self, path: str | WeightsInMemory, version: int) -> None:
        # off the event loop: the update waits for the running batch to stop (its samples are aborted);
        # the scheduler hands `path` to LocalRunner.load_weights as it is
        ok, message = await asyncio.to_thread(self.scheduler.update_weights, path, str(version), True)  # type: ignore[arg-type]
        if not ok:
            raise GenerationServerError(message)

    def flop_shape(self) -> FlopShape | None:
        return shape_of(self.scheduler.runner.module)

    def update_weights_in_memory(self, weights: WeightsInMemory, version: int) -> None:
        self.loop.run(self._update_weights(weights, version))
        self.version = version

    def destroy(self) -> None:
        self.scheduler.stop()  # aborts what runs: the batch ends at its next decoding step
        self.scheduler.join(timeout=10)
        self.loop.close()

    close = destroy


class LocalBackend(ModelBackend):
    """Generation in this process on a thread of its own, following another model's weights."""

    Args = LocalBackendArgs
    capabilities = frozenset({"generate", "update_weights", "images"})
    weights_in_memory = True
    applies_adapters = True

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: LocalBackendArgs = self.args
        device: str = a.device
        if a.devices and device != "cpu" and torch.cuda.is_available():
            device = f"cuda:{a.devices[0]}"  # its GPU among the visible ones
        runner = LocalRunner.in_memory(model.module, model.tokenizer, model.name, device, a.dtype)
        started = threading.Event()
        failed: list[OSError] = []

        def thread_setup() -> None:  # placement and torch's thread count are per calling thread
            try:
                if a.cpus:  # Linux: this thread alone, and the threads it starts from now on
                    os.sched_setaffinity(0, set(a.cpus))
            except OSError as e:
                failed.append(e)
            finally:
                started.set()
            if a.generation_threads():
                torch.set_num_threads(a.generation_threads())

        scheduler = Scheduler(
            runner,
            a.batch_window_ms / 1000,
            a.max_batch_size,
            weight_version=str(model.version.global_step),
            on_thread_start=thread_setup,
        )
        scheduler.start()
        started.wait()
        if failed:
            scheduler.stop()
            raise UserError(
                f"model {model.name}: cannot run its generation thread on cores {compact(a.cpus or [])}: "
                f"{failed[0].strerror}"
            )
        model.module = LocalEngine(
            LocalGenerator(runner, scheduler), EventLoopThread(), model.name, model.version.global_step
        )
        model.device, model.dtype = runner.device, runner.dtype
        return model

"""The inference engine: generation by prompt group, asynchronous, following another model's weights.

An inference engine (the in-process `local` generator, SGLang servers, vLLM servers) generates; it does
not train or run forward passes. Its API:

    submit_group(prompt, gconfig, eos_ids, n) -> Future[list[Sample]]   one prompt, n samples; returns at
                                                                        once, resolves when all n are done
    generate(input_, mb_spec, tokenizer, gconfig) -> GenerationResult   every prompt of a batch (grouped
                                                                        by identical prompts), in order
    update_weights(path, version)       load an HF export; requests in flight are aborted and continued
                                        on the new weights (or waited for, per backend)
    pause() / resume()                  hold new requests / let them go
    version                             the policy version of the weights it holds

Requests run on an asyncio loop in a thread of their own (`EventLoopThread`), so callers on any thread
(the trainer, the rollout producer) submit and wait without blocking each other.

`GroupGenerator` is what the engines share underneath: one request per prompt group, and the
continuation of samples that a weight update aborted — re-sent with the tokens generated so far
appended to the prompt and `max_new_tokens` reduced by as many; the sample's output and log-probs are
the concatenation, and it records the weight version of every piece.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.base import Engine
from arealcli.runtime.generation.sampling import GenerationResult, stop_texts_of
from arealcli.runtime.vision import per_sample_images
from arealcli.runtime.wire.sglang import Completion, sampling_params
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec


class GenerationServerError(RuntimeError):
    """Generation failed (a server died, none could be reached, a request was refused): the message
    says which and why."""


@dataclass
class Sample:
    output_ids: list[int]
    logprobs: list[float]
    finish_type: str  # stop | length
    weight_versions: list[str | None]  # one per request that contributed tokens
    pieces: list[int]  # tokens each of those requests contributed
    resends: int = 0

    def versions(self) -> tuple[int | None, int | None]:
        """(first, last) numeric weight version among the pieces; None when the generator reports none."""
        known = [int(v) for v in self.weight_versions if v is not None and v.lstrip("-").isdigit()]
        return (min(known), max(known)) if known else (None, None)


# the sampling params' key under which a prompt's images go to a generator that reads them (not sent on)
IMAGES_PARAM = "_images"


class GroupGenerator:
    """One request per prompt group; samples aborted by a weight update are continued until they finish.

    Subclasses implement `request(prompt, params, n)`: one request for `n` samples of `prompt` with
    SGLang-style sampling params, answered with `n` Completions (finish type stop, length or abort).
    """

    max_abort_resends: int = 8
    # it takes a prompt's images (params[IMAGES_PARAM]: (pixel_values, image_grid_thw)) with its ids
    reads_images: bool = False

    async def request(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Completion]:
        raise NotImplementedError

    async def request_many(
        self, groups: list[tuple[list[int], dict[str, Any], int]]
    ) -> list[list[Completion]]:
        """The first request of several groups; by default each on its own (the local generator sends
        them together, so that they form one batch)."""
        return await all_or_none([self.request(p, params, n) for p, params, n in groups])

    async def generate(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Sample]:
        """`n` samples of one prompt; aborted samples are re-sent until they finish."""
        (samples,) = await self.generate_many([(prompt, params, n)])
        return samples

    async def generate_many(self, groups: list[tuple[list[int], dict[str, Any], int]]) -> list[list[Sample]]:
        firsts = await self.request_many(groups)
        for (_, _, n), completions in zip(groups, firsts, strict=True):
            if len(completions) != n:
                raise GenerationServerError(f"a request for n={n} samples returned {len(completions)}")
        return await all_or_none(
            [
                self._finish_group(prompt, params, completions)
                for (prompt, params, _), completions in zip(groups, firsts, strict=True)
            ]
        )

    async def _finish_group(
        self, prompt: list[int], params: dict[str, Any], completions: list[Completion]
    ) -> list[Sample]:
        """The samples of one group, each continued until it finishes (all_or_none: cancelled with the
        other groups, its own continuations are cancelled and abandoned too)."""
        return await all_or_none([self._finish(prompt, params, c) for c in completions])

    async def _finish(self, prompt: list[int], params: dict[str, Any], c: Completion) -> Sample:
        ids, lps, versions, resends = list(c.output_ids), list(c.logprobs), [c.weight_version], 0
        pieces = [len(c.output_ids)]
        while c.finish_type == "abort":
            status = c.finish.get("status_code")
            if isinstance(status, int) and 400 <= status < 500:
                raise GenerationServerError(f"the server rejected a request: {c.finish.get('message')}")
            remaining = params["max_new_tokens"] - len(ids)
            if remaining <= 0:
                return Sample(ids, lps, "length", versions, pieces, resends)
            resends += 1
            if resends > self.max_abort_resends:
                raise GenerationServerError(
                    f"a sample was aborted {resends} times (max_abort_resends={self.max_abort_resends}); "
                    f"last reason: {c.finish.get('message')}"
                )
            again = {
                **params,
                "max_new_tokens": remaining,
                "min_new_tokens": max(0, params.get("min_new_tokens", 0) - len(ids)),
            }
            (c,) = await self.request(prompt + ids, again, 1)
            ids += c.output_ids
            lps += c.logprobs
            versions.append(c.weight_version)
            pieces.append(len(c.output_ids))
        return Sample(ids, lps, c.finish_type, versions, pieces, resends)


async def all_or_none(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """The results of `coros`, run together, in order. The first failure is raised and the others are
    cancelled (their work is no longer wanted) and abandoned: nothing goes on running, and nothing
    fails later unseen ("Task exception was never retrieved")."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            abandon(task)
        raise


def abandon(task: asyncio.Future) -> None:
    """Drop a task whose outcome is no longer wanted: cancelled if it still runs, and the failure it
    ended with (or ends with, should it not heed the cancellation) retrieved here, so that asyncio never
    prints it as "never retrieved": whoever abandons it has reported what went wrong."""
    if not task.done():
        task.cancel()
    task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


@dataclass
class EventLoopThread:
    """An asyncio loop in a daemon thread, so synchronous callers (the trainer) can run coroutines."""

    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self.loop.run_forever, name="generation-client", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs (threads waiting on it get CancelledError, never a hang), then stop."""
        if self.loop.is_running():

            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                if tasks:  # let the cancellations reach the threads waiting on them before the loop stops
                    await asyncio.wait(tasks, timeout=1.0)

            try:
                self.submit(cancel_all()).result(timeout=2)
            except Exception:  # a loop too busy to answer is stopped anyway
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


def prompt_groups(prompts: list[list[int]], images: list | None = None) -> list[tuple[int, int]]:
    """(start, size) of runs of identical consecutive prompts (and images): one request with n = size each."""
    groups: list[tuple[int, int]] = []

    def same(a: int, b: int) -> bool:
        if prompts[a] != prompts[b]:
            return False
        return images is None or all(torch.equal(x, y) for x, y in zip(images[a], images[b], strict=True))

    for i in range(len(prompts)):
        if groups and same(groups[-1][0], i):
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((i, 1))
    return groups


class InferenceEngine(Engine):
    """Generation on a GroupGenerator, run on an event-loop thread (see the module docstring).

    Subclasses implement `_update_weights(path, version)` (a coroutine, on the loop).
    """

    def __init__(self, generator: GroupGenerator, loop: EventLoopThread, name: str, version: int = 0):
        self.generator, self.loop, self.name = generator, loop, name
        self.version = version
        self._open: asyncio.Event | None = None  # created on the loop; cleared while paused

    # ------------------------------------------------------------------ the group API

    async def _gate(self) -> None:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        await self._open.wait()

    async def _groups(self, groups: list[tuple[list[int], dict[str, Any], int]]) -> list[list[Sample]]:
        await self._gate()
        return [list(x) for x in await self.generator.generate_many(groups)]

    async def _group(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Sample]:
        (samples,) = await self._groups([(prompt, params, n)])
        return samples

    def submit_group(
        self, prompt: list[int], gconfig: GenerationHyperparameters, eos_ids: set[int], n: int
    ) -> concurrent.futures.Future:
        """`n` samples of `prompt`: a future resolving to a list of `Sample`s."""
        return self.loop.submit(self._group(list(prompt), sampling_params(gconfig, sorted(eos_ids), n=1), n))

    def submit_groups(
        self, prompts: list[list[int]], gconfig: GenerationHyperparameters, eos_ids: set[int], n: int
    ) -> concurrent.futures.Future:
        """Several groups at once (one batch where the generator batches): a future of a list per prompt."""
        params = sampling_params(gconfig, sorted(eos_ids), n=1)
        return self.loop.submit(self._groups([(list(p), params, n) for p in prompts]))

    def generate(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, tokenizer, gconfig: GenerationHyperparameters
    ) -> GenerationResult:
        """One result per sample of `packed_prompts`, in input order (mb_spec does not apply: the
        generator batches by itself). Runs of identical prompts go as one group request."""
        prompts = [t.tolist() for t in input_.unpack("packed_prompts")]
        eos = {tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set()
        params = sampling_params(gconfig, sorted(eos), n=1)
        images = per_sample_images(input_)
        if images is not None and not self.generator.reads_images:
            raise GenerationServerError(
                f"model {self.name!r} generates on a server that is sent token ids only; prompts with images "
                "generate in the trainer's own backend (hf, fsdp) or on `local`"
            )
        groups = [
            (prompts[start], params if images is None else {**params, IMAGES_PARAM: images[start]}, n)
            for start, n in prompt_groups(prompts, images)
        ]
        samples = [s for group in self.loop.run(self._groups(groups)) for s in group]
        first, last = zip(*(s.versions() for s in samples), strict=True) if samples else ((), ())
        result = GenerationResult(
            [s.output_ids for s in samples],
            [s.logprobs for s in samples],
            [s.finish_type == "length" for s in samples],
            list(first),
            list(last),
        )
        texts = stop_texts_of(gconfig, tokenizer)  # servers stop on texts; this makes the cut exact
        return texts.cut(result) if texts is not None else result

    # ------------------------------------------------------------------ control

    def pause(self) -> None:
        """New groups wait (those in flight go on) until `resume`."""

        async def close_gate() -> None:
            self._open = self._open or asyncio.Event()
            self._open.clear()

        self.loop.run(close_gate())

    def resume(self) -> None:
        async def open_gate() -> None:
            self._open = self._open or asyncio.Event()
            self._open.set()

        self.loop.run(open_gate())

    def take_faults(self) -> tuple[list[str], dict[str, float]]:
        """What its servers went through since last asked (restarts, reconnections: one line each) and the
        run's totals (`faults/server_restarts`, `faults/time_lost_s`); nothing for in-process generators."""
        take = getattr(self.generator, "take_events", None)
        if take is None:
            return [], {}
        g: Any = self.generator
        return take(), {"faults/server_restarts": float(g.restarts), "faults/time_lost_s": g.time_lost_s}

    def update_weights(self, path: str, version: int) -> None:
        self.loop.run(self._update_weights(path, version))
        self.version = version

    async def _update_weights(self, path: str, version: int) -> None:
        raise NotImplementedError

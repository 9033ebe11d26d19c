"""The batching loop of `areal serve` (and of the `local` backend): requests that arrive together are
generated together.

Continuous batching (`continuous=True`, as `areal serve` runs it, on Qwen2/Llama-family modules, through
`RunningBatch`): one thread keeps a batch of samples running; between two decoding steps, requests queued
since join it (their prompts prefilled in one forward pass) and finished samples leave, so a request never
waits for another's batch to end. When nothing runs, the first batch is collected while requests keep
arriving (each within `batch_window_s` of the previous one, for at most 10 windows); while a batch runs,
queued requests join it at the first step after the oldest has waited `batch_window_s` (or at once when
they fill the batch). Otherwise (the `local` backend, whose samples must draw the random numbers the
trainer's own `generate` draws; LoRA layers; other families) each collected batch runs whole, as one
generate call per sampling params.

Weight updates follow SGLang: with `abort_all_requests` every queued and running sample is aborted first
(it returns finish_reason "abort" with the tokens generated so far); otherwise the update waits until the
running samples finish. No sample starts while an update is pending. `abort(seqs)` aborts only the given
samples (a client that went away): queued ones leave the queue, running ones leave the batch before the
next step; they end as "abort" with the tokens they have.

While a sample runs in a continuous batch, its `output_ids` and `logprobs` (and `top`, when `top_n`
asks for the best alternatives of every generated token) are the lists the batch appends to: a reader
(a streaming response) sees its tokens as they come.

`stats`: batches (prefills: groups of prompts that joined together), steps (decoding steps), forwards
(model forward passes: batches + steps), samples, tokens, max_running (most samples in one step),
aborted (samples aborted one by one with `abort`).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from arealcli.runtime.generation.model_runner import WeightsRefused
from arealcli.runtime.generation.running_batch import RunningBatch
from arealcli.runtime.generation.sequence import Sequence
from arealcli.runtime.wire.sglang import Sampling, finish_abort, finish_length, finish_stop

logger = logging.getLogger(__name__)
T = TypeVar("T")


class UnknownAdapter(KeyError):
    """A request for an adapter the server does not serve (never loaded, or unloaded)."""

    def __str__(self) -> str:
        return f"the adapter {self.args[0]!r} is not served here (load it first: /load_lora_adapter)"


class Scheduler:
    """The queue of samples to generate, and the thread that generates them."""

    def __init__(
        self,
        runner,
        batch_window_s: float = 0.005,
        max_batch_size: int = 256,
        weight_version="default",
        on_thread_start: Callable[[], None] | None = None,
        continuous: bool = False,
    ):
        self.runner = runner
        self.on_thread_start = on_thread_start  # e.g. torch threads of the batching thread
        # continuous batching where the module allows it; otherwise every collected batch runs whole,
        # drawing its random numbers exactly as `sampling.generate` does for that batch
        self.continuous = continuous
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self._queue: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._abort_epoch = 0  # bumped by abort_all; a batch stops when it changes
        self._abort_message = "Aborted"
        self._updating = 0  # weight updates asked for and not done (`updates_waiting`): no batch may start
        self._running = False
        self._stopped = False
        self._update_lock = threading.Lock()
        self.forward_sleep_s = 0.0  # SGLang's /slow_down: sleep before every decode step (tests)
        self._thread = threading.Thread(target=self._loop, name="batching-loop", daemon=True)
        self.stats = {
            "batches": 0,
            "steps": 0,
            "forwards": 0,
            "samples": 0,
            "tokens": 0,
            "max_running": 0,
            "aborted": 0,
        }

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the batching thread to end (after `stop`)."""
        if self._thread.is_alive():
            self._thread.join(timeout)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self.abort_all("server shutting down")

    # ------------------------------------------------------------------ requests

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the server is shutting down")
            now = time.monotonic()
            for s in seqs:
                s.queued_at = now
            self._queue.extend(seqs)
            self._cv.notify_all()

    def abort_all(self, message: str = "Aborted by abort_all") -> int:
        """Abort every queued and running sample; returns how many were queued."""
        with self._cv:
            self._abort_epoch += 1
            self._abort_message = message
            queued = list(self._queue)
            self._queue.clear()
        for s in queued:
            s.complete(finish_abort(message), version=self.version_of(s))
        return len(queued)

    def abort(self, seqs: list[Sequence], message: str = "Aborted: the client went away") -> None:
        """Abort these samples only: queued ones end now, running ones before the next decoding step (with
        the tokens they have; a batch that runs whole stops once all its samples are aborted)."""
        with self._cv:
            for s in seqs:
                s.cancelled = True
            queued = [s for s in self._queue if s.cancelled]
            if queued:
                self._queue = deque(s for s in self._queue if not s.cancelled)
            self.stats["aborted"] += len(queued)
        for s in queued:
            s.complete(finish_abort(message), version=self.version_of(s))

    def version_of(self, s: Sequence) -> str:
        """The weight version a sample is generated with: its adapter's, or the base weights'."""
        return self.version(s.adapter)

    def version(self, adapter: str | None) -> str:
        """The weight version of a served adapter, or (None, or an adapter no longer served) the base's."""
        if adapter is not None and adapter in self.runner.adapters:
            return self.runner.adapters.version(adapter)
        return self.weight_version

    def _unserved(self, s: Sequence) -> bool:
        """Fail `s` if its adapter was unloaded while it waited; True when it did."""
        if s.adapter is None or s.adapter in self.runner.adapters:
            return False
        s.fail(str(UnknownAdapter(s.adapter)))
        return True

    def score(
        self, rows: list[tuple[list[int], int]], top_n: int, g=None, adapter: str | None = None, images=None
    ):
        """`runner.score(rows, top_n, g, adapter, images)` (prompt log-probs: one forward pass, no cache), run by
        the calling thread with no weight update in between (it holds their lock); and the weight version
        it used."""
        with self._update_lock:
            if adapter is not None and adapter not in self.runner.adapters:
                raise UnknownAdapter(adapter)
            return self.runner.score(rows, top_n, g, adapter, images), self.version(adapter)

    @property
    def updates_waiting(self) -> int:
        """Weight updates asked for and not done: waiting for the update lock (another update, a scoring
        pass), for the running samples, or loading. No batch starts while there is one."""
        return self._updating

    def change_adapter(self, change: Callable[[], T]) -> T:
        """Run `change()` (load, replace or unload a served adapter) once the running samples are done, with
        no batch starting meanwhile; what it returns. Its errors are raised."""
        return self._exclusive(change, abort=False)

    def _exclusive(self, change: Callable[[], T], abort: bool) -> T:
        with self._cv:
            self._updating += 1
        try:
            with self._update_lock:
                if abort:
                    self.abort_all("Aborted by a weight update")
                with self._cv:
                    while self._running:
                        self._cv.wait()
                return change()
        finally:
            with self._cv:
                self._updating -= 1
                self._cv.notify_all()

    def update_weights(
        self, path: str, version: str | None, abort: bool, root: str | None = None
    ) -> tuple[bool, str]:
        """Load the weights in folder `path` once the running samples are done (or aborted, with `abort`):
        (True, what changed), or (False, why) when they cannot be loaded (the weights untouched). With
        `root`, the runner opens the folder once, here under the update lock, and loads it only if it lies
        below `root` and neither it nor its files are symbolic links: WeightsRefused otherwise (a policy
        refusal, raised for the server to answer 403; only a confined load can be refused)."""

        def load() -> str:
            try:
                self.runner.load_weights(path, root=root)
            except WeightsRefused:
                raise
            except Exception as e:
                return f"Failed to update weights: {e}"
            if version is not None:  # before any batch can start with the new weights
                self.weight_version = version
            return ""

        failed = self._exclusive(load, abort)
        if failed:
            return False, failed
        message = "Succeeded to update model weights."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    # ------------------------------------------------------------------ the loop

    def _take_batch(self) -> list[Sequence] | None:
        """Called with the condition held: the next batch, or None once stopped."""
        while True:
            while not self._stopped and (not self._queue or self._updating):
                self._cv.wait()
            if self._stopped:
                return None
            # collect while requests keep coming (each within the window of the last), at most 10 windows
            now = time.monotonic()
            cap, quiet_until, seen = (
                now + 10 * self.batch_window_s,
                now + self.batch_window_s,
                len(self._queue),
            )
            while len(self._queue) < self.max_batch_size and not self._updating and not self._stopped:
                remaining = min(cap, quiet_until) - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
                if len(self._queue) > seen:
                    seen, quiet_until = len(self._queue), time.monotonic() + self.batch_window_s
            if self._stopped:
                return None
            if self._queue and not self._updating:
                return [self._queue.popleft() for _ in range(min(len(self._queue), self.max_batch_size))]

    def _admit(self, running: int) -> list[Sequence] | None:
        """Called with the condition held, `running` samples running: the samples to add now (maybe none;
        with nothing running, waits for a batch), or None once stopped."""
        if not running:
            return self._take_batch()
        if self._stopped:
            return None
        room = self.max_batch_size - running
        if self._updating or not self._queue or room <= 0:
            return []
        if len(self._queue) < room and time.monotonic() - self._queue[0].queued_at < self.batch_window_s:
            return []  # let more arrive: every join costs a forward pass
        return [self._queue.popleft() for _ in range(min(room, len(self._queue)))]

    def _loop(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        decoder = self.runner.row_decoder() if self.continuous else None
        if decoder is not None:
            self._continuous(RunningBatch(self.runner, decoder))
            return
        while True:
            with self._cv:
                batch = self._take_batch()
                if batch is None:
                    return
                epoch = self._abort_epoch
                self._running = True
            try:
                self._run(batch, epoch)
            except Exception as e:  # the requests get an error; the loop goes on
                traceback.print_exc()
                for s in batch:
                    if not s.done.is_set():
                        s.fail(f"{type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def _continuous(self, batch: RunningBatch) -> None:
        """Step the running batch; samples join between steps and leave when done (see the module doc)."""
        epoch = self._abort_epoch
        while True:
            with self._cv:
                aborted, epoch = self._abort_epoch != epoch, self._abort_epoch
                message = self._abort_message
            if aborted:  # the running samples end with what they have
                self._abort_rows(batch, message)
            for row in batch.drop(lambda row: row.seq.cancelled):  # aborted one by one (Scheduler.abort)
                self.stats["aborted"] += 1
                row.seq.complete(
                    finish_abort("Aborted: the client went away"),
                    row.ids,
                    row.logprobs,
                    self.version_of(row.seq),
                )
            with self._cv:
                if not len(batch):  # idle: a waiting weight update may go ahead
                    self._running = False
                    self._cv.notify_all()
                new = self._admit(len(batch))
                self._running = True
            if new is None:  # stopped
                self._abort_rows(batch, self._abort_message)
                return
            try:
                self._step(batch, new)
            except Exception as e:  # the samples get an error; the loop goes on
                traceback.print_exc()
                for row in batch.clear():
                    row.seq.fail(f"{type(e).__name__}: {e}")
                for s in new:
                    if not s.done.is_set():
                        s.fail(f"{type(e).__name__}: {e}")
            finally:
                with self._cv:
                    self._running = len(batch) > 0
                    self._cv.notify_all()

    def _abort_rows(self, batch: RunningBatch, message: str) -> None:
        for row in batch.clear():
            row.seq.complete(finish_abort(message), row.ids, row.logprobs, self.version_of(row.seq))

    def _step(self, batch: RunningBatch, new: list[Sequence]) -> None:
        """Add `new` to the batch (one prefill), sample every row's next token, finish what is done, and
        run the next decoding step for the rest."""
        if self.forward_sleep_s:
            time.sleep(self.forward_sleep_s)
        join = []
        for s in new:
            if s.cancelled:  # aborted between the queue and the batch
                self.stats["aborted"] += 1
                s.complete(finish_abort("Aborted: the client went away"), version=self.version_of(s))
            elif self._unserved(s):
                pass
            elif s.max_new_tokens == 0:
                s.complete(finish_length(s.sampling.max_new_tokens), version=self.version_of(s))
            elif s.sampling.stop and self.runner.tokenizer is None:
                s.fail(f"{self.runner.model_path} has no tokenizer: stop texts need one (use stop_token_ids)")
            else:
                join.append(s)
        if join:
            for s, why in batch.add(join):  # the samples that could not join
                logger.warning("sample %s failed: %s", s.rid, why)
                s.fail(why)
            self.stats["batches"] += 1
            self.stats["forwards"] += 1
        if not len(batch):
            return
        self.stats["max_running"] = max(self.stats["max_running"], len(batch))
        finished, failed = batch.sample()
        for row, why in failed:  # this sample's failure fails its request only
            logger.warning("sample %s failed: %s", row.seq.rid, why)
            row.seq.fail(why)
        for row, finish in finished:
            self.stats["samples"] += 1
            self.stats["tokens"] += len(row.ids)
            row.seq.complete(finish, row.ids, row.logprobs, self.version_of(row.seq))
        if len(batch):
            batch.forward()
            self.stats["steps"] += 1
            self.stats["forwards"] += 1

    def _run(self, batch: list[Sequence], epoch: int) -> None:
        def aborted() -> bool:  # polled before every decode step
            if self.forward_sleep_s:
                time.sleep(self.forward_sleep_s)
            return self._abort_epoch != epoch or all(s.cancelled for s in batch)

        def step() -> bool:  # polled by `generate` before every decoding step
            self.stats["steps"] += 1
            self.stats["forwards"] += 1
            return aborted()

        groups: dict[tuple[Sampling, str | None], list[Sequence]] = {}
        for s in batch:
            if not self._unserved(s):
                groups.setdefault((s.sampling.batch_key(), s.adapter), []).append(s)
        self.stats["batches"] += 1
        for (key, adapter), seqs in groups.items():
            version = self.version_of(seqs[0])
            for s in [s for s in seqs if s.max_new_tokens == 0]:
                s.complete(finish_length(s.sampling.max_new_tokens), version=version)
            todo = [s for s in seqs if s.max_new_tokens > 0]
            if todo and not aborted():
                max_new = max(s.max_new_tokens for s in todo)
                self.stats["max_running"] = max(self.stats["max_running"], len(todo))
                self.stats["forwards"] += 1  # the prefill
                try:
                    images = [s.images for s in todo] if any(s.images is not None for s in todo) else None
                    rows = self.runner.generate([s.prompt for s in todo], key, max_new, step, adapter, images)
                except Exception as e:  # these params fail: their samples only, the other groups go on
                    logger.warning("sampling failed for %d samples: %s: %s", len(todo), type(e).__name__, e)
                    for s in todo:
                        s.fail(f"sampling failed: {type(e).__name__}: {e}")
                    continue
                was_aborted = self._abort_epoch != epoch
                for s, row in zip(todo, rows, strict=True):
                    self._finish(s, row, was_aborted or s.cancelled, version)
            for s in todo:
                if not s.done.is_set():
                    s.complete(finish_abort(self._abort_message), version=version)

    def _finish(self, s: Sequence, row, was_aborted: bool, version: str) -> None:
        ids, lps = row.output_ids[: s.max_new_tokens], row.logprobs[: s.max_new_tokens]
        if row.stopped_by is not None and len(row.output_ids) <= s.max_new_tokens:
            finish = finish_stop(row.stopped_by)
        elif len(ids) >= s.max_new_tokens or not was_aborted:
            finish = finish_length(s.sampling.max_new_tokens)
        else:
            finish = finish_abort(self._abort_message)
        self.stats["samples"] += 1
        self.stats["tokens"] += len(ids)
        s.complete(finish, ids, lps, version)

"""The batching loop of `areal serve`: requests that arrive together run as one generate call.

One thread takes whatever is queued, keeps collecting while more arrive (each within `batch_window_s`
of the previous one, for at most 10 windows), and generates them together (grouped by sampling params). Weight updates follow SGLang: with `abort_all_requests` every queued and
running sample is aborted first (it returns finish_reason "abort" with the tokens generated so far);
otherwise the update waits for the running batch to finish. No batch starts while an update is pending.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arealcli.runtime.wire.sglang import Sampling, finish_abort, finish_length, finish_stop


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


class Scheduler:
    def __init__(
        self,
        runner,
        batch_window_s: float = 0.005,
        max_batch_size: int = 256,
        weight_version="default",
        on_thread_start: Callable[[], None] | None = None,
    ):
        self.runner = runner
        self.on_thread_start = on_thread_start  # e.g. torch threads of the batching thread
        self.batch_window_s = batch_window_s
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self._queue: deque[Sequence] = deque()
        self._cv = threading.Condition()
        self._abort_epoch = 0  # bumped by abort_all; a batch stops when it changes
        self._abort_message = "Aborted"
        self._updating = 0  # weight updates waiting or running: no batch may start
        self._running = False
        self._stopped = False
        self._update_lock = threading.Lock()
        self.forward_sleep_s = 0.0  # SGLang's /slow_down: sleep before every decode step (tests)
        self._thread = threading.Thread(target=self._loop, name="batching-loop", daemon=True)
        self.stats = {"batches": 0, "samples": 0, "tokens": 0}

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
            s.complete(finish_abort(message), version=self.weight_version)
        return len(queued)

    def update_weights(self, path: str, version: str | None, abort: bool) -> tuple[bool, str]:
        with self._update_lock:
            if abort:
                self.abort_all("Aborted by a weight update")
            with self._cv:
                self._updating += 1
                while self._running:
                    self._cv.wait()
            try:
                self.runner.load_weights(path)
                if version is not None:  # before any batch can start with the new weights
                    self.weight_version = version
            except Exception as e:  # reported to the caller: success false, weights untouched
                return False, f"Failed to update weights: {e}"
            finally:
                with self._cv:
                    self._updating -= 1
                    self._cv.notify_all()
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

    def _loop(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
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

    def _run(self, batch: list[Sequence], epoch: int) -> None:
        def aborted() -> bool:  # polled before every decode step
            if self.forward_sleep_s:
                time.sleep(self.forward_sleep_s)
            return self._abort_epoch != epoch

        version = self.weight_version
        groups: dict[Sampling, list[Sequence]] = {}
        for s in batch:
            groups.setdefault(s.sampling.batch_key(), []).append(s)
        self.stats["batches"] += 1
        for key, seqs in groups.items():
            for s in [s for s in seqs if s.max_new_tokens == 0]:
                s.complete(finish_length(s.sampling.max_new_tokens), version=version)
            todo = [s for s in seqs if s.max_new_tokens > 0]
            if todo and not aborted():
                max_new = max(s.max_new_tokens for s in todo)
                rows = self.runner.generate([s.prompt for s in todo], key, max_new, aborted)
                was_aborted = self._abort_epoch != epoch
                for s, row in zip(todo, rows, strict=True):
                    self._finish(s, row, was_aborted, version)
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

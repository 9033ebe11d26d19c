"""Asynchronous rollout: the rollout side generates step batches ahead of training, under a staleness bound.

With `rollout: {max_staleness: K}` the dataflow's calls split in two (schema.recipe.on_rollout_side):
the rollout side (generate calls, and weightless inference such as rewards) and the training side
(inference and train_step calls on trained models). One step, top to bottom:

    producer thread   for s = start, start + 1, ...:
                        wait until the weights after step s - K are published        (the staleness gate)
                        a worker thread: batch_s = dataset batch of step s -> rollout-side calls
                                         (generate on the generation model -> reward) -> buffer[s]
    trainer           batch = buffer.take(s)                                         (waits if not done)
                      training-side calls (ref / proximal log-probs, actor and critic updates)
                      export the actor -> update the generation model (requests in flight are aborted
                      and continued on the new weights; each sample records first and last version)
                      publish(s + 1)                                                 (opens the gate)

So at most K + 1 batches are in flight or buffered, and the policy that starts generating batch s is
at most K versions older than the one that trains on it. K = 0 runs the same calls in the same order
as the synchronous loop: the same results, bit for bit.

Which batch a step trains on is a pure function of the step (datasets.Batches), so a checkpoint needs
no buffer state: on resume, buffered batches are regenerated from the resumed weights (no prompt is
trained twice or skipped), and the first batches after a resume are fresh (lag 0).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.run.dataflow import Call, active, run_calls
from arealcli.schema.recipe import on_rollout_side


class RolloutStopped(RuntimeError):
    """The producer was stopped (shutdown) while the trainer waited for a batch."""


class RolloutProducer:
    def __init__(
        self,
        calls: list[Call],
        batch_of: Callable[[int], SequenceSample],
        max_staleness: int,
        start: int,
        end: int,
    ):
        self.calls = [c for c in calls if on_rollout_side(c.spec)]
        self.batch_of, self.max_staleness, self.start, self.end = batch_of, max_staleness, start, end
        self._cv = threading.Condition()
        self._published = start  # the weights after step `_published - 1` are on the generation model
        self._futures: dict[int, Future] = {}
        self._stopped = False
        self._workers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._loop, name="rollout-producer", daemon=True)
        self.started_at: dict[int, int] = {}  # step -> published step when its generation started

    def needed(self, step: int) -> bool:
        """Does step `step` train on a rollout (is any rollout-side call active then)?"""
        return any(active(c.spec, step) for c in self.calls)

    def start_producing(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ producer side

    def _loop(self) -> None:
        step = self.start
        while step < self.end:
            with self._cv:
                while not self._stopped and self._published < step - self.max_staleness:
                    self._cv.wait()
                if self._stopped:
                    return
                if self.needed(step):
                    self.started_at[step] = self._published
                    future: Future = Future()
                    self._futures[step] = future
                    # a daemon thread per batch (at most K + 1 at once, by the gate): a worker stuck in a
                    # request when the run stops must not keep the process alive
                    worker = threading.Thread(
                        target=self._produce, args=(step, future), name=f"rollout-{step}", daemon=True
                    )
                    worker.start()
                    self._workers.append(worker)
                    self._cv.notify_all()
            step += 1

    def _produce(self, step: int, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            batch, stats = run_calls(self.calls, self.batch_of(step), step)
        except BaseException as e:  # raised in the trainer by take()
            if not self._stopped:  # after a stop, failing requests are the shutdown itself
                future.set_exception(e)
            return
        stats["rollout/produce_s"] = time.perf_counter() - t0
        if not self._stopped:
            future.set_result((batch, stats))

    # ------------------------------------------------------------------ trainer side

    def take(self, step: int) -> tuple[SequenceSample, dict[str, float]]:
        """The rollout batch of `step` (waits for it); an error of the rollout side is raised here."""
        t0 = time.perf_counter()
        with self._cv:
            while step not in self._futures and not self._stopped:
                self._cv.wait()
            if self._stopped:
                raise RolloutStopped("the rollout producer was stopped")
            future = self._futures.pop(step)
        while True:
            try:
                batch, stats = future.result(timeout=0.5)
                break
            except FutureTimeout:
                if self._stopped:
                    raise RolloutStopped("the rollout producer was stopped") from None
        stats["rollout/wait_s"] = time.perf_counter() - t0
        stats["rollout/started_behind"] = float(step - self.started_at.pop(step, step))
        return batch, stats

    def publish(self, step: int) -> None:
        """The weights after step `step - 1` are now on the generation model: batches up to
        `step + max_staleness` may start."""
        with self._cv:
            self._published = max(self._published, step)
            self._cv.notify_all()

    def stop(self) -> None:
        """Stop producing: nothing new starts; batches in flight are dropped (their engines are stopped
        next, which ends their requests)."""
        with self._cv:
            self._stopped = True
            for future in self._futures.values():
                future.cancel()
            self._cv.notify_all()

    def join(self, timeout: float = 10.0) -> None:
        """Wait (bounded) for the workers to end after `stop` and the engines' shutdown: no thread may be
        inside torch when the interpreter exits."""
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))

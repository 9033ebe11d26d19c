"""The one run driver: build the trainer, train, close — for `areal train` in one process and for every
worker it launches (the console and the header on the reporting rank only).

    run(recipe, recipe_path, run_dir, resume, display, stop)
      placement (the training backends' cpus/devices), then torch's thread count (`trainer.threads`:
      fixed for the run by default, or following the free cores; OMP_NUM_THREADS wins)
      Trainer(..., hooks) -> setup -> header and notes -> train -> close
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from arealcli.runtime.run import threads
from arealcli.runtime.run.session import StopSignals
from arealcli.runtime.run.trainer import Hooks, Trainer
from arealcli.schema.recipe import Recipe

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class Display:
    """Where a reporting rank shows the run: the console (header, progress line) and notes."""

    console: Console
    note: Callable[[str], None]


@dataclass
class RunResult:
    global_step: int
    elapsed_s: float  # this process's training time
    start_step: int = 0  # where this process started (a resumed run: its checkpoint's step)
    finished_before: bool = False  # resumed a run that had already trained every step: nothing ran


def run(
    recipe: Recipe,
    recipe_path: Path,
    run_dir: Path,
    resume: bool = False,
    display: Display | None = None,
    stop: StopSignals | None = None,
    on_stop: Callable[[KeyboardInterrupt], None] | None = None,
) -> RunResult:
    """Train `recipe` into `run_dir`. `display`: this process reports (None on other ranks). `stop`:
    installed around the run so Ctrl-C and SIGTERM end it cleanly (a KeyboardInterrupt, Terminated for
    SIGTERM, is raised to the caller after the trainer closed; `on_stop` sees it first)."""
    from arealcli.runtime.console.progress import ConsoleProgress, default_metrics, header

    cores = threads.place_trainer(recipe)  # the training backends' `cpus` / `devices`
    policy = threads.thread_setting(recipe.trainer.threads, cores, run_dir, resume)
    progress = None
    if display is not None:
        metrics = recipe.trainer.console_metrics or default_metrics(recipe.dataflow.calls)
        t = recipe.trainer
        progress = ConsoleProgress(
            display.console,
            recipe.experiment,
            metrics,
            recipe.dataflow.calls,
            t.eval_every_n_steps if t.eval_every_n_steps and recipe.eval_dataset else None,
            t.save_every_n_steps,
            t.eval_at_start and recipe.eval_dataset is not None,
        )
    hooks = Hooks(
        progress=progress.update if progress is not None else None,
        stop_requested=stop.raise_if_requested if stop is not None else None,
        thread_policy=policy,
        note=display.note if display is not None else None,
    )
    trainer = Trainer(recipe, recipe_path.resolve().parent, run_dir, resume=resume, hooks=hooks)
    t0 = time.perf_counter()
    start_step = 0
    try:
        with progress if progress is not None else contextlib.nullcontext():
            if stop is not None:
                stop.install()
            trainer.setup()
            start_step = trainer.global_step
            if resume and start_step >= trainer.total_steps:  # nothing to do: nothing is rewritten
                return RunResult(start_step, 0.0, start_step, finished_before=True)
            t0 = time.perf_counter()  # this session's training time (setup excluded)
            if display is not None and progress is not None:
                header(display.console, trainer.describe(recipe_path))
                for note in [*trainer.notes, *busy_note(policy)]:
                    display.note(note)
                progress.start(trainer.global_step, trainer.total_steps)
            trainer.train()
    except Exception as e:
        if trainer.logger is not None:  # it failed while training: what this attempt did, for the caller
            with contextlib.suppress(AttributeError):
                e.arealcli_run = RunResult(trainer.global_step, time.perf_counter() - t0, start_step)  # type: ignore[attr-defined]
        raise
    except KeyboardInterrupt as e:
        if progress is not None:
            progress.stop()  # (the `with` has ended it already; nothing is drawn after the message)
        if on_stop is not None:
            on_stop(e)  # said before a shutdown that may hang
        raise
    finally:
        trainer.close()
        if stop is not None:
            stop.restore()
    return RunResult(trainer.global_step, time.perf_counter() - t0, start_step)


def attempt_of(error: BaseException) -> RunResult | None:
    """What a run that raised `error` while training had done (its `global_step` is the last complete
    step: the failure was in the next one); None when it failed before training."""
    return getattr(error, "arealcli_run", None)


def busy_note(policy) -> list[str]:
    """Said once when a fixed thread count computes beside a busy neighbour."""
    if not isinstance(policy, threads.FixedThreads) or policy.other_load < 0.5:
        return []
    return [
        f"other processes are using about {policy.other_load:.1f} cores: this run keeps its "
        f"{policy.threads} torch thread(s) (the same results as alone, more slowly); "
        "trainer.threads: adaptive follows the load instead"
    ]

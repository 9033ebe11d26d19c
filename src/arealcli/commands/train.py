"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR] [--nproc-per-node N ...]`."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import typer

from arealcli.commands.common import console, err_console, fail, load_recipe, say_error
from arealcli.errors import UserError
from arealcli.schema.paths import path_problems

# Written into every run directory this tool creates. `--overwrite` removes only directories that have
# it, so a mistyped `-o` or `experiment` can never delete anything else.
RUN_MARKER = ".arealcli-run"


def run_dir_for(recipe, output_dir: Path | None) -> Path:
    if output_dir is not None:
        return output_dir
    return Path(recipe.output_dir) if recipe.output_dir else Path("runs") / recipe.experiment


def has_results(run_dir: Path) -> bool:
    """Did a run in `run_dir` get anywhere (metrics logged or a checkpoint written)?"""
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return True
    return any((run_dir / "checkpoints").glob("step_*"))


def _protected(run_dir: Path) -> bool:
    """The current directory, any folder above it, and the home folder are never removed."""
    target = run_dir.resolve()
    here = Path.cwd().resolve()
    return target == here or target in here.parents or target == Path.home().resolve()


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Make `run_dir` ready (created, marked as ours), or exit 2 saying why not. Never removes a
    directory this tool did not create."""
    if resume and overwrite:
        raise fail(["--resume and --overwrite exclude each other"])
    if run_dir.exists() and not run_dir.is_dir():
        raise fail([f"run directory {run_dir} is a file; give a directory with --output-dir"])
    if run_dir.is_dir() and any(run_dir.iterdir()) and not resume:
        if not (run_dir / RUN_MARKER).is_file():
            raise fail(
                [
                    f"{run_dir} already exists and was not created by `areal train` (it has no "
                    f"{RUN_MARKER} marker), so nothing in it is touched; pick another directory (--output-dir, "
                    "or another `experiment`) or empty it yourself"
                ]
            )
        if overwrite and _protected(run_dir):
            raise fail(
                [f"--overwrite will not remove {run_dir}: it is the current, a parent or the home folder"]
            )
        if overwrite:
            shutil.rmtree(run_dir)
        elif not has_results(run_dir):  # a run that failed during setup: nothing to lose
            console.print(f"replacing {run_dir}: its run stopped before logging a step", highlight=False)
            shutil.rmtree(run_dir)
        else:
            raise fail(
                [
                    f"run directory {run_dir} already exists. Use --resume to continue it, --overwrite to "
                    "delete it, or --output-dir to pick another"
                ]
            )
    if resume and not (run_dir / "checkpoints").exists():
        raise fail([f"--resume: {run_dir} has no checkpoints to resume from"])
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_MARKER).write_text("a run directory of areal train; --overwrite may remove it\n")
    except OSError as e:
        raise fail([f"cannot use {run_dir} as the run directory: {e.strerror or e}"]) from None


def check_resume(resolved, recipe_dir: Path, run_dir: Path) -> None:
    """--resume with the run's own recipe: refuse a difference that would train something else (listing
    it); allow and record the ones that only change length, logging and connections."""
    import datetime

    import yaml

    from arealcli.schema.resume import differences, with_absolute_paths

    saved_path = run_dir / "recipe.yaml"
    if not saved_path.is_file():
        return  # a run from before recipes were saved: nothing to compare
    saved = yaml.safe_load(saved_path.read_text()) or {}
    now = with_absolute_paths(resolved.model_dump(mode="json"), recipe_dir)
    refused, allowed = differences(saved, now)
    if refused:
        shown = refused[:15] + ([f"... and {len(refused) - 15} more"] if len(refused) > 15 else [])
        raise fail(
            [
                f"--resume: the recipe differs from the run's own ({saved_path}) in what it trains:",
                *(f"  {line}" for line in shown),
                f"resume with the run's recipe (`areal train {saved_path} --resume -o {run_dir}` plus only "
                "the changes allowed on resume: max_steps, logging, eval and save cadence, server "
                "connections), or start a new run (--output-dir)",
            ]
        )
    if allowed:
        history = run_dir / "recipe-history"
        history.mkdir(exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        (history / f"resume-{stamp}.yaml").write_text(
            "# changed on resume:\n"
            + "".join(f"#   {line}\n" for line in allowed)
            + yaml.safe_dump(now, sort_keys=False)
        )
        for line in allowed:
            say_error(f"resuming with a changed setting: {line} (recorded in {history})", title="note")


def data_parallel_size(recipe, world: int) -> int:
    """Ranks that take distinct data: the world over the largest model-parallel group of any model."""
    model_parallel = max(
        getattr(m.backend.args, "tensor_parallel_size", 1)
        * getattr(m.backend.args, "pipeline_parallel_size", 1)
        for m in recipe.models.values()
    )
    return max(1, world // model_parallel)


def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(
        None, help="key.path=value overrides (relative paths in them: from the current directory)."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the run directory's last checkpoint.", metavar=""
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete the existing run directory (one areal train made) first.",
        metavar="",
    ),
    output_dir: Path = typer.Option(
        None, "--output-dir", "-o", help="Run directory (default runs/<experiment>)."
    ),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, help="Worker processes on this node (data-parallel ranks)."
    ),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="Nodes (run the same command on each)."),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="This node's rank, 0..nnodes-1."),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", help="Address of node 0."),
    master_port: int = typer.Option(
        None, "--master-port", help="Rendezvous port on node 0 (default: a free port; 29500 multi-node)."
    ),
) -> None:
    """Train: build the models and run the recipe's dataflow every step."""
    resolved, src = load_recipe(recipe, overrides or [])
    problems = path_problems(resolved, recipe.resolve().parent)
    if problems:
        raise fail([f"{src.where(p.where)}: {'.'.join(map(str, p.where))}: {p.message}" for p in problems])
    run_dir = run_dir_for(resolved, output_dir)
    world = nproc_per_node * nnodes
    if node_rank >= nnodes:
        raise fail([f"--node-rank {node_rank} must be below --nnodes {nnodes}"])
    dp = data_parallel_size(resolved, world)
    if resolved.dataset.batch_size % dp:
        from arealcli.runtime.trainer import batch_size_problem

        raise fail([batch_size_problem(resolved.dataset.batch_size, dp)])
    if node_rank == 0:  # the run directory is node 0's (shared with the other nodes)
        prepare_run_dir(run_dir, resume, overwrite)
        if resume:
            check_resume(resolved, recipe.resolve().parent, run_dir)
    if world == 1:
        return train_here(resolved, recipe, run_dir, resume)

    from arealcli.runtime.launch import LaunchSpec, WorkerJob, launch

    spec = LaunchSpec(nproc_per_node, nnodes, node_rank, master_addr, master_port)
    result = launch(WorkerJob(str(recipe), overrides or [], str(run_dir), resume), spec)
    if result.exit_code != 0:
        if result.error is not None:
            say_error(result.error)
        else:
            err_console.print("interrupted: the last complete checkpoint is kept; continue with --resume")
        raise typer.Exit(result.exit_code)
    console.print(f"done: {result.global_step} steps on {world} processes; run directory {run_dir}")
    if node_rank == 0:
        from arealcli.runtime.progress import header
        from arealcli.runtime.report import summary_lines

        header(console, summary_lines(run_dir))


class Terminated(KeyboardInterrupt):
    """SIGTERM (what Slurm and Kubernetes send): stopped like Ctrl-C."""


class StopSignals:
    """Ctrl-C and SIGTERM stop a run within seconds, whatever they interrupt.

    The first signal raises KeyboardInterrupt (Terminated for SIGTERM) where the main thread is, is
    remembered (the trainer raises it again before its next step, should the exception have been
    swallowed where it landed), and arms a hard exit: a shutdown that hangs (a request stuck in a
    server, a lock held where the interrupt landed) ends after `grace_s` without further cleanup. A
    second signal exits at once. Nothing is lost: checkpoints are written atomically.
    """

    def __init__(self, grace_s: float = 15.0):
        self.grace_s = grace_s
        self.signum: int | None = None

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    @property
    def code(self) -> int:
        return 143 if self.signum == signal.SIGTERM else 130

    def _exception(self) -> KeyboardInterrupt:
        return Terminated() if self.signum == signal.SIGTERM else KeyboardInterrupt()

    def _on_signal(self, signum, frame) -> None:
        import os

        if self.signum is not None:
            os._exit(self.code)  # the second Ctrl-C: now
        self.signum = signum
        self._arm_hard_exit()
        raise self._exception()

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise self._exception()

    def _arm_hard_exit(self) -> None:
        import os
        import threading

        def hard_exit() -> None:
            sys.stderr.write(f"shutdown took over {self.grace_s:.0f} s; exiting without further cleanup\n")
            sys.stderr.flush()
            os._exit(self.code)

        timer = threading.Timer(self.grace_s, hard_exit)
        timer.daemon = True
        timer.start()


def train_here(resolved, recipe: Path, run_dir: Path, resume: bool) -> None:
    import time

    from arealcli.runtime import threads
    from arealcli.runtime.progress import ConsoleProgress, default_metrics, header
    from arealcli.runtime.report import summary_lines
    from arealcli.runtime.trainer import Trainer

    trainer = Trainer(resolved, recipe.resolve().parent, run_dir, resume=resume)
    stop = StopSignals()
    trainer.stop_requested = stop.raise_if_requested
    if threads.enabled():  # torch threads = the cores other processes leave free (re-measured as it runs)
        trainer.thread_policy = threads.ThreadPolicy()
        trainer.thread_policy.measure_now()
    metrics = resolved.trainer.console_metrics or default_metrics(resolved.dataflow.calls)
    t0 = time.perf_counter()
    with ConsoleProgress(console, resolved.experiment, metrics) as progress:
        trainer.progress = progress.update
        stop.install()
        try:
            trainer.setup()
            header(console, trainer.describe(recipe))
            for note in trainer.notes:
                say_error(note, title="note")
            progress.start(trainer.global_step, trainer.total_steps)
            trainer.train()
        except KeyboardInterrupt as e:
            why = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
            code = 143 if isinstance(e, Terminated) else 130
            err_console.print(f"{why}: the last complete checkpoint is kept; continue with --resume")
            raise typer.Exit(code) from None
        except UserError as e:
            raise fail([str(e)]) from None
        finally:
            trainer.close()
            stop.restore()
    console.print(f"done: {trainer.global_step} steps; run directory {run_dir}", highlight=False)
    header(console, summary_lines(run_dir, time.perf_counter() - t0))

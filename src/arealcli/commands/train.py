"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR] [--nproc-per-node N ...]`."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import typer
from rich.text import Text

from arealcli.commands.common import (
    console,
    err_console,
    fail,
    load_recipe,
    overrides_argument,
    recipe_argument,
    say,
    say_error,
)
from arealcli.errors import UserError
from arealcli.runtime.console.progress import header
from arealcli.runtime.run.launch import PREPARED_ENV, RESUME_FLAGS_ENV
from arealcli.runtime.run.session import (
    COMMANDS_LOG,
    RUN_MARKER,
    StopSignals,
    Terminated,
    apply_permissions,
    check_resume,
    data_parallel_size,
    has_results,
    prepare_run_dir,
    restores_umask,
    run_dir_for,
)
from arealcli.schema.paths import path_problems


@dataclass
class Invocation:
    """How this run was started: enough to say the exact command that continues it."""

    recipe: Path
    overrides: list[str]
    run_dir: Path
    default_run_dir: Path
    launch_flags: list[str] = field(default_factory=list)
    resumed: bool = False  # this invocation resumed the run

    def resume_command(self) -> str:
        """The shortest command that continues this run: the same recipe when nothing was changed on
        the command line; else the run's own resolved recipe (overrides included) and its directory,
        or, when this invocation resumed (its overrides, e.g. a longer max_steps, are not in the run's
        recipe), this invocation again."""
        out = ["-o", str(self.run_dir)] if self.run_dir != self.default_run_dir else []
        if not self.overrides and not out:
            args = [str(self.recipe), "--resume"]
        elif self.resumed:
            args = [str(self.recipe), *self.overrides, "--resume", *out]
        else:
            args = [str(self.run_dir / "recipe.yaml"), "--resume", "-o", str(self.run_dir)]
        return shlex.join(["areal", "train", *args, *self.launch_flags])

    def command(self) -> str:
        """This invocation in one order (recipe, overrides, -o, --resume, launch flags; relative paths as
        given; --overwrite left out): what commands.log records."""
        out = ["-o", str(self.run_dir)] if self.run_dir != self.default_run_dir else []
        resume = ["--resume"] if self.resumed else []
        return shlex.join(
            ["areal", "train", str(self.recipe), *self.overrides, *out, *resume, *self.launch_flags]
        )

    def record(self) -> None:
        """Append this command to RUN/commands.log (when, where from, what): the run's own history,
        which `areal export` quotes in the model card."""
        import datetime
        import os

        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        try:
            with open(self.run_dir / COMMANDS_LOG, "a") as f:
                f.write(f"{stamp}  cd {shlex.quote(os.getcwd())} && {self.command()}\n")
        except OSError:
            pass  # a record, never a reason to fail

    def restart_command(self) -> str:
        out = ["-o", str(self.run_dir)] if self.run_dir != self.default_run_dir else []
        return shlex.join(["areal", "train", str(self.recipe), *self.overrides, *out, "--overwrite"])


@dataclass
class ClusterFlags:
    """The command-line flags of `--launcher slurm|ray`."""

    launcher: str
    nnodes: int | None
    nproc_per_node: int
    address: str | None
    wait: bool
    dry_run: bool
    resume: bool
    overwrite: bool

    def argv(self) -> list[str]:
        """The flags that start this job again (in the command a stopped run prints)."""
        out = [f"--launcher={self.launcher}"]
        if self.nnodes is not None:
            out.append(f"--nnodes={self.nnodes}")
        if self.nproc_per_node > 1:
            out.append(f"--nproc-per-node={self.nproc_per_node}")
        if self.address:
            out.append(f"--address={self.address}")
        return out


def _say_stop(lines: list[str]) -> None:
    """The stop message on stderr: the first line wrapped between words in a terminal, the command on
    its own line, never broken (a terminal's own wrap keeps it one line for copying)."""
    say(lines[0], err_console)
    label, _, command = lines[1].partition(": ")
    if err_console.is_terminal and len(lines[1]) > err_console.width >= len(command):
        err_console.print(Text(f"{label}:"))  # the command whole on the next line
        err_console.print(Text(command), soft_wrap=True)
    else:
        err_console.print(Text(lines[1]), soft_wrap=True)


def kept_checkpoint(run_dir: Path) -> tuple[Path, int] | tuple[None, None]:
    """The run's last complete checkpoint and its step (None, None before the first)."""
    from arealcli.runtime.run.checkpoint import latest_checkpoint
    from arealcli.runtime.run.targets import step_of

    kept = latest_checkpoint(run_dir / "checkpoints", cleanup=False)
    return (kept, step_of(kept)) if kept is not None else (None, None)


def stop_message(why: str, job: Invocation) -> list[str]:
    """What an interrupted run says: the checkpoint kept (step and path) and the command that
    continues from it."""
    kept, step = kept_checkpoint(job.run_dir)
    if kept is None:
        return [
            f"{why}: no checkpoint was written yet, so nothing can be resumed",
            f"start again with: {job.restart_command()}",
        ]
    return [
        f"{why}: the last complete checkpoint is kept: step {step}, {kept}",
        f"continue with: {job.resume_command()}",
    ]


def _recover(recovery, failure, job: Invocation) -> bool:
    """Start again from the last checkpoint (say so), or say why not (False)."""
    _, step = kept_checkpoint(job.run_dir)
    why_not = recovery.why_not(failure, step)
    if why_not is not None:
        if step is not None:  # (without a checkpoint the stop message says so)
            failure.hint = "; ".join(x for x in (failure.hint, why_not) if x)
        return False
    say_error(
        f"{failure.what}. Starting again from the checkpoint of step {step} (recovery {recovery.done} of "
        f"at most {recovery.retries}; the traceback: {failure.crash_log})",
        title="recovering",
    )
    return True


def _say_failure(failure, job: Invocation) -> None:
    """A failed run's single screen: what failed, what to do, the checkpoint kept, the command."""
    lines = failure.lines()
    say_error(lines[0])
    for line in lines[1:]:
        say_error(line, title="")
    _say_stop(stop_message("stopped", job))


@restores_umask
def train(
    recipe: Path = recipe_argument(),
    overrides: list[str] = overrides_argument(),
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
        None, "--output-dir", "-o", metavar="DIR", help="Run directory (default runs/<experiment>)."
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Check the recipe, overrides and run directory, say what would run, and stop.",
        metavar="",
    ),
    nproc_per_node: int = typer.Option(
        1, "--nproc-per-node", min=1, metavar="N", help="Worker processes on this node (data-parallel ranks)."
    ),
    nnodes: int = typer.Option(
        None,
        "--nnodes",
        min=1,
        metavar="N",
        help="Nodes: local: run the same command on each; slurm/ray: the job's (default cluster.nodes).",
    ),
    node_rank: int = typer.Option(
        0, "--node-rank", min=0, metavar="N", help="This node's rank, 0..nnodes-1."
    ),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr", metavar="HOST", help="Address of node 0."),
    master_port: int = typer.Option(
        None,
        "--master-port",
        metavar="PORT",
        help="Rendezvous port on node 0 (default: a free port; 29500 multi-node).",
    ),
    launcher: str = typer.Option(
        "local",
        "--launcher",
        metavar="local|slurm|ray",
        help="local: processes on this machine; slurm: submit an sbatch job; ray: run on a Ray cluster "
        "(recipe `cluster:` places servers and trainer by node).",
    ),
    address: str = typer.Option(
        None, "--address", metavar="HOST:PORT", help="--launcher ray: the cluster (default RAY_ADDRESS)."
    ),
    wait: bool = typer.Option(
        False,
        "--wait",
        help="--launcher slurm: follow the job's trainer log until it ends, and exit with its code.",
        metavar="",
    ),
) -> None:
    """Train: build the models and run the recipe's dataflow every step.

    Examples:
    areal train recipes/quickstart.yaml
    areal train recipes/sft-quickstart.yaml trainer.max_steps=40 -o runs/sft-short
    areal train recipes/quickstart.yaml --resume trainer.max_steps=300
    areal train recipes/quickstart-server.yaml --launcher slurm --nnodes 2 --dry-run
    """
    if launcher not in ("local", "slurm", "ray"):
        raise fail([f"--launcher {launcher!r}: choose local, slurm or ray"])
    resolved, src = load_recipe(recipe, overrides or [])
    problems = path_problems(resolved, recipe.resolve().parent)
    if problems:
        raise fail([f"{src.where(p.where)}: {'.'.join(map(str, p.where))}: {p.message}" for p in problems])
    run_dir = run_dir_for(resolved, output_dir)
    apply_permissions(resolved.trainer.permissions)  # before anything is written (workers inherit it)
    if launcher != "local":
        from arealcli.commands.train_cluster import launch_cluster

        flags = ClusterFlags(launcher, nnodes, nproc_per_node, address, wait, dry_run, resume, overwrite)
        job = Invocation(recipe, overrides or [], run_dir, run_dir_for(resolved, None), flags.argv(), resume)
        return launch_cluster(resolved, job, flags)
    nnodes = nnodes or 1
    world = nproc_per_node * nnodes
    if node_rank >= nnodes:
        raise fail([f"--node-rank {node_rank} must be below --nnodes {nnodes}"])
    dp = data_parallel_size(resolved, world)
    if resolved.dataset.batch_size % dp:
        from arealcli.runtime.run.trainer import batch_size_problem

        raise fail([batch_size_problem(resolved.dataset.batch_size, dp)])
    if dry_run:
        return _dry_run(resolved, recipe, run_dir, resume, overwrite)
    launch_flags = [f"--nproc-per-node={nproc_per_node}"] if nproc_per_node > 1 else []
    if nnodes > 1:
        launch_flags += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}"]
    if os.environ.get(RESUME_FLAGS_ENV) is not None:  # started by a cluster launcher: say its command
        launch_flags = shlex.split(os.environ[RESUME_FLAGS_ENV])
    job = Invocation(recipe, overrides or [], run_dir, run_dir_for(resolved, None), launch_flags, resume)
    if node_rank == 0 and os.environ.get(PREPARED_ENV) != "1":  # node 0's (shared with the other nodes)
        try:
            replaced = prepare_run_dir(run_dir, resume, overwrite, resolved.trainer.permissions)
            notes = check_resume(resolved, recipe.resolve().parent, run_dir) if resume else []
        except UserError as e:
            raise fail(e.lines) from None
        if replaced:
            say(replaced)
        job.record()
        for note in notes:
            say_error(note, title="note")
    if world == 1:
        return train_here(resolved, recipe, job, resume)

    from arealcli.runtime.run.failures import Recovery, failure_of
    from arealcli.runtime.run.launch import LaunchSpec, WorkerJob, launch

    spec = LaunchSpec(nproc_per_node, nnodes, node_rank, master_addr, master_port)
    recovery = Recovery(resolved.trainer.recover.mode, resolved.trainer.recover.retries)
    while True:
        result = launch(WorkerJob(str(recipe), overrides or [], str(run_dir), resume), spec)
        if result.exit_code != 1 or result.error is None:
            break
        failure = failure_of(result.error, run_dir)  # a worker failed (exit 2, bad input, is not retried)
        if not _recover(recovery, failure, job) or node_rank != 0:
            _say_failure(failure, job)
            raise typer.Exit(1)
        resume = True
    if result.exit_code != 0:
        if result.error is not None:
            say_error(result.error)
        else:
            why = "terminated (SIGTERM)" if result.exit_code == 143 else "interrupted"
            _say_stop(stop_message(why, job))
        raise typer.Exit(result.exit_code)
    say(f"done: {result.global_step} steps on {world} processes; run directory {run_dir}")
    if node_rank == 0:
        from arealcli.runtime.console.report import summary_lines

        header(console, summary_lines(run_dir))


def train_here(resolved, recipe: Path, job: Invocation, resume: bool) -> None:
    from arealcli.runtime.console.report import summary_lines
    from arealcli.runtime.models import flops
    from arealcli.runtime.run.driver import Display, attempt_of, run
    from arealcli.runtime.run.failures import Recovery, failure_of

    def stopped(e: KeyboardInterrupt) -> None:
        why = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        _say_stop(stop_message(why, job))

    display = Display(console, lambda note: say_error(note, title="note"))
    recovery = Recovery(resolved.trainer.recover.mode, resolved.trainer.recover.retries)
    first_start, spent = None, 0.0  # over the recoveries: this command's steps and training time
    while True:
        try:
            result = run(resolved, recipe, job.run_dir, resume, display, StopSignals(), on_stop=stopped)
            first_start = result.start_step if first_start is None else first_start
            spent += result.elapsed_s
            break
        except KeyboardInterrupt as e:
            raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
        except UserError as e:
            raise fail(e.lines) from None
        except Exception as e:  # noqa: BLE001  (every other failure: one message, or a recovery)
            attempt = attempt_of(e)
            failure = failure_of(e, job.run_dir, attempt.global_step + 1 if attempt else None)
            if attempt is not None:
                first_start = attempt.start_step if first_start is None else first_start
                spent += attempt.elapsed_s
            if not _recover(recovery, failure, job):
                _say_failure(failure, job)
                raise typer.Exit(1) from None
            resume = True
    if result.finished_before:
        say(
            f"nothing to do: {job.run_dir} has already trained all {result.global_step} steps "
            f"(its summary: areal report {shlex.quote(str(job.run_dir))}; to train longer, resume with "
            f"a larger trainer.max_steps=N)"
        )
        return
    steps = result.global_step - (first_start if first_start is not None else result.start_step)
    say(f"done: {steps} steps; run directory {job.run_dir}")
    header(console, summary_lines(job.run_dir, spent, steps, peaks=flops.peaks))


def _dry_run(resolved, recipe: Path, run_dir: Path, resume: bool, overwrite: bool) -> None:
    """What `areal train` would do, without touching anything."""
    if resume and overwrite:
        raise fail(["--resume and --overwrite exclude each other"])
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    if resume and not (run_dir / "checkpoints").is_dir():
        raise fail([f"--resume: {run_dir} has no checkpoints to resume from"])
    if resume and (run_dir / "recipe.yaml").is_file():
        import yaml

        from arealcli.schema.resume import differences, with_absolute_paths

        saved = yaml.safe_load((run_dir / "recipe.yaml").read_text()) or {}
        now = with_absolute_paths(resolved.model_dump(mode="json"), recipe.resolve().parent)
        refused, allowed = differences(saved, now)
        if refused:
            raise fail(
                [f"--resume: the recipe differs from the run's own in what it trains: {x}" for x in refused]
            )
        for line in allowed:
            say_error(f"resuming would change a setting: {line}", title="note")
    if exists and not resume:
        ours = (run_dir / RUN_MARKER).is_file()
        if not ours:
            raise fail(
                [f"{run_dir} already exists and was not created by `areal train`; nothing in it is touched"]
            )
        if has_results(run_dir) and not overwrite:
            raise fail([f"run directory {run_dir} already exists. Use --resume, --overwrite or --output-dir"])
    action = "resume" if resume else "replace" if exists else "create"
    say(
        f"dry run: would {action} {run_dir} and train {resolved.experiment} "
        f"({len(resolved.models)} model(s), {len(resolved.dataflow.calls)} call(s)); nothing was written"
    )

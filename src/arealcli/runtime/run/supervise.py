"""Supervising a run: the attempts of one `areal train`, recovery from the last checkpoint
(`trainer.recover`), and the message that says how to continue a stopped run.

One loop, `supervised`, serves one process (`run_here`) and a worker group (`run_workers`,
`--nproc-per-node`/`--nnodes`); a cluster launcher's nodes run `areal train` again, each supervising
itself, and the launcher prepares the run directory with `prepare` like a local run. Nothing here parses
flags or exits: messages go through a `Voice`, an exit code is a `RunEnded`, bad input a `UserError`.

    start(recipe, job, spec, voice)
      dry run: the run-directory policy with dry_run=True, and what would run
      node 0: prepare (run directory, resume check, commands.log)
      one process: run_here | workers: run_workers   -- each: supervised(attempt, recovery, job, voice)
"""

from __future__ import annotations

import datetime
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from arealcli.errors import UserError
from arealcli.runtime.run.launch import PREPARED_ENV, RESUME_FLAGS_ENV, LaunchSpec
from arealcli.runtime.run.session import (
    COMMANDS_LOG,
    StopSignals,
    Terminated,
    check_resume,
    data_parallel_size,
    prepare_run_dir,
)

if TYPE_CHECKING:
    from rich.console import Console

    from arealcli.runtime.run.failures import Failure, Recovery

T = TypeVar("T")


@dataclass
class Invocation:
    """How this run was started: enough to say the exact command that continues it."""

    recipe: Path
    overrides: list[str]
    run_dir: Path
    default_run_dir: Path
    launch_flags: list[str] = field(default_factory=list)
    resumed: bool = False  # this invocation resumed the run (--resume)
    overwrite: bool = False  # --overwrite: an earlier run in run_dir may be replaced
    dry_run: bool = False  # --dry-run: check and say, write nothing

    def _out(self) -> list[str]:
        return ["-o", str(self.run_dir)] if self.run_dir != self.default_run_dir else []

    def resume_command(self) -> str:
        """The shortest command that continues this run: the same recipe when nothing was changed on
        the command line; else the run's own resolved recipe (overrides included) and its directory,
        or, when this invocation resumed (its overrides, e.g. a longer max_steps, are not in the run's
        recipe), this invocation again."""
        out = self._out()
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
        resume = ["--resume"] if self.resumed else []
        return shlex.join(
            ["areal", "train", str(self.recipe), *self.overrides, *self._out(), *resume, *self.launch_flags]
        )

    def record(self) -> None:
        """Append this command to RUN/commands.log (when, where from, what): the run's own history,
        which `areal export` quotes in the model card."""
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        try:
            with open(self.run_dir / COMMANDS_LOG, "a") as f:
                f.write(f"{stamp}  cd {shlex.quote(os.getcwd())} && {self.command()}\n")
        except OSError:
            pass  # a record, never a reason to fail

    def restart_command(self) -> str:
        return shlex.join(["areal", "train", str(self.recipe), *self.overrides, *self._out(), "--overwrite"])


@dataclass
class ClusterFlags:
    """The command-line flags of `--launcher slurm|ray`."""

    launcher: str
    nnodes: int | None
    nproc_per_node: int
    address: str | None
    wait: bool

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


def local_flags(spec: LaunchSpec) -> list[str]:
    """The launch flags of a local run, for the command that continues it; a cluster launcher's node
    says the launcher's own (it sets RESUME_FLAGS_ENV)."""
    if os.environ.get(RESUME_FLAGS_ENV) is not None:
        return shlex.split(os.environ[RESUME_FLAGS_ENV])
    out = [f"--nproc-per-node={spec.nproc_per_node}"] if spec.nproc_per_node > 1 else []
    if spec.nnodes > 1:
        out += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            f"--master-addr={spec.master_addr}",
        ]
    return out


class RunEnded(Exception):
    """The run ended with exit code `code`; its message has been said."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class Failed(Exception):
    """An attempt failed in a way recovery may answer (not bad input, not a stop signal)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.what)
        self.failure = failure


@dataclass
class Voice:
    """Where supervision speaks: the console the run draws on, one line to stdout, one titled line to
    stderr (`error(line, title)`), and the stop message (its last line the command, never broken)."""

    console: Console
    say: Callable[[str], None]
    error: Callable[..., None]
    stop: Callable[[list[str]], None]

    def note(self, line: str) -> None:
        self.error(line, title="note")


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


def _recover(recovery: Recovery, failure: Failure, job: Invocation, voice: Voice) -> bool:
    """Start again from the last checkpoint (say so), or say why not (False)."""
    _, step = kept_checkpoint(job.run_dir)
    why_not = recovery.why_not(failure, step)
    if why_not is not None:
        if step is not None:  # (without a checkpoint the stop message says so)
            failure.hint = "; ".join(x for x in (failure.hint, why_not) if x)
        return False
    voice.error(
        f"{failure.what}. Starting again from the checkpoint of step {step} (recovery {recovery.done} of "
        f"at most {recovery.retries}; the traceback: {failure.crash_log})",
        title="recovering",
    )
    return True


def _say_failure(failure: Failure, job: Invocation, voice: Voice) -> None:
    """A failed run's single screen: what failed, what to do, the checkpoint kept, the command."""
    lines = failure.lines()
    voice.error(lines[0])
    for line in lines[1:]:
        voice.error(line, title="")
    voice.stop(stop_message("stopped", job))


def supervised(
    attempt: Callable[[bool], T], recovery: Recovery, job: Invocation, voice: Voice, retry: bool = True
) -> T:
    """Run `attempt(resume)` until it returns; after a `Failed` attempt start again from the last
    checkpoint while `recovery` allows (and `retry`: node 0 of a multi-node run only), else say the
    failure and end with exit code 1."""
    resume = job.resumed
    while True:
        try:
            return attempt(resume)
        except Failed as e:
            if not retry or not _recover(recovery, e.failure, job, voice):  # only node 0 says it recovers
                _say_failure(e.failure, job, voice)
                raise RunEnded(1) from None
        resume = True


def _recovery(recipe) -> Recovery:
    from arealcli.runtime.run.failures import Recovery

    return Recovery(recipe.trainer.recover.mode, recipe.trainer.recover.retries)


def _why(code: int) -> str:
    return "terminated (SIGTERM)" if code == 143 else "interrupted"


def check_world(recipe, world: int) -> None:
    """The batch divides over the data-parallel ranks of `world` processes, or UserError."""
    dp = data_parallel_size(recipe, world)
    if recipe.dataset.batch_size % dp:
        from arealcli.runtime.run.trainer import batch_size_problem

        raise UserError(batch_size_problem(recipe.dataset.batch_size, dp))


def prepare(recipe, job: Invocation, voice: Voice) -> None:
    """Before training, once per run (node 0): the run directory made ready by its policy, a resume
    checked against the run's own recipe, this command recorded in commands.log."""
    replaced = prepare_run_dir(job.run_dir, job.resumed, job.overwrite, recipe.trainer.permissions)
    notes = check_resume(recipe, job.recipe.resolve().parent, job.run_dir) if job.resumed else []
    if replaced:
        voice.say(replaced)
    job.record()
    for note in notes:
        voice.note(note)


def check_dry(recipe, job: Invocation, voice: Voice) -> str:
    """`prepare` with dry_run=True: the run-directory policy and the resume check refuse what a run
    would refuse, and nothing is written. Returns what the run would do: create, replace or resume."""
    run_dir = job.run_dir
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    prepare_run_dir(run_dir, job.resumed, job.overwrite, recipe.trainer.permissions, dry_run=True)
    if job.resumed:
        for note in check_resume(recipe, job.recipe.resolve().parent, run_dir, dry_run=True):
            voice.note(note)
    return "resume" if job.resumed else "replace" if exists else "create"


def dry_run(recipe, job: Invocation, voice: Voice) -> None:
    """What `areal train` would do here: `check_dry`, then one line."""
    action = check_dry(recipe, job, voice)
    run_dir = job.run_dir
    voice.say(
        f"dry run: would {action} {run_dir} and train {recipe.experiment} "
        f"({len(recipe.models)} model(s), {len(recipe.dataflow.calls)} call(s)); nothing was written"
    )


def start(recipe, job: Invocation, spec: LaunchSpec, voice: Voice) -> None:
    """`areal train` on this machine: checked, then (dry) said, or prepared (node 0) and supervised in
    one process or a worker group."""
    check_world(recipe, spec.world)
    if job.dry_run:
        return dry_run(recipe, job, voice)
    if spec.node_rank == 0 and os.environ.get(PREPARED_ENV) != "1":  # node 0's (shared with the others)
        prepare(recipe, job, voice)
    if spec.world == 1:
        return run_here(recipe, job, voice)
    return run_workers(recipe, job, spec, voice)


@dataclass
class _Tally:
    """Over the recoveries of one command: the step it started from and its training time."""

    first_start: int | None = None
    spent: float = 0.0

    def add(self, result) -> None:
        self.first_start = result.start_step if self.first_start is None else self.first_start
        self.spent += result.elapsed_s


def run_here(recipe, job: Invocation, voice: Voice) -> None:
    """Train in this process, recovering from failures; say what it did."""
    from arealcli.runtime.console.progress import header
    from arealcli.runtime.console.report import summary_lines
    from arealcli.runtime.models import flops
    from arealcli.runtime.run.driver import Display, attempt_of, run
    from arealcli.runtime.run.failures import failure_of

    def stopped(e: KeyboardInterrupt) -> None:
        voice.stop(stop_message(_why(143 if isinstance(e, Terminated) else 130), job))

    display, tally = Display(voice.console, voice.note), _Tally()

    def attempt(resume: bool):
        try:
            result = run(recipe, job.recipe, job.run_dir, resume, display, StopSignals(), on_stop=stopped)
        except KeyboardInterrupt as e:
            raise RunEnded(143 if isinstance(e, Terminated) else 130) from None
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001  (every other failure: one message, or a recovery)
            done = attempt_of(e)
            failure = failure_of(e, job.run_dir, done.global_step + 1 if done else None)
            if done is not None:
                tally.add(done)
            raise Failed(failure) from None
        tally.add(result)
        return result

    result = supervised(attempt, _recovery(recipe), job, voice)
    if result.finished_before:
        voice.say(
            f"nothing to do: {job.run_dir} has already trained all {result.global_step} steps "
            f"(its summary: areal report {shlex.quote(str(job.run_dir))}; to train longer, resume with "
            f"a larger trainer.max_steps=N)"
        )
        return
    steps = result.global_step - (tally.first_start if tally.first_start is not None else result.start_step)
    voice.say(f"done: {steps} steps; run directory {job.run_dir}")
    header(voice.console, summary_lines(job.run_dir, tally.spent, steps, peaks=flops.peaks))


def run_workers(recipe, job: Invocation, spec: LaunchSpec, voice: Voice) -> None:
    """Train in a group of worker processes on this node, recovering (node 0) from a worker's failure;
    say what they did."""
    from arealcli.runtime.console.progress import header
    from arealcli.runtime.console.report import summary_lines
    from arealcli.runtime.run.failures import failure_of
    from arealcli.runtime.run.launch import WorkerJob, launch

    def attempt(resume: bool):
        result = launch(WorkerJob(str(job.recipe), job.overrides, str(job.run_dir), resume), spec)
        if result.exit_code == 1 and result.error is not None:  # (exit 2, bad input, is not retried)
            raise Failed(failure_of(result.error, job.run_dir))
        return result

    result = supervised(attempt, _recovery(recipe), job, voice, retry=spec.node_rank == 0)
    if result.exit_code != 0:
        if result.error is not None:
            voice.error(result.error)
        else:
            voice.stop(stop_message(_why(result.exit_code), job))
        raise RunEnded(result.exit_code)
    voice.say(f"done: {result.global_step} steps on {spec.world} processes; run directory {job.run_dir}")
    if spec.node_rank == 0:
        header(voice.console, summary_lines(job.run_dir))

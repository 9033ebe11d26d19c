"""The run directory's policy: where a run goes, what may be replaced, what resume may change, and how
a stop signal ends a run. Errors are `UserError`s (exit 2); nothing here prints."""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.wire.auth import CLUSTER_KEY_ENV

# Written into every run directory this tool creates. `--overwrite` removes only directories that have
# it, so a mistyped `-o` or `experiment` can never delete anything else.
RUN_MARKER = ".arealcli-run"
# Every `areal train` of the run, one line each: `TIME  cd DIR && areal train ...`.
COMMANDS_LOG = "commands.log"
# `trainer.permissions`: (the umask of `areal train`, the mode of the run directory). A run's files hold
# its samples, its data's text and its servers' logs: no other user reads them unless told to.
PERMISSIONS = {"private": (0o077, 0o700), "group": (0o027, 0o750)}


def apply_permissions(permissions: str) -> None:
    """Set this process's umask for `trainer.permissions`: every file and folder the run writes from
    here on (by this process, its workers and the servers it launches, which inherit it) is private
    (0600/0700), or readable by the group (0640/0750). Files written outside the run directory meanwhile
    (e.g. a model downloaded into the Hugging Face cache) get the same modes."""
    os.umask(PERMISSIONS[permissions][0])


def restores_umask(command):
    """Wrap a command that calls `apply_permissions`: the caller's umask is back when it returns, so an
    in-process caller (a test, a notebook) keeps its own."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        previous = os.umask(0o077)  # (reading the umask sets it; the safe value meanwhile)
        os.umask(previous)
        try:
            return command(*args, **kwargs)
        finally:
            os.umask(previous)

    return wrapper


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


def prepare_run_dir(
    run_dir: Path, resume: bool, overwrite: bool, permissions: str = "private", dry_run: bool = False
) -> str | None:
    """Make `run_dir` ready (created, marked as ours, its mode per `permissions`: 0700 or 0750, also on
    resume, whatever its mode was), or raise UserError saying why not. Never removes a directory this
    tool did not create. Returns a line to show when it replaced a failed start. `dry_run`: the same
    refusals, nothing removed or written (`areal train --dry-run`)."""
    if resume and overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} is a file; give a directory with --output-dir")
    replaced = None
    if run_dir.is_dir() and any(run_dir.iterdir()) and not resume:
        replaced = _clear(run_dir, overwrite, dry_run)
    if resume and not (run_dir / "checkpoints").is_dir():
        raise UserError(f"--resume: {run_dir} has no checkpoints to resume from")
    if dry_run:
        return replaced
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _set_mode(run_dir, PERMISSIONS[permissions][1])
        (run_dir / RUN_MARKER).write_text("a run directory of areal train; --overwrite may remove it\n")
    except OSError as e:
        raise UserError(f"cannot use {run_dir} as the run directory: {e.strerror or e}") from None
    return replaced


def _set_mode(folder: Path, mode: int) -> None:
    """chmod `folder` to `mode`, keeping its set-group-ID bit (a team folder's files keep its group)."""
    folder.chmod(mode | (folder.stat().st_mode & stat.S_ISGID))


def _clear(run_dir: Path, overwrite: bool, dry_run: bool = False) -> str | None:
    """An existing, non-empty run directory without --resume: removed when ours and allowed (`dry_run`:
    only said)."""
    if not (run_dir / RUN_MARKER).is_file():
        raise UserError(
            f"{run_dir} already exists and was not created by `areal train` (it has no "
            f"{RUN_MARKER} marker), so nothing in it is touched; pick another directory (--output-dir, "
            "or another `experiment`) or empty it yourself"
        )
    if overwrite and _protected(run_dir):
        raise UserError(
            f"--overwrite will not remove {run_dir}: it is the current, a parent or the home folder"
        )
    if overwrite:
        if not dry_run:
            shutil.rmtree(run_dir)
        return None
    if not has_results(run_dir):  # a run that failed during setup: nothing to lose
        if not dry_run:
            shutil.rmtree(run_dir)
        return f"replacing {run_dir}: its run stopped before logging a step"
    raise UserError(
        f"run directory {run_dir} already exists. Use --resume to continue it, --overwrite to "
        "delete it, or --output-dir to pick another"
    )


def check_resume(resolved, recipe_dir: Path, run_dir: Path, dry_run: bool = False) -> list[str]:
    """--resume with the run's own recipe: refuse a difference that would train something else (listing
    it); allow and record the ones that only change length, logging and connections. Returns the notes
    on what changed (`dry_run`: on what would change; nothing recorded)."""
    import yaml

    from arealcli.schema.resume import differences, with_absolute_paths

    saved_path = run_dir / "recipe.yaml"
    if not saved_path.is_file():
        return []  # a run from before recipes were saved: nothing to compare
    saved = yaml.safe_load(saved_path.read_text()) or {}
    now = with_absolute_paths(resolved.model_dump(mode="json"), recipe_dir)
    refused, allowed = differences(saved, now)
    if refused:
        shown = refused[:15] + ([f"... and {len(refused) - 15} more"] if len(refused) > 15 else [])
        raise UserError(
            f"--resume: the recipe differs from the run's own ({saved_path}) in what it trains:",
            *(f"  {line}" for line in shown),
            f"resume with the run's recipe (`areal train {saved_path} --resume -o {run_dir}` plus only "
            "the changes allowed on resume: max_steps, logging, eval and save cadence, server "
            "connections), or start a new run (--output-dir)",
        )
    if dry_run:
        return [f"resuming would change a setting: {line}" for line in allowed]
    if not allowed:
        return []
    history = run_dir / "recipe-history"
    history.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    (history / f"resume-{stamp}.yaml").write_text(
        "# changed on resume:\n"
        + "".join(f"#   {line}\n" for line in allowed)
        + yaml.safe_dump(now, sort_keys=False)
    )
    return [f"resuming with a changed setting: {line} (recorded in {history})" for line in allowed]


def data_parallel_size(recipe, world: int) -> int:
    """Ranks that take distinct data: the world over the largest model-parallel group of any model."""
    model_parallel = max(
        getattr(m.backend.args, "tensor_parallel_size", 1)
        * getattr(m.backend.args, "pipeline_parallel_size", 1)
        for m in recipe.models.values()
    )
    return max(1, world // model_parallel)


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
        self._previous: dict = {}

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
        if self.signum is not None:
            os._exit(self.code)  # the second Ctrl-C: now
        self.signum = signum
        self._arm_hard_exit()
        raise self._exception()

    def raise_if_requested(self) -> None:
        if self.signum is not None:
            raise self._exception()

    def _arm_hard_exit(self) -> None:
        def hard_exit() -> None:
            sys.stderr.write(f"shutdown took over {self.grace_s:.0f} s; exiting without further cleanup\n")
            sys.stderr.flush()
            os._exit(self.code)

        timer = threading.Timer(self.grace_s, hard_exit)
        timer.daemon = True
        timer.start()


# Set by the cluster launchers (runtime/launchers) for the `areal train` they start on each node:
SERVERS_ENV = "AREALCLI_CLUSTER_SERVERS"  # {"model": ["host:port", ...]}: servers they started for it
# and CLUSTER_KEY_ENV (wire/auth, with the other key variables): those servers' key


def given_servers(name: str, backend: Any) -> Any:
    """Model `name`'s backend spec as this process should build it: when a cluster launcher started the
    model's servers on their own nodes (`cluster.allocation`), it connects to them by address instead of
    launching its own (the recipe, and the run's recipe.yaml, keep `launch`)."""
    import json

    addresses = json.loads(os.environ.get(SERVERS_ENV) or "{}").get(name)
    if not addresses:
        return backend
    args = backend.args.model_copy(
        update={
            "launch": False if isinstance(backend.args.launch, bool) else None,
            "addresses": list(addresses),
            "api_key_env": CLUSTER_KEY_ENV,
        }
    )
    return backend.model_copy(update={"args": args})

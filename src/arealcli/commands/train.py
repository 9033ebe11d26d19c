"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR] [--nproc-per-node N ...]`."""

from __future__ import annotations

from pathlib import Path

import typer

from arealcli.commands.common import console, err_console, fail, load_recipe, say_error
from arealcli.errors import UserError
from arealcli.runtime.console.progress import header
from arealcli.runtime.run.session import (
    StopSignals,
    Terminated,
    check_resume,
    data_parallel_size,
    prepare_run_dir,
    run_dir_for,
)
from arealcli.schema.paths import path_problems


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
        from arealcli.runtime.run.trainer import batch_size_problem

        raise fail([batch_size_problem(resolved.dataset.batch_size, dp)])
    if node_rank == 0:  # the run directory is node 0's (shared with the other nodes)
        try:
            replaced = prepare_run_dir(run_dir, resume, overwrite)
            notes = check_resume(resolved, recipe.resolve().parent, run_dir) if resume else []
        except UserError as e:
            raise fail(e.lines) from None
        if replaced:
            console.print(replaced, highlight=False)
        for note in notes:
            say_error(note, title="note")
    if world == 1:
        return train_here(resolved, recipe, run_dir, resume)

    from arealcli.runtime.run.launch import LaunchSpec, WorkerJob, launch

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
        from arealcli.runtime.console.report import summary_lines

        header(console, summary_lines(run_dir))


def train_here(resolved, recipe: Path, run_dir: Path, resume: bool) -> None:
    from arealcli.runtime.console.report import summary_lines
    from arealcli.runtime.run.driver import Display, run

    def stopped(e: KeyboardInterrupt) -> None:
        why = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        err_console.print(f"{why}: the last complete checkpoint is kept; continue with --resume")

    display = Display(console, lambda note: say_error(note, title="note"))
    try:
        result = run(resolved, recipe, run_dir, resume, display, StopSignals(), on_stop=stopped)
    except KeyboardInterrupt as e:
        raise typer.Exit(143 if isinstance(e, Terminated) else 130) from None
    except UserError as e:
        raise fail(e.lines) from None
    console.print(f"done: {result.global_step} steps; run directory {run_dir}", highlight=False)
    header(console, summary_lines(run_dir, result.elapsed_s))

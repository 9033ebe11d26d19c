"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR] [--nproc-per-node N ...]`."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from arealcli.commands.common import console, err_console, fail, load_recipe
from arealcli.schema.paths import missing_paths


def run_dir_for(recipe, output_dir: Path | None) -> Path:
    if output_dir is not None:
        return output_dir
    return Path(recipe.output_dir) if recipe.output_dir else Path("runs") / recipe.experiment


def prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise fail(["--resume and --overwrite exclude each other"])
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        if not overwrite:
            raise fail(
                [
                    f"run directory {run_dir} already exists. Use --resume to continue it, --overwrite to "
                    "delete it, or --output-dir to pick another"
                ]
            )
        shutil.rmtree(run_dir)
    if resume and not (run_dir / "checkpoints").exists():
        raise fail([f"--resume: {run_dir} has no checkpoints to resume from"])


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
    overrides: list[str] = typer.Argument(None, help="key.path=value overrides."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run directory's last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run directory first."),
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
    missing = missing_paths(resolved, recipe.resolve().parent)
    if missing:
        raise fail(
            [f"{src.where(where)}: {'.'.join(map(str, where))}: {message}" for where, message in missing]
        )
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

    from arealcli.runtime.trainer import write_resolved_recipe

    if node_rank == 0:
        write_resolved_recipe(resolved, run_dir)
    if world == 1:
        return train_here(resolved, recipe, run_dir, resume)

    from arealcli.runtime.launch import LaunchSpec, WorkerJob, launch

    spec = LaunchSpec(nproc_per_node, nnodes, node_rank, master_addr, master_port)
    result = launch(WorkerJob(str(recipe), overrides or [], str(run_dir), resume), spec)
    if result.exit_code != 0:
        if result.error is not None:
            err_console.print("[bold red]error:[/] ", end="")
            err_console.print(result.error, markup=False)
        else:
            err_console.print("interrupted: the last complete checkpoint is kept; continue with --resume")
        raise typer.Exit(result.exit_code)
    console.print(f"[green]done[/]: {result.global_step} steps on {world} processes; run directory {run_dir}")


def train_here(resolved, recipe: Path, run_dir: Path, resume: bool) -> None:
    from arealcli.runtime.progress import ConsoleProgress
    from arealcli.runtime.trainer import Trainer

    trainer = Trainer(resolved, recipe.resolve().parent, run_dir, resume=resume)
    with ConsoleProgress(console, resolved.experiment) as progress:
        trainer.progress = progress.update
        try:
            trainer.setup()
            if trainer.resumed_from is not None:
                console.print(f"resuming from {trainer.resumed_from} (step {trainer.global_step})")
            progress.start(trainer.global_step, trainer.total_steps)
            trainer.train()
        except KeyboardInterrupt:
            err_console.print("interrupted: the last complete checkpoint is kept; continue with --resume")
            raise typer.Exit(130) from None
        finally:
            trainer.close()
    console.print(f"[green]done[/]: {trainer.global_step} steps; run directory {run_dir}")

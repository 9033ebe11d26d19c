"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR]`."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from arealcli.commands.common import console, err_console, fail, load_recipe


def run_dir_for(recipe, output_dir: Path | None) -> Path:
    if output_dir is not None:
        return output_dir
    return Path(recipe.output_dir) if recipe.output_dir else Path("runs") / recipe.experiment


def train(
    recipe: Path = typer.Argument(..., help="Recipe YAML file."),
    overrides: list[str] = typer.Argument(None, help="key.path=value overrides."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the run directory's last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run directory first."),
    output_dir: Path = typer.Option(
        None, "--output-dir", "-o", help="Run directory (default runs/<experiment>)."
    ),
) -> None:
    """Train: build the models and run the recipe's dataflow every step."""
    resolved, _ = load_recipe(recipe, overrides or [])
    run_dir = run_dir_for(resolved, output_dir)
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

    from arealcli.runtime.progress import ConsoleProgress
    from arealcli.runtime.trainer import Trainer, write_resolved_recipe

    write_resolved_recipe(resolved, run_dir)
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

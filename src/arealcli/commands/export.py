"""`areal export RUN DIR [--step N] [--model NAME] [--adapter] [--force] [--push-to-hub REPO]`: a run's
checkpoint as a self-contained Hugging Face folder with a model card. DIR is the second argument or
`-o DIR`, as a user types it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from arealcli.commands.common import console, fail, flag
from arealcli.errors import UserError

TRUE = ("1", "ON", "YES", "TRUE")


RunDir = Annotated[
    Path, typer.Argument(metavar="RUN", help="A run directory of areal train (or one of its checkpoints).")
]
OutDir = Annotated[
    Path | None,
    typer.Argument(metavar="DIR", show_default=False, help="The folder to write (new or empty); or -o DIR."),
]
Output = Annotated[
    Path | None, typer.Option("--output", "-o", metavar="DIR", help="The folder to write (new or empty).")
]
Step = Annotated[
    int | None,
    typer.Option("--step", min=0, metavar="N", help="The checkpoint of step N (default: the latest)."),
]
Model = Annotated[
    str | None,
    typer.Option("--model", metavar="NAME", help="Which model (default: the one the recipe generates with)."),
]
Adapter = Annotated[
    bool, flag("--adapter", "LoRA runs: the adapters alone (peft) instead of merged weights.")
]
Force = Annotated[bool, flag("--force", "Replace DIR if an earlier areal export wrote it.")]
PushToHub = Annotated[
    str | None,
    typer.Option(
        "--push-to-hub", metavar="REPO", help="Then upload the folder to this Hub repository (owner/name)."
    ),
]


def export(
    run_dir: RunDir,
    out_dir: OutDir = None,
    output: Output = None,
    step: Step = None,
    model: Model = None,
    adapter: Adapter = False,
    force: Force = False,
    push_to_hub: PushToHub = None,
) -> None:
    """Export a run's checkpoint as a Hugging Face model folder with a model card.

    Examples:
    areal export runs/quickstart exports/quickstart
    areal export runs/quickstart --step 200 --model actor -o exports/qs-200
    areal export runs/qwen-lora --adapter -o exports/qwen-lora-adapter
    areal export runs/quickstart -o exports/qs --push-to-hub me/quickstart
    """
    output = _output(out_dir, output)
    if push_to_hub is not None:
        _check_hub(push_to_hub)
    from arealcli.runtime.run.export import export as write_export
    from arealcli.runtime.run.targets import find_model

    try:
        found = find_model(run_dir, model, step)
        if found.run_dir is None:
            raise UserError(f"{run_dir} is a model folder, not a run directory: there is nothing to export")
        out = write_export(found, output, adapter, force)
    except UserError as e:
        raise fail(e.lines) from None
    what = "adapters" if adapter else "model"
    console.print(
        f"exported {what} {found.model} of {found.run_dir} at step {found.step} to {out} "
        f"(model card: {out / 'README.md'})",
        highlight=False,
        soft_wrap=True,
    )
    if push_to_hub is not None:
        _push(out, push_to_hub)


def _output(positional: Path | None, option: Path | None) -> Path:
    """The folder to write: `areal export RUN DIR` or `-o DIR`, given once."""
    if positional is None and option is None:
        raise fail(["where to: give the folder to write, areal export RUN DIR (or -o DIR)"])
    if positional is not None and option is not None and positional != option:
        raise fail([f"two folders to write ({positional} and -o {option}): give one"])
    return positional if positional is not None else option  # type: ignore[return-value]


def _check_hub(repo: str) -> None:
    """Before anything is written: a valid repository name, and a Hub that can be reached."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError as e:
        raise fail([f"--push-to-hub {repo}: not a repository name (owner/name): {e}"]) from None
    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE:
        raise fail(
            [
                "--push-to-hub: HF_HUB_OFFLINE is set, so nothing can be uploaded and nothing was exported; "
                "export without --push-to-hub (upload the folder later: hf upload REPO DIR), or unset "
                "HF_HUB_OFFLINE"
            ]
        )


def _push(out: Path, repo: str) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo, exist_ok=True)
        info = api.upload_folder(repo_id=repo, folder_path=str(out), commit_message="areal export")
    except Exception as e:  # network, authentication, permissions: the folder itself is complete
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise fail(
            [
                f"--push-to-hub {repo}: the upload failed ({type(e).__name__}: {first}); the folder {out} is "
                f"complete: upload it with `hf upload {repo} {out}` once that is fixed (`hf auth login`)"
            ]
        ) from None
    console.print(f"uploaded {out} to {getattr(info, 'commit_url', repo)}", highlight=False, soft_wrap=True)

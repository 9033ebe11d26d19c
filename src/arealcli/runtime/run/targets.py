"""Which model folder a path means: an HF model folder itself, one checkpoint of a run
(`checkpoints/step_00000250/`), or a run directory (its `checkpoints/LATEST`, or `--step N`); in a
checkpoint, the model named with `--model`, else the one the recipe generates with (a `generate` call's
model, or the trained model it follows), else the only one saved. What `areal chat` and `areal export`
open. Errors are `UserError`s naming what is there instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.run.checkpoint import latest_checkpoint, step_dir_name

CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class ModelCheckpoint:
    """An HF model folder, and where it comes from when it is a run's checkpoint."""

    model_dir: Path
    run_dir: Path | None = None
    step: int | None = None
    model: str | None = None  # the recipe's name for it

    def describe(self) -> str:
        if self.run_dir is None:
            return str(self.model_dir)
        return f"{self.run_dir}: step {self.step}, model {self.model} ({self.model_dir})"


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def step_of(step_dir: Path) -> int:
    return int(step_dir.name.split("_", 1)[1])


def find_model(path: Path, model: str | None = None, step: int | None = None) -> ModelCheckpoint:
    """The model folder `path` means (see the module doc)."""
    if is_model_dir(path):
        if model is not None or step is not None:
            raise UserError(f"{path} is a model folder: --model and --step choose within a run directory")
        return ModelCheckpoint(path)
    if (path / CHECKPOINTS).is_dir():
        return _in_checkpoint(_step_dir(path, step), path, model)
    if path.name.startswith("step_") and path.parent.name == CHECKPOINTS and path.is_dir():
        if step is not None:
            raise UserError(f"{path} is one checkpoint: --step chooses within a run directory")
        return _in_checkpoint(path, path.parent.parent, model)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    raise UserError(
        f"{path} is neither a model folder (no config.json), a run directory of areal train (no "
        f"{CHECKPOINTS}/) nor one of its checkpoints"
    )


def saved_steps(run_dir: Path) -> list[int]:
    root = run_dir / CHECKPOINTS
    return sorted(step_of(p) for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


def _step_dir(run_dir: Path, step: int | None) -> Path:
    root = run_dir / CHECKPOINTS
    steps = saved_steps(run_dir)
    if step is None:
        latest = latest_checkpoint(root, cleanup=False)
        if latest is None:
            raise UserError(
                f"{run_dir} has no complete checkpoint yet (they are written every "
                "trainer.save_every_n_steps steps and at the end of a run)"
            )
        return latest
    chosen = root / step_dir_name(step)
    if not chosen.is_dir():
        kept = ", ".join(map(str, steps)) if steps else "none"
        raise UserError(f"{run_dir} has no checkpoint of step {step} (kept: {kept})")
    return chosen


def run_recipe(run_dir: Path) -> dict[str, Any]:
    """The run's resolved recipe (`recipe.yaml`) as data; {} when there is none or it is unreadable."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _in_checkpoint(step_dir: Path, run_dir: Path, model: str | None) -> ModelCheckpoint:
    saved = sorted(d.name for d in step_dir.iterdir() if is_model_dir(d))
    step = step_of(step_dir)
    if model is not None:
        if model not in saved:
            raise UserError(
                f"{step_dir} holds no model {model!r} (saved: {', '.join(saved) or 'none'}); "
                "only trained models are saved"
            )
        return ModelCheckpoint(step_dir / model, run_dir, step, model)
    chosen = generating_model(run_recipe(run_dir), saved)
    if chosen is None:
        raise UserError(
            f"{step_dir} holds several models ({', '.join(saved)}): pick one with --model NAME"
            if saved
            else f"{step_dir} holds no model folder"
        )
    return ModelCheckpoint(step_dir / chosen, run_dir, step, chosen)


def generating_model(recipe: dict[str, Any], saved: list[str]) -> str | None:
    """The saved model the recipe generates with: a `generate` call's model, or the model whose weights
    it starts from or follows; else the only saved model that is not a critic; else the only saved model
    (a reward model's run). None when ambiguous."""
    models = recipe.get("models") or {}
    for call in generate_calls(recipe):
        name = saved_source(models, call.get("model"), saved)
        if name is not None:
            return name
    policies = [m for m in saved if not (models.get(m) or {}).get("value_head")]
    if len(policies) == 1:
        return policies[0]
    return saved[0] if len(saved) == 1 and not policies else None


def generate_calls(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    calls = (recipe.get("dataflow") or {}).get("calls") or []
    return [c for c in calls if isinstance(c, dict) and c.get("type") == "generate"]


def saved_source(models: dict[str, Any], name: Any, saved: list[str]) -> str | None:
    """`name` if it is saved, else the saved model it follows (`weights_from`) or starts from
    (`init_from`), following the chain; None if none is saved."""
    seen: set[str] = set()
    while isinstance(name, str) and name not in saved and name not in seen:
        seen.add(name)
        spec = models.get(name) or {}
        name = spec.get("weights_from") or spec.get("init_from")
    return name if isinstance(name, str) and name in saved else None

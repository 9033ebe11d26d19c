"""The batch plan of a recipe: prompts x samples per prompt -> minibatches -> optimizer steps.

Runs on a validated recipe only (typed args): a plugin interface's args may lack any of the fields
read here, which then take their neutral value.
"""

from __future__ import annotations

from typing import Any

from arealcli.schema.recipe import CallSpec, Recipe, on_rollout_side
from arealcli.schema.registry import INTERFACES
from arealcli.schema.source import Path_


def samples_per_step(recipe: Recipe) -> tuple[int, int]:
    """(prompts per step, samples per prompt) — n of the first generate call, else 1."""
    n = 1
    for call in recipe.dataflow.calls:
        if call.type == "generate":
            n = _count(getattr(getattr(call.interface.args, "generation", None), "n", 1))
            break
    return recipe.dataset.batch_size, n


def _count(value: Any) -> int:
    """A positive count, or 1 for anything else (a plugin's field of another meaning)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _on_dataset(call: CallSpec) -> bool:
    """Does the call train on the dataset's own sequences (one per prompt, e.g. SFT), not on samples?"""
    entry = INTERFACES.find(call.interface.type_)
    return entry is not None and entry.trains_on_dataset


def _minibatches(call: CallSpec) -> tuple[int, int]:
    args = call.interface.args
    return _count(getattr(args, "n_minibatches", 1)), _count(getattr(args, "sample_reuse", 1))


def plan_lines(recipe: Recipe) -> list[str]:
    prompts, n = samples_per_step(recipe)
    lines = [f"batch: {prompts} prompts x {n} samples = {prompts * n} sequences per step"]
    if recipe.rollout is None:
        lines.append("rollout: synchronous (every call in order, every step)")
    else:
        rollout = [c.name for c in recipe.dataflow.calls if on_rollout_side(c)]
        training = [c.name for c in recipe.dataflow.calls if not on_rollout_side(c)]
        lines.append(
            f"rollout: asynchronous, max_staleness {recipe.rollout.max_staleness} (a batch trains at most "
            f"{recipe.rollout.max_staleness} policy version(s) after the one that started generating it); "
            f"rollout side, ahead on a background thread: {', '.join(rollout)}; "
            f"training side: {', '.join(training) or '-'}"
        )
    for call in recipe.dataflow.calls:
        if call.type != "train_step":
            continue
        mbs, reuse = _minibatches(call)
        size = prompts if _on_dataset(call) else prompts * n
        mb = call.mb_spec
        split = f">= {mb.n_mbs} micro-batch(es)" + (
            f" of <= {mb.max_tokens_per_mb} tokens" if mb.max_tokens_per_mb else ""
        )
        when = ""
        if call.start_step or call.end_step:
            when = f" (steps {call.start_step}..{call.end_step - 1 if call.end_step else 'end'})"
        lines.append(
            f"{call.name}{when}: {size} sequences -> {mbs} minibatch(es) of {size // mbs} x {reuse} pass(es)"
            f" = {mbs * reuse} optimizer step(s) per training step; each minibatch in {split}"
        )
    return lines


def plan_problems(recipe: Recipe) -> list[tuple[Path_, str]]:
    """Divisibility rules: every minibatch gets the same number of sequences."""
    prompts, n = samples_per_step(recipe)
    out: list[tuple[Path_, str]] = []
    for i, call in enumerate(recipe.dataflow.calls):
        if call.type != "train_step" or _on_dataset(call):
            continue
        mbs, _ = _minibatches(call)
        if (prompts * n) % mbs:
            out.append(
                (
                    ("dataflow", "calls", i, "interface", "args", "n_minibatches"),
                    f"{prompts} prompts x {n} samples = {prompts * n} sequences do not split into {mbs} equal "
                    "minibatches; change dataset.batch_size or n_minibatches",
                )
            )
    return out

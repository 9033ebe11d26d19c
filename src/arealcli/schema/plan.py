"""The batch plan of a recipe: prompts x samples per prompt -> minibatches -> optimizer steps.

Runs on a validated recipe only (typed args): a plugin interface's args may lack any of the fields
read here, which then take their neutral value.
"""

from __future__ import annotations

from typing import Any

from arealcli.schema.components.datasets import PAIR
from arealcli.schema.recipe import CallSpec, Recipe, on_rollout_side
from arealcli.schema.registry import INTERFACES, dataset_keys
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


def _pairs(recipe: Recipe) -> bool:
    """Is the dataset one of preference pairs (two sequences per row: chosen, rejected)?"""
    return PAIR in (dataset_keys({"type_": recipe.dataset.type_}) or ())


def plan_lines(recipe: Recipe) -> list[str]:
    prompts, n = samples_per_step(recipe)
    lines = [f"batch: {prompts} prompts x {n} samples = {prompts * n} sequences per step"]
    if _pairs(recipe):
        lines = [
            f"batch: {prompts} pairs = {2 * prompts} sequences per step (each a chosen and a rejected response)"
        ]
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
        size = (2 if _pairs(recipe) else 1) * prompts if _on_dataset(call) else prompts * n
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


def threads_word(threads: int | str) -> str:
    """How the training process's torch threads are set (`trainer.threads`), and how they wait."""
    import os

    count = {
        "auto": "torch threads: the cores it may use, fixed for the run",
        "adaptive": "torch threads follow the free cores",
    }.get(str(threads), f"{threads} torch thread(s)")
    if os.environ.get("OMP_NUM_THREADS"):
        count = f"{os.environ['OMP_NUM_THREADS']} torch thread(s) (OMP_NUM_THREADS)"
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE").lower()
    return f"{count}, waiting {policy}ly (OMP_WAIT_POLICY)"


def placement_lines(recipe: Recipe) -> list[str]:
    """Where each model computes: its scope (the training process, a thread of it, launched servers),
    its cores and GPUs; then which models compute at the same time."""
    from arealcli.schema.checks.placement import compact, model_sides

    def ids(values: list[int] | None, unset: str) -> str:
        return unset if values is None else compact(values)

    lines = []
    for name, spec in recipe.models.items():
        if spec.base_of is not None:
            lines.append(f"{name}: shares {spec.base_of}'s engine")
            continue
        args, kind = spec.backend.args, spec.backend.type_
        scope = getattr(type(args), "placement_scope", None)
        cpus, devices = getattr(args, "cpus", None), getattr(args, "devices", None)
        where = f"cpus {ids(cpus, 'any')}, devices {ids(devices, 'default')}"
        if scope == "process":
            threads = f"{len(cpus)} torch thread(s)" if cpus else threads_word(recipe.trainer.threads)
            lines.append(f"{name} ({kind}): the training process, {where}; {threads}")
        elif scope == "thread":
            n = args.generation_threads()
            lines.append(
                f"{name} ({kind}): a generation thread of the training process, {where}; "
                f"{n or 'default'} torch thread(s)"
            )
        elif scope == "servers" and getattr(args, "addresses", None):
            lines.append(f"{name} ({kind}): servers at {', '.join(args.addresses)} (placed where they run)")
        elif scope == "servers":
            servers = "; ".join(
                f"server {i}: cpus {ids(args.server_cpus(i), 'any')}, devices "
                f"{ids(args.server_devices(i), 'default')}"
                for i in range(args.num_servers)
            )
            lines.append(f"{name} ({kind}): {args.num_servers} launched server process(es): {servers}")
        else:
            lines.append(f"{name} ({kind}): not placed (the backend takes no cpus/devices)")
    sides = model_sides(recipe.dataflow.calls, recipe.rollout is not None)
    if recipe.rollout is None:
        lines.append("synchronous: models compute one after another and may share cores and GPUs")
    else:
        ahead = sorted(n for n, s in sides.items() if "rollout" in s)
        behind = sorted(n for n, s in sides.items() if "training" in s)
        lines.append(
            f"concurrent: {', '.join(ahead) or '-'} (rollout side) beside {', '.join(behind) or '-'} "
            "(training side): their cores and GPUs must differ"
        )
    return lines

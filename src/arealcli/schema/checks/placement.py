"""Placement: every `cpus` / `devices` id exists here, and models that compute at the same time do not
share one.

What runs at the same time: with a `rollout` section, the rollout side (generation, rewards) runs ahead
of the training side, so a model used by rollout-side calls computes beside every model used by
training-side calls. Without one, calls run one after another and models may share cores and GPUs.
Cores must be in this process's affinity (`os.sched_getaffinity`); GPUs are checked against the ones
visible here (CUDA_VISIBLE_DEVICES, else the NVIDIA driver's list), and not at all where none is known.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from arealcli.schema.checks.context import Graph
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import CallSpec, on_rollout_side

KINDS = {"cpus": "core", "devices": "GPU"}
# The cores the training process could use before its placement pinned it (compact form, e.g. "0-3"):
# what launched servers that are not placed themselves run on, rather than the trainer's own cores.
UNPLACED_CPUS_ENV = "AREALCLI_UNPLACED_CPUS"


def model_sides(calls: Iterable[CallSpec], asynchronous: bool) -> dict[str, set[str]]:
    """The sides ("rollout", "training") each model's calls run on; one side for all when synchronous."""
    sides: dict[str, set[str]] = {}
    for c in calls:
        if c.model is not None:
            side = "rollout" if asynchronous and on_rollout_side(c) else "training"
            sides.setdefault(c.model, set()).add(side)
    return sides


def concurrent(a: set[str], b: set[str]) -> bool:
    """Do two models with these sides ever compute at the same time?"""
    return bool(a and b) and (a | b) == {"rollout", "training"}


def usable_cpus() -> set[int] | None:
    """The cores this process may run on; None where the OS does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def visible_gpus() -> int | None:
    """How many GPUs this process sees; None when that is unknown here (no driver, nothing set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")])
    driver = Path("/proc/driver/nvidia/gpus")
    return sum(1 for _ in driver.iterdir()) if driver.is_dir() else None


def compact(ids: Iterable[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i != run[-1] + 1:
            out.append(_run(run))
            run = []
        run.append(i)
    if run:
        out.append(_run(run))
    return ",".join(out)


def parse_ids(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5}."""
    ids: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        ids |= set(range(int(lo), int(hi or lo) + 1))
    return ids


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def placed(g: Graph) -> dict[str, Any]:
    """The validated backend args of every model that places something."""
    out = {}
    for name in g.models:
        args = g.typed.get(("models", name, "backend"))
        if getattr(args, "cpus", None) is not None or getattr(args, "devices", None) is not None:
            out[name] = args
    return out


def check_placement(g: Graph) -> list[Problem]:
    args = placed(g)
    return _unavailable(args, usable_cpus(), visible_gpus()) + _overlaps(g, args)


def _unavailable(args: dict[str, Any], cpus: set[int] | None, gpus: int | None) -> list[Problem]:
    problems = []
    for name, a in args.items():
        for j, core in enumerate(a.cpus or []):
            if cpus is not None and core not in cpus:
                message = (
                    f"core {core} is not available here: this process may run on cores {compact(cpus)} "
                    "(its CPU affinity)"
                )
                problems.append(Problem(("models", name, "backend", "args", "cpus", j), message, core))
        for j, gpu in enumerate(a.devices or []):
            if gpus is not None and gpu >= gpus:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                seen = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "the NVIDIA driver"
                message = f"GPU {gpu} is not visible here: {gpus} GPU(s) visible ({seen}); ids count from 0"
                problems.append(Problem(("models", name, "backend", "args", "devices", j), message, gpu))
    return problems


def _overlaps(g: Graph, args: dict[str, Any]) -> list[Problem]:
    sides = model_sides(g.calls, g.data.get("rollout") is not None)
    names = list(args)
    problems = []
    for i, name in enumerate(names):
        for other in names[:i]:
            if not concurrent(sides.get(name, set()), sides.get(other, set())):
                continue
            for key, kind in KINDS.items():
                shared = set(getattr(args[name], key) or []) & set(getattr(args[other], key) or [])
                if not shared:
                    continue
                gen, train = (name, other) if "rollout" in sides.get(name, set()) else (other, name)
                message = (
                    f"{kind}(s) {compact(shared)} are also placed for model {other!r} "
                    f"(models.{other}.backend.args.{key}), which computes at the same time ({gen!r} "
                    f"generates ahead on the rollout side while {train!r} trains); give each its own"
                )
                problems.append(Problem(("models", name, "backend", "args", key), message, sorted(shared)))
    return problems

"""Checks of an episode workflow's outside pieces before a run starts (`areal check`, `areal train`),
without torch: an environment server to start must be importable from where the run looks (the current
directory, beside the recipe)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any


def workflow_problems(recipe) -> list[str]:
    """`where: problem` for the actor's workflow: an openenv `app` whose module cannot be found."""
    out = []
    for call in recipe.dataflow.calls:
        workflow: Any = getattr(call.interface.args, "workflow", None)
        if workflow is None or workflow.type_ != "openenv" or getattr(workflow.args, "app", None) is None:
            continue
        module = workflow.args.app.split(":", 1)[0]
        app_dir = workflow.args.app_dir
        try:
            if app_dir and app_dir not in sys.path:
                sys.path.insert(0, app_dir)
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package is missing, or the name is not a module's
            found = False
        if not found:
            out.append(
                f"call {call.name!r}: the openenv workflow's app {workflow.args.app!r}: cannot import {module} "
                "(looked in the current directory, beside the recipe and in the installed packages)"
            )
            break  # every call of the actor names the same workflow
    return out

"""What `--resume` may change: the resolved recipe against the one saved in the run directory.

A run directory's `recipe.yaml` is the resolved recipe of the run (presets expanded, defaults filled,
local paths absolute). Resuming with a different algorithm, model, data or optimizer would quietly
train something else, so any difference is refused, except settings that only change how long the run
goes and what it writes: those are allowed and recorded (`recipe-history/`).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any

# dotted paths (fnmatch patterns) that a resumed run may change
SAFE = (
    "trainer.max_steps",
    "trainer.total_train_epochs",
    "trainer.log_every_n_steps",
    "trainer.eval_every_n_steps",
    "trainer.eval_at_start",
    "trainer.samples_every_n_steps",
    "trainer.save_every_n_steps",
    "trainer.keep_last_n_checkpoints",
    "trainer.tensorboard",
    "trainer.permissions",  # who may read the run's files, not what it trains
    "output_dir",
    "models.*.backend.args.addresses",
    "models.*.backend.args.addresses.*",
    "models.*.backend.args.*timeout_s",
    "models.*.backend.args.max_retries",
    "models.*.backend.args.retry_backoff_s",
    "models.*.backend.args.max_concurrent_requests",
    "models.*.backend.args.python",
    "models.*.backend.args.python_executable",
    "models.*.backend.args.num_threads",
    "models.*.backend.args.cpus",  # placement: where it runs, not what it trains
    "models.*.backend.args.cpus.*",
    "models.*.backend.args.devices",
    "models.*.backend.args.devices.*",
)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": [1]}} -> {"a.b.0": 1}; empty containers are kept as values."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(data, list) and data:
        out = {}
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: data}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed) differences, each as `path: saved -> now`."""
    a, b = flatten(saved), flatten(now)
    refused: list[str] = []
    allowed: list[str] = []
    for key in sorted(set(a) | set(b)):
        if a.get(key, "(absent)") == b.get(key, "(absent)"):
            continue
        line = f"{key}: {_short(a.get(key, '(absent)'))} -> {_short(b.get(key, '(absent)'))}"
        (allowed if any(fnmatch.fnmatchcase(key, p) for p in SAFE) else refused).append(line)
    return refused, allowed


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 50 else text[:47] + "..."


def with_absolute_paths(data: dict[str, Any], recipe_dir: Path) -> dict[str, Any]:
    """The resolved recipe (as data) with its local paths made absolute, so the saved copy runs from
    anywhere and compares equal whatever folder the user resumes from."""
    from arealcli.schema.paths import resolve

    def fix(container: Any, key: str) -> None:
        if isinstance(container, dict) and isinstance(container.get(key), str):
            try:
                container[key] = str(resolve(container[key], recipe_dir).resolve())
            except (ValueError, OSError):
                pass  # check reported it

    for spec in (data.get("models") or {}).values():
        fix(spec, "path")
    fix(data.get("tokenizer"), "path")
    for key in ("dataset", "eval_dataset"):
        fix((data.get(key) or {}).get("args"), "path")
    for call in (data.get("dataflow") or {}).get("calls") or []:  # an environment server's module: the
        workflow = ((call.get("interface") or {}).get("args") or {}).get("workflow")  # recipe's folder
        args = workflow.get("args") if isinstance(workflow, dict) else None
        if isinstance(args, dict) and args.get("app") and not args.get("app_dir"):
            args["app_dir"] = str(recipe_dir.resolve())
        if isinstance(args, dict) and args.get("env") and not args.get("env_dir"):  # a verifiers env's
            args["env_dir"] = str(recipe_dir.resolve())
    for key in ("dataset", "eval_dataset"):  # a verifiers taskset's module: the recipe's folder
        args = (data.get(key) or {}).get("args")
        if isinstance(args, dict) and args.get("taskset") and not args.get("taskset_dir"):
            args["taskset_dir"] = str(recipe_dir.resolve())
    return data

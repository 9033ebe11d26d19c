"""verifiers configs (verifiers >= 0.4, `verifiers.v1`), without torch: `areal check` validates a recipe's
tasksets and env with them before anything is built, the `verifiers` dataset and workflow load with them.

A taskset or env is named by its module (`id`): an installed package, one of verifiers' own
(`verifiers.v1.tasksets.*`, `verifiers.v1.envs.*`), or a module beside the recipe. Its config is a
pydantic model the module defines; verifiers validates the recipe's mapping with it, so a missing
required field or a wrong type is named by its path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from arealcli.errors import UserError

HARNESS = "arealcli_chat"  # the in-process chat harness (package arealcli_chat) every role runs by default
INSTALL = "pip install 'arealcli[verifiers]'"


def import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise UserError(
            f"verifiers environments need the verifiers package (>= 0.4): {INSTALL} ({e})"
        ) from None
    return vf


def on_path(*folders: str | Path | None) -> None:
    """Folders a taskset's or env's module may be in, searched first."""
    for folder in reversed([str(f) for f in folders if f]):
        if folder not in sys.path:
            sys.path.insert(0, folder)


def _why(e: Exception) -> str:
    """One line per problem of a pydantic validation error (`loc: message`), else the error's text."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            return "; ".join(
                f"{'.'.join(map(str, err['loc'])) or '(the config)'}: {err['msg']}" for err in errors()
            )
        except (TypeError, KeyError):
            pass
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def taskset_config(taskset: dict[str, Any], folder: str | Path | None = None) -> Any:
    """The taskset's validated config ({id: MODULE, ...its fields})."""
    vf = import_verifiers()
    on_path(folder)
    name = str(taskset.get("id"))
    try:
        return vf.taskset_config_type(name).model_validate(taskset)
    except (ModuleNotFoundError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"verifiers taskset {name!r}: {_why(e)}") from None


def env_config(env: dict[str, Any], folder: str | Path | None = None) -> Any:
    """The env's validated config ({taskset: {id, ...}, id: ENV, ROLE: {...}, ...its fields}); every role
    (a field typed `vf.AgentConfig`) runs the `arealcli_chat` harness in a subprocess-free runtime unless
    the recipe names its own."""
    vf = import_verifiers()
    on_path(folder)
    raw = json.loads(json.dumps(env))  # a copy
    taskset = raw.get("taskset") or {}
    name = f"{taskset.get('id')!r}" + (f" (env {raw['id']!r})" if raw.get("id") else "")
    try:
        cls = vf.env_config_type(str(taskset.get("id")), raw.get("id") or "")
        for role, field in cls.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, vf.AgentConfig):
                seat = raw.setdefault(role, {})
                if isinstance(seat, dict):
                    seat.setdefault("harness", {"id": HARNESS})
                    seat.setdefault("runtime", {"type": "subprocess"})
        return vf.resolve_env_config(raw)
    except (ModuleNotFoundError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"verifiers env of taskset {name}: {_why(e)}") from None


def verifiers_problems(recipe: Any) -> list[str]:
    """`where: problem` for the recipe's verifiers tasksets and env: the package is installed, each module
    imports, each config validates (its required fields given, each of the right type)."""
    wanted: list[tuple[str, Any]] = []
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key, None)
        if spec is not None and spec.type_ == "verifiers":
            wanted.append((f"{key}.args.taskset", spec.args))
    for call in recipe.dataflow.calls:
        workflow: Any = getattr(call.interface.args, "workflow", None)
        if workflow is not None and workflow.type_ == "verifiers":
            wanted.append((f"call {call.name!r}: workflow.args.env", workflow.args))
            break  # every call of the actor names the same workflow
    if not wanted:
        return []
    try:
        import_verifiers()
    except UserError as e:
        return [f"{wanted[0][0]}: {e}"]
    out = []
    for where, args in wanted:
        try:
            if hasattr(args, "taskset"):
                taskset_config(args.taskset, args.taskset_dir)
            else:
                env_config(args.env, args.env_dir)
        except UserError as e:
            out.append(f"{where}: {e}")
    return out

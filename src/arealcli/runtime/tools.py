"""Tools an episode can call: `fn(argument text) -> result text`; a `ToolError` is shown to the model.

Built in:
    calculator   arithmetic parsed with `ast` (never `eval`): + - * / // % ** and parentheses on numbers,
                 with limits on the size of powers and results.
    python       runs the argument as a Python program in a subprocess and returns what it printed: a
                 new session, no network (its own network namespace), an unprivileged user when started
                 as root, and limits on wall time, CPU time, memory, processes, open files and file size.
                 Off unless a workflow enables it (`allow_python: true`); `areal check` refuses it otherwise.

Register your own with `register_tool(name, fn)` (from a module listed in the recipe's `imports:`).
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import math
import operator
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from arealcli.schema.base import NoArgs
from arealcli.schema.registry import TOOLS, Entry

Tool = Callable[[str], str]


class ToolError(Exception):
    """A tool could not answer; its message becomes the tool's output (the episode goes on)."""


def register_tool(name: str, fn: Tool) -> Tool:
    """Register `fn(argument: str) -> str` as a tool named `name`."""
    TOOLS.add(
        Entry(
            name, fn, NoArgs, (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "", fn.__module__
        )
    )
    return fn


def get_tool(name: str) -> Tool:
    return TOOLS.get(name).load()


# ------------------------------------------------------------------ calculator

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPR_CHARS, MAX_EXPONENT, MAX_MAGNITUDE = 200, 64, 1e30


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % ** and parentheses) safely; integers stay exact."""
    text = expression.strip()
    if not text or len(text) > MAX_EXPR_CHARS:
        raise ToolError(f"calculator: give an arithmetic expression of at most {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ToolError(f"calculator: cannot parse {text!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("calculator: the result is not a finite number")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.10g}"
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"calculator: exponents above {MAX_EXPONENT} are refused")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("calculator: division by zero") from None
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ToolError("calculator: the result is out of range")
        return value
    raise ToolError(
        f"calculator: only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}"
    )


# ------------------------------------------------------------------ python executor

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
NOBODY = 65534


def _sandbox(memory_bytes: int, cpu_s: int) -> None:  # runs in the child, before exec
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    if libc.unshare(CLONE_NEWNET if root else CLONE_NEWUSER | CLONE_NEWNET) != 0:
        os._exit(97)  # no network isolation here: refuse to run the code
    limits = {
        resource.RLIMIT_AS: memory_bytes,
        resource.RLIMIT_CPU: cpu_s,
        resource.RLIMIT_NPROC: 32,
        resource.RLIMIT_NOFILE: 64,
        resource.RLIMIT_FSIZE: 1 << 20,
        resource.RLIMIT_CORE: 0,
    }
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))
    if root:  # process limits bind an unprivileged user only
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _world_runnable(path: str) -> bool:
    """Can an unprivileged user run `path` (every folder on the way searchable, the file executable)?"""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    folders = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
    return all(os.stat(f).st_mode & 0o001 for f in folders) and bool(os.stat(real).st_mode & 0o001)


def _interpreter() -> str:
    """This Python, or (started as root, which the sandbox leaves) one the `nobody` user can run."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate) and _world_runnable(candidate):
            return candidate
    raise ToolError("python: no Python interpreter an unprivileged user can run (the sandbox drops root)")


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000) -> str:
    """Run `code` with `python -I` in the sandbox; its stdout (and the last line of an error)."""
    try:
        proc = subprocess.Popen(
            [_interpreter(), "-I", "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd="/tmp",
            env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"},
            preexec_fn=lambda: _sandbox(memory_mb << 20, max(1, math.ceil(timeout_s))),
        )
    except OSError as e:
        raise ToolError(f"python: cannot start ({e.strerror})") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ToolError(f"python: no result within {timeout_s:g} s") from None
    finally:
        _kill_group(proc)  # whatever it started dies with it
    if proc.returncode == 97:
        raise ToolError("python: the network cannot be isolated on this machine, so code is not run")
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit (soft, then hard)
            last = [f"no result within {timeout_s:g} s (its CPU time limit)"]
        elif proc.returncode < 0:
            last = [f"killed by {signal.Signals(-proc.returncode).name}"]
        raise ToolError(f"python: {last[0][:300]}")
    return out.decode(errors="replace")[:max_output_chars].rstrip()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def python_tool(code: str) -> str:
    """Run a Python program in a sandbox (no network, time and memory limits); what it prints."""
    return run_python(code)


def tool_schema(name: str) -> dict[str, Any]:
    """A registered tool as an OpenAI function: one string parameter, named as the tool function's own
    first parameter (the calculator's `expression`, python's `code`)."""
    fn = get_tool(name)
    try:
        param = next(iter(inspect.signature(fn).parameters))
    except (StopIteration, TypeError, ValueError):
        param = "input"
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": TOOLS.get(name).description,
            "parameters": {"type": "object", "properties": {param: {"type": "string"}}, "required": [param]},
        },
    }

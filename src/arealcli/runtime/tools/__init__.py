"""Tools an episode can call: `fn(argument text) -> result text`; a `ToolError` is shown to the model.

Built in:
    calculator   arithmetic parsed with `ast` (never `eval`): + - * / // % ** and parentheses on numbers,
                 with limits on the size of powers and results.
    python       runs the argument as a Python program in a subprocess and returns what it printed: a
                 new session, no network (its own network namespace), an unprivileged user when started
                 as root, limits on wall time, CPU time, memory, processes, open files and file size, and
                 (Landlock, seccomp) writes only in a fresh temporary folder; its output is read as
                 it comes and a program that prints past `max_output_chars` is stopped; see `sandbox.py`.
                 Off unless a workflow enables it (`allow_python: true`); `areal check` refuses it otherwise.

Register your own with `register_tool(name, fn)` (from a module listed in the recipe's `imports:`).
A tool may return a `ToolOutput` instead of text: text and pictures, which a vision-language model sees in
the next turn of a `tool_use` episode (`<image>` in the text marks where each goes; else they come first).

Layer 0 of runtime/__init__.py's table: it imports only folders of lower layers.
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arealcli.runtime.tools.sandbox import SandboxError, run_confined
from arealcli.schema.base import NoArgs
from arealcli.schema.registry import TOOLS, Entry

Tool = Callable[[str], "str | ToolOutput"]


@dataclass
class ToolOutput:
    """A tool's answer with pictures: `images` are PIL images, image bytes, data: URLs or file paths."""

    text: str
    images: list[Any] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


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


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output_chars: int = 2000) -> str:
    """Run `code` with `python -I` in the sandbox (`sandbox.py`); its stdout (and the last line of an
    error)."""
    try:
        return run_confined(code, timeout_s, memory_mb, max_output_chars)
    except SandboxError as e:
        raise ToolError(f"python: {e}") from None


def python_tool(code: str) -> str:
    """Run a Python program in a sandbox (no network, writes only its temporary folder, time and memory
    limits); what it prints."""
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

"""What every command shares: consoles, and loading a recipe or exiting 2 with every problem."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from arealcli.schema.recipe import Recipe
from arealcli.schema.source import Located
from arealcli.schema.validate import RecipeUnusable, load_valid_recipe

# User text (recipe values, file names) is printed literally: no markup, no emoji codes (`:100:`).
console = Console(emoji=False, highlight=False)
err_console = Console(stderr=True, emoji=False, highlight=False, soft_wrap=True)


class Device(str, Enum):
    """Where a local model runs (`--device`)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(str, Enum):
    """A local model's weights and compute dtype (`--dtype`)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def say(line: str, out: Console = console) -> None:
    """One message, literal: in a terminal wrapped between words, elsewhere one line (greppable)."""
    out.print(Text(line), soft_wrap=not out.is_terminal)


def say_error(line: str, title: str = "error") -> None:
    """One message on stderr, `title:` styled, the message itself literal."""
    text = Text.assemble((f"{title}: ", "bold red"), line) if title else Text(line)
    err_console.print(text, soft_wrap=not err_console.is_terminal)  # a terminal: wrapped between words


def say_stop(lines: list[str]) -> None:
    """The stop message on stderr: the first line wrapped between words in a terminal, the command on
    its own line, never broken (a terminal's own wrap keeps it one line for copying)."""
    say(lines[0], err_console)
    label, _, command = lines[1].partition(": ")
    if err_console.is_terminal and len(lines[1]) > err_console.width >= len(command):
        err_console.print(Text(f"{label}:"))  # the command whole on the next line
        err_console.print(Text(command), soft_wrap=True)
    else:
        err_console.print(Text(lines[1]), soft_wrap=True)


def voice():
    """How a supervised run speaks here: the consoles above (runtime/run/supervise.py's Voice)."""
    from arealcli.runtime.run.supervise import Voice

    return Voice(console, say, say_error, say_stop)


def fail(lines: list[str], title: str = "error") -> typer.Exit:
    for line in lines:
        say_error(line, title)
    return typer.Exit(2)


def load_recipe(file: Path, overrides: list[str]) -> tuple[Recipe, Located]:
    """The validated recipe, or exit 2 after printing every problem as file:line:col: path: message."""
    try:
        return load_valid_recipe(file, overrides)
    except RecipeUnusable as e:
        if e.heading:
            err_console.print(Text(e.heading, style="bold red"))
            raise fail(e.lines, title="") from None
        raise fail(e.lines) from None


def flag(name: str, help: str) -> Any:  # a typer.Option, typed as the value it gives
    """An option that takes no value (`--resume`): shown in --help without one."""
    return typer.Option(name, help=help, metavar="")


def recipe_argument() -> Any:  # a typer.Argument, typed as the value it gives
    return typer.Argument(..., metavar="RECIPE", help="Recipe YAML file.", show_default=False)


def overrides_argument() -> Any:
    return typer.Argument(
        None,
        metavar="KEY=VALUE",
        help="Overrides such as trainer.max_steps=100 (relative paths in them: from the current directory).",
        show_default=False,
    )

"""The `areal` command-line application."""

import re

import typer
from typer.core import TyperCommand, TyperGroup

from arealcli import __version__
from arealcli.commands.chat import chat
from arealcli.commands.check import check
from arealcli.commands.eval import eval_
from arealcli.commands.export import export
from arealcli.commands.init import init
from arealcli.commands.list_ import list_
from arealcli.commands.report import report
from arealcli.commands.schema import schema
from arealcli.commands.serve import serve
from arealcli.commands.serve_reward import serve_reward
from arealcli.commands.train import train


def _flag_help(command, ctx):
    """`--help` as the flag it is: shown without a value."""
    option = super(type(command), command).get_help_option(ctx)
    if option is not None:
        option.metavar = ""
    return option


class Command(TyperCommand):
    get_help_option = _flag_help

    def collect_usage_pieces(self, ctx):
        """`RECIPE [KEY=VALUE]...`: a required argument plain, not in braces."""
        return [re.sub(r"^\{(.*)\}", r"\1", p) for p in super().collect_usage_pieces(ctx)]


class Group(TyperGroup):
    get_help_option = _flag_help


app = typer.Typer(
    name="areal",
    cls=Group,
    help="Declarative RL (PPO, GRPO) and SFT training for language models.",
    epilog=(
        "Start with: areal train recipes/quickstart.yaml  (areal COMMAND --help: each command's examples)"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        print(f"areal {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print the version and exit.",
        metavar="",
    ),
) -> None:
    """Declarative RL (PPO, GRPO) and SFT training for language models."""


for name, command in (
    ("train", train),
    ("check", check),
    ("list", list_),
    ("serve", serve),
    ("serve-reward", serve_reward),
    ("report", report),
    ("schema", schema),
    ("init", init),
    ("chat", chat),
    ("export", export),
    ("eval", eval_),
):
    app.command(name, cls=Command)(command)

if __name__ == "__main__":
    app()

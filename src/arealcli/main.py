"""The `areal` command-line application."""

import typer

from arealcli.commands.check import check
from arealcli.commands.init import init
from arealcli.commands.list_ import list_
from arealcli.commands.report import report
from arealcli.commands.schema import schema
from arealcli.commands.serve import serve
from arealcli.commands.train import train

app = typer.Typer(
    name="areal",
    help="Declarative RL (PPO, GRPO) and SFT training for language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("train")(train)
app.command("check")(check)
app.command("list")(list_)
app.command("serve")(serve)
app.command("report")(report)
app.command("schema")(schema)
app.command("init")(init)

if __name__ == "__main__":
    app()

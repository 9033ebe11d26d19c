"""Console progress: a rich progress bar with live metrics on a terminal, log lines otherwise."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from arealcli.runtime.metrics import fmt

HEADLINE = ("loss", "reward", "accuracy", "nll", "grad_norm", "lr")


def headline(stats: dict[str, float]) -> str:
    keys = [k for k in stats if k.split("/")[-1] in HEADLINE or k.startswith("eval/")]
    return fmt(stats, keys)


class ConsoleProgress:
    def __init__(self, console: Console, title: str):
        self.console, self.title = console, title
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = None

    def __enter__(self) -> ConsoleProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def start(self, step: int, total: int) -> None:
        self.task = self.progress.add_task(self.title, total=total, completed=step, metrics="")

    def update(self, step: int, total: int, stats: dict[str, float], log_now: bool = True) -> None:
        line = headline(stats)
        if self.task is not None:
            self.progress.update(self.task, completed=step, metrics=line)
        if log_now and not self.console.is_terminal:
            self.console.print(f"step {step}/{total} {line}", markup=False, highlight=False)

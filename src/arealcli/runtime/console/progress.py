"""What `areal train` prints: a header, a progress line, and the end-of-run summary.

In a terminal: a rich progress bar that always keeps step/total, elapsed time and ETA, followed by a few
chosen metrics (`trainer.console_metrics`, or defaults from the calls: the reward and the held-out
score of an actor, the loss of SFT). Written to a file (Slurm, nohup): one unwrapped line per logged
step, `step 120/250 [0:41 < 0:44] reward=0.52 held-out accuracy=0.73`. Held-out metrics (`eval/...`)
are always labelled as such; the last one is kept on the line between evaluations.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from arealcli.schema.registry import INTERFACES


def default_metrics(calls: Iterable) -> list[str]:
    """The headline metrics of a dataflow: per training call, its reward or its loss; held-out scores."""
    keys: list[str] = []
    for c in calls:
        workflow = getattr(c.interface.args, "workflow", None)
        if c.type == "generate" and workflow is not None:  # episodes: how often the model calls a tool
            keys += [f"{c.name}/episode/tool_call_rate", f"{c.name}/episode/turns"]
        if c.type != "train_step":
            continue
        entry = INTERFACES.find(c.interface.type_)
        if entry is not None and entry.learns_from_rewards:
            keys += [f"{c.name}/reward", f"eval/{c.name}/accuracy"]
        elif entry is not None and entry.value_head:  # a critic
            keys += [f"{c.name}/loss"]
        else:
            keys += [f"{c.name}/loss", f"eval/{c.name}/nll", f"eval/{c.name}/accuracy"]
    return keys


def label(key: str, all_keys: Iterable[str]) -> str:
    """A short, unambiguous label: `actor_train/reward` -> `reward` when no other key ends like it;
    `eval/...` -> `held-out ...`."""
    held_out = key.startswith("eval/")
    bare = key[len("eval/") :] if held_out else key
    name = bare.rsplit("/", 1)[-1]
    clash = [
        k for k in all_keys if k != key and k.rsplit("/", 1)[-1] == name and k.startswith("eval/") == held_out
    ]
    text = bare if clash else name
    return f"held-out {text}" if held_out else text


def clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ConsoleProgress:
    def __init__(self, console: Console, title: str, metrics: list[str] | None = None):
        self.console, self.title = console, title
        self.metrics = list(metrics or [])
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("<"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.task: TaskID | None = None
        self.latest: dict[str, tuple[float, int]] = {}  # key -> (value, step): kept between evaluations
        self.t0 = time.perf_counter()
        self.start_step = 0

    def __enter__(self) -> ConsoleProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def start(self, step: int, total: int) -> None:
        self.t0, self.start_step = time.perf_counter(), step
        self.task = self.progress.add_task(self.title, total=total, completed=step, metrics="")

    def line(self, stats: dict[str, float], step: int) -> str:
        """The chosen metrics of this step; held-out ones from the last evaluation (with its step)."""
        self.latest = {k: v for k, v in self.latest.items() if k.startswith("eval/")}
        for k, v in stats.items():
            if isinstance(v, int | float):
                self.latest[k] = (float(v), step)
        keys = [k for k in self.metrics if k in self.latest]
        parts = []
        for k in keys:
            value, at = self.latest[k]
            held = f" (step {at})" if k.startswith("eval/") and at != step else ""
            parts.append(f"{label(k, keys)}={value:.4g}{held}")
        return "  ".join(parts)

    def update(self, step: int, total: int, stats: dict[str, float], log_now: bool = True) -> None:
        text = self.line(stats, step)
        if self.task is not None:
            self.progress.update(self.task, completed=step, metrics=text)
        if log_now and not self.console.is_terminal:
            elapsed = time.perf_counter() - self.t0
            done = step - self.start_step
            eta = elapsed / done * (total - step) if done > 0 else 0.0
            self.console.print(
                Text(f"step {step}/{total} [{clock(elapsed)} < {clock(eta)}] {text}"), soft_wrap=True
            )


def header(console: Console, lines: list[tuple[str, str]]) -> None:
    """`key   value` lines, printed before training starts (terminal and log file alike)."""
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        console.print(Text.assemble((f"{k:<{width}}  ", "bold"), v), soft_wrap=True)

"""What `areal train` prints while it trains: a header and a progress line.

In a terminal: one live line that fits the terminal's width whatever it is, keeping, in this order,
the experiment name (shortened), step/total, elapsed time < time left, then as many of the chosen
metrics as fit whole (`trainer.console_metrics`, or defaults from the calls: the reward and the
held-out score of an actor, the loss of SFT), and a bar when there is room. Written to a file or a pipe
(Slurm, nohup): one unwrapped line per logged step, `step 120/250 [0:41 < 0:44] reward=0.52  held-out
accuracy=0.73`. Held-out metrics (`eval/...`) are always labelled as such; the last one is kept on the
line between evaluations. The time left comes from per-phase step times (`eta.Eta`); `+` after it
means a phase not reached yet (RL after an SFT warm-up) is counted at the rate seen so far.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable

from rich.console import Console, ConsoleOptions, RenderResult
from rich.live import Live
from rich.text import Text

from arealcli.runtime.console.eta import Eta, Segment, phases_of
from arealcli.runtime.console.text import clock, fit_lines, shorten
from arealcli.schema.registry import INTERFACES

__all__ = ["ConsoleProgress", "ProgressLine", "clock", "default_metrics", "header", "label"]


def default_metrics(calls: Iterable) -> list[str]:
    """The headline metrics of a dataflow, most important first: the rewards of the calls that learn
    from them and the held-out scores (`eval/accuracy`, `eval/reward/<name>`), an agent's tool use,
    the KL to the reference or teacher, then losses (SFT, a critic; dpo with its preference accuracy, held out too) and the held-out NLL
    (`eval/<call>/...` when two calls report one).
    A key ending in `*` stands for every key that starts with the rest."""
    rl: list[str] = []
    tools: list[str] = []
    losses: list[str] = []
    for c in calls:
        workflow = getattr(c.interface.args, "workflow", None)
        if c.type == "generate" and workflow is not None and workflow.type_ == "openenv":  # its steps
            tools += [f"{c.name}/env/steps", f"{c.name}/env/errors"]
        elif c.type == "generate" and workflow is not None:  # episodes: how often the model calls a tool
            tools += [f"{c.name}/episode/tool_call_rate", f"{c.name}/episode/turns"]
        if c.type != "train_step":
            continue
        entry = INTERFACES.find(c.interface.type_)
        if entry is not None and entry.learns_from_rewards:
            rl += [f"{c.name}/reward", "eval/accuracy", "eval/reward/*", f"eval/{c.name}/accuracy"]
            rl += [f"{c.name}/kl_ref"]  # to the reference, or distillation's teacher (its only signal)
        elif entry is not None and entry.trains_on_pairs and entry.value_head:  # a reward model
            losses += [f"{c.name}/loss", f"{c.name}/accuracy", "eval/pairwise_accuracy"]
        elif entry is not None and entry.trains_on_pairs:  # dpo: how often the chosen response wins
            losses += [f"{c.name}/loss", f"{c.name}/rewards/accuracies", "eval/rewards/accuracies"]
        elif entry is not None and entry.value_head:  # a critic
            losses += [f"{c.name}/loss"]
        else:
            losses += [f"{c.name}/loss", "eval/nll", f"eval/{c.name}/nll", "eval/accuracy"]
    return list(dict.fromkeys(rl + tools + losses))


def label(key: str, all_keys: Iterable[str]) -> str:
    """A short, unambiguous label: `actor_train/reward` -> `reward` when no other key ends like it;
    `eval/...` -> `held-out ...`."""
    held_out = key.startswith("eval/")
    bare = key[len("eval/") :] if held_out else key
    name = bare.rsplit("/", 1)[-1]
    clash = [
        k for k in all_keys if k != key and k.rsplit("/", 1)[-1] == name and k.startswith("eval/") == held_out
    ]
    text = bare if clash or (held_out and bare.startswith("reward/")) else name
    return f"held-out {text}" if held_out else text


def times_text(elapsed: float, left: float | None, guess: bool) -> str:
    """`0:41 < 0:44`: elapsed, then the time left (`?` before a step was timed, `+` for a guess)."""
    return f"{clock(elapsed)} < {'?' if left is None else clock(left)}{'+' if guess else ''}"


class ProgressLine:
    """The live line: fits any width, dropping the least important parts first (never cutting a part
    in the middle): the bar, then metrics from the last (a held-out score first loses the step it was
    measured at), then the title shrinks to a few characters."""

    BAR_MAX, BAR_MIN = 24, 8

    def __init__(self, title: str):
        self.title = title
        self.step = self.total = 0
        self.metrics: list[str] = []  # `label=value` parts, most important first
        self.elapsed: Callable[[], float] = lambda: 0.0
        self.left: Callable[[], tuple[float | None, bool]] = lambda: (None, False)

    def render(self, width: int) -> Text:
        count = f"{self.step}/{self.total}"
        times = times_text(self.elapsed(), *self.left())
        core = f"{count} {times}"
        room = max(4, width - len(core) - 1)  # the title shrinks first to make room for metrics...
        title = shorten(self.title, min(len(self.title), max(10, width // 6), room))
        used = len(title) + 1 + len(core)
        metrics: list[str] = []
        for part in self.metrics:
            if used + 2 + len(part) > width:  # without the step of a held-out score, if that fits
                part = re.sub(r" \(step \d+\)$", "", part)
            if used + 2 + len(part) > width:
                break
            metrics.append(part)
            used += 2 + len(part)
        if len(title) < len(self.title):  # ... and takes back what they leave
            title = shorten(self.title, min(room, len(title) + width - used))
            used = len(title) + 1 + len(core) + sum(2 + len(m) for m in metrics)
        bar = min(self.BAR_MAX, width - used - 1)
        line = Text(no_wrap=True, overflow="ellipsis", end="")
        line.append(title, style="bold")
        if bar >= self.BAR_MIN and self.total:
            done = round(bar * min(self.step, self.total) / self.total)
            line.append(" ")
            line.append("━" * done, style="bar.complete" if self.step < self.total else "bar.finished")
            line.append("━" * (bar - done), style="bar.back")
        line.append(" ")
        line.append(count, style="progress.download")
        line.append(" ")
        line.append(times, style="progress.elapsed")
        for part in metrics:
            line.append("  " + part)
        line.truncate(width)
        return line

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # two columns stay free: a `^C` the terminal echoes after the line must not wrap it (the next
        # redraw would then leave a copy of the line behind)
        yield self.render(max(1, options.max_width - 2))


class ConsoleProgress:
    """The progress line of a run in a terminal, or plain lines per logged step elsewhere."""

    def __init__(
        self,
        console: Console,
        title: str,
        metrics: list[str] | None = None,
        calls: Iterable = (),
        eval_every: int | None = None,
        save_every: int | None = None,
        eval_at_start: bool = False,
    ):
        self.console, self.title = console, title
        self.metrics = list(metrics or [])
        self.calls = list(calls)
        self.cadence = (eval_every, save_every, eval_at_start)  # steps that also evaluate or save
        self.view = ProgressLine(title)
        self.view.elapsed = self.elapsed
        self.view.left = self.left
        self.live: Live | None = None
        self.stopped = False
        self.latest: dict[str, tuple[float, int]] = {}  # key -> (value, step): kept between evaluations
        self.eta = Eta([Segment(0, 0, ())])
        self.t0 = self.t_last = time.perf_counter()
        self.left_at_last: tuple[float | None, bool] = (None, False)
        self.start_step = 0

    def __enter__(self) -> ConsoleProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, step: int, total: int) -> None:
        now = time.perf_counter()
        self.t0 = self.t_last = now
        self.start_step = step
        self.view.step, self.view.total = step, total
        self.eta = Eta(phases_of(self.calls, total), *self.cadence)
        self.eta.start(step, now)
        if self.console.is_terminal and not self.stopped:
            self.live = Live(self.view, console=self.console, refresh_per_second=2, transient=False)
            self.live.start()

    def stop(self) -> None:
        """End the live line (idempotent): nothing is drawn after this, whatever is printed next."""
        self.stopped = True
        if self.live is not None:
            self.live.stop()
            self.live = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> tuple[float | None, bool]:
        """Time left: the estimate at the last step, counted down since."""
        left, guess = self.left_at_last
        if left is None:
            return None, False
        return max(0.0, left - (time.perf_counter() - self.t_last)), guess

    def line(self, stats: dict[str, float], step: int) -> list[str]:
        """The chosen metrics of this step; held-out ones from the last evaluation (with its step)."""
        self.latest = {k: v for k, v in self.latest.items() if k.startswith("eval/")}
        for k, v in stats.items():
            if isinstance(v, int | float):
                self.latest[k] = (float(v), step)
        keys = list(dict.fromkeys(k for m in self.metrics for k in self._matching(m)))
        parts = []
        for k in keys:
            value, at = self.latest[k]
            held = f" (step {at})" if k.startswith("eval/") and at != step else ""
            parts.append(f"{label(k, keys)}={value:.4g}{held}")
        return parts

    def _matching(self, metric: str) -> list[str]:
        if metric.endswith("*"):
            return sorted(k for k in self.latest if k.startswith(metric[:-1]))
        return [metric] if metric in self.latest else []

    def update(self, step: int, total: int, stats: dict[str, float], log_now: bool = True) -> None:
        if self.stopped:
            return
        now = time.perf_counter()
        self.eta.record(step, now)
        self.t_last, self.left_at_last = now, self.eta.remaining(step)
        parts = self.line(stats, step)
        self.view.step, self.view.total, self.view.metrics = step, total, parts
        if self.live is not None:
            self.live.refresh()
        elif log_now and not self.console.is_terminal:
            times = times_text(now - self.t0, *self.left_at_last)
            self.console.print(Text(f"step {step}/{total} [{times}] {'  '.join(parts)}"), soft_wrap=True)


def header(console: Console, lines: list[tuple[str, str]]) -> None:
    """`key   value` lines (before training starts, and the summary after it). In a terminal a long
    value wraps at spaces under itself, a path too long for a line is shortened in the middle; in a
    file each stays one line."""
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        if not console.is_terminal:
            console.print(Text.assemble((f"{k:<{width}}  ", "bold"), v), soft_wrap=True)
            continue
        for i, part in enumerate(fit_lines(v, max(20, console.width - width - 2))):
            key = f"{k:<{width}}  " if i == 0 else " " * (width + 2)
            console.print(Text.assemble((key, "bold"), part), soft_wrap=True)

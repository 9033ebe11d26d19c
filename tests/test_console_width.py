"""The console at any width: the progress line at 60/80/120 columns (rich `Console(width=...)`), summary
lines that wrap between words, plain lines when piped, nothing drawn after a stop, and the time left
estimated per phase (SFT warm-up, then RL) on a synthetic run."""

from __future__ import annotations

import io
import random
import re
from types import SimpleNamespace

import pytest
from rich.console import Console

from arealcli.runtime.console.eta import Eta, phases_of
from arealcli.runtime.console.progress import ConsoleProgress, ProgressLine, header
from arealcli.runtime.console.text import fit_lines, shorten

WIDTHS = (60, 80, 120)
METRICS = [
    "reward=0.2773",
    "held-out accuracy=0.6875 (step 120)",
    "held-out nll=0.5404",
    "actor_train/loss=-0.0200",
    "entropy=1.234",
]


def terminal(width: int) -> Console:
    return Console(
        file=io.StringIO(), width=width, force_terminal=True, color_system=None, legacy_windows=False
    )


def rendered(console: Console) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # type: ignore[attr-defined]
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def progress_line(title: str = "quickstart-grpo-with-a-rather-long-experiment-name") -> ProgressLine:
    line = ProgressLine(title)
    line.step, line.total, line.metrics = 137, 250, list(METRICS)
    line.elapsed = lambda: 41.0
    line.left = lambda: (44.0, False)
    return line


@pytest.mark.parametrize("width", WIDTHS)
def test_progress_line_keeps_what_matters_at_any_width(width):
    console = terminal(width)
    console.print(progress_line())
    (line,) = rendered(console)  # one line, never wrapped
    assert len(line) <= width
    assert "137/250 0:41 < 0:44" in line  # step/total, elapsed < time left: always
    assert line.startswith("quick")  # the experiment, shortened to leave room
    shown = [m.split(" (step")[0] for m in METRICS if m.split(" (step")[0] in line]
    assert shown == [m.split(" (step")[0] for m in METRICS[: len(shown)]]  # in order of importance
    parts = line.split("0:44", 1)[1].split("  ")[1:]
    assert all(p in METRICS or p + " (step 120)" in METRICS for p in parts)  # each whole or not at all
    if width >= 80:
        assert "reward=0.2773  held-out accuracy=0.6875" in line
    if width >= 120:
        assert "held-out accuracy=0.6875 (step 120)" in line
    line = progress_line("quickstart")
    line.metrics = METRICS[:1]
    assert "━" in line.render(width)  # room for a bar too


def test_progress_line_short_name_is_kept_and_tiny_widths_keep_the_count():
    line = progress_line("quickstart")
    assert line.render(60).plain.startswith("quickstart ")
    assert "137/250 0:41 < 0:44" in line.render(40).plain
    line.left = lambda: (None, False)
    assert "0:41 < ?" in line.render(80).plain  # before a step was timed
    line.left = lambda: (75.0, True)
    assert "0:41 < 1:15+" in line.render(80).plain  # a guess: a phase not reached yet


@pytest.mark.parametrize("width", WIDTHS)
def test_summary_lines_wrap_between_words_in_a_terminal(width):
    path = "/home/someone/projects/experiments/runs/quickstart-with-a-long-name/checkpoints/step_00000250"
    lines = [
        ("time", "1400 steps in 0:11 this session (18.18 steps/s); run total 1400"),
        ("held-out", "accuracy: final 0.8711 (step 250), best 0.8711 (step 250); at start 0"),
        ("checkpoint", f"{path}  (each model folder loads with from_pretrained)"),
    ]
    console = terminal(width)
    header(console, lines)
    out = rendered(console)
    assert all(len(line) <= width for line in out), out
    words = {w for line in out for w in line.split()}
    for _, value in lines:
        for word in value.split():
            assert word in words or "…" in shorten(word, width - 12), word  # whole, or a shortened path
    assert out[0].startswith("time        1400 steps in 0:11")
    assert all(line.startswith(("time ", "held-out ", "checkpoint ", "            ")) for line in out)


def test_summary_lines_stay_one_line_each_in_a_file():
    console = Console(file=io.StringIO(), width=60)
    value = "accuracy: final 0.8711 (step 250), best 0.8711 (step 250); at start 0.0; reward 0.3 -> 0.67"
    header(console, [("held-out", value)])
    assert console.file.getvalue() == f"held-out  {value}\n"  # type: ignore[attr-defined]


def test_fit_lines_never_splits_a_word():
    text = "a-rather-long-word " * 5 + "short /a/really/long/path/that/cannot/fit/on/one/line/at/all.png"
    lines = fit_lines(text, 24)
    assert all(len(line) <= 24 for line in lines)
    assert lines[0] == "a-rather-long-word"
    assert lines[-1].startswith("/a/really") and lines[-1].endswith("all.png") and "…" in lines[-1]


def calls(warmup: int):
    """The quickstart's dataflow shape: an SFT warm-up call, then the RL calls."""
    return [
        SimpleNamespace(name="sft_warmup", start_step=0, end_step=warmup),
        SimpleNamespace(name="actor_gen", start_step=warmup, end_step=None),
        SimpleNamespace(name="actor_train", start_step=warmup, end_step=None),
    ]


def test_piped_output_is_one_plain_line_per_logged_step():
    console = Console(file=io.StringIO(), width=60)
    progress = ConsoleProgress(console, "quickstart", ["actor_train/reward", "eval/accuracy"], calls(2))
    progress.start(0, 4)
    for step in range(1, 5):
        stats = {"actor_train/reward": 0.25 * step, **({"eval/accuracy": 0.5} if step == 2 else {})}
        progress.update(step, 4, stats, log_now=step % 2 == 0)
    progress.stop()
    lines = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 2
    assert re.fullmatch(r"step 2/4 \[0:00 < 0:00\+?\] reward=0.5  held-out accuracy=0.5", lines[0]), lines[0]
    assert re.fullmatch(r"step 4/4 \[0:00 < 0:00\] reward=1  held-out accuracy=0.5 \(step 2\)", lines[1])


def test_nothing_is_drawn_after_a_stop():
    console = terminal(80)
    progress = ConsoleProgress(console, "quickstart", ["sft/loss"])
    progress.start(0, 10)
    progress.update(1, 10, {"sft/loss": 1.5})
    progress.stop()
    console.print("interrupted: the last complete checkpoint is kept")
    progress.update(2, 10, {"sft/loss": 1.4})
    progress.stop()
    out = rendered(console)
    assert out[-1] == "interrupted: the last complete checkpoint is kept"
    assert "1/10" in out[-2] and not any("2/10" in line for line in out)


def test_phases_cut_where_calls_start_and_stop():
    segments = phases_of(calls(60), 250)
    assert [(s.start, s.end) for s in segments] == [(0, 60), (60, 250)]
    assert segments[0].phase == ("sft_warmup",) and segments[1].phase == ("actor_gen", "actor_train")
    assert [(s.start, s.end) for s in phases_of([SimpleNamespace(name="sft", start_step=0)], 9)] == [(0, 9)]


def quickstart_step_times(seed: int = 0) -> list[float]:
    """A synthetic quickstart: 60 SFT warm-up steps (~0.08 s), then 190 GRPO steps (~0.4 s, slowly
    growing as responses change) — evaluation on 256 held-out prompts at the start and every 20 steps,
    a checkpoint every 50 steps, and noise."""
    rng = random.Random(seed)
    times = []
    for step in range(250):
        t = 0.08 if step < 60 else 0.36 + 0.08 * (step - 60) / 190
        t *= rng.uniform(0.8, 1.25)
        if step == 0:
            t += 1.5  # evaluation before the first step
        if (step + 1) % 20 == 0 or step == 249:
            t += 0.9
        if (step + 1) % 50 == 0:
            t += 0.3
        times.append(t)
    return times


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eta_is_within_30_percent_from_a_fifth_of_the_run_on(seed):
    times = quickstart_step_times(seed)
    total_time = sum(times)
    eta = Eta(phases_of(calls(60), 250), eval_every=20, save_every=50, eval_at_start=True)
    now = 0.0
    eta.start(0, now)
    checked = 0
    for step, t in enumerate(times, start=1):
        now += t
        eta.record(step, now)
        left, at_least = eta.remaining(step)
        truth = total_time - now
        if now >= 0.2 * total_time and step < 250:
            assert not at_least
            assert left is not None and abs(left - truth) <= 0.3 * truth, (step, left, truth)
            checked += 1
        if step == 1:
            assert left is None  # its time includes the evaluation at the start: no rate yet
        elif step <= 60:
            assert at_least  # the RL rate is not known yet: the estimate says it is a guess
    assert checked > 150


def test_one_average_over_both_phases_would_be_far_off():
    """Why phases: the old estimate (elapsed / steps done * steps left) right after the warm-up."""
    times = quickstart_step_times()
    done = sum(times[:70])
    naive = done / 70 * 180
    truth = sum(times[70:])
    assert naive < 0.5 * truth

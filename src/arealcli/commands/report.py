"""`areal report RUN_DIR [RUN_DIR ...]`: the summary of finished runs and their report picture.

One run: redraws RUN_DIR/report.png. Several: one picture with every run overlaid (a color per run),
written to `--output` (default `report.png` in the current directory).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from arealcli.commands.common import console, fail


def report(
    run_dirs: list[Path] = typer.Argument(
        ..., metavar="RUN_DIR", help="Run directories (as written by areal train).", show_default=False
    ),
    output: Path = typer.Option(
        None,
        "--output",
        "-o",
        metavar="PNG",
        help="Picture to write (default: RUN_DIR/report.png for one run, report.png here for several).",
    ),
    labels: list[str] = typer.Option(
        None, "--label", metavar="TEXT", help="A legend label per run, in order (default: folder names)."
    ),
) -> None:
    """Summaries of finished runs and a picture of their metrics (several runs: overlaid).

    Examples:
    areal report runs/quickstart
    areal report runs/quickstart runs/ppo-quickstart -o grpo-vs-ppo.png
    areal report runs/a runs/b --label sync --label async
    """
    problems = [
        f"{d}: no metrics.jsonl (is it a run directory of areal train?)"
        for d in run_dirs
        if not (d / "metrics.jsonl").is_file()
    ]
    if problems:
        raise fail(problems)
    if labels and len(labels) != len(run_dirs):
        raise fail([f"--label given {len(labels)} times for {len(run_dirs)} run directories"])
    from arealcli.runtime.console.progress import header
    from arealcli.runtime.console.report import plot, summary_lines

    out = output or (run_dirs[0] / "report.png" if len(run_dirs) == 1 else Path("report.png"))
    written = plot(run_dirs, out, labels or None)
    for d in run_dirs:
        console.print(Text(str(d), style="bold"))
        header(console, [(k, v) for k, v in summary_lines(d) if k != "report"])
    if written is not None:
        console.print(Text.assemble(("report", "bold"), f"  {written}"))

"""`areal eval`'s table: one target's metrics with their 95% intervals, or several targets side by side,
and a footer that says what the sampled scores mean."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text


def short(label: str, width: int = 40) -> str:
    """A label cut from the left to `width` characters (the end of a path tells targets apart)."""
    return label if len(label) <= width else "…" + label[-(width - 1) :]


COUNTS = ("judge_unparsable",)  # whole numbers, without an interval


def _fmt(name: str, v: float) -> str:
    if name in COUNTS:
        return f"{v:.0f}"
    return f"{v:.1f}" if name == "response_tokens" else f"{v:.3f}"


def eval_table(reports: list[tuple[str, dict[str, Any], list]]) -> list[tuple[Any, bool]]:
    """What to print, in order, each with whether it is printed unwrapped (soft_wrap): (one target) its
    prompt count and a metric/value/interval table; (several) a table of targets by metrics; then the
    footer, when there is one."""
    cols = [m for m in reports[0][1] if not m.endswith("_ci95")]
    out: list[tuple[Any, bool]] = []
    table = Table()
    if len(reports) == 1:
        label, metrics, results = reports[0]
        unit = type(results[0]).UNIT if results else "prompts"  # prompts, or a reward model's pairs
        out.append((Text(f"{label}: {len(results)} {unit}"), True))
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("95% interval", justify="right")
        for m in cols:
            lo, hi = metrics.get(f"{m}_ci95", (None, None))
            interval = "" if lo is None or hi is None else f"{_fmt(m, lo)} .. {_fmt(m, hi)}"
            table.add_row(m, _fmt(m, metrics[m]), interval)
    else:
        table.add_column("target", overflow="fold")
        for m in cols:
            table.add_column(m, justify="right")
        for label, metrics, _ in reports:
            table.add_row(short(label), *(_fmt(m, metrics[m]) for m in cols))
    out.append((table, False))
    note = footer(cols)
    if note:
        out.append((Text(note, style="dim"), False))
    return out


def footer(cols: list[str]) -> str | None:
    """What the sampled scores mean, under the table: avg@k and pass@k differ even at k = 1 (avg@k
    reads the first k samples, pass@k all n), which a reader otherwise takes for a bug."""
    parts = []
    if any(c.startswith("avg@") for c in cols):
        parts.append("avg@k: mean reward of each prompt's first k samples")
    if any(c.startswith("pass@") for c in cols):
        parts.append("pass@k: chance that k of all n samples hold a correct one (unbiased estimator)")
    if any(c.startswith("maj@") for c in cols):
        parts.append("maj@k: majority answer of the first k samples is correct")
    if not parts:
        return None
    tail = "; avg@1 and pass@1 differ by sampling noise" if {"avg@1", "pass@1"} <= set(cols) else ""
    return "; ".join(parts) + tail + "."

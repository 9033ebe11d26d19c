"""The end of a run: a summary on the console and `report.png` in the run directory.

Both read the run directory only (`metrics.jsonl`, `checkpoints/LATEST`), so `areal report RUN_DIR
[RUN_DIR ...]` redraws them for finished runs and overlays several runs in one picture.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

# panel title -> which metric keys go there: a suffix after the last "/" ("reward"), a whole key
# ("timing/step_s"), or "eval/<suffix>" for held-out metrics ("eval/pass@*": every k); "env/*": an
# environment's own numbers (`<call>/env/<name>`, its reward aside). Titles ending in "{}" get a panel per key.
PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("reward (sampled rollouts)", ("reward",)),
    ("held-out accuracy / reward", ("eval/accuracy", "eval/reward", "eval/pairwise_accuracy")),
    ("held-out NLL", ("eval/nll",)),
    ("environment", ("env/*",)),
    ("held-out with samples", ("eval/pass@*", "eval/avg@*", "eval/maj@*")),
    ("loss: {}", ("loss",)),
    ("KL", ("kl_ref", "kl_loss", "approx_kl")),
    ("entropy", ("entropy",)),
    ("response length (tokens)", ("response_len",)),
    ("step time (s)", ("timing/step_s",)),
]
LOWER_IS_BETTER = ("nll", "ppl", "loss")


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _panel_keys(rows: list[dict], patterns: tuple[str, ...]) -> list[str]:
    keys = sorted({k for r in rows for k in r if k != "step"})
    out = []
    for k in keys:
        suffix = k.rsplit("/", 1)[-1]
        for p in patterns:
            if p == "env/*":
                if "/env/" in k and suffix != "reward":
                    out.append(k)
                continue
            wanted = p[len("eval/") :]
            if p.startswith("eval/") and k.startswith("eval/") and p.endswith("*"):
                if suffix.startswith(wanted[:-1]):
                    out.append(k)
            elif p.startswith("eval/") and k.startswith("eval/") and suffix == wanted:
                out.append(k)
            elif "/" in p and not p.startswith("eval/") and k == p:
                out.append(k)
            elif "/" not in p and not k.startswith(("eval/", "timing/")) and suffix == p:
                out.append(k)
    return out


def _panels(runs: list[tuple[Path, list[dict]]]) -> list[tuple[str, list[str]]]:
    """(title, keys) of every panel with data in at least one run."""
    out = []
    for title, patterns in PANELS:
        keys = sorted({k for _, rows in runs for k in _panel_keys(rows, patterns)})
        if not keys:
            continue
        if "{}" in title:  # a panel per key: their scales differ (SFT and PPO losses)
            out += [(title.format(k.rsplit("/", 1)[0]), [k]) for k in keys]
        else:
            out.append((title, keys))
    return out


def summary_lines(
    run_dir: Path,
    elapsed_s: float | None = None,
    session_steps: int | None = None,
    peaks: Callable[[], dict[str, float]] | None = None,
) -> list[tuple[str, str]]:
    """(label, text) lines: this session's time, held-out scores (final and best), reward trend, speed,
    compute, checkpoint, report. `elapsed_s` and `session_steps` are what this process trained (a
    resumed run counts only its own steps; the run total follows). `peaks()` measures the cores' matmul
    peak ({"fp32": FLOP/s, ...}): given, the compute line says the share of it the run achieved."""
    from arealcli.runtime.console.text import clock

    rows = read_metrics(run_dir)
    out: list[tuple[str, str]] = []
    steps = [r["step"] for r in rows]
    total = max(steps) if steps else 0
    done = total if session_steps is None else session_steps
    if elapsed_s and done:
        speed = f"{done / elapsed_s:.2f} steps/s" if done >= elapsed_s else f"{elapsed_s / done:.2f} s/step"
        this = "" if done == total else " this session"
        run_total = "" if done == total else f"; run total {total}"
        out.append(("time", f"{done} steps in {clock(elapsed_s)}{this} ({speed}){run_total}"))
    for key in sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("/ppl")}):
        xs, ys = series(rows, key)
        if not ys:
            continue
        lower = key.rsplit("/", 1)[-1] in LOWER_IS_BETTER
        best = (min if lower else max)(range(len(ys)), key=lambda i: ys[i])
        start = f"; at start {ys[0]:.4g}" if xs[0] == 0 else ""
        out.append(
            (
                "held-out",
                f"{key[5:]}: final {ys[-1]:.4g} (step {xs[-1]}), best {ys[best]:.4g} (step {xs[best]}){start}",
            )
        )
    for key in sorted({k for r in rows for k in r if k.endswith("/reward") and not k.startswith("eval/")}):
        _, ys = series(rows, key)
        if len(ys) >= 2:
            n = max(1, min(10, len(ys) // 4))
            first, last = sum(ys[:n]) / n, sum(ys[-n:]) / n
            out.append(("reward", f"{key}: {first:.3g} (first {n} logged) -> {last:.3g} (last {n})"))
    gen = [
        (r.get("timing/step_s", 0.0), v)
        for r in rows
        for k, v in r.items()
        if k.endswith("/generated_tokens")
    ]
    if gen and sum(t for t, _ in gen) > 0:
        out.append(
            (
                "generation",
                f"{sum(v for _, v in gen) / sum(t for t, _ in gen):.0f} tokens/s per rank (RL steps)",
            )
        )
    out += compute_lines(rows, peaks)
    latest = Path(run_dir) / "checkpoints" / "LATEST"
    if latest.exists():
        ckpt = Path(run_dir) / "checkpoints" / latest.read_text().strip()
        out.append(("checkpoint", f"{ckpt}  (each model folder loads with from_pretrained)"))
    if (Path(run_dir) / "report.png").exists():
        out.append(("report", str(Path(run_dir) / "report.png")))
    return out


def compute_lines(rows: list[dict], peaks: Callable[[], dict[str, float]] | None) -> list[tuple[str, str]]:
    """Achieved model FLOP/s (`perf/<call>_gflop` over `timing/<call>_s`) of the whole steps and of each
    call that computed in the training process, and their share of the measured matmul peak."""
    calls = sorted({k[5:-6] for r in rows for k in r if k.startswith("perf/") and k.endswith("_gflop")})
    if not calls:
        return []
    peak = peaks() if peaks is not None else {}

    def rate(gflop: float, seconds: float) -> str:
        share = f" = {100 * gflop * 1e9 / seconds / peak['fp32']:.1f}% of peak" if "fp32" in peak else ""
        return f"{gflop / seconds:.3g} GFLOP/s{share}"

    def total(key: str, time_key: str) -> tuple[float, float]:
        both = [(r[key], r[time_key]) for r in rows if key in r and r.get(time_key)]
        return sum(g for g, _ in both), sum(t for _, t in both)

    per_call = []
    for name in calls:
        gflop, seconds = total(f"perf/{name}_gflop", f"timing/{name}_s")
        if seconds > 0:
            per_call.append(f"{name} {rate(gflop, seconds)}")
    steps = [r for r in rows if r.get("timing/step_s") and any(f"perf/{c}_gflop" in r for c in calls)]
    gflop = sum(r.get(f"perf/{c}_gflop", 0.0) for r in steps for c in calls)
    seconds = sum(r["timing/step_s"] for r in steps)
    out = [("compute", f"whole steps {rate(gflop, seconds)}; " + ", ".join(per_call))] if seconds else []
    if peak:
        measured = ", ".join(f"{k} {v / 1e9:.3g} GFLOP/s" for k, v in peak.items())
        out.append(
            ("peak", f"matmul on these cores, measured after the run: {measured} (model FLOPs vs fp32)")
        )
    return out


def plot(run_dirs: list[Path], out: Path, labels: list[str] | None = None) -> Path | None:
    """One PNG of the panels that have data, every run overlaid (a color per run). None when no run
    has metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(Path(d))) for d in run_dirs]
    runs = [(d, rows) for d, rows in runs if rows]
    if not runs:
        return None
    labels = labels or [d.name for d, _ in runs]
    panels = _panels(runs)
    cols = 3 if len(panels) > 4 else 2
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    for ax, (title, keys) in zip(axes.flat, panels, strict=False):
        for r, ((_, rows), name) in enumerate(zip(runs, labels, strict=True)):
            for j, key in enumerate(keys):
                xs, ys = series(rows, key)
                if not ys:
                    continue
                tag = key[5:] if key.startswith("eval/") else key
                marker = "o" if key.startswith("eval/") or len(xs) < 30 else None
                ax.plot(
                    xs,
                    ys,
                    styles[j % len(styles)],
                    color=colors[r % len(colors)],
                    marker=marker,
                    markersize=3,
                    linewidth=1.2,
                    label=f"{name}: {tag}" if len(runs) > 1 else tag,
                )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(" vs ".join(labels) if len(runs) > 1 else f"run {labels[0]}", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

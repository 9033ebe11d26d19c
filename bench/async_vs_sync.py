"""Synchronous vs asynchronous RL on the quickstart task, in one run on the same machine.

Each configuration is a whole `areal train` run (a subprocess, one at a time): the SFT warm-up, then
GRPO, held-out evaluation every 20 steps. Reported per run:

    RL step/s       1 / mean step time over the RL steps (generation, reward, training, weight sync;
                    in the async runs generation overlaps training, so a step is what the trainer waits)
    vs base         the RL step rate relative to the baseline run (--baseline, default sync)
    to base acc     training time (sum of step times, evaluation excluded) until held-out accuracy first
                    reaches the baseline run's final accuracy ("-" if never)
    final acc       held-out greedy accuracy at the last step
    lag 0/1/2/...   share of trained samples generated k policy versions before the trainer's

    python bench/async_vs_sync.py                    # sync, async K=2, K=4 with and without decoupling
    python bench/async_vs_sync.py --steps 120 --only sync "async K=2"
    python bench/async_vs_sync.py --baseline "sync placed" --only "async K=2 placed"   # two cores split

Runs use the shipped recipes (recipes/quickstart.yaml, recipes/quickstart-async.yaml) with overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYNC = ROOT / "recipes" / "quickstart.yaml"
ASYNC = ROOT / "recipes" / "quickstart-async.yaml"
PLAIN = ["dataflow.actor.use_decoupled_loss=false", "dataflow.actor.behav_imp_weight_cap=null"]

RECOMPUTE = ["dataflow.actor.prox_logp_method=recompute"]  # a forward pass for the proximal log-probs
LOGLINEAR = ["dataflow.actor.prox_logp_method=loglinear"]  # none: interpolated by version
# Placement on two cores: the trainer's threads on core 0, the generator (`local`: its thread) on core 1.
PLACED = ["models.actor.backend.args.cpus=[0]", "models.actor_gen.backend.args.cpus=[1]"]
SYNC_PLACED = ["rollout=null", *PLACED]  # the async recipe run synchronously, with the same placement

CONFIGS: dict[str, tuple[Path, list[str]]] = {
    "sync": (SYNC, []),
    "async K=0": (ASYNC, ["rollout.max_staleness=0"]),
    "async K=2": (ASYNC, []),  # the shipped recipe
    "async K=2 recompute": (ASYNC, RECOMPUTE),
    "async K=2 loglinear": (ASYNC, LOGLINEAR),
    "async K=2 plain": (ASYNC, PLAIN),
    "async K=4": (ASYNC, ["rollout.max_staleness=4"]),
    "async K=4 plain": (ASYNC, ["rollout.max_staleness=4", *PLAIN]),
    "sync placed": (ASYNC, SYNC_PLACED),
    "async K=2 placed": (ASYNC, PLACED),
    "async K=2 recompute placed": (ASYNC, [*RECOMPUTE, *PLACED]),
    "async K=2 loglinear placed": (ASYNC, [*LOGLINEAR, *PLACED]),
}
DEFAULT = ["sync", "async K=2", "async K=2 recompute", "async K=4 plain"]


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def run(name: str, recipe: Path, overrides: list[str], steps: int, out: Path) -> dict:
    run_dir = out / name.replace(" ", "_").replace("=", "")
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(recipe), *overrides]
    cmd += [f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1", "trainer.save_every_n_steps=null"]
    cmd += ["trainer.samples_every_n_steps=null", "-o", str(run_dir)]
    b0, t0 = cpu_busy()
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    b1, t1 = cpu_busy()
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "actor_train/reward" in r]
    clock, evals = 0.0, []  # (training time so far, held-out accuracy)
    for r in rows:
        clock += r.get("timing/step_s", 0.0)
        if "eval/accuracy" in r:
            evals.append((clock, r["eval/accuracy"]))
    hist: dict[int, float] = {}
    for r in rl:
        for k, v in r.items():
            if k.startswith("actor_train/version_lag_hist/"):
                lag = int(k.rsplit("/", 1)[1])
                hist[lag] = hist.get(lag, 0.0) + v / len(rl)
    return {
        "name": name,
        "rl_steps": len(rl),
        "step_s": sum(r["timing/step_s"] for r in rl) / len(rl),
        "wall_s": wall,
        "cores": (b1 - b0) / (t1 - t0) * (os.cpu_count() or 1),
        "evals": evals,
        "final_acc": evals[-1][1] if evals else float("nan"),
        "lag_hist": hist,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=250, help="Training steps (60 of them SFT warm-up).")
    p.add_argument("--only", nargs="+", default=DEFAULT, choices=list(CONFIGS), help="Configurations.")
    p.add_argument(
        "--baseline", default="sync", choices=list(CONFIGS), help="What the others are compared with."
    )
    args = p.parse_args()
    names = list(dict.fromkeys([args.baseline, *args.only]))  # the baseline first
    results = []
    with tempfile.TemporaryDirectory(prefix="async-bench-") as tmp:
        for name in names:
            recipe, overrides = CONFIGS[name]
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results.append(run(name, recipe, overrides, args.steps, Path(tmp)))
    base = results[0]
    target = base["final_acc"]
    width = max(len(n) for n in names) + 2
    print(f"{'config':<{width}}{'RL steps':>9}{'RL step/s':>10}{'vs base':>8}{'wall s':>8}{'cores':>6}"
          f"{'to base acc':>12}{'final acc':>10}  lag histogram (share of samples at lag 0, 1, ...)")  # fmt: skip
    for r in results:
        reach = next((t for t, acc in r["evals"] if acc >= target - 1e-9), None)
        hist = " ".join(f"{k}:{v:.2f}" for k, v in sorted(r["lag_hist"].items())) or "-"
        print(
            f"{r['name']:<{width}}{r['rl_steps']:>9}{1 / r['step_s']:>10.2f}{base['step_s'] / r['step_s']:>7.2f}x"
            f"{r['wall_s']:>8.1f}{r['cores']:>6.2f}{(f'{reach:.1f} s' if reach is not None else '-'):>12}"
            f"{r['final_acc']:>10.3f}  {hist}"
        )
    print(
        f"(base: {names[0]}; cores: average busy CPUs of the whole machine during the run, of {os.cpu_count()})"
    )
    print(f"(cores: average busy CPUs of the whole machine during the run, of {os.cpu_count()})")


if __name__ == "__main__":
    main()

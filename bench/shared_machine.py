"""Training steps alone, beside a competing CPU load, and two trainings at once, in one run.

A shared machine (a laptop with a browser, a CI runner, a node with a neighbour) takes cores away at
random. torch's OpenMP threads wait for each other at every parallel region; threads that spin while
they wait burn the time slices the other process needs, so a step can take many times longer than the
lost cores explain. This measures it:

    for each setting: `areal train` alone; then beside `--busy` pure-Python busy loops, or (`--pair`)
    next to a second copy of itself started at the same moment; median step time after `--skip` steps;
    slowdown = loaded / alone (two processes sharing the cores fairly: 2.0x with --pair).

Settings (environment of the training processes): `passive` (what `areal train` does: OMP_WAIT_POLICY=
PASSIVE, threads sleep while they wait; the count fixed at the cores), `spinning` (GOMP_SPINCOUNT=300000:
torch's own OpenMP default, about 3 ms of spinning at every wait, what `areal train` did before) and
`1 thread` (OMP_NUM_THREADS=1).

    python bench/shared_machine.py                      # sft-quickstart, 40 steps, one busy process
    python bench/shared_machine.py --recipe recipes/quickstart.yaml --steps 90 --skip 65 --pair
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "passive": {},  # the default (arealcli sets OMP_WAIT_POLICY=PASSIVE)
    "spinning": {"GOMP_SPINCOUNT": "300000"},  # libgomp's default when no policy is set
    "short spin": {"GOMP_SPINCOUNT": "20000"},  # about 0.2 ms of spinning, then sleep
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def start(recipe: Path, steps: int, env: dict[str, str], out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(recipe), f"trainer.max_steps={steps}"]
    cmd += ["trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=null", "trainer.eval_at_start=false"]
    cmd += ["trainer.save_every_n_steps=null", "trainer.samples_every_n_steps=null", "-o", str(out)]
    return subprocess.Popen(
        cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def median_step(proc: subprocess.Popen, out: Path, skip: int) -> float:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["timing/step_s"] for r in rows[skip:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "sft-quickstart.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="First steps left out of the median.")
    p.add_argument("--busy", type=int, default=1, help="Competing busy processes.")
    p.add_argument("--pair", action="store_true", help="Two copies of the training at once (no busy loops).")
    p.add_argument("--only", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = p.parse_args()
    load = "a second copy of itself" if args.pair else f"{args.busy} busy process(es)"
    print(f"{args.recipe.name}, {args.steps} steps, {os.cpu_count()} CPUs, beside {load}")
    print(f"{'setting':<10}{'alone ms':>10}{'loaded ms':>20}{'slowdown':>16}")
    with tempfile.TemporaryDirectory(prefix="shared-bench-") as tmp:
        for name in args.only:
            env, out = SETTINGS[name], Path(tmp) / name
            alone = median_step(start(args.recipe, args.steps, env, out / "alone"), out / "alone", args.skip)
            if args.pair:
                procs = [start(args.recipe, args.steps, env, out / f"pair{i}") for i in (0, 1)]
                loaded = [median_step(pr, out / f"pair{i}", args.skip) for i, pr in enumerate(procs)]
            else:
                hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
                try:
                    time.sleep(0.5)
                    proc = start(args.recipe, args.steps, env, out / "loaded")
                    loaded = [median_step(proc, out / "loaded", args.skip)]
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
            ms = " / ".join(f"{x * 1000:.1f}" for x in loaded)
            slow = " / ".join(f"{x / alone:.2f}x" for x in loaded)
            print(f"{name:<10}{alone * 1000:>10.1f}{ms:>20}{slow:>16}")


if __name__ == "__main__":
    main()

"""The quickstart's training steps alone and beside a competing CPU load, in one run.

A shared machine (a laptop with a browser, a CI runner, a node with a neighbour) takes cores away at
random. torch's OpenMP threads then wait at every barrier for a peer the OS has descheduled, spinning
while they wait: a step can take many times longer than the lost cores explain. This measures it:

    for each setting: `areal train` alone, then beside N busy processes (pure-Python loops, one per
    `--busy`); median step time of the steps after the first few; slowdown = loaded / alone.

Settings (environment of the training process): `default` (what `areal train` does on its own: torch
threads follow the cores other processes leave free), `fixed` (torch's own choice, one thread per core
whatever the load: what it did before) and `1 thread`.

    python bench/shared_machine.py                      # sft-quickstart, 40 steps, one busy process
    python bench/shared_machine.py --recipe recipes/quickstart.yaml --steps 80 --busy 1
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
    "default": {},  # threads follow the free cores (runtime/threads.py)
    "fixed": {"AREALCLI_THREAD_POLICY": "off"},  # torch's own choice: one thread per core, always
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
BUSY = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass\n"


def run(recipe: Path, steps: int, env: dict[str, str], out: Path, skip: int) -> float:
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(recipe), f"trainer.max_steps={steps}"]
    cmd += ["trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=null", "trainer.eval_at_start=false"]
    cmd += ["trainer.save_every_n_steps=null", "trainer.samples_every_n_steps=null", "-o", str(out)]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["timing/step_s"] for r in rows[skip:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "sft-quickstart.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="First steps left out of the median.")
    p.add_argument("--busy", type=int, default=1, help="Competing busy processes.")
    p.add_argument("--only", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = p.parse_args()
    print(f"{args.recipe.name}, {args.steps} steps, {os.cpu_count()} CPUs, {args.busy} busy process(es)")
    print(f"{'setting':<10}{'alone ms':>10}{'loaded ms':>11}{'slowdown':>10}")
    with tempfile.TemporaryDirectory(prefix="shared-bench-") as tmp:
        for name in args.only:
            env = SETTINGS[name]
            alone = run(args.recipe, args.steps, env, Path(tmp) / f"{name}-alone", args.skip)
            hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
            try:
                time.sleep(0.5)
                loaded = run(args.recipe, args.steps, env, Path(tmp) / f"{name}-loaded", args.skip)
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            print(f"{name:<10}{alone * 1000:>10.1f}{loaded * 1000:>11.1f}{loaded / alone:>9.2f}x")


if __name__ == "__main__":
    main()

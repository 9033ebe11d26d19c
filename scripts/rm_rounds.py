"""Reward-model rounds for the RLHF quickstart: mine and train again until the top answer is right.

Round 1 is recipes/rm-quickstart.yaml's run. Each further round N scores every two-digit answer of each
train prompt with the newest model (scripts/mine_hard_pairs.py), adds its three top-scored wrong answers
to round N-1's pairs (data/arith-pairs-rN/train.jsonl) and trains the newest model on them with
recipes/rm-round2.yaml (runs/rm-roundN, 1000 steps). It stops when the newest model ranks the right
answer first for at least --until of the train prompts (default 90%), or after --max-rounds rounds.

Why rounds, and why a stop on that share: a policy trained against the reward model ends up writing
the answers the model scores highest, so RLHF comes as close to the exact answers as the model's top
answers are right. How many rounds that takes depends on how well the first round learned, which
depends on the CPU's kernels: on an AVX-512 machine the first round ranks the right answer first for
71% of the train prompts and the second for 97% (done after round 2); with the kernels of a CPU without
AVX the rounds give 43%, 66%, 79%, 86%, ...

Usage:
    areal train recipes/rm-quickstart.yaml && python scripts/rm_rounds.py
    areal train recipes/rlhf-quickstart.yaml models.reward_model.path=<the folder it prints last>
A round whose run already has its last checkpoint is not trained again (run the script again to go on
after an interruption, or with a higher --until for more rounds).
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
from pathlib import Path

from make_preference_data import read_rows, write_rows
from mine_hard_pairs import ANSWERS, ROUND1, load, mine

TRAIN_PROMPTS = Path("data/max3/train.jsonl")  # paths from the repository root, as mine_hard_pairs.py's
TEST_PROMPTS = Path("data/max3/test.jsonl")
FIRST_PAIRS = Path("data/arith-pairs/train.jsonl")
ROUND_STEPS = 1000  # recipes/rm-round2.yaml's trainer.max_steps


def last_checkpoint(run: Path) -> Path:
    return run / "checkpoints" / f"step_{ROUND_STEPS:08d}" / "reward_model"


def train_round(n: int, model: Path, pairs: Path, run: Path) -> None:
    cmd = [
        sys.executable, "-m", "arealcli.main", "train", "recipes/rm-round2.yaml",
        "-o", str(run), f"experiment=rm-round{n}",
        f"models.reward_model.path={model.resolve()}", f"dataset.args.path={pairs.resolve()}",
    ]  # fmt: skip
    print(f"round {n}: training {run} on {pairs}", flush=True)
    done = subprocess.run(cmd)
    if done.returncode != 0 or not last_checkpoint(run).is_dir():
        raise SystemExit(f"round {n}: `{' '.join(cmd)}` failed (exit {done.returncode})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first", default=ROUND1, help="round 1's model folder")
    p.add_argument("--pairs", default=str(FIRST_PAIRS), help="the pairs round 1 trained on")
    p.add_argument("--until", type=float, default=0.9, help="stop at this top-1 share of the train prompts")
    p.add_argument("--max-rounds", type=int, default=6, help="the most rounds, round 1 included")
    p.add_argument("--runs", default="runs", help="where rounds 2.. train (rm-roundN)")
    p.add_argument("--data", default="data", help="where their pairs go (arith-pairs-rN/train.jsonl)")
    p.add_argument("--k", type=int, default=3, help="wrong answers mined per prompt and round")
    a = p.parse_args()
    if not 0 < a.until <= 1:
        p.error(f"--until {a.until}: a share, in (0, 1]")
    if a.max_rounds < 1:
        p.error(f"--max-rounds {a.max_rounds}: at least 1 (round 1 is the model given)")
    model, pairs = Path(a.first), Path(a.pairs)
    prompts, held_out = read_rows(TRAIN_PROMPTS), read_rows(TEST_PROMPTS)
    for n in range(1, a.max_rounds + 1):
        net, tokenizer = load(model)
        mined, top1 = mine(net, tokenizer, prompts, a.k)
        held = mine(net, tokenizer, held_out, 0)[1]
        print(f"round {n}: {model}: top-scored of all {len(ANSWERS)} for {top1:.1%} of the train prompts "
              f"({held:.1%} held out)", flush=True)  # fmt: skip
        if top1 >= a.until or n == a.max_rounds:
            break
        rows = read_rows(pairs) + mined
        random.Random(0).shuffle(rows)  # as mine_hard_pairs.py does: round 2 is the documented one
        pairs = Path(a.data) / f"arith-pairs-r{n + 1}" / "train.jsonl"
        pairs.parent.mkdir(parents=True, exist_ok=True)
        write_rows(pairs, rows, f"pairs ({len(mined)} mined)")
        run = Path(a.runs) / f"rm-round{n + 1}"
        if last_checkpoint(run).is_dir():
            print(f"round {n + 1}: {run} is trained already", flush=True)
        else:
            train_round(n + 1, model, pairs, run)
        model = last_checkpoint(run)
    reason = "reached" if top1 >= a.until else f"not reached after {n} rounds"
    print(f"reward model: {model} (--until {a.until:.0%} {reason})")


if __name__ == "__main__":
    main()

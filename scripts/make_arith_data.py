"""Generate the small tasks shipped in data/ (deterministic: same seed, same files).

Tasks (train and test share no prompt):
  add   {"prompt": "23+45=", "answer": "68"}            -> data/arith
  max3  {"prompt": "max(37,82,15)=", "answer": "82"}    -> data/max3
Usage: python scripts/make_arith_data.py [--task add|max3] [--out DIR] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make(seed: int, max_operand: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(pairs)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]


def make_max3(seed: int, n: int) -> list[dict]:
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n:
        xs = tuple(rng.randrange(10, 100) for _ in range(3))
        if xs in seen or len(set(xs)) < 3:
            continue
        seen.add(xs)
        rows.append({"prompt": f"max({xs[0]},{xs[1]},{xs[2]})=", "answer": str(max(xs))})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=["add", "max3"], default="add")
    p.add_argument("--out", default=None, help="default: data/arith (add) or data/max3 (max3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=49)
    p.add_argument("--test-size", type=int, default=256)
    a = p.parse_args()
    rows = make(a.seed, a.max_operand) if a.task == "add" else make_max3(a.seed, 4000)
    out = Path(a.out or ("data/arith" if a.task == "add" else "data/max3"))
    out.mkdir(parents=True, exist_ok=True)
    splits = {"test": rows[: a.test_size], "train": rows[a.test_size :]}
    for name, part in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")
        print(f"{out / (name + '.jsonl')}: {len(part)} rows")


if __name__ == "__main__":
    main()

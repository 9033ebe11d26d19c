"""Generate the arithmetic task shipped in data/arith (deterministic: same seed, same files).

Each row: {"prompt": "23+45=", "answer": "68"}. Train and test sets share no prompt.
Usage: python scripts/make_arith_data.py [--out data/arith] [--seed 0]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/arith")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=49)
    p.add_argument("--test-size", type=int, default=256)
    a = p.parse_args()
    rows = make(a.seed, a.max_operand)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"test": rows[: a.test_size], "train": rows[a.test_size :]}
    for name, part in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")
        print(f"{out / (name + '.jsonl')}: {len(part)} rows")


if __name__ == "__main__":
    main()

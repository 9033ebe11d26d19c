"""Generate data/chat: two-turn conversations for the multi-turn SFT quickstart (deterministic).

    {"messages": [{"role": "user", "content": "12+7?"}, {"role": "assistant", "content": "19"},
                  {"role": "user", "content": "minus 5?"}, {"role": "assistant", "content": "14"}]}

The second answer depends on the first turn: learning it needs the whole conversation in context, and
the loss is on the assistant's turns only. Train and test share no first question.
Usage: python scripts/make_chat_data.py [--out data/chat] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def make(seed: int) -> list[dict]:
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 50) for b in range(1, 10)]
    rng.shuffle(pairs)
    rows = []
    for a, b in pairs:
        c = rng.randrange(1, 10)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a}+{b}?"},
                    {"role": "assistant", "content": str(a + b)},
                    {"role": "user", "content": f"minus {c}?"},
                    {"role": "assistant", "content": str(a + b - c)},
                ]
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data" / "chat")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rows = make(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    test, train = rows[:40], rows[40:]
    for name, part in (("train", train), ("test", test)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{args.out / name}.jsonl: {len(part)} conversations")


if __name__ == "__main__":
    main()

"""Preference pairs for the reward-model quickstart, from the GRPO quickstart's task (deterministic).

Each prompt of data/max3 (`max(37,82,15)=`) gives pairs {"prompt", "chosen", "rejected", "kind"}: the
correct answer chosen, a wrong one rejected. The wrong answers are near misses, the mistakes a policy
makes, so that a reward model trained on them ranks what the policy writes (a reward model that only
ever saw far-off answers is easy to fool):
  other   another number of the prompt (the policy picked the wrong one)   82 vs 37
  above   a number above the answer that is not in the prompt             82 vs 83, 92
          (without these a reward model learns "bigger is better", which a policy exploits)
  digit   its last digit off by 1 to 3                                    82 vs 81, 85
  tens    its first digit off by 1 to 3                                   82 vs 52, 92
  junk    a digit replaced by another character                           82 vs 8), e2
  length  a digit missing or one too many                                  82 vs 8, 823
  random  any other two-digit number                                      82 vs 17, 64
  high    any number above the answer                                     82 vs 90, 97
The kinds are the mistakes a policy made while GRPO trained on an earlier reward model's scores (its
samples, sorted): it wrote answers one off in the last digit, and characters that are not digits, which
that reward model, never shown such answers, scored above the right one; and, from the judge quickstart,
numbers far from the answer (a judge shown only near misses passed 95, 96, 97 for max(15,36,31)).
Train pairs come from data/max3/train.jsonl (one of each kind per prompt, two of `digit`), test pairs
from data/max3/test.jsonl (one of each kind; the held-out prompts of the quickstarts): train and test
share no prompt.
Usage: python scripts/make_preference_data.py [--out data/arith-pairs] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

KINDS = ("other", "above", "digit", "tens", "junk", "length", "random", "high")
TRAIN_EXTRA = ("digit",)  # the kind a policy exploits most (the last digit must match): twice in train
JUNK = "!#$%&()*+-./:;<=>?@[]^_{|}~abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
PROMPT = re.compile(r"^max\((\d+),(\d+),(\d+)\)=$")


def near_miss(kind: str, numbers: list[int], rng: random.Random) -> str:
    """A wrong answer of `kind` for a prompt whose numbers are `numbers` (two digits each)."""
    best = max(numbers)
    if kind in ("random", "high"):  # any other two-digit number; any number above the answer
        low = best + 1 if kind == "high" and best < 99 else 10
        return str(rng.choice([x for x in range(low, 100) if x != best]))
    if kind == "other":
        return str(rng.choice([x for x in numbers if x != best]))
    if kind == "junk":
        text, place = str(best), rng.randrange(2)
        return text[:place] + rng.choice(JUNK) + text[place + 1 :]
    if kind == "above":  # one digit raised by 1 to 3 (99: a digit too many, the only way up)
        bigger = [best + d * p for p in (1, 10) for d in (1, 2, 3) if best + d * p <= 99]
        return str(rng.choice(bigger)) if bigger else str(best) + str(rng.randrange(10))
    if kind == "length":
        text = str(best)
        return rng.choice(text) if rng.random() < 0.5 else text + str(rng.randrange(10))
    place = 10 if kind == "tens" else 1
    while True:  # digit / tens: that digit off by 1 to 3 (the other one stays, still two digits)
        wrong = best + rng.choice([-3, -2, -1, 1, 2, 3]) * place
        if 10 <= wrong <= 99 and (place == 10 or wrong // 10 == best // 10):
            return str(wrong)


def numbers_of(row: dict) -> list[int]:
    """The three numbers of a max3 prompt (ValueError for any other prompt)."""
    match = PROMPT.match(row["prompt"])
    if match is None:
        raise ValueError(f"not a max3 prompt: {row['prompt']!r}")
    return [int(x) for x in match.groups()]


def pairs_of(rows: list[dict], kinds: tuple[str, ...], rng: random.Random) -> list[dict]:
    """A pair of each of `kinds` per row."""
    out = []
    for row in rows:
        numbers = numbers_of(row)
        for kind in kinds:
            out.append(
                {
                    "prompt": row["prompt"],
                    "chosen": str(max(numbers)),
                    "rejected": near_miss(kind, numbers, rng),
                    "kind": kind,
                }
            )
    return out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: Path, rows: list[dict], what: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{path}: {len(rows)} {what}")


def command_line(doc: str, default_out: str) -> tuple[Path, random.Random, Path]:
    """The task's folder, the random stream (--seed) and the output folder (made) of a data script."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--source", default="data/max3", help="the task's folder (train.jsonl, test.jsonl)")
    p.add_argument("--out", default=default_out)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return Path(a.source), random.Random(a.seed), out


def main() -> None:
    source, rng, out = command_line(__doc__, "data/arith-pairs")
    for split, kinds in (("train", KINDS + TRAIN_EXTRA), ("test", KINDS)):
        pairs = pairs_of(read_rows(source / f"{split}.jsonl"), kinds, rng)
        write_rows(out / f"{split}.jsonl", pairs, "pairs")


if __name__ == "__main__":
    main()

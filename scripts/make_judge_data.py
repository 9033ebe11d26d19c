"""Verdicts for the judge quickstart, from the GRPO quickstart's task (deterministic).

A judge reads a prompt of data/max3 followed by an answer and a question mark, and says whether the
answer is right: {"prompt": "max(37,82,15)=82?", "answer": "Y"} or {"prompt": "max(37,82,15)=37?",
"answer": "N"}. The wrong answers are the near misses of scripts/make_preference_data.py (another number
of the prompt, one above, a digit off, a junk character, a digit missing or too many) and an empty answer:
any other two-digit number and one above the right one: the mistakes a policy makes, and those it makes
to fool a judge (a judge trained on near misses only passed 95, 96, 97 for max(15,36,31), and GRPO
learnt to write them). Each prompt gives four wrong answers of different kinds and the right one four
times, so that the judge sees as many Y as N.
Train verdicts come from data/max3/train.jsonl, test verdicts from data/max3/test.jsonl (the held-out
prompts of the quickstarts): train and test share no prompt.
Usage: python scripts/make_judge_data.py [--out data/max3-judge] [--seed 0]
"""

from __future__ import annotations

import random

from make_preference_data import KINDS, command_line, near_miss, numbers_of, read_rows, write_rows

WRONG = (*KINDS[:6], "empty", *KINDS[6:])  # the pairs' wrong answers and an empty one
RIGHT_COPIES = 4


def wrong_answer(kind: str, numbers: list[int], rng: random.Random) -> str:
    """A wrong answer of `kind`: the preference pairs' (near misses, any other number, one above the
    answer: the answers a policy writes once it has found that big numbers often pass), or nothing."""
    return "" if kind == "empty" else near_miss(kind, numbers, rng)


def verdicts_of(rows: list[dict], rng: random.Random) -> list[dict]:
    out = []
    for row in rows:
        numbers = numbers_of(row)
        right = str(max(numbers))
        for _ in range(RIGHT_COPIES):
            out.append({"prompt": f"{row['prompt']}{right}?", "answer": "Y", "kind": "right"})
        for kind in rng.sample(WRONG, RIGHT_COPIES):
            wrong = wrong_answer(kind, numbers, rng)
            out.append({"prompt": f"{row['prompt']}{wrong}?", "answer": "N", "kind": kind})
    rng.shuffle(out)
    return out


def main() -> None:
    source, rng, out = command_line(__doc__, "data/max3-judge")
    for split in ("train", "test"):
        write_rows(out / f"{split}.jsonl", verdicts_of(read_rows(source / f"{split}.jsonl"), rng), "verdicts")


if __name__ == "__main__":
    main()

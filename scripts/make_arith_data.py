"""Generate the small tasks shipped in data/ (deterministic: same seed, same files).

Tasks (train and test share no prompt):
  add   {"prompt": "23+45=", "answer": "68"}            -> data/arith
  add-prefs {"prompt": "23+45=", "chosen": "68",        -> data/arith-prefs (the DPO quickstart: add's
         "rejected": "63"}                                 prompts and split, the correct sum chosen, a
                                                           plausible wrong one rejected: the units digit
                                                           wrong, a dropped or spurious carry, the digits
                                                           swapped; 4 pairs per training prompt, 1 per
                                                           test prompt)
  max3  {"prompt": "max(37,82,15)=", "answer": "82"}    -> data/max3
  mul   {"prompt": "417*38=", "answer": "15846",        -> data/mul  (the agent quickstart: the tiny
         "episode": [{"role": "assistant", "content": "[417*38]"},    model cannot multiply, but it
                     {"role": "tool", "content": "=15846 "},          can learn to call the calculator)
                     {"role": "assistant", "content": "15846"}],
         "fc_episode": [...]}  the same episode as OpenAI messages (an assistant turn with a
                               calculator tool call, the tool's answer, the answer): the
                               function-calling quickstart's warm-up
Usage: python scripts/make_arith_data.py [--task add|add-prefs|max3|mul] [--out DIR] [--seed 0]
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


def wrong_sums(a: int, b: int) -> list[int]:
    """The plausible wrong answers to a + b: the units digit wrong, the carry dropped (or one added where
    there is none), the digits swapped; never the sum itself, never negative."""
    right = a + b
    units = [right - right % 10 + d for d in range(10)]
    carry = right - 10 if a % 10 + b % 10 >= 10 else right + 10
    swapped = int(str(right)[::-1])
    return sorted({x for x in [*units, carry, swapped] if x != right and x >= 0})


def make_prefs(seed: int, max_operand: int, test_size: int, per_prompt: int) -> list[dict]:
    """`add`'s rows in `add`'s order (the same train/test split) as preference pairs: the sum chosen, a
    plausible wrong one rejected; `per_prompt` pairs (each with another wrong sum) per training prompt,
    one per test prompt."""
    rng = random.Random(seed + 1)
    rows = []
    for i, row in enumerate(make(seed, max_operand)):
        a, b = (int(x) for x in row["prompt"].rstrip("=").split("+"))
        for wrong in rng.sample(wrong_sums(a, b), 1 if i < test_size else per_prompt):
            rows.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong)})
    return rows


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


def make_mul(seed: int, n: int) -> list[dict]:
    """3-digit x 2-digit products, with a worked calculator episode (the tool_use workflow's format:
    a call in [...], its result written back as `={result} `, then the answer)."""
    rng = random.Random(seed)
    seen, rows = set(), []
    while len(rows) < n:
        a, b = rng.randrange(100, 1000), rng.randrange(10, 100)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        episode = [
            {"role": "assistant", "content": f"[{a}*{b}]"},
            {"role": "tool", "content": f"={a * b} "},
            {"role": "assistant", "content": str(a * b)},
        ]
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a}*{b}"})},
        }
        fc_episode = [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)},
        ]
        rows.append(
            {"prompt": f"{a}*{b}=", "answer": str(a * b), "episode": episode, "fc_episode": fc_episode}
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=["add", "add-prefs", "max3", "mul"], default="add")
    p.add_argument(
        "--out", default=None, help="default: data/arith (add), data/arith-prefs, data/max3 or data/mul"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=49)
    p.add_argument("--test-size", type=int, default=256, help="test prompts (add-prefs: one pair each)")
    p.add_argument("--pairs-per-prompt", type=int, default=4, help="add-prefs: pairs per training prompt")
    a = p.parse_args()
    if a.task == "add":
        rows = make(a.seed, a.max_operand)
    elif a.task == "add-prefs":
        rows = make_prefs(a.seed, a.max_operand, a.test_size, a.pairs_per_prompt)
    else:
        rows = make_max3(a.seed, 4000) if a.task == "max3" else make_mul(a.seed, 4000)
    folders = {"add": "data/arith", "add-prefs": "data/arith-prefs", "max3": "data/max3", "mul": "data/mul"}
    out = Path(a.out or folders[a.task])
    out.mkdir(parents=True, exist_ok=True)
    splits = {"test": rows[: a.test_size], "train": rows[a.test_size :]}  # add-prefs: 1 pair per test prompt
    for name, part in splits.items():
        with open(out / f"{name}.jsonl", "w") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")
        print(f"{out / (name + '.jsonl')}: {len(part)} rows")


if __name__ == "__main__":
    main()

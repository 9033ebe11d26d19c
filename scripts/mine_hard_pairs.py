"""Hard pairs for a second round of the reward-model quickstart: the wrong answers a trained reward model
scores highest (deterministic for a given model).

For each prompt of data/max3 (`max(37,82,15)=`) the reward model scores every two-digit answer; the k
wrong ones it scores highest become pairs {"prompt", "chosen": the right answer, "rejected": that wrong
one, "kind": "hard"}, written after the first round's pairs (shuffled together) for the second round,
recipes/rm-round2.yaml.

Why: pairwise accuracy on random near misses says little about what a policy that maximizes the score
finds. A policy trained against the reward model ends up writing the answer the model scores highest,
so what counts is how often the right answer is the top-scored one of all answers ("top-1", printed
here): after the first round 98.6% of held-out pairs are ranked right, yet the right answer is the
top-scored one for only 70% of the prompts. The mined pairs are those misrankings, the pairs a labeller
would add after looking at what the model gets wrong (a round of reward-model data collection, as
done for the reward models of RLHF systems).

Usage:
    python scripts/mine_hard_pairs.py [MODEL] [--prompts data/max3/train.jsonl]
        [--pairs data/arith-pairs/train.jsonl] [--k 3] [--out data/arith-pairs-r2/train.jsonl]
    python scripts/mine_hard_pairs.py MODEL --prompts data/max3/test.jsonl --k 0   # top-1 only
MODEL: a reward model folder (default: the first round's last checkpoint,
runs/rm-quickstart/checkpoints/step_00002000/reward_model). Needs the model only, not arealcli.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from make_preference_data import numbers_of, read_rows, write_rows
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

ANSWERS = [str(x) for x in range(10, 100)]  # every two-digit answer
ROUND1 = "runs/rm-quickstart/checkpoints/step_00002000/reward_model"


@torch.no_grad()
def answer_scores(model, tokenizer, prompt: str) -> torch.Tensor:
    """(len(ANSWERS),) the model's score of prompt + answer + EOS for every answer (one batch, equal
    lengths: no padding)."""
    ids = [
        tokenizer(prompt + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for answer in ANSWERS
    ]
    return model(input_ids=torch.tensor(ids)).logits.squeeze(-1).float()


def mine(model, tokenizer, rows: list[dict], k: int) -> tuple[list[dict], float]:
    """The k top-scored wrong answers of each row as pairs, and the share of rows whose right answer is
    the top-scored one."""
    pairs, top1 = [], 0
    for row in rows:
        right = str(max(numbers_of(row)))
        order = torch.argsort(answer_scores(model, tokenizer, row["prompt"]), descending=True).tolist()
        ranked = [ANSWERS[i] for i in order]
        top1 += ranked[0] == right
        wrong = [a for a in ranked if a != right][:k]
        pairs += [{"prompt": row["prompt"], "chosen": right, "rejected": w, "kind": "hard"} for w in wrong]
    return pairs, top1 / max(len(rows), 1)


def load(folder: str | Path):
    """The reward model and tokenizer of a model folder (a checkpoint's reward_model)."""
    if not Path(folder, "config.json").is_file():
        what = f"no reward model at {folder}: train it first (areal train recipes/rm-quickstart.yaml)"
        print(what, file=sys.stderr)
        raise SystemExit(2)
    hf_logging.disable_progress_bar()
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=ROUND1, help="a reward model folder")
    p.add_argument("--prompts", default="data/max3/train.jsonl", help="the task's prompts to mine")
    p.add_argument("--pairs", default="data/arith-pairs/train.jsonl", help="the first round's pairs, kept")
    p.add_argument("--k", type=int, default=3, help="wrong answers per prompt (0: print top-1 only)")
    p.add_argument("--out", default="data/arith-pairs-r2/train.jsonl")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    model, tokenizer = load(a.model)
    mined, top1 = mine(model, tokenizer, read_rows(Path(a.prompts)), a.k)
    print(
        f"{a.model}: the right answer is the top-scored of all {len(ANSWERS)} for {top1:.1%} of {a.prompts}"
    )
    if a.k == 0:
        return
    rows = read_rows(Path(a.pairs)) + mined
    random.Random(a.seed).shuffle(rows)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_rows(out, rows, f"pairs ({len(mined)} mined)")


if __name__ == "__main__":
    main()

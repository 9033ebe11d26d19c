"""The reward-model quickstarts learn: the reward model ranks held-out pairs (pairwise accuracy >= 95%), a
second round on its own top-scored wrong answers makes the right answer its top-scored one more often, and
GRPO with it as the only reward rises toward GRPO on the exact answers.

They run the real recipes end to end, so they are marked slow; CI runs them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(recipe: str, run_dir: Path, *overrides: str) -> None:
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(REPO / "recipes" / recipe), "-o", str(run_dir)]
    proc = subprocess.run([*cmd, *overrides], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]


def mine(*args: str) -> float:
    """Run scripts/mine_hard_pairs.py from the repository root; the top-1 share it prints."""
    cmd = [sys.executable, str(REPO / "scripts" / "mine_hard_pairs.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"top-scored of all \d+ for ([\d.]+)%", proc.stdout)
    assert found, proc.stdout
    return float(found.group(1)) / 100


@pytest.mark.slow
def test_the_reward_model_learns_in_two_rounds_and_rlhf_on_it_comes_near_exact_rewards(tmp_path):
    """The RLHF pipeline as shipped. The RM quickstart (2000 steps): held-out pairwise accuracy >= 95%
    (98.6% here; 95.5% with ATEN_CPU_CAPABILITY=default), yet the right answer is the top-scored of all
    two-digit answers for few held-out prompts (69.9%; 36.7%). Mining its top-scored wrong answers and a
    second round (rm-round2, 1000 steps) make the right answer the top-scored one at least 10 points more
    often (96.9%; 58.2%). GRPO with that model as the only reward (60 SFT + 190 RL steps) raises held-out
    accuracy by at least 10 points (61.3% -> 85.2%; 61.7% -> 75.0%), ends within 15 points of the GRPO
    quickstart on the exact answers run here on the same kernels (87.9%: 2.7 points under it; 87.5%: 12.5
    under it) and does not fall more than 8 points from its best (1.1; 6.6). The bounds are those that
    hold under both kernel sets: how close RLHF comes depends on how well the first round learned
    (docs/reward-models.md). About 4 + 2 + 2 + 2 + 1 minutes on two idle cores."""
    rm = tmp_path / "rm"
    train("rm-quickstart.yaml", rm)
    evals = {r["step"]: r["eval/pairwise_accuracy"] for r in rows(rm) if "eval/pairwise_accuracy" in r}
    print(f"reward model, first round: held-out pairwise accuracy {evals}")
    assert evals[0] < 0.6 and evals[max(evals)] >= 0.95, evals
    first = rm / "checkpoints" / "step_00002000" / "reward_model"
    top1_first = mine(str(first), "--prompts", "data/max3/test.jsonl", "--k", "0")

    pairs = tmp_path / "pairs-r2" / "train.jsonl"
    mine(str(first), "--out", str(pairs))
    rm2 = tmp_path / "rm2"
    train("rm-round2.yaml", rm2, f"models.reward_model.path={first}", f"dataset.args.path={pairs}")
    second = rm2 / "checkpoints" / "step_00001000" / "reward_model"
    top1_second = mine(str(second), "--prompts", "data/max3/test.jsonl", "--k", "0")
    print(f"top-1 on held-out prompts: first round {top1_first:.3f}, second {top1_second:.3f}")
    assert top1_second > top1_first + 0.1, (top1_first, top1_second)

    rlhf = tmp_path / "rlhf"
    train("rlhf-quickstart.yaml", rlhf, f"models.reward_model.path={second}")
    acc = {r["step"]: r["eval/accuracy"] for r in rows(rlhf) if "eval/accuracy" in r}
    print(f"rlhf: held-out accuracy {acc}")
    exact = tmp_path / "exact"
    train("quickstart.yaml", exact)
    exact_acc = [r["eval/accuracy"] for r in rows(exact) if "eval/accuracy" in r][-1]
    print(f"grpo on the exact answers: held-out accuracy {exact_acc}")
    assert acc[250] >= acc[60] + 0.10, acc
    assert acc[250] >= exact_acc - 0.15, (acc, exact_acc)
    assert acc[250] >= max(acc.values()) - 0.08, acc
    rewards = [r["actor_train/reward"] for r in rows(rlhf) if "actor_train/reward" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards  # the reward model's mean score rose

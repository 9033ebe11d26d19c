"""The reward-model quickstarts learn: the reward model ranks held-out pairs (pairwise accuracy >= 95%),
and GRPO with it as the only reward raises held-out accuracy and keeps it.

They run the real recipes end to end, so they are marked slow; CI runs them.
"""

from __future__ import annotations

import json
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


@pytest.mark.slow
def test_the_reward_model_learns_and_grpo_on_it_raises_heldout_accuracy(tmp_path):
    """The RM quickstart as shipped (2000 steps): held-out pairwise accuracy >= 95% (96.4% here). Then the
    RLHF quickstart on its checkpoint (60 SFT + 190 GRPO steps, a KL penalty to the warm-up's policy):
    held-out accuracy rises at least 10 points above the warm-up (61.3% -> 74.6% here) and does not fall
    back more than 5 points from its best (without the KL it rose to 68.0% and fell to 46.9%:
    docs/reward-models.md); the reward model's mean score of the samples rises. About 4 + 2 minutes on
    two idle cores."""
    rm = tmp_path / "rm"
    train("rm-quickstart.yaml", rm)
    evals = {r["step"]: r["eval/pairwise_accuracy"] for r in rows(rm) if "eval/pairwise_accuracy" in r}
    print(f"reward model: held-out pairwise accuracy {evals}")
    assert evals[0] < 0.6 and evals[max(evals)] >= 0.95, evals

    checkpoint = rm / "checkpoints" / "step_00002000" / "reward_model"
    rlhf = tmp_path / "rlhf"
    train("rlhf-quickstart.yaml", rlhf, f"models.reward_model.path={checkpoint}")
    acc = {r["step"]: r["eval/accuracy"] for r in rows(rlhf) if "eval/accuracy" in r}
    print(f"rlhf: held-out accuracy {acc}")
    assert acc[250] >= acc[60] + 0.10, acc
    assert acc[250] >= max(acc.values()) - 0.05, acc
    rewards = [r["actor_train/reward"] for r in rows(rlhf) if "actor_train/reward" in r]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3, rewards  # the reward model's mean score rose

"""The reward-model quickstarts learn: the reward model ranks held-out pairs (pairwise accuracy >= 95%), more
rounds on its own top-scored wrong answers make the right answer its top-scored one more often, and
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


@pytest.mark.slow
def test_the_reward_model_learns_in_two_rounds_and_rlhf_on_it_comes_near_exact_rewards(tmp_path):
    """The RLHF pipeline as shipped. The RM quickstart (2000 steps): held-out pairwise accuracy >= 95%
    (98.6% here; 95.5% with ATEN_CPU_CAPABILITY=default), yet the right answer is the top-scored of all
    two-digit answers for few held-out prompts (69.9%; 36.7%). scripts/rm_rounds.py mines its top-scored
    wrong answers and trains a second round (rm-round2, 1000 steps), which makes the right answer the
    top-scored one at least 10 points more often (96.9%; 58.2%), and goes on while the train prompts'
    top-1 is under 90% (done after round 2 here; the default kernels need more, 3 at most in this test).
    GRPO with the last round as the only reward (60 SFT + 190 RL steps) raises held-out accuracy by at
    least 10 points (61.3% -> 85.2%; 61.7% -> 80.5% after round 3), ends within 15 points of the GRPO
    quickstart on the exact answers run here on the same kernels (87.9%: 2.7 points under it; 87.5%: 7.0
    under it) and does not fall more than 8 points from its best (1.1; 4.3). About 4 + 4 + 2 + 2 + 1
    minutes on two idle cores."""
    rm = tmp_path / "rm"
    train("rm-quickstart.yaml", rm)
    evals = {r["step"]: r["eval/pairwise_accuracy"] for r in rows(rm) if "eval/pairwise_accuracy" in r}
    print(f"reward model, first round: held-out pairwise accuracy {evals}")
    assert evals[0] < 0.6 and evals[max(evals)] >= 0.95, evals

    # scripts/rm_rounds.py: mine and train again until the train prompts' top-1 >= 90% (two rounds here)
    first = rm / "checkpoints" / "step_00002000" / "reward_model"
    cmd = [sys.executable, str(REPO / "scripts" / "rm_rounds.py"), "--first", str(first)]
    cmd += ["--runs", str(tmp_path), "--data", str(tmp_path / "data"), "--max-rounds", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"round (\d): (\S+): top-scored of all 90 for ([\d.]+)% of the train prompts "
                       r"\(([\d.]+)% held out\)", proc.stdout)  # fmt: skip
    print(found)
    top1 = [(float(tr) / 100, float(held) / 100) for _, _, tr, held in found]
    assert len(top1) >= 2 and top1[1][1] > top1[0][1] + 0.1, top1  # the second round, held out
    assert top1[-1][0] >= 0.9 or len(top1) == 3, top1  # stopped at --until, or at --max-rounds
    second = Path(re.findall(r"reward model: (\S+) ", proc.stdout)[-1])
    assert second == Path(found[-1][1]) and second.is_dir(), proc.stdout

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

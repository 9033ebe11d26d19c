"""The shipped quickstarts learn: held-out accuracy after RL clearly above the accuracy after warm-up.

These run the real recipes end to end (a few minutes on two cores), so they are marked slow; CI runs them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def eval_accuracy(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def train(recipe: str, run_dir, *overrides: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "arealcli.main",
        "train",
        str(REPO / "recipes" / recipe),
        "-o",
        str(run_dir),
        *overrides,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["quickstart.yaml", "ppo-quickstart.yaml", "quickstart-async.yaml"])
def test_rl_raises_heldout_accuracy(recipe, tmp_path):
    run_dir = tmp_path / "run"
    train(recipe, run_dir, "trainer.samples_every_n_steps=50")
    acc = eval_accuracy(run_dir)
    warm = acc[60]  # the end of the SFT warm-up: RL starts here
    final = acc[max(acc)]
    print(f"{recipe}: held-out accuracy {acc}")
    assert final >= warm + 0.10, acc
    samples = sorted((run_dir / "samples").glob("step_*.jsonl"))
    assert samples and json.loads(samples[-1].read_text().splitlines()[0])["prompt"].startswith("max(")
    # the final checkpoint is a normal HF directory
    from transformers import AutoModelForCausalLM

    latest = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / latest / "actor")


@pytest.mark.slow
def test_multi_turn_sft_learns_the_assistant_turns(tmp_path):
    run_dir = tmp_path / "run"
    train("sft-chat.yaml", run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    nll = [r["eval/nll"] for r in rows if "eval/nll" in r]
    assert nll[0] > 4.0 and nll[-1] < 1.0, nll  # per assistant token, from uniform guessing to learned

"""Our reward-model loss equals TRL's `RewardTrainer` loss on one batch of one small model.

The reward model is saved as Hugging Face's sequence classifier and loaded back by TRL; TRL's
`compute_loss` runs on the batch its own collator builds from the same token ids. Without TRL these
tests skip, except under CI (env CI set), where they fail.
"""

from __future__ import annotations

import os

import pytest
import torch

from arealcli.runtime.interfaces.reward_model import RewardModelInterface
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import RewardModelArgs
from tests.test_reward_model import ROWS, pairs, rm_model


@pytest.fixture(scope="module")
def trl():
    try:
        import trl
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"TRL is not installed ({e}); CI runs this test: pip install -c constraints.txt trl")
        pytest.skip(f"TRL is not installed ({e})")
    return trl


@pytest.mark.parametrize("margin, center", [(False, None), (True, 0.1)])
def test_our_loss_equals_trls_reward_trainer(trl, char_tok, tmp_path, margin, center):
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    rows = [{**r, "m": 0.25 * i} for i, r in enumerate(ROWS)] if margin else ROWS
    batch = pairs(char_tok, tmp_path, rows=rows, **({"margin_key": "m"} if margin else {}))
    model = rm_model(char_tok)
    interface = RewardModelInterface(RewardModelArgs(center_rewards_coefficient=center or 0.0))
    interface.train_step(model, batch, MicroBatchSpec())  # one step first: a head that is not fresh
    interface.save(model, str(tmp_path / "rm"))
    ours = interface.train_step(model, batch, MicroBatchSpec(n_mbs=2))["loss"]  # the loss before this step

    seqs = [s.tolist() for s in batch.unpack("packed_input_ids")]  # chosen, rejected, chosen, ...
    examples = [
        {"chosen_ids": c, "rejected_ids": r} | ({"margin": m} if margin else {})
        for c, r, m in zip(seqs[0::2], seqs[1::2], batch.meta["margin"][0::2], strict=True)
    ]
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1)
    config = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        center_rewards_coefficient=center,
    )
    trainer = RewardTrainer(
        model=hf, args=config, train_dataset=Dataset.from_list(examples), processing_class=char_tok
    )
    inputs = DataCollatorForPreference(pad_token_id=char_tok.pad_token_id)(examples)
    assert inputs["input_ids"].shape[0] == 2 * len(ROWS)  # padded: the lengths differ
    with torch.no_grad():
        theirs = float(trainer.compute_loss(trainer.model, inputs))
    assert ours == pytest.approx(theirs, abs=1e-5), (ours, theirs)
    assert 0.05 < theirs < 5  # a real loss of a partly trained model, not a constant

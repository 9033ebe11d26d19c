"""Our preference losses equal TRL's on one batch and one small model: DPOTrainer's loss for sigmoid,
ipo, hinge and robust, and CPOTrainer's SimPO (cpo_alpha 0: the loss alone), within 1e-5; the summed
log-probs of each response too (TRL's logged logps/chosen and logps/rejected, and CPOTrainer's public
`get_batch_logps`). TRL builds the batch (its tokenization, padding and completion masks); our
interface gets the same sequences in its packed pair layout. TRL is a test dependency: without it these
tests skip, except under CI (env CI set), where they fail."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
from conftest import tiny_module, toy_pairs

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.preferences import CHOSEN, REJECTED
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.dpo import DPOInterface, pair_logps
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.datasets import PAIR
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import REF_LOGPROBS, DPOArgs

# 9 pairs; rejected responses of 1 to 4 letters, so TRL pads and masks
PAIRS = [{**p, "rejected": p["rejected"][: 1 + k % 4]} for k, p in enumerate(toy_pairs()[::5])]
DPO_CASES = {
    "sigmoid": {"beta": 0.5},
    "ipo": {"beta": 0.5},
    "hinge": {"beta": 0.5},
    "robust": {"beta": 0.5, "label_smoothing": 0.2},
}


def require_trl() -> Any:
    try:
        import trl
    except ImportError as e:
        msg = f"TRL is not installed ({e}); pip install -c constraints.txt -e '.[test]'"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI must run the TRL comparison", pytrace=False)
        pytest.skip(msg)
    return trl


@pytest.fixture(scope="module")
def modules(char_tok):
    """A policy and a reference that differ (other seeds), so every log-ratio is far from 0."""
    return tiny_module(char_tok, seed=1), tiny_module(char_tok, seed=2)


def packed_pairs(chosen: list[tuple[torch.Tensor, torch.Tensor]], rejected: list) -> SequenceSample:
    """Our layout (data/preferences.py) of TRL's sequences: per pair (ids, response mask), chosen then
    rejected."""
    ids, seqs, masks = [], [], []
    for k, pair in enumerate(zip(chosen, rejected, strict=True)):
        for role, (seq, mask) in zip((CHOSEN, REJECTED), pair, strict=True):
            ids.append((k, role))
            seqs.append(seq)
            masks.append(mask.bool())
    return SequenceSample.from_lists(
        ids,
        {"packed_input_ids": seqs, "loss_mask": masks, "prompt_mask": [~m for m in masks]},
        {PAIR: [k for k, _ in ids]},
    )


def engines(char_tok, modules) -> tuple[Model, Model]:
    """The policy and the reference on the hf backend (copies of the modules)."""
    return tuple(  # type: ignore[return-value]
        HFBackend(HFBackendArgs(device="cpu")).initialize(
            Model(name, copy.deepcopy(m), char_tok), FinetuneSpec(1, 8, 8, 10)
        )
        for name, m in zip(("actor", "ref"), modules, strict=True)
    )


def our_loss(char_tok, modules, batch: SequenceSample, args: DPOArgs) -> tuple[dict[str, float], Any]:
    """The dpo interface's loss and metrics on `batch` (one micro-batch; the reference's call first), and
    the reference's summed response log-probs of each pair (chosen (P,), rejected (P,))."""
    policy, ref = engines(char_tok, modules)
    iface = DPOInterface(args)
    logp = iface.inference(ref, batch, MicroBatchSpec()).data["packed_logprobs"]
    batch.data[REF_LOGPROBS], batch.seqlens[REF_LOGPROBS] = logp, batch.seqlens["packed_input_ids"]
    ref_sums = pair_logps(logp, batch, with_reference=False)
    return policy.module.eval_batch(batch, MicroBatchSpec(), iface._loss_fn), ref_sums


def exact_logps(module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """sum_t mask_{t+1} log softmax(logits_t)[ids_{t+1}] of one sequence, straight from the HF model."""
    with torch.no_grad():
        logp = torch.log_softmax(module(ids[None]).logits[0, :-1].double(), -1)
    return float((logp.gather(-1, ids[1:, None])[:, 0] * mask[1:]).sum())


@pytest.mark.parametrize("loss", list(DPO_CASES))
def test_dpo_losses_equal_trls_dpo_trainer(char_tok, modules, tmp_path, loss):
    """TRL's DPOTrainer computes its policy's log-probs itself and takes the reference's as given
    (precompute_ref_log_probs: ours, which equal the HF model's log-softmax; TRL's own fused head on the
    reference is off by up to ~1e-3 here, see the last assertion)."""
    require_trl()
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPO_CASES[loss]
    config = DPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, per_device_train_batch_size=len(PAIRS),
        loss_type=[loss], precompute_ref_log_probs=True, **args,
    )  # fmt: skip
    policy, ref = (copy.deepcopy(m) for m in modules)
    trainer = DPOTrainer(
        model=policy,
        ref_model=ref,
        args=config,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=char_tok,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    rows = [
        (ids[m.bool()], c[m.bool()])
        for ids, m, c in zip(
            batch["input_ids"], batch["attention_mask"], batch["completion_mask"], strict=True
        )
    ]
    half = len(rows) // 2  # TRL's batch: every chosen sequence, then every rejected one
    ours, ref_sums = our_loss(
        char_tok, modules, packed_pairs(rows[:half], rows[half:]), DPOArgs(loss=loss, **args)
    )
    trl_ref = batch["ref_chosen_logps"].clone(), batch["ref_rejected_logps"].clone()
    batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_sums.logp_chosen, ref_sums.logp_rejected
    trl_loss = float(trainer.compute_loss(trainer.model, batch).detach())
    logged = trainer._metrics["train" if trainer.model.training else "eval"]  # TRL's record of the step
    assert abs(ours["loss"] - trl_loss) < 1e-5, (ours["loss"], trl_loss)
    assert trl_loss > 0.05 and abs(trl_loss - math.log(2)) > 0.01  # a loss that tells the variants apart
    for key in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert ours[key] == pytest.approx(logged[key][-1], abs=1e-5), key
    assert ours["rewards/accuracies"] == pytest.approx(logged["rewards/accuracies"][-1])
    # the reference's log-probs: ours are the HF model's; TRL's fused LM head differs a little
    exact = torch.tensor([exact_logps(modules[1], ids, mask) for ids, mask in rows], dtype=torch.float64)
    ours_ref = torch.cat([ref_sums.logp_chosen, ref_sums.logp_rejected])
    torch.testing.assert_close(ours_ref.double(), exact, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(trl_ref).double(), exact, atol=2e-3, rtol=0)


def test_simpo_equals_trls_cpo_trainer(char_tok, modules, tmp_path):
    require_trl()
    from datasets import Dataset
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    config = CPOConfig(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, loss_type="simpo", cpo_alpha=0.0, beta=2.0,
        simpo_gamma=0.5, label_smoothing=0.1,
    )  # fmt: skip
    trainer = CPOTrainer(
        model=copy.deepcopy(modules[0]),
        args=config,
        train_dataset=Dataset.from_list(PAIRS),
        processing_class=char_tok,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    trl_loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)

    def rows(side: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        keep = [m.bool() for m in batch[f"{side}_attention_mask"]]
        return [
            (ids[k], (lab != -100)[k])
            for ids, lab, k in zip(batch[f"{side}_input_ids"], batch[f"{side}_labels"], keep, strict=True)
        ]

    ours, _ = our_loss(
        char_tok, modules, packed_pairs(rows("chosen"), rows("rejected")),
        DPOArgs(loss="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1),
    )  # fmt: skip
    assert abs(ours["loss"] - float(trl_loss)) < 1e-5, (ours["loss"], float(trl_loss))
    assert ours["rewards/chosen"] == pytest.approx(metrics["rewards/chosen"], abs=1e-5)
    assert ours["rewards/margins"] == pytest.approx(metrics["rewards/margins"], abs=1e-5)
    # the log-probs themselves, through TRL's public function: per-token means (SimPO's), then sums
    with torch.no_grad():
        logits = modules[0](batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
    mean = CPOTrainer.get_batch_logps(logits, batch["chosen_labels"], average_log_prob=True)
    assert ours["rewards/chosen"] == pytest.approx(2.0 * float(mean.mean()), abs=1e-5)
    total = CPOTrainer.get_batch_logps(logits, batch["chosen_labels"], average_log_prob=False)
    assert ours["logps/chosen"] == pytest.approx(float(total.mean()), abs=1e-4)

"""Reward models: a value-head model trained on preference pairs (Bradley-Terry), and the same model,
frozen, scoring a policy's samples as the reward of RL.

    reward_model  train_step   pairs (chosen, rejected) -> scores s_w, s_l -> -log sigma(s_w - s_l - m)
                  evaluate     held-out pairwise accuracy: the share of pairs with s_w > s_l
    rm_reward     inference    samples (prompt + response) -> `rewards` = their scores, shaped by the
                               `returns` call like any reward (reward_bias, reward_scaling, max_reward_clip)

A sequence's score is the head's output at its last token that is not the pad token
(`algo.bradley_terry.score_positions`): what Hugging Face's sequence classifier gives for the exported
model. The math is in `algo/bradley_terry.py`; the pair layout of a batch in `data/preferences.py`.
"""

from __future__ import annotations

import torch

from arealcli.runtime import distributed
from arealcli.runtime.algo import bradley_terry as bt
from arealcli.runtime.data.preferences import pair_indices
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.models.model import Model
from arealcli.schema.components.datasets import MARGIN
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import ModelRewardArgs, RewardModelArgs


def sequence_scores(values: torch.Tensor, mb: SequenceSample, pad_id: int | None) -> torch.Tensor:
    """(B,) score of each sequence of a micro-batch from its packed per-token head outputs (tokens,)."""
    ids = mb.data["packed_input_ids"]
    at = bt.score_positions(ids, mb.cu_seqlens("packed_input_ids"), pad_id)
    return values.float()[at.to(values.device)]


def pair_scores(scores: torch.Tensor, mb: SequenceSample) -> tuple[torch.Tensor, torch.Tensor]:
    """(s_w (P,), s_l (P,)) of the P pairs of a batch laid out as pairs, from its sequence scores (B,)."""
    chosen, rejected = pair_indices(mb)
    return scores[chosen], scores[rejected]


def pair_margins(mb: SequenceSample, like: torch.Tensor) -> torch.Tensor:
    """(P,) each pair's margin m (the dataset's `margin`; 0 when the batch has none)."""
    chosen, _ = pair_indices(mb)
    values = [mb.meta[MARGIN][i] for i in chosen] if MARGIN in mb.meta else [0.0] * len(chosen)
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def score(model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> torch.Tensor:
    """(B,) scores of a batch's sequences, in its order (a forward pass of the value-head model)."""
    pad_id = model.tokenizer.pad_token_id

    def per_sample(values: torch.Tensor, mb: SequenceSample) -> list[torch.Tensor]:
        return list(sequence_scores(values, mb, pad_id).cpu())

    return model.module.forward(data, mb_spec, post_hook=per_sample, aggregate_fn=torch.stack)


class RewardModelInterface(ModelInterface):
    """Bradley-Terry reward model: a value-head model trained on preference pairs to score responses."""

    Args = RewardModelArgs

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        pad_id = model.tokenizer.pad_token_id

        def loss_fn(values: torch.Tensor, mb: SequenceSample):
            chosen, rejected = pair_scores(sequence_scores(values, mb, pad_id), mb)  # (P,), (P,)
            loss = bt.bradley_terry_loss(chosen, rejected, pair_margins(mb, chosen)).mean()
            c = self.args.center_rewards_coefficient
            if c > 0:
                loss = loss + c * bt.centering_penalty(chosen, rejected).mean()
            return loss, {k: v.detach() for k, v in bt.pair_metrics(chosen, rejected).items()}

        stats = model.module.train_batch(
            data,
            mb_spec,
            loss_fn,
            loss_weight_fn=lambda mb: mb.bs // 2,  # pairs: the step's loss is the mean over all of them
            version_steps=model.version.global_step,
            lr_scale=self.args.lr_scale,
        )
        model.inc_version()
        return stats

    def evaluate(self, model: Model, loader) -> dict[str, float]:
        """Held-out `pairwise_accuracy` (share of pairs with s_w > s_l) and the mean `pairwise_margin`
        s_w - s_l, over every rank's pairs."""
        wins, margins, pairs = 0.0, 0.0, 0.0
        for batch in loader:
            chosen, rejected = pair_scores(score(model, batch, MicroBatchSpec()), batch)
            wins += float((chosen > rejected).sum())
            margins += float((chosen - rejected).sum())
            pairs += chosen.numel()
        wins, margins, pairs = distributed.all_reduce([wins, margins, pairs])
        return {"pairwise_accuracy": wins / max(pairs, 1.0), "pairwise_margin": margins / max(pairs, 1.0)}


class ModelRewardInterface(ModelInterface):
    """Score responses with a trained reward model (frozen): the score of prompt + response."""

    Args = ModelRewardArgs

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        scores = score(model, data, mb_spec).float()  # (B,) raw: the returns call shapes them
        return SequenceSample(data.ids, {"rewards": [1] * data.bs}, {"rewards": scores})

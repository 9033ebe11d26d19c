"""Direct preference optimization: learn from pairs (chosen, rejected) against a frozen reference.

The reference is an ordinary model of the recipe, run before the train call by an `inference` call of
this interface, whose per-token log-probs are kept as `packed_ref_logprobs`:

    ref_logprobs  inference   on ref     packed_input_ids -> packed_logprobs, renamed packed_ref_logprobs
    dpo           train_step  on actor   packed_input_ids, loss_mask, pair, packed_ref_logprobs

One `train_step`, top to bottom:
  pair_logps   per pair: the policy's log-probs of the chosen and of the rejected response, summed over
               the response's tokens (`loss_mask`), the reference's likewise, and the token counts
  loss         the registered preference loss `loss` (sigmoid = DPO, ipo, hinge, robust, simpo; a
               plugin's), averaged over the step's pairs: one optimizer step
`evaluate` gives held-out preference accuracy: how often the chosen response's implicit reward beats
the rejected one's (the trainer runs the reference's call on the held-out pairs first: `eval_inputs`).

Micro-batches hold whole pairs (the `pair` key; data/preferences.py), so each pair's loss is computed
in one graph; a micro-batch weighs its number of pairs, so the step's loss is the mean over every pair
of every rank, whatever the split into micro-batches and ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from arealcli.runtime import distributed
from arealcli.runtime.data.preferences import pair_indices
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, takes_lm_output
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.preference_losses import Pairs, pair_metrics
from arealcli.runtime.interfaces.sft import answer_token_mask
from arealcli.runtime.interfaces.token_logprobs import next_token_logprobs
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import REF_LOGPROBS, DPOArgs
from arealcli.schema.registry import PREFERENCE_LOSSES

# what the held-out metrics sum over the pairs (then divided by their count)
EVAL_SUMS = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")


def response_logps(logp: Tensor, mask: Tensor, mb: SequenceSample) -> tuple[Tensor, Tensor]:
    """(sum_t m_t logp_t (B,), sum_t m_t (B,)) of each sequence of a packed batch: logp, mask (tokens,)."""
    lens = torch.tensor(mb.seqlens["packed_input_ids"], device=logp.device)
    seq = torch.repeat_interleave(torch.arange(mb.bs, device=logp.device), lens)  # (tokens,)
    m = mask.to(logp.device, logp.dtype)
    return logp.new_zeros(mb.bs).index_add(0, seq, logp * m), logp.new_zeros(mb.bs).index_add(0, seq, m)


def pair_logps(logp: Tensor, mb: SequenceSample, with_reference: bool) -> Pairs:
    """The pairs of a batch from its per-token log-probs (tokens,) (position t: log p(x_{t+1})): the
    response sums under the policy and (from `packed_ref_logprobs`) the reference, the token counts."""
    mask = answer_token_mask(mb)  # (tokens,) the positions that predict a response token
    sums, counts = response_logps(logp, mask, mb)  # (B,)
    chosen, rejected = pair_indices(mb)
    ref_c = ref_r = None
    if with_reference:
        ref, _ = response_logps(mb.data[REF_LOGPROBS].to(logp), mask, mb)
        ref_c, ref_r = ref[chosen], ref[rejected]
    return Pairs(sums[chosen], sums[rejected], ref_c, ref_r, counts[chosen], counts[rejected])


def num_pairs(mb: SequenceSample) -> float:
    """A micro-batch's loss weight: its number of pairs."""
    return float(mb.bs // 2)


@takes_lm_output
def _token_logprobs(outputs: LMOutput | Tensor, mb: SequenceSample) -> Tensor:
    return next_token_logprobs(outputs, mb)


class DPOInterface(ModelInterface):
    """Direct preference optimization on pairs (chosen, rejected) against a frozen reference model."""

    Args = DPOArgs

    def __init__(self, args: DPOArgs):
        super().__init__(args)
        self.loss = PREFERENCE_LOSSES.get(args.loss).load()  # registered: preference_losses.py, plugins
        self.with_reference = args.needs_reference()
        # what `evaluate` reads besides the dataset's keys: the trainer runs the calls that make them
        self.eval_inputs = (REF_LOGPROBS,) if self.with_reference else ()

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        """log p(x_{t+1} | x_<=t) of every token under this model (the reference): `packed_logprobs`."""
        logp = model.module.forward(data, mb_spec, post_hook=_token_logprobs)
        return SequenceSample(
            data.ids,
            {"packed_logprobs": list(data.seqlens["packed_input_ids"])},
            {"packed_logprobs": logp.cpu()},
        )

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        self._require(data, "train_step")
        stats = model.module.train_batch(
            data,
            mb_spec,
            loss_fn=self._loss_fn,
            loss_weight_fn=num_pairs,
            version_steps=model.version.global_step,
            lr_scale=self.args.lr_scale,
        )
        model.inc_version()
        return stats

    @takes_lm_output  # `outputs` is the micro-batch's LMOutput: log-probs chunk by chunk
    def _loss_fn(self, outputs: LMOutput | Tensor, mb: SequenceSample) -> tuple[Tensor, dict[str, Tensor]]:
        """The mean preference loss over the micro-batch's pairs, and TRL's metrics."""
        pairs = pair_logps(next_token_logprobs(outputs, mb), mb, self.with_reference)
        loss, chosen_reward, rejected_reward = self.loss(pairs, self.args)  # (P,) each
        return loss.mean(), pair_metrics(pairs, chosen_reward, rejected_reward)

    @torch.no_grad()
    def evaluate(self, model: Model, loader) -> dict[str, float]:
        """On held-out pairs: preference accuracy (`rewards/accuracies`: the chosen response's implicit
        reward beats the rejected one's), the mean loss and rewards; over every rank's pairs."""
        sums = dict.fromkeys(EVAL_SUMS, 0.0)
        n = 0.0
        for batch in loader:
            self._require(batch, "evaluate")
            per_seq = model.module.forward(
                batch, MicroBatchSpec(), post_hook=_response_sums, aggregate_fn=torch.stack
            )  # (B, 2): summed response log-prob, response tokens
            pairs = self._eval_pairs(per_seq, batch)
            loss, chosen, rejected = self.loss(pairs, self.args)
            stats = pair_metrics(pairs, chosen, rejected)
            count = len(loss)
            sums["loss"] += float(loss.sum())
            for k in EVAL_SUMS[1:]:
                sums[k] += float(stats[k]) * count
            n += count
        totals = distributed.all_reduce([n, *sums.values()])
        return {k: v / max(totals[0], 1.0) for k, v in zip(EVAL_SUMS, totals[1:], strict=True)}

    def _eval_pairs(self, per_seq: Tensor, batch: SequenceSample) -> Pairs:
        chosen, rejected = pair_indices(batch)
        ref_c = ref_r = None
        if self.with_reference:
            ref, _ = response_logps(batch.data[REF_LOGPROBS].float(), answer_token_mask(batch), batch)
            ref_c, ref_r = ref[chosen], ref[rejected]
        sums, counts = per_seq[:, 0].float().cpu(), per_seq[:, 1].float().cpu()
        return Pairs(sums[chosen], sums[rejected], ref_c, ref_r, counts[chosen], counts[rejected])

    def _require(self, data: SequenceSample, what: str) -> None:
        """The keys the data must have: a user's own dataflow may lack them (`areal check` says so too)."""
        missing = sorted(k for k in self.args.train_inputs() if k not in data.keys)
        if missing:
            raise RuntimeError(
                f"dpo's {what} needs {', '.join(missing)} (has {sorted(data.keys)}): `pair` comes from a "
                "preference dataset, packed_ref_logprobs from an inference call of the reference model"
            )


@takes_lm_output
def _response_sums(outputs: LMOutput | Tensor, mb: SequenceSample) -> list[Tensor]:
    """[summed response log-prob, response tokens] of each sequence of a micro-batch."""
    logp = next_token_logprobs(outputs, mb)
    sums, counts = response_logps(logp, answer_token_mask(mb), mb)
    return list(torch.stack([sums, counts], dim=1))

"""Supervised fine-tuning: next-token negative log-likelihood over answer tokens."""

from __future__ import annotations

import math

import torch

from arealcli.runtime import distributed
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, takes_lm_output
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.token_logprobs import next_token_logprobs
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import SFTArgs


def answer_token_mask(mb: SequenceSample) -> torch.Tensor:
    """(tokens,) bool: True where the *next* token is one the loss counts (the positions that predict it).

    The counted tokens are those of `loss_mask` when the batch has one (multi-turn chat: every assistant
    turn), else everything after the prompt (`prompt_mask`). Position t of a sequence predicts token
    t+1; the last position of each sequence predicts nothing.
    """
    counted = mb.data["loss_mask"].bool() if "loss_mask" in mb.data else ~mb.data["prompt_mask"].bool()
    target_is_answer = torch.roll(counted, shifts=-1)  # (tokens,)
    ends = mb.cu_seqlens("packed_input_ids")[1:] - 1
    target_is_answer[ends] = False
    return target_is_answer


def num_answer_tokens(mb: SequenceSample) -> int:
    return int(answer_token_mask(mb).sum())


def token_nll(outputs: LMOutput | torch.Tensor, mb: SequenceSample) -> tuple[torch.Tensor, torch.Tensor]:
    """-log p(x_{t+1} | x_<=t) at every position (tokens,) (0 at each sequence's last), and the
    answer-token mask (tokens,); `outputs` an `LMOutput` or packed logits (tokens, V)."""
    logp = next_token_logprobs(outputs, mb)
    return -logp, answer_token_mask(mb).to(logp.device)


@takes_lm_output
def sft_loss(
    outputs: LMOutput | torch.Tensor, mb: SequenceSample
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean NLL over the micro-batch's answer tokens; `outputs` an `LMOutput` or logits (tokens, V)."""
    nll, mask = token_nll(outputs, mb)
    loss = (nll * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"n_tokens": mask.sum().float()}


@takes_lm_output
def per_sample_nll(outputs: LMOutput | torch.Tensor, mb: SequenceSample) -> list[torch.Tensor]:
    """[summed answer NLL, answer tokens] for each sample of the micro-batch."""
    nll, mask = token_nll(outputs, mb)
    lens = mb.seqlens["packed_input_ids"]
    return [
        torch.stack([(n * m).sum(), m.sum().float()])
        for n, m in zip(nll.split(lens), mask.split(lens), strict=True)
    ]


class SFTInterface(ModelInterface):
    """Supervised fine-tuning: next-token NLL over answer tokens."""

    Args = SFTArgs

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        stats = model.module.train_batch(
            data,
            mb_spec,
            loss_fn=sft_loss,
            loss_weight_fn=num_answer_tokens,
            version_steps=model.version.global_step,
            lr_scale=self.args.lr_scale,
            token_normalize_scope=self.args.token_normalize_scope,
        )
        stats["ppl"] = math.exp(min(stats["loss"], 50.0))
        model.inc_version()
        return stats

    def evaluate(self, model: Model, loader) -> dict[str, float]:
        nll_sum, n_tokens = 0.0, 0.0
        for batch in loader:
            out = model.module.forward(
                batch, MicroBatchSpec(), post_hook=per_sample_nll, aggregate_fn=torch.stack
            )
            nll_sum += float(out[:, 0].sum())
            n_tokens += float(out[:, 1].sum())
        nll_sum, n_tokens = distributed.all_reduce([nll_sum, n_tokens])  # over every rank's slice
        nll = nll_sum / max(n_tokens, 1.0)
        return {"nll": nll, "ppl": math.exp(min(nll, 50.0))}

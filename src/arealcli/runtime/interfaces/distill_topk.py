"""Top-k on-policy distillation (`preset: distill` with `topk: K`): at every position of the student's
own samples that predicts a response token, the KL from the teacher's K most likely next tokens to the
student, computed exactly over those K tokens instead of estimated from the one token sampled.

    inference   (on the teacher)  packed_input_ids -> packed_topk_ids (tokens, K), packed_topk_logprobs
                                  (tokens, K): the teacher's K most likely next tokens at each position
                                  and their log-probs (log_softmax over the whole vocabulary)
    train_step  (on the student)  L = mean over response tokens t of sum_j q_tj (log q_tj - log pi(v_tj | c_t)),
                                  q_t = softmax of the teacher's top-K log-probs (renormalized over them),
                                  v_tj the teacher's j-th token; one optimizer step per minibatch

With K = the vocabulary it is the exact forward KL(pi_T || pi) at every position; any K keeps the
teacher's most likely tokens, where almost all of its mass is (`teacher_mass`: the mass its top-K held,
before renormalizing). The loss is supervised (no rewards, no returns, no PPO ratio): the samples are the
student's own, which is what makes it on-policy (Agarwal et al. 2024, GKD, with beta = 0). The held-out
evaluation is the actor's (greedy accuracy on the eval prompts).
"""

from __future__ import annotations

import torch

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, takes_lm_output
from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
from arealcli.runtime.interfaces.sft import answer_token_mask, num_answer_tokens
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import TOPK_IDS, TOPK_LOGPROBS, TopKDistillArgs


def teacher_topk(lm: LMOutput, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (tokens, k), ids (tokens, k)) of the k most likely next tokens at every position."""
    logp = torch.log_softmax(lm.logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return values, ids


@takes_lm_output
def topk_kl_loss(outputs: LMOutput, mb: SequenceSample) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over response-predicting positions of KL(q || pi) on the teacher's top-k tokens."""
    mask = answer_token_mask(mb).to(outputs.device)
    rows = outputs.rows(mask)
    student = torch.log_softmax(rows.logits.float(), dim=-1)  # (n, V)
    ids = mb.data[TOPK_IDS].to(outputs.device)[mask]  # (n, k)
    teacher = mb.data[TOPK_LOGPROBS].to(outputs.device)[mask].float()  # (n, k)
    q = torch.log_softmax(teacher, dim=-1)  # renormalized over the top k
    kl = (q.exp() * (q - student.gather(-1, ids))).sum(-1)  # (n,)
    n = mask.sum().clamp(min=1)
    stats = {
        "teacher_mass": teacher.exp().sum(-1).sum().detach() / n,
        "student_mass": student.gather(-1, ids).exp().sum(-1).sum().detach() / n,
    }
    return kl.sum() / n, stats


class TopKDistillInterface(PPOActorInterface):
    """The teacher's top-k next tokens (inference on the teacher) and the student's update toward them
    (train_step); generation and held-out evaluation are the actor's."""

    Args = TopKDistillArgs

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        k = self.args.topk

        def hook(outputs: LMOutput, mb: SequenceSample) -> list[tuple[torch.Tensor, torch.Tensor]]:
            values, ids = teacher_topk(outputs, k)
            lens = mb.seqlens["packed_input_ids"]
            return list(zip(values.cpu().split(lens), ids.cpu().split(lens), strict=True))

        per_sample = model.module.forward(data, mb_spec, post_hook=takes_lm_output(hook), aggregate_fn=list)
        lens = list(data.seqlens["packed_input_ids"])
        return SequenceSample(
            data.ids,
            {TOPK_LOGPROBS: lens, TOPK_IDS: lens},
            {
                TOPK_LOGPROBS: torch.cat([v for v, _ in per_sample]),
                TOPK_IDS: torch.cat([i for _, i in per_sample]),
            },
        )

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        seeds = [model.version.global_step]  # one pass over the student's samples
        stats = self.minibatch_updates(model, data, mb_spec, topk_kl_loss, num_answer_tokens, seeds)
        stats["kl_topk"] = stats.get("loss", 0.0)
        model.inc_version()
        return stats

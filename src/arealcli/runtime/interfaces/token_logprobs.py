"""Next-token log-probs (and entropy) of packed sequences, from a micro-batch's `LMOutput` or logits.

Position t of a sequence predicts token t+1: its target is the next token of the same sequence. The
last position of each sequence predicts nothing; its log-prob and entropy are set to 0.
"""

from __future__ import annotations

import torch

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, as_lm_output


def next_tokens(mb: SequenceSample) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets (tokens,): the next token at every position, ends (B,): each sequence's last position)."""
    targets = torch.roll(mb.data["packed_input_ids"], shifts=-1)
    ends = mb.cu_seqlens("packed_input_ids")[1:] - 1
    return targets, ends


def next_token_logprobs(
    outputs: LMOutput | torch.Tensor, mb: SequenceSample, temperature: float = 1.0
) -> torch.Tensor:
    """(tokens,) log p(x_{t+1} | x_<=t) = log_softmax(logits_t / T)[x_{t+1}]; 0 at each sequence's end."""
    lm = as_lm_output(outputs)
    targets, ends = next_tokens(mb)
    return lm.logprobs(targets, temperature).index_fill(0, ends.to(lm.device), 0.0)


def next_token_logprobs_and_entropy(
    outputs: LMOutput | torch.Tensor, mb: SequenceSample, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs (tokens,), entropy (tokens,)) of softmax(logits_t / T), in one pass; both 0 at each
    sequence's end."""
    lm = as_lm_output(outputs)
    targets, ends = next_tokens(mb)
    logp, ent = lm.logprobs_and_entropy(targets, temperature)
    ends = ends.to(lm.device)
    return logp.index_fill(0, ends, 0.0), ent.index_fill(0, ends, 0.0)

"""A Bradley-Terry reward model's math: which token scores a sequence, the pairwise loss, its metrics.

A reward model gives a scalar score s(x, y) to a prompt x with a response y: its head's output at the
sequence's last token. For a preference pair (y_w chosen, y_l rejected) Bradley-Terry models
P(y_w > y_l | x) = sigma(s_w - s_l), and the loss is its negative log-likelihood:

    L = -log sigma(s_w - s_l - m)                  m: the pair's margin (0 unless the data gives one)
      + c * (s_w + s_l)^2                          c: center_rewards_coefficient (keeps scores near 0)

averaged over the pairs. Pairwise accuracy is the share of pairs with s_w > s_l.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def score_positions(ids: torch.Tensor, cu_seqlens: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """(B,) packed position of the token that scores each sequence: its last token that is not `pad_id`
    (Hugging Face's sequence classifiers' rule, so a saved reward model scores the same there), or its
    first when every token is `pad_id`; the last token when there is no pad token.

    ids (tokens,) packed token ids; cu_seqlens (B + 1,) the sequences' offsets in them.
    """
    ends = cu_seqlens[1:] - 1  # (B,)
    if pad_id is None:
        return ends
    starts = cu_seqlens[:-1]
    lens = (cu_seqlens[1:] - starts).tolist()
    seq = torch.repeat_interleave(
        torch.arange(len(lens), device=ids.device), torch.tensor(lens, device=ids.device)
    )
    pos = torch.arange(ids.shape[0], device=ids.device)  # (tokens,)
    kept = torch.where(ids != pad_id, pos, torch.full_like(pos, -1))  # (tokens,) -1 on pad tokens
    last = torch.full_like(ends, -1).scatter_reduce(0, seq, kept, reduce="amax")  # (B,)
    return torch.where(last >= 0, last, starts)


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """(P,) -log sigma(s_w - s_l - m) of each pair; chosen, rejected, margin (P,)."""
    diff = chosen - rejected  # (P,)
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff)


def centering_penalty(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(P,) (s_w + s_l)^2: with a coefficient, it pulls the scores of each pair towards 0 (a reward
    model's scores are otherwise free up to a constant)."""
    return (chosen + rejected) ** 2


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Means over the pairs: `accuracy` (share with s_w > s_l), `rewards/chosen` (s_w),
    `rewards/rejected` (s_l), `rewards/margins` (s_w - s_l)."""
    return {
        "accuracy": (chosen > rejected).float().mean(),
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }

"""The built-in algorithm variants the PPO actor picks by name: policy losses (`policy_loss`),
advantage estimators (`adv_norm`) and KL estimators (`kl_estimator`).

Each is a plain function over tensors, registered in schema/builtins.py (so `areal check` knows the
names without importing torch). A recipe's `imports:` module adds its own the same way:

    from arealcli.api import register_policy_loss

    def my_loss(logp, old_logp, advantages, mask, args, prox_logp=None):
        ...
        return loss, {"my_stat": value}

    register_policy_loss("my_loss", my_loss)

Shapes: (B, T) are per-token tensors of the response view (one row per sequence); (B,) per sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from arealcli.runtime.algo import functional as F
from arealcli.runtime.interfaces.rl_common import dp_masked_normalize, dp_std

# ----------------------------------------------------------------------------- policy losses
# fn(logp, old_logp, advantages, mask, args, prox_logp=None) -> (scalar loss, {stat: detached scalar})


def ppo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    args: Any,
    prox_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO: clip-higher (eps_clip_higher), dual clip (c_clip), decoupled PPO (prox_logp), a
    per-token or per-sequence ratio (importance_ratio)."""
    return _clipped(logp, old_logp, advantages, mask, args, prox_logp, args.importance_ratio)


def gspo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    args: Any,
    prox_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO's clipped objective on one ratio per sequence, exp(mean_t log r_t)."""
    return _clipped(logp, old_logp, advantages, mask, args, prox_logp, "sequence")


def _clipped(logp, old_logp, advantages, mask, args, prox_logp, importance_ratio: str):
    return F.ppo_actor_loss(
        logp,
        old_logp,
        advantages,
        mask,
        eps_clip=args.eps_clip,
        eps_clip_higher=args.eps_clip_higher,
        c_clip=args.c_clip,
        prox_logp=prox_logp,
        behav_imp_weight_cap=args.behav_imp_weight_cap,
        behav_imp_weight_mode=args.behav_imp_weight_mode,
        aggregation=args.aggregation,
        max_len=args.generation.max_new_tokens,
        importance_ratio=importance_ratio,
    )


def cispo(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    args: Any,
    prox_logp: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): the importance weight is clipped and detached, so every token keeps its
    policy-gradient signal (PPO's clip drops the gradient of clipped tokens).

    r = exp(logp - denom)   (denom = prox_logp when decoupled, else old_logp)
    L = -sg(clip(r, 1 - eps_clip, 1 + eps_clip_higher)) * A * logp       [higher defaults to eps_clip]
    decoupled: L *= sg(exp(prox_logp - old_logp)), the behaviour weight.
    loss = aggregate_loss(L, mask, aggregation, max_len)
    """
    denom = (old_logp if prox_logp is None else prox_logp).detach()
    high = args.eps_clip if args.eps_clip_higher is None else args.eps_clip_higher
    ratio = torch.exp((logp.detach() - denom).clamp(-20.0, 20.0))  # (B, T)
    weight = ratio.clamp(1 - args.eps_clip, 1 + high)  # (B, T) no gradient
    token_loss = -weight * advantages.detach() * logp  # (B, T)
    if prox_logp is not None:
        token_loss = token_loss * torch.exp((prox_logp - old_logp).detach().clamp(max=20.0))
    valid = mask.bool()
    loss = F.aggregate_loss(token_loss, valid, args.aggregation, args.generation.max_new_tokens)
    with torch.no_grad():
        stats = {
            "approx_kl": 0.5 * F.masked_mean((logp.detach() - denom) ** 2, valid),
            "clip_frac": F.masked_mean((weight != ratio).float(), valid),
            "ratio_mean": F.masked_mean(ratio, valid),
            "ratio_max": torch.where(valid, ratio, 0.0).max(),
        }
    return loss, stats


# ----------------------------------------------------------------------------- advantage estimators
# fn(scores (B,), advantages (B, T), mask (B, T), group_ids (B,), args) -> (B, T), 0 outside the mask


def batch(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """The returns call's GAE advantages whitened over every token of the batch (PPO; every rank's)."""
    return dp_masked_normalize(advantages, mask)


def none(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """The returns call's GAE advantages as they are."""
    return advantages * mask


def _per_group(scores: Tensor, group_ids: Tensor, args: Any, divide_std: bool, leave_one_out: bool) -> Tensor:
    return F.group_normalize(
        scores,
        group_ids,
        subtract_mean=True,
        divide_std=divide_std,
        leave_one_out=leave_one_out,
        unbiased=args.group_std_estimator == "unbiased",
    )


def group(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """Sequence scores against their prompt group, as group_std and leave_one_out say: (s - mean_g) /
    std_g by default (GRPO), the batch std (LitePPO), no std (Dr.GRPO), the others' mean (RLOO)."""
    seq = _per_group(scores, group_ids, args, args.group_std == "group", args.leave_one_out)  # (B,)
    if args.group_std == "batch":  # group mean, batch std (over every rank's batch)
        seq = seq / (dp_std(scores) + 1e-5)
    return seq[:, None] * mask


def grpo(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """GRPO: A_i = (s_i - mean_g) / (std_g + 1e-5) on every token of sample i."""
    return _per_group(scores, group_ids, args, True, False)[:, None] * mask


def dr_grpo(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """Dr.GRPO: A_i = s_i - mean_g (no std; pair it with aggregation seq-mean-token-sum-norm)."""
    return _per_group(scores, group_ids, args, False, False)[:, None] * mask


def rloo(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """RLOO: A_i = s_i - mean of the other samples of its group."""
    return _per_group(scores, group_ids, args, False, True)[:, None] * mask


def lite_ppo(scores: Tensor, advantages: Tensor, mask: Tensor, group_ids: Tensor, args: Any) -> Tensor:
    """LitePPO: A_i = (s_i - mean_g) / std of the whole batch's scores."""
    seq = _per_group(scores, group_ids, args, False, False) / (dp_std(scores) + 1e-5)
    return seq[:, None] * mask


# ----------------------------------------------------------------------------- KL estimators
# fn(logp, ref_logp) -> (B, T), log r = logp - ref_logp


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log r: unbiased, can be negative."""
    return F.kl_estimate(logp, ref_logp, "k1")


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = (log r)^2 / 2: biased, >= 0, low variance."""
    return F.kl_estimate(logp, ref_logp, "k2")


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = exp(-log r) - 1 + log r: unbiased, >= 0 (log r clamped to +-10)."""
    return F.kl_estimate(logp, ref_logp, "k3")


def abs_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """|log r|: >= 0, biased (verl's `abs`)."""
    return (logp - ref_logp).abs()

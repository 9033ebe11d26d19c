"""The built-in preference losses the `dpo` interface picks by name (`loss`), one plain function each.

Each is registered in schema/builtins.py (so `areal check` knows the names without importing torch); a
recipe's `imports:` module adds its own the same way:

    from arealcli.api import register_preference_loss

    def my_loss(pairs, args):
        h = pairs.logratio_margin()
        return -torch.nn.functional.logsigmoid(args.beta * h), *pairs.rewards(args.beta)

    register_preference_loss("my_loss", my_loss)

fn(pairs, args) -> (loss (P,), chosen_reward (P,), rejected_reward (P,)): one loss and one implicit
reward per pair; `args` the DPOArgs. The rewards are statistics (`rewards/chosen`, `rewards/accuracies`,
held-out preference accuracy), never differentiated. Notation, per pair: logp_c, logp_r the policy's
log-probs of the chosen and the rejected response summed over their tokens, ref_c, ref_r the
reference's, |c|, |r| their token counts, sigma the logistic function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid, relu


@dataclass
class Pairs:
    """Per pair (P,): summed response log-probs under the policy (with gradients) and the reference
    (None for a reference-free loss), and the responses' token counts."""

    logp_chosen: Tensor
    logp_rejected: Tensor
    ref_chosen: Tensor | None
    ref_rejected: Tensor | None
    len_chosen: Tensor
    len_rejected: Tensor

    def logratios(self) -> tuple[Tensor, Tensor]:
        """(logp_c - ref_c, logp_r - ref_r), each (P,)."""
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ValueError("this loss needs the reference model's log-probs (packed_ref_logprobs)")
        return self.logp_chosen - self.ref_chosen, self.logp_rejected - self.ref_rejected

    def logratio_margin(self) -> Tensor:
        """h = (logp_c - ref_c) - (logp_r - ref_r)   (P,)"""
        chosen, rejected = self.logratios()
        return chosen - rejected

    def rewards(self, beta: float) -> tuple[Tensor, Tensor]:
        """DPO's implicit rewards beta * (logp - ref) of the chosen and the rejected response (P,)."""
        chosen, rejected = self.logratios()
        return beta * chosen.detach(), beta * rejected.detach()


def _smoothed_logistic(x: Tensor, eps: float) -> Tensor:
    """-(1 - eps) log sigma(x) - eps log sigma(-x): the logistic loss of a label flipped with prob. eps."""
    return -(1 - eps) * logsigmoid(x) - eps * logsigmoid(-x)


def sigmoid(pairs: Pairs, args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """DPO (Rafailov et al. 2023); with label_smoothing eps, conservative DPO (cDPO).

    h = (logp_c - ref_c) - (logp_r - ref_r)
    L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
    """
    return _smoothed_logistic(args.beta * pairs.logratio_margin(), args.label_smoothing), *pairs.rewards(
        args.beta
    )


def ipo(pairs: Pairs, args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al. 2023), on per-token log-ratios (as TRL; beta is the paper's tau).

    h = (logp_c - ref_c) / |c| - (logp_r - ref_r) / |r|
    L = (h - 1 / (2 beta))^2
    """
    chosen, rejected = pairs.logratios()
    h = chosen / pairs.len_chosen.clamp(min=1) - rejected / pairs.len_rejected.clamp(min=1)
    return (h - 1 / (2 * args.beta)) ** 2, *pairs.rewards(args.beta)


def hinge(pairs: Pairs, args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """SLiC's hinge loss (Zhao et al. 2023) on DPO's margin.

    L = max(0, 1 - beta h),   h = (logp_c - ref_c) - (logp_r - ref_r)
    """
    return relu(1 - args.beta * pairs.logratio_margin()), *pairs.rewards(args.beta)


def robust(pairs: Pairs, args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Robust DPO (rDPO, Chowdhury et al. 2024): unbiased under labels flipped with probability eps.

    L = (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)
    """
    x, eps = args.beta * pairs.logratio_margin(), args.label_smoothing
    loss = (-(1 - eps) * logsigmoid(x) + eps * logsigmoid(-x)) / (1 - 2 * eps)
    return loss, *pairs.rewards(args.beta)


def simpo(pairs: Pairs, args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al. 2024): no reference model; length-normalized log-probs and a margin gamma.

    h = logp_c / |c| - logp_r / |r| - gamma / beta
    L = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
    rewards: beta * logp / |y|
    """
    chosen = pairs.logp_chosen / pairs.len_chosen.clamp(min=1)  # (P,)
    rejected = pairs.logp_rejected / pairs.len_rejected.clamp(min=1)
    h = chosen - rejected - args.simpo_gamma / args.beta
    loss = _smoothed_logistic(args.beta * h, args.label_smoothing)
    return loss, args.beta * chosen.detach(), args.beta * rejected.detach()


def pair_metrics(pairs: Pairs, chosen_reward: Tensor, rejected_reward: Tensor) -> dict[str, Tensor]:
    """TRL's names: the means over the pairs of the implicit rewards, their margin, how often the chosen
    one wins (`rewards/accuracies`), and the summed log-probs of the responses."""
    with torch.no_grad():
        return {
            "rewards/chosen": chosen_reward.mean(),
            "rewards/rejected": rejected_reward.mean(),
            "rewards/margins": (chosen_reward - rejected_reward).mean(),
            "rewards/accuracies": (chosen_reward > rejected_reward).float().mean(),
            "logps/chosen": pairs.logp_chosen.detach().mean(),
            "logps/rejected": pairs.logp_rejected.detach().mean(),
        }

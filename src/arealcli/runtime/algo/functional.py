"""The RL math as plain torch functions: rewards, KL, advantages, normalization, losses.

Conventions (each function states its formula in its docstring):

- B = batch rows (sequences), T = padded response length, N = number of sequences (flat), V = vocab.
- Token-level tensors are right-padded `(B, T)`. `mask (B, T)` (bool or 0/1 float) is 1 on the valid
  response tokens, contiguous from the left, then 0. Padding positions may hold any finite value:
  every function ignores them and writes 0 there.
- `logp` = current policy, `old_logp` = behaviour policy (generated the data), `ref_logp` = frozen
  reference, `prox_logp` = policy recomputed just before the update (decoupled / off-policy PPO).
- Every masked average is 0, not NaN, when nothing is valid, and keeps the autograd graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


# ----------------------------------------------------------------------------- masked statistics


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """mean(x) over positions where mask = 1: sum(x * mask) / sum(mask); 0 where sum(mask) = 0.

    dim=None reduces everything to a scalar; an int reduces only that dimension.
    """
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    # Divide by 1 where nothing is valid: the numerator is 0 there, so the result is 0 (and so is
    # its gradient), never 0/0 = NaN.
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_normalize(
    x: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    subtract_mean: bool = True,
    divide_std: bool = True,
    eps: float = 1e-5,
) -> Tensor:  # (B, T)
    """(x - mean) / (std + eps) over all valid tokens of the batch; padding stays 0.

    mean and std (population std, unbiased=False) are taken over every valid token of `x`, whichever
    of the two steps is enabled.
    """
    mean = masked_mean(x, mask)  # ()
    std = masked_mean((x - mean) ** 2, mask).sqrt()  # ()
    out = x - mean if subtract_mean else x
    if divide_std:
        out = out / (std + eps)
    return out * mask.to(x.dtype)


# ----------------------------------------------------------------------------- rewards and KL


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3), elementwise.

    log r = logp - ref_logp
    k1 = log r                          (unbiased, can be negative)
    k2 = (log r)^2 / 2                  (biased, >= 0, low variance)
    k3 = exp(-log r) - 1 + log r        (unbiased, >= 0); log r clamped to [-10, 10] first so
                                         exp() cannot overflow.
    """
    log_r = logp - ref_logp
    if kind == "k1":
        return log_r
    if kind == "k2":
        return log_r.pow(2) / 2
    if kind == "k3":
        log_r = log_r.clamp(-10.0, 10.0)
        return torch.exp(-log_r) - 1 + log_r
    raise ValueError(f"unknown KL estimator kind {kind!r}; expected one of {KL_KINDS}")


def shape_scores(
    scores: Tensor,  # (B,)
    bias: float = 0.0,
    scale: float = 1.0,
    max_abs: float = 5.0,
) -> Tensor:  # (B,)
    """Reward shaping: clip((score - bias) * scale, -max_abs, +max_abs).

    Sign convention: the bias is SUBTRACTED (bias=0.5 maps a 0/1 verifier score to -0.5/+0.5 before
    scaling). The newer reference system adds its bias instead; negate it when porting a config.
    """
    return ((scores - bias) * scale).clamp(-max_abs, max_abs)


def overlong_penalty(
    response_lengths: Tensor,  # (B,)
    max_new_tokens: int,
    overlong_tokens: int,
    penalty_factor: float,
) -> Tensor:  # (B,)
    """DAPO soft overlong punishment: a linear penalty over the last `overlong_tokens` before the limit.

    free = max_new_tokens - overlong_tokens
    penalty = 0                                                   if len <= free
            = -penalty_factor * (len - free) / overlong_tokens    otherwise (-penalty_factor at the limit)
    """
    if overlong_tokens <= 0:
        raise ValueError(
            f"overlong_tokens must be > 0 (got {overlong_tokens}); skip the penalty to disable it"
        )
    free = max_new_tokens - overlong_tokens
    lengths = response_lengths if response_lengths.is_floating_point() else response_lengths.float()
    excess = (lengths - free).clamp(min=0)  # (B,) tokens into the penalty window
    return -penalty_factor * excess / overlong_tokens


def token_rewards(
    scores: Tensor,  # (B,)
    mask: Tensor,  # (B, T)
    kl: Tensor | None,  # (B, T)
    kl_coef: float,
) -> Tensor:  # (B, T)
    """Per-token rewards for classic PPO with KL in the reward.

    r_t = -kl_coef * kl_t                on valid tokens (0 on padding)
    r_last += score                      at the last valid token of each row
    A row with no valid token gets all zeros (its score is dropped).
    """
    B, T = mask.shape
    valid = mask.bool()  # (B, T)
    rewards = torch.zeros(B, T, dtype=scores.dtype, device=scores.device)
    if kl is not None:
        rewards = torch.where(valid, -kl_coef * kl.to(scores.dtype), rewards)
    positions = torch.arange(T, device=mask.device)  # (T,)
    last = (positions * valid).argmax(-1)  # (B,) index of the last valid token (0 if none)
    at_last = (positions == last[:, None]) & valid.any(-1, keepdim=True)  # (B, T)
    return rewards + at_last * scores[:, None]


# ----------------------------------------------------------------------------- advantages


def gae(
    rewards: Tensor,  # (B, T)
    values: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    bootstrap: Tensor,  # (B,)
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:  # advantages (B, T), returns (B, T)
    """Generalized advantage estimation, vectorized over rows, one reverse pass over T.

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    V after the last valid token is bootstrap[b] (0 for a sequence that ended with EOS, the critic's
    value for a truncated one) and A after it is 0. returns = A + V. Both are 0 on padding.
    With V = 0 and gamma = lam = 1, A_t = sum of rewards from t on (+ bootstrap).
    """
    valid = mask.bool()  # (B, T)
    next_value = bootstrap.to(values.dtype)  # (B,) V_{t+1}
    next_adv = torch.zeros_like(next_value)  # (B,) A_{t+1}
    advantages = [next_adv] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        adv = delta + gamma * lam * next_adv  # (B,)
        # On padding keep carrying the bootstrap value and A = 0 back to the last valid token.
        advantages[t] = torch.where(valid[:, t], adv, torch.zeros_like(adv))
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_adv = advantages[t]
    adv = torch.stack(advantages, dim=1)  # (B, T)
    returns = torch.where(valid, adv + values, torch.zeros_like(adv))  # (B, T)
    return adv, returns


def group_normalize(
    scores: Tensor,  # (N,)
    group_ids: Tensor,  # (N,) long, any values; equal id = responses to the same prompt
    subtract_mean: bool = True,
    divide_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-5,
    unbiased: bool = False,
) -> Tensor:  # (N,)
    """Per-group normalization of sequence scores (GRPO and its variants).

    GRPO:     (s_i - mean_g) / (std_g + eps)           std = population std (realhf), or with
                                                       unbiased=True the n - 1 estimator (TRL, AReaL 1.0)
    Dr.GRPO:  s_i - mean_g                             subtract_mean=True, divide_std=False
    RLOO:     s_i - mean of the OTHER members of g     leave_one_out=True (a group of size 1 -> 0)
    A group whose scores are all identical (including a group of one) gets exactly 0 whenever a
    baseline is subtracted -- not a rounding residue divided by eps, and never NaN.
    """
    if leave_one_out and not subtract_mean:
        raise ValueError("leave_one_out=True replaces the group-mean baseline; it needs subtract_mean=True")
    groups, inverse = torch.unique(group_ids, return_inverse=True)  # inverse (N,): group index 0..G-1
    G = groups.numel()

    def group_sum(x: Tensor) -> Tensor:  # (N,) -> (G,)
        return scores.new_zeros(G).index_add(0, inverse, x)

    count = group_sum(torch.ones_like(scores))  # (G,)
    total = group_sum(scores)  # (G,)
    mean = (total / count)[inverse]  # (N,)
    dof = (count - 1).clamp(min=1) if unbiased else count  # (G,) a group of one has std 0 either way
    std = (group_sum((scores - mean) ** 2) / dof).sqrt()[inverse]  # (N,)

    out = scores
    if leave_one_out:
        others = (count[inverse] - 1).clamp(min=1)  # (N,)
        out = scores - (total[inverse] - scores) / others
    elif subtract_mean:
        out = scores - mean
    if divide_std:
        out = out / (std + eps)
    if subtract_mean:
        group_min = scores.new_zeros(G).scatter_reduce(0, inverse, scores, "amin", include_self=False)
        group_max = scores.new_zeros(G).scatter_reduce(0, inverse, scores, "amax", include_self=False)
        constant = (group_min == group_max)[inverse]  # (N,)
        out = torch.where(constant, torch.zeros_like(out), out)
    return out


def dynamic_sampling_mask(
    scores: Tensor,  # (N,) e.g. 1 = correct
    group_ids: Tensor,  # (N,) long
    lower: float = 0.0,
    upper: float = 1.0,
) -> Tensor:  # (N,) bool
    """DAPO dynamic sampling: keep the samples of groups whose scores are not all the same (std > 0)
    and whose mean score r has lower <= r <= upper.

    A group whose samples all score the same -- all correct, all wrong, or [0.5, 0.5] -- has zero
    group-normalized advantage and carries no GRPO signal, so it is dropped. The caller refills the batch.
    """
    groups, inverse = torch.unique(group_ids, return_inverse=True)  # inverse (N,): group index 0..G-1
    scores = scores if scores.is_floating_point() else scores.float()
    G = groups.numel()
    total = scores.new_zeros(G).index_add(0, inverse, scores)  # (G,)
    count = scores.new_zeros(G).index_add(0, inverse, torch.ones_like(scores))  # (G,)
    rate = total / count  # (G,)
    high = scores.new_full((G,), float("-inf")).scatter_reduce(0, inverse, scores, "amax")  # (G,)
    low = scores.new_full((G,), float("inf")).scatter_reduce(0, inverse, scores, "amin")  # (G,)
    return ((high > low) & (rate >= lower) & (rate <= upper))[inverse]


# ----------------------------------------------------------------------------- losses


def aggregate_loss(
    loss_tokens: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    mode: str,
    max_len: int | None = None,
) -> Tensor:  # ()
    """Reduce per-token losses to a scalar.

    token-mean               sum(L * mask) / sum(mask)
    seq-mean-token-mean      mean over rows with >= 1 valid token of (row's masked mean)
    seq-mean-token-sum-norm  sum(L * mask) / (B * max_len)    (Dr.GRPO; max_len defaults to T, and B
                             counts every row so the normalizer is a constant)
    An all-zero mask gives 0 (not NaN) that is still connected to the graph.
    """
    if mode == "token-mean":
        return masked_mean(loss_tokens, mask)
    if mode == "seq-mean-token-mean":
        row_mean = masked_mean(loss_tokens, mask, dim=-1)  # (B,)
        row_valid = mask.bool().any(-1)  # (B,)
        return masked_mean(row_mean, row_valid)
    if mode == "seq-mean-token-sum-norm":
        B, T = loss_tokens.shape
        return (loss_tokens * mask.to(loss_tokens.dtype)).sum() / (B * (T if max_len is None else max_len))
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")


BEHAV_IMP_WEIGHT_MODES = ("mask", "truncate", "seq-mask", "seq-truncate")


def loglinear_alpha(behaviour_versions: Tensor, version: int) -> Tensor:
    """Per sample, how far the proximal policy is from the behaviour policy toward the current one.

    The proximal policy is the trained model before this update (version V = `version`, the number
    of updates so far); the policy being trained is taken one version ahead (V + 1); a sample was
    generated by version v_b <= V. Interpolating in version time (AReaL's log-linear approximation):

        alpha = (V - v_b) / (V + 1 - v_b)      in [0, 1); 0 for a sample of the current weights.
    """
    v_b = behaviour_versions.float().clamp(max=float(version))
    return (version - v_b) / (version + 1 - v_b)


def loglinear_prox_logp(old_logp: Tensor, logp: Tensor, alpha: Tensor) -> Tensor:
    """Proximal log-probs without a forward pass: log pi_prox ~ log pi_b + alpha (log pi_theta - log pi_b),
    linear in log space between the behaviour log-probs and the current ones (no gradient)."""
    return (old_logp + alpha * (logp - old_logp)).detach()


def prox_approx_errors(
    approx: Tensor, prox_logp: Tensor, old_logp: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """How far approximated proximal log-probs are from recomputed ones, over the masked tokens:
    mean |approx - prox| and mean |exp(approx - old) - exp(prox - old)| (the behaviour weight's error)."""
    w_err = torch.exp((approx - old_logp).clamp(max=20.0)) - torch.exp((prox_logp - old_logp).clamp(max=20.0))
    return {
        "prox_approx_abs_err": masked_mean((approx - prox_logp).abs(), mask).detach(),
        "prox_approx_weight_err": masked_mean(w_err.abs(), mask).detach(),
    }


def mismatch_stats(generator_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Generator vs trainer log-probs of the generated tokens (numeric mismatch at staleness 0, plus the
    policy's drift when the samples are older): mean |log ratio| and KL(pi_gen || pi_train) by k3."""
    log_ratio = (trainer_logp - generator_logp).detach()
    return {
        "mismatch_abs_log_ratio": masked_mean(log_ratio.abs(), mask),
        "mismatch_kl": masked_mean(kl_estimate(generator_logp.detach(), trainer_logp.detach(), "k3"), mask),
    }


def ppo_actor_loss(
    logp: Tensor,  # (B, T) current policy; the only input that receives gradients
    old_logp: Tensor,  # (B, T) behaviour policy
    advantages: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    prox_logp: Tensor | None = None,  # (B, T) decoupled PPO only
    behav_imp_weight_cap: float | None = None,
    aggregation: str = "token-mean",
    max_len: int | None = None,
    behav_imp_weight_mode: str = "mask",
    importance_ratio: str = "token",
    max_log_ratio: float = 20.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO policy loss, with DAPO clip-higher, dual clip and AReaL's decoupled objective.

    denom = prox_logp if given (decoupled) else old_logp
    log r = clamp(logp - denom, -max_log_ratio, +max_log_ratio)    [20, as verl: exp(30) would be 1e13]
    ratio = exp(log r)                                  importance_ratio="token" (PPO)
          = exp(mean_t log r) per sequence, the gradient that of each token's logp
                                                        importance_ratio="sequence" (GSPO)
    L     = max(-A * ratio, -A * clip(ratio, 1 - eps_clip, 1 + eps_clip_higher))   [higher = eps_clip]
    dual clip (c_clip > 1), for A < 0:  L = min(L, c_clip * |A|)
    decoupled: w = exp(prox_logp - old_logp) (no grad, the behaviour importance weight); L = L * w.
               With behav_imp_weight_cap C: mode "mask" sets L = 0 where w > C, mode "truncate" uses
               min(w, C). Either way those tokens STAY in the denominator (dividing by the kept tokens
               only would inflate the gradient by N / N_kept).
               Sequence modes ("seq-mask", "seq-truncate"; verl's sequence-level rollout correction):
               every token of sequence i gets w_i = exp(mean_t (prox_logp - old_logp)), the geometric
               mean of its token weights; "seq-mask" zeroes the sequence where w_i > C, "seq-truncate"
               uses min(w_i, C).
    loss  = aggregate_loss(L, mask, aggregation, max_len)

    With prox_logp recomputed by the trainer under the very weights that generated (staleness 0), w is
    the ratio between the trainer's and the generation engine's probabilities of the same policy: the
    cap then corrects their numeric mismatch (truncated importance sampling).

    stats (detached scalars over the tokens that count for the loss):
      approx_kl      0.5 * mean((logp - denom)^2)   (the k2 estimator: >= 0, low variance)
      clip_frac      fraction of tokens where the clipped term is the larger one (its gradient is 0)
      dual_clip_frac fraction of tokens capped by the dual clip
      ratio_mean, ratio_max (over the tokens that are not capped away), and when decoupled
      behav_imp_weight_mean / _max and behav_imp_weight_capped_frac over every counted token.
    """
    if importance_ratio not in ("token", "sequence"):
        raise ValueError(f"importance_ratio must be 'token' or 'sequence', got {importance_ratio!r}")
    if behav_imp_weight_mode not in BEHAV_IMP_WEIGHT_MODES:
        raise ValueError(
            f"behav_imp_weight_mode must be one of {BEHAV_IMP_WEIGHT_MODES}, got {behav_imp_weight_mode!r}"
        )
    if c_clip is not None and c_clip <= 1:
        raise ValueError(f"c_clip must be > 1 for dual-clip PPO (got {c_clip}); use None to disable it")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    advantages = advantages.detach()
    old_logp = old_logp.detach()
    denom = old_logp if prox_logp is None else prox_logp.detach()
    valid = mask.bool()  # (B, T)

    raw_log_ratio = logp - denom  # (B, T)
    log_ratio = raw_log_ratio.clamp(-max_log_ratio, max_log_ratio)  # (B, T)
    if importance_ratio == "sequence":  # GSPO: s_i = exp(mean_t log r_t), d s_i/d logp_t = s_i / |y_i|
        seq = masked_mean(log_ratio, valid, dim=-1)  # (B,)
        log_ratio = seq.detach()[:, None] + (logp - logp.detach())  # (B, T) value s_i, grad of logp_t
        log_ratio = torch.where(valid, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(log_ratio)  # (B, T)
    loss_unclipped = -advantages * ratio  # (B, T)
    loss_clipped = -advantages * ratio.clamp(1 - eps_clip, 1 + eps_high)  # (B, T)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # (B, T) pessimistic of the two
    clipped = loss_clipped > loss_unclipped  # (B, T)

    dual_clipped = torch.zeros_like(valid)
    if c_clip is not None:
        cap = c_clip * advantages.abs()  # (B, T)
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)

    stats: dict[str, Tensor] = {}
    counted = valid  # (B, T) tokens whose loss is not capped away (for the ratio statistics)
    if prox_logp is not None:
        behav_log_weight = denom - old_logp  # (B, T) log w = log pi_prox - log pi_behav
        if behav_imp_weight_mode.startswith("seq-"):  # one weight per sequence: the geometric mean
            seq_log_weight = masked_mean(behav_log_weight, valid, dim=-1)  # (B,)
            behav_log_weight = seq_log_weight[:, None].expand_as(behav_log_weight)
        behav_weight = torch.exp(behav_log_weight.clamp(max=20.0))  # (B, T)
        weight = behav_weight
        if behav_imp_weight_cap is not None:
            over = behav_weight > behav_imp_weight_cap  # (B, T)
            if behav_imp_weight_mode.endswith("mask"):
                weight = torch.where(over, torch.zeros_like(weight), weight)
                counted = valid & ~over
            else:
                weight = weight.clamp(max=behav_imp_weight_cap)
            stats["behav_imp_weight_capped_frac"] = masked_mean(over.float(), valid)
        loss = loss * weight
        stats["behav_imp_weight_mean"] = masked_mean(behav_weight, valid)
        stats["behav_imp_weight_max"] = torch.where(valid, behav_weight, 0.0).max()

    total = aggregate_loss(loss, valid, aggregation, max_len)  # every valid token in the denominator
    with torch.no_grad():
        stats["approx_kl"] = 0.5 * masked_mean(log_ratio.detach() ** 2, counted)
        clamped = raw_log_ratio.detach().abs() > max_log_ratio
        stats["log_ratio_clamped_frac"] = masked_mean(clamped.float(), valid)
        stats["clip_frac"] = masked_mean(clipped.float(), counted)
        stats["dual_clip_frac"] = masked_mean(dual_clipped.float(), counted)
        stats["ratio_mean"] = masked_mean(ratio.detach(), counted)
        stats["ratio_max"] = torch.where(counted, ratio.detach(), 0.0).max()  # ratio > 0; 0 if none
    return total, {k: v.detach() for k, v in stats.items()}


def critic_loss(
    values: Tensor,  # (B, T) current critic; the only input that receives gradients
    old_values: Tensor,  # (B, T) critic at rollout time
    returns: Tensor,  # (B, T)
    mask: Tensor,  # (B, T)
    value_eps_clip: float | None = 0.2,
    aggregation: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss (PPO2-style).

    v_clip = v_old + clip(v - v_old, -value_eps_clip, +value_eps_clip)
    L      = max((v - R)^2, (v_clip - R)^2) / 2          (value_eps_clip=None: L = (v - R)^2 / 2)
    stats: value_clip_frac (tokens where the clipped term is larger), value_mean, return_mean.
    """
    old_values = old_values.detach()
    returns = returns.detach()
    loss_unclipped = (values - returns) ** 2  # (B, T)
    loss = loss_unclipped
    clipped = torch.zeros_like(mask, dtype=torch.bool)
    if value_eps_clip is not None:
        v_clip = old_values + (values - old_values).clamp(-value_eps_clip, value_eps_clip)  # (B, T)
        loss_clipped = (v_clip - returns) ** 2  # (B, T)
        loss = torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    total = aggregate_loss(loss / 2, mask, aggregation)
    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean(clipped.float(), mask),
            "value_mean": masked_mean(values.detach(), mask),
            "return_mean": masked_mean(returns, mask),
        }
    return total, stats


def entropy_from_logits(logits: Tensor) -> Tensor:  # (..., V) -> (...)
    """H = -sum_v p_v * log p_v, with log p from log_softmax (stable for large logits).

    -inf logits (masked vocabulary) contribute 0: log p is clamped to the dtype's minimum so the
    0 * -inf = NaN product never happens, in the forward or the backward pass.
    """
    logp = torch.log_softmax(logits, dim=-1)  # (..., V)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


# ----------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019) steering the measured KL toward `target`.

    err   = clip(current_kl / target - 1, -0.2, 0.2)
    value = value * (1 + err * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0 (got target={target}, horizon={horizon})")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def kl_controller(init_kl_coef: float, target: float | None, horizon: float):
    """The adaptive controller when a target KL is given, else a fixed coefficient."""
    if target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target, horizon)

"""Shared by the actor and the critic: response views of packed data, shaped rewards, GAE returns.

Per-token keys are aligned with `packed_input_ids`: position t of a sequence holds the quantity of the
*action* that produces token t+1 (its log-prob, the value of the state before it); the last position
holds the value of the final state (used to bootstrap a truncated response) and 0 for log-probs. The
action positions of a sequence with P prompt tokens and L tokens are P-1 .. L-2 (`answer_token_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arealcli.runtime import distributed
from arealcli.runtime.algo import functional as F
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.sft import answer_token_mask
from arealcli.schema.components.interfaces import RETURNS_OUTPUTS, RewardShaping


def action_index(mb: SequenceSample) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) indices into the packed tokens of each sequence's action positions, and their mask.

    Computed once per micro-batch (cached on it): every response view is then one gather.
    """
    cached = mb.cache.get("action_index")
    if cached is not None:
        return cached
    act = answer_token_mask(mb)  # (tokens,)
    pos = act.nonzero().squeeze(-1)  # (A,) packed positions of all actions, sample by sample
    cu = mb.cu_seqlens("packed_input_ids")
    sample = torch.searchsorted(cu[1:], pos, right=True)  # (A,) which sequence each action is in
    counts = torch.bincount(sample, minlength=mb.bs)  # (B,)
    first = torch.nn.functional.pad(counts.cumsum(0), (1, 0))[:-1]  # (B,) index of each row's first action
    col = torch.arange(pos.shape[0]) - first[sample]  # (A,) column within the row
    t = int(counts.max()) if mb.bs else 0
    index = torch.zeros(mb.bs, t, dtype=torch.long)
    mask = torch.zeros(mb.bs, t, dtype=torch.bool)
    index[sample, col] = pos
    mask[sample, col] = True
    mb.cache["action_index"] = (index, mask)
    return index, mask


def response_view(x: torch.Tensor, mb: SequenceSample) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed per-token `x` (tokens,) -> its action positions as (B, T) right-padded, and the mask."""
    index, mask = action_index(mb)
    index, mask = index.to(x.device), mask.to(x.device)
    return x[index] * mask.to(x.dtype) if x.is_floating_point() else x[index] * mask, mask


def to_packed(padded: torch.Tensor, mb: SequenceSample) -> torch.Tensor:
    """Inverse of `response_view`: (B, T) at action positions -> packed (tokens,), 0 elsewhere."""
    index, mask = action_index(mb)
    out = padded.new_zeros(int(sum(mb.seqlens["packed_input_ids"])))
    out[index.to(padded.device)[mask]] = padded[mask.to(padded.device)]
    return out


def final_state_values(values: torch.Tensor, mb: SequenceSample) -> torch.Tensor:
    """(B,) value at the last position of each sequence (the state after the last token)."""
    ends = mb.cu_seqlens("packed_input_ids")[1:] - 1
    return values[ends.to(values.device)]


@dataclass
class Returns:
    scores: torch.Tensor  # (B,) shaped sequence scores
    mask: torch.Tensor  # (B, T) action mask
    kl: torch.Tensor | None  # (B, T) k1 KL of the behaviour policy to the reference
    advantages: torch.Tensor  # (B, T) GAE advantages (not normalized)
    returns: torch.Tensor  # (B, T)
    values: torch.Tensor  # (B, T)
    kl_coef: float  # the KL controller's coefficient of this step


def shaped_scores(
    raw: torch.Tensor,
    no_eos: torch.Tensor,
    resp_len: torch.Tensor,
    s: RewardShaping,
    max_new_tokens: int | None,
):
    """(B,) scores after the optional no-EOS score, DAPO overlong penalty, bias/scale/clip."""
    scores = raw.float()
    no_eos_value = s.no_eos_value()
    if no_eos_value is not None:
        scores = torch.where(no_eos, torch.full_like(scores, no_eos_value), scores)
    if s.overlong_tokens is not None and max_new_tokens is not None:
        scores = scores + F.overlong_penalty(
            resp_len, max_new_tokens, s.overlong_tokens, s.overlong_penalty_factor
        )
    return F.shape_scores(scores, s.reward_bias, s.reward_scaling, s.max_reward_clip)


def _views(data: SequenceSample) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(B, T) response views: the action mask, the k1 KL of the behaviour policy to the reference
    (None without reference log-probs), and the values (0 without a critic)."""
    old_logp, mask = response_view(data.data["packed_logprobs"].float(), data)
    kl = None
    if "packed_ref_logprobs" in data.data:
        ref_logp, _ = response_view(data.data["packed_ref_logprobs"].float(), data)
        kl = F.kl_estimate(old_logp, ref_logp, "k1") * mask
    if "values" in data.data:
        return mask, kl, response_view(data.data["values"].float(), data)[0]
    return mask, kl, torch.zeros_like(old_logp)


def compute_returns(
    data: SequenceSample,
    s: RewardShaping,
    gae_lambda: float,
    kl_coef: float,
    max_new_tokens: int | None = None,
    returns_lambda: float | None = None,
) -> Returns:
    """Shaped scores -> per-token rewards (KL penalty with coefficient `kl_coef` when in the reward) ->
    GAE: advantages with `gae_lambda`, returns (the critic's targets) with `returns_lambda` (default the
    same). Computed by the `returns` call only; the actor and the critic read its keys (`given_returns`)."""
    mask, kl, values = _views(data)
    no_eos = data.data["seq_no_eos_mask"].bool()  # (B,)
    raw = data.data["rewards"] if "rewards" in data.data else torch.zeros(data.bs)  # distill: KL alone
    scores = shaped_scores(raw, no_eos, mask.sum(-1), s, max_new_tokens)
    # bootstrap from the final state's value only for truncated responses
    bootstrap = (
        torch.where(no_eos, final_state_values(data.data["values"].float(), data), torch.zeros_like(scores))
        if "values" in data.data
        else torch.zeros_like(scores)
    )
    rewards = F.token_rewards(
        scores, mask, kl if s.kl_in_reward else None, kl_coef if s.kl_in_reward else 0.0
    )
    adv, ret = F.gae(rewards, values, mask, bootstrap, s.discount, gae_lambda)
    if returns_lambda is not None and returns_lambda != gae_lambda:
        _, ret = F.gae(rewards, values, mask, bootstrap, s.discount, returns_lambda)
    return Returns(scores, mask, kl, adv, ret, values, kl_coef)


def given_returns(data: SequenceSample, caller: str) -> Returns:
    """`Returns` from the keys the `returns` call produced (advantages, returns, seq_scores): the one
    place rewards become advantages, so the actor and the critic see the same values."""
    missing = [k for k in RETURNS_OUTPUTS if k not in data.data and k not in data.meta]
    if missing:
        raise RuntimeError(
            f"{caller} needs {', '.join(missing)} from a `returns` call before it (interface `returns`; "
            "the grpo and ppo presets add one)"
        )
    mask, kl, values = _views(data)
    adv, _ = response_view(data.data["advantages"].float(), data)
    ret, _ = response_view(data.data["returns"].float(), data)
    kl_coef = float(data.meta["kl_coef"][0]) if data.bs else 0.0
    return Returns(data.data["seq_scores"].float(), mask, kl, adv, ret, values, kl_coef)


def dp_masked_normalize(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`F.masked_normalize` with mean and std over the valid tokens of every rank's batch."""
    if distributed.world() == 1:
        return F.masked_normalize(x, mask, eps=eps)
    m = mask.to(x.dtype)
    total, count = distributed.all_reduce([float((x * m).sum()), float(m.sum())])
    mean = total / count if count > 0 else 0.0
    (sq,) = distributed.all_reduce([float(((x - mean) ** 2 * m).sum())])
    std = (sq / count) ** 0.5 if count > 0 else 0.0
    return (x - mean) / (std + eps) * m


def dp_std(x: torch.Tensor) -> float:
    """Population std of `x` (1-D) over every rank's values."""
    s, sq, n = distributed.all_reduce([float(x.sum()), float((x.double() ** 2).sum()), float(x.numel())])
    mean = s / max(n, 1.0)
    return max(sq / max(n, 1.0) - mean**2, 0.0) ** 0.5


def group_ids(data: SequenceSample) -> torch.Tensor:
    """(B,) prompt group of each sample: generated samples have ids (prompt id, j)."""
    keys = [i[0] if isinstance(i, tuple) else i for i in data.ids]
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def shuffled_minibatches(n: int, n_minibatches: int, seed: int) -> list[list[int]]:
    """Shuffled, sorted index lists of at most `n_minibatches` minibatches.

    Over several ranks the list always has exactly `n_minibatches` entries (some may be empty): every
    rank must make the same number of optimizer steps, whatever its number of samples.
    """
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    size = max(1, -(-n // n_minibatches))
    out = [sorted(perm[i : i + size]) for i in range(0, n, size)]
    if distributed.world() > 1:
        out += [[] for _ in range(n_minibatches - len(out))]
    return out

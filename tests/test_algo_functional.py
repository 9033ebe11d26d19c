"""Hand-computed checks of the RL math in arealcli.runtime.algo.functional.

Every expected number is written out (with its arithmetic in a comment), never recomputed with the
formula under test. Padding positions hold junk values (99, 100, ...) to prove they are ignored.
"""

import math

import pytest
import torch
from torch.testing import assert_close

from arealcli.runtime.algo.functional import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    critic_loss,
    dynamic_sampling_mask,
    entropy_from_logits,
    gae,
    group_normalize,
    kl_estimate,
    loglinear_alpha,
    loglinear_prox_logp,
    masked_mean,
    masked_normalize,
    mismatch_stats,
    overlong_penalty,
    ppo_actor_loss,
    prox_approx_errors,
    shape_scores,
    token_rewards,
)

LN2 = 0.6931471805599453
LN1_5 = 0.4054651081081644
LN5 = 1.6094379124341003


def exact_zero(x):
    assert torch.equal(x, torch.zeros_like(x)), x


# ----------------------------------------------------------------------------- kl_estimate


def test_kl_estimate_k1_k2_k3():
    logp = torch.tensor([[0.0, 1.0], [-1.0, 2.5]])
    ref = torch.tensor([[0.0, 0.0], [0.0, 0.5]])  # log r = [[0, 1], [-1, 2]]
    assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([[0.0, 1.0], [-1.0, 2.0]]))
    # k2 = (log r)^2 / 2
    assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([[0.0, 0.5], [0.5, 2.0]]))
    # k3 = e^{-log r} - 1 + log r: 0 | e^-1 = 0.36787944 | e^1 - 2 = 0.71828183 | e^-2 + 1 = 1.13533528
    assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([[0.0, 0.36787944], [0.71828183, 1.13533528]]))


def test_kl_estimate_k3_clamps_log_ratio_to_10():
    logp = torch.tensor([20.0, -20.0])
    ref = torch.zeros(2)
    # log r clamped to +10: e^-10 - 1 + 10 = 9.0000454; to -10: e^10 - 1 - 10 = 22015.4657948
    assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([9.0000454, 22015.4657948]))
    assert torch.isfinite(kl_estimate(torch.tensor([1e4]), torch.tensor([-1e4]), "k3")).all()


def test_kl_estimate_rejects_unknown_kind():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


# ----------------------------------------------------------------------------- shaping / penalties


def test_shape_scores_subtracts_bias_scales_and_clips():
    scores = torch.tensor([1.0, 0.0, 10.0, -10.0])
    # (1-.5)*2 = 1 | (0-.5)*2 = -1 | (10-.5)*2 = 19 -> 5 | (-10-.5)*2 = -21 -> -5
    assert_close(shape_scores(scores, bias=0.5, scale=2.0, max_abs=5.0), torch.tensor([1.0, -1.0, 5.0, -5.0]))
    assert_close(shape_scores(torch.tensor([0.3, 7.0, -6.0])), torch.tensor([0.3, 5.0, -5.0]))


def test_overlong_penalty_is_linear_over_the_last_window():
    lengths = torch.tensor([50, 80, 81, 90, 100])
    # free = 100 - 20 = 80; penalty = -(len - 80) / 20
    expected = torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0])
    assert_close(
        overlong_penalty(lengths, max_new_tokens=100, overlong_tokens=20, penalty_factor=1.0), expected
    )
    # factor 2: len 90 -> -2 * 10/20 = -1, at the limit -2
    assert_close(
        overlong_penalty(torch.tensor([90, 100]), max_new_tokens=100, overlong_tokens=20, penalty_factor=2.0),
        torch.tensor([-1.0, -2.0]),
    )
    with pytest.raises(ValueError, match="overlong_tokens"):
        overlong_penalty(lengths, max_new_tokens=100, overlong_tokens=0, penalty_factor=1.0)


# ----------------------------------------------------------------------------- token_rewards


MASK_4x4 = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)


def test_token_rewards_kl_penalty_plus_score_at_last_token():
    scores = torch.tensor([1.0, 2.0, 3.0, -1.0])
    kl = torch.tensor(
        [[0.1, 0.2, 0.3, 9.0], [0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0], [0.4, 9.0, 9.0, 9.0]]
    )
    expected = torch.tensor(
        [
            [-0.01, -0.02, -0.03 + 1.0, 0.0],  # score 1 at t=2, padding 0
            [-0.05, -0.05, -0.05, -0.05 + 2.0],  # full row, score at t=3
            [0.0, 0.0, 0.0, 0.0],  # no valid token: all zeros, score dropped
            [-0.04 - 1.0, 0.0, 0.0, 0.0],  # one valid token gets both
        ]
    )
    assert_close(token_rewards(scores, MASK_4x4, kl, kl_coef=0.1), expected)


def test_token_rewards_without_kl_and_with_bool_mask():
    scores = torch.tensor([1.0, 2.0, 3.0, -1.0])
    expected = torch.tensor(
        [[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0]]
    )
    assert_close(token_rewards(scores, MASK_4x4.bool(), None, kl_coef=0.1), expected)


# ----------------------------------------------------------------------------- gae


def test_gae_without_critic_is_reward_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 5.0]])  # last token is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(rewards, torch.zeros(1, 4), mask, torch.zeros(1), gamma=1.0, lam=1.0)
    assert_close(adv, torch.tensor([[6.0, 5.0, 3.0, 0.0]]))  # 1+2+3, 2+3, 3
    assert_close(ret, torch.tensor([[6.0, 5.0, 3.0, 0.0]]))


def test_gae_truncated_vs_eos_and_padding():
    # gamma = lam = 0.5 (gamma*lam = 0.25). Rows 0 and 1 share r = [0, 0, 1], V = [0.5, 1, 2], length 3.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 99.0], [0.0, 0.0, 1.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
    values = torch.tensor([[0.5, 1.0, 2.0, 99.0], [0.5, 1.0, 2.0, 99.0], [99.0, 99.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    bootstrap = torch.tensor([4.0, 0.0, 7.0])  # row 0 truncated (critic says 4), row 1 ended with EOS
    adv, ret = gae(rewards, values, mask, bootstrap, gamma=0.5, lam=0.5)
    # row 0: t2 delta = 1 + .5*4 - 2 = 1 -> A=1; t1 delta = 0 + .5*2 - 1 = 0 -> A = .25*1 = .25;
    #        t0 delta = 0 + .5*1 - .5 = 0 -> A = .25*.25 = .0625.   returns = A + V
    # row 1: t2 delta = 1 + 0 - 2 = -1 -> A=-1; t1 -> -.25; t0 -> -.0625
    # row 2: nothing valid -> zeros
    expected_adv = torch.tensor([[0.0625, 0.25, 1.0, 0.0], [-0.0625, -0.25, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    expected_ret = torch.tensor([[0.5625, 1.25, 3.0, 0.0], [0.4375, 0.75, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert_close(adv, expected_adv)
    assert_close(ret, expected_ret)


def test_gae_bootstrap_on_a_full_length_row():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    adv, ret = gae(rewards, torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([10.0]), gamma=1.0, lam=1.0)
    # A_t = future rewards + bootstrap: 1+2+10, 2+10, 2+10, 2+10
    assert_close(adv, torch.tensor([[13.0, 12.0, 12.0, 12.0]]))
    assert_close(ret, torch.tensor([[13.0, 12.0, 12.0, 12.0]]))


# ----------------------------------------------------------------------------- masked statistics


def test_masked_mean_all_dims_one_dim_and_empty():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert_close(masked_mean(x, mask), torch.tensor(1.5))  # (1+2)/2
    assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 0.0]))  # empty row -> 0
    assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 2.0, 0.0]))
    x.requires_grad_(True)
    out = masked_mean(x, torch.zeros(2, 3))
    exact_zero(out.detach())
    out.backward()
    exact_zero(x.grad)


def test_masked_normalize_over_valid_tokens_of_the_batch():
    # valid = [2, 4, 4, 4, 5, 5, 7, 9]: mean 5, population std 2 (var = (9+1+1+1+0+0+4+16)/8 = 4)
    x = torch.tensor([[2.0, 4.0, 4.0, 4.0, 50.0], [5.0, 5.0, 7.0, 9.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]], dtype=torch.float32)
    assert_close(
        masked_normalize(x, mask, eps=0.0),
        torch.tensor([[-1.5, -0.5, -0.5, -0.5, 0.0], [0.0, 0.0, 1.0, 2.0, 0.0]]),
    )
    assert_close(
        masked_normalize(x, mask),  # default eps: divide by 2 + 1e-5
        torch.tensor([[-3.0, -1.0, -1.0, -1.0, 0.0], [0.0, 0.0, 2.0, 4.0, 0.0]]) / 2.00001,
    )
    assert_close(
        masked_normalize(x, mask, divide_std=False),
        torch.tensor([[-3.0, -1.0, -1.0, -1.0, 0.0], [0.0, 0.0, 2.0, 4.0, 0.0]]),
    )
    assert_close(
        masked_normalize(x, mask, subtract_mean=False, eps=0.0),
        torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [2.5, 2.5, 3.5, 4.5, 0.0]]),
    )


def test_masked_normalize_all_masked_is_zero_not_nan():
    exact_zero(masked_normalize(torch.tensor([[3.0, 4.0]]), torch.zeros(1, 2)))


# ----------------------------------------------------------------------------- group_normalize


# Group ids interleaved and not 0..G-1 on purpose.
#   id 7: [1, 0, 1, 0]       mean .5, std .5
#   id 2: [.3, .3, .3]       identical rewards
#   id 9: [5]                single element
#   id 4: [0, 0, 0, 1]       mean .25, std sqrt(3)/4 = .4330127
GROUP_IDS = torch.tensor([7, 2, 4, 7, 9, 2, 4, 7, 4, 2, 7, 4])
GROUP_SCORES = torch.tensor([1.0, 0.3, 0.0, 0.0, 5.0, 0.3, 0.0, 1.0, 0.0, 0.3, 0.0, 1.0])
SQRT3 = 1.7320508075688772


def test_group_normalize_grpo():
    out = group_normalize(GROUP_SCORES, GROUP_IDS, eps=0.0)
    # id 7: ±.5/.5 = ±1 | id 4: -.25/(sqrt3/4) = -1/sqrt3, .75/(sqrt3/4) = sqrt3 | ids 2, 9: exactly 0
    a, b = -1 / SQRT3, SQRT3
    assert_close(out, torch.tensor([1.0, 0.0, a, -1.0, 0.0, 0.0, a, 1.0, a, 0.0, -1.0, b]))
    default_eps = group_normalize(GROUP_SCORES, GROUP_IDS)
    assert_close(default_eps[[0, 3]], torch.tensor([0.5, -0.5]) / 0.50001)
    for i in (1, 4, 5, 9):  # identical-reward group and single-element group
        assert default_eps[i].item() == 0.0


def test_group_normalize_identical_rewards_are_exactly_zero():
    # 0.1 is not representable: a naive (s - mean) / (std + eps) leaves a residue here.
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 1])
    for kwargs in (
        {},
        {"divide_std": False},
        {"leave_one_out": True},
        {"leave_one_out": True, "divide_std": False},
    ):
        exact_zero(group_normalize(scores, ids, **kwargs))


def test_group_normalize_dr_grpo_mean_only():
    out = group_normalize(GROUP_SCORES, GROUP_IDS, divide_std=False)
    # id 7: s - .5 | id 4: s - .25 | ids 2, 9: 0
    assert_close(out, torch.tensor([0.5, 0.0, -0.25, -0.5, 0.0, 0.0, -0.25, 0.5, -0.25, 0.0, -0.5, 0.75]))


def test_group_normalize_leave_one_out():
    out = group_normalize(GROUP_SCORES, GROUP_IDS, divide_std=False, leave_one_out=True)
    # id 7 [1,0,1,0]: 1 - (1/3) = 2/3, 0 - (2/3) = -2/3 | id 4 [0,0,0,1]: 0 - 1/3, 1 - 0 = 1
    # id 9 (single) -> 0 | id 2 (identical) -> 0
    c, d = 2 / 3, -1 / 3
    assert_close(out, torch.tensor([c, 0.0, d, -c, 0.0, 0.0, d, c, d, 0.0, -c, 1.0]))
    # divided by the group std (sqrt3/4): id 4 -> -1/3 * 4/sqrt3 = -0.7698004, 1 * 4/sqrt3 = 2.3094011
    out_std = group_normalize(GROUP_SCORES, GROUP_IDS, leave_one_out=True, eps=0.0)
    assert_close(out_std[[2, 11]], torch.tensor([-0.7698004, 2.3094011]))
    with pytest.raises(ValueError, match="subtract_mean"):
        group_normalize(GROUP_SCORES, GROUP_IDS, subtract_mean=False, leave_one_out=True)


def test_group_normalize_std_only_and_single_group_no_nan():
    # No baseline: s / (std_g + eps). id 7: 1/.5 = 2, 0/.5 = 0
    out = group_normalize(GROUP_SCORES, GROUP_IDS, subtract_mean=False, eps=0.0)
    assert_close(out[[0, 3]], torch.tensor([2.0, 0.0]))
    exact_zero(group_normalize(torch.tensor([3.0]), torch.tensor([0])))


# ----------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_drops_groups_that_all_score_the_same():
    # id 0 all correct (1) | id 1 all wrong (0) | id 2 rate .25 | id 3 single correct (1)
    # | id 4 [0.5, 0.5]: constant, no signal although its mean is strictly inside (0, 1) | id 5 [.2, .8]
    ids = torch.tensor([0, 1, 2, 0, 1, 2, 3, 2, 2, 4, 4, 5, 5])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.2, 0.8])
    keep = dynamic_sampling_mask(scores, ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    # bounds on the mean are inclusive: .25 >= .25 stays, a lower bound of .3 drops it
    assert dynamic_sampling_mask(scores, ids, lower=0.25).tolist() == keep.tolist()
    keep_lb = dynamic_sampling_mask(scores, ids, lower=0.3, upper=1.0)
    assert keep_lb.tolist() == [False] * 11 + [True, True]


def test_group_normalize_unbiased_std():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0])
    ids = torch.tensor([0, 0, 0, 0, 1])
    pop = group_normalize(scores, ids)
    unb = group_normalize(scores, ids, unbiased=True)
    # group 0: mean .25; population std sqrt(.1875) = .4330; unbiased sqrt(.25) = .5
    assert_close(pop[0], torch.tensor(0.75 / (0.4330127 + 1e-5)))
    assert_close(unb[0], torch.tensor(0.75 / (0.5 + 1e-5)))
    assert unb[4] == 0 and pop[4] == 0  # a group of one: 0 either way, never NaN


# ----------------------------------------------------------------------------- aggregate_loss


LOSS_3x4 = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK_3x4 = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)


def test_aggregate_loss_modes():
    # valid tokens: 1, 2 | 5, 6, 7, 8 | none; sum 29, count 6
    assert_close(aggregate_loss(LOSS_3x4, MASK_3x4, "token-mean"), torch.tensor(29 / 6))
    # row means 1.5 and 6.5; the empty row is excluded -> 4
    assert_close(aggregate_loss(LOSS_3x4, MASK_3x4, "seq-mean-token-mean"), torch.tensor(4.0))
    # Dr.GRPO: 29 / (3 rows * T=4) and 29 / (3 * 8)
    assert_close(aggregate_loss(LOSS_3x4, MASK_3x4, "seq-mean-token-sum-norm"), torch.tensor(29 / 12))
    assert_close(
        aggregate_loss(LOSS_3x4, MASK_3x4, "seq-mean-token-sum-norm", max_len=8), torch.tensor(29 / 24)
    )
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(LOSS_3x4, MASK_3x4, "sum")


def test_aggregate_loss_token_mean_gradient():
    loss_tokens = LOSS_3x4.clone().requires_grad_(True)
    aggregate_loss(loss_tokens, MASK_3x4, "token-mean").backward()
    assert_close(loss_tokens.grad, MASK_3x4 / 6)
    loss_tokens.grad = None
    aggregate_loss(loss_tokens, MASK_3x4, "seq-mean-token-mean").backward()
    # each valid row weighs 1/2, spread over its tokens: row 0 -> 1/4 each, row 1 -> 1/8 each
    assert_close(loss_tokens.grad, torch.tensor([[0.25, 0.25, 0, 0], [0.125] * 4, [0.0] * 4]))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_aggregate_loss_all_masked_is_zero_and_differentiable(mode):
    loss_tokens = LOSS_3x4.clone().requires_grad_(True)
    out = aggregate_loss(loss_tokens, torch.zeros(3, 4), mode)
    exact_zero(out.detach())
    out.backward()
    exact_zero(loss_tokens.grad)


# ----------------------------------------------------------------------------- ppo_actor_loss


def actor_batch():
    """One row, six valid tokens + one padding token; old_logp = 0 so ratio = exp(logp).

    t  A   ratio  -A*r  -A*clip(r,.8,1.2)  L     clipped?
    0  +1  1.0    -1    -1                 -1    no
    1  +1  1.5    -1.5  -1.2               -1.2  yes
    2  -1  0.5    0.5   0.8                0.8   yes
    3  -2  1.5    3.0   2.4                3.0   no
    4  +2  0.5    -1.0  -1.6               -1.0  no
    5  -1  5.0    5.0   1.2                5.0   no   (dual clip c=3 caps it at 3)
    6  pad
    """
    logp = torch.tensor([[0.0, LN1_5, -LN2, LN1_5, -LN2, LN5, 5.0]], requires_grad=True)
    old_logp = torch.zeros(1, 7, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 2.0, -1.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]], dtype=torch.float32)
    return logp, old_logp, adv, mask


def test_ppo_actor_loss_values_stats_and_gradients():
    logp, old_logp, adv, mask = actor_batch()
    loss, stats = ppo_actor_loss(logp, old_logp, adv, mask, eps_clip=0.2)
    assert_close(loss, torch.tensor(5.6 / 6))  # (-1 - 1.2 + .8 + 3 - 1 + 5) / 6
    assert_close(stats["clip_frac"], torch.tensor(2 / 6))
    assert_close(stats["dual_clip_frac"], torch.tensor(0.0))
    assert_close(stats["ratio_mean"], torch.tensor(10 / 6))  # (1 + 1.5 + .5 + 1.5 + .5 + 5) / 6
    assert_close(stats["ratio_max"], torch.tensor(5.0))  # the padding ratio e^5 is ignored
    # 0.5 * mean(log r^2) = 0.5 * (0 + 2 * .1644020 + 2 * .4804530 + 2.5902904) / 6 = 0.5 * 3.8800003 / 6
    assert_close(stats["approx_kl"], torch.tensor(0.5 * 3.8800003 / 6))
    assert "behav_imp_weight_mean" not in stats
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())

    loss.backward()
    # dL/dlogp = -A * ratio / 6 on unclipped tokens, 0 on clipped ones and padding
    assert_close(logp.grad, torch.tensor([[-1 / 6, 0.0, 0.0, 3 / 6, -1 / 6, 5 / 6, 0.0]]))
    assert old_logp.grad is None
    assert adv.grad is None


def test_ppo_actor_loss_dual_clip():
    logp, old_logp, adv, mask = actor_batch()
    loss, stats = ppo_actor_loss(logp, old_logp, adv, mask, c_clip=3.0)
    # t5: min(5, 3 * |-1|) = 3; t3: min(3, 3 * 2 = 6) = 3 unchanged -> (-1 - 1.2 + .8 + 3 - 1 + 3) / 6
    assert_close(loss, torch.tensor(3.6 / 6))
    assert_close(stats["dual_clip_frac"], torch.tensor(1 / 6))
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-1 / 6, 0.0, 0.0, 3 / 6, -1 / 6, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="c_clip"):
        ppo_actor_loss(logp, old_logp, adv, mask, c_clip=1.0)


def test_ppo_actor_loss_clip_higher():
    logp = torch.tensor([[LN1_5, math.log(1.25)]])
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    # symmetric eps .2: both capped at 1.2 -> L = [-1.2, -1.2]
    loss, stats = ppo_actor_loss(logp, torch.zeros(1, 2), adv, mask)
    assert_close(loss, torch.tensor(-1.2))
    assert_close(stats["clip_frac"], torch.tensor(1.0))
    # DAPO clip-higher .28: 1.5 -> 1.28, 1.25 not clipped -> (-1.28 - 1.25) / 2
    loss, stats = ppo_actor_loss(logp, torch.zeros(1, 2), adv, mask, eps_clip_higher=0.28)
    assert_close(loss, torch.tensor(-2.53 / 2))
    assert_close(stats["clip_frac"], torch.tensor(0.5))


def test_ppo_actor_loss_decoupled():
    # t0: w = pi_prox/pi_old = 2, ratio vs prox = 1.1, A = +1 -> L = -1.1 * 2 = -2.2
    #     (against old_logp the ratio would be 2.2 and get clipped: prox must be the denominator)
    # t1: w = .5, ratio 1, A = -1 -> L = 1 * .5 = .5
    # t2: w = e^3 = 20.0855, ratio 1, A = +1 -> L = -20.0855 (dropped when the cap is 5)
    prox = torch.tensor([[LN2, -LN2, 3.0]], requires_grad=True)
    logp = torch.tensor([[LN2 + math.log(1.1), -LN2, 3.0]], requires_grad=True)
    old_logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)

    loss, stats = ppo_actor_loss(logp, old_logp, adv, mask, prox_logp=prox, behav_imp_weight_cap=5.0)
    # t2 is capped away but stays in the denominator: (-2.2 + .5 + 0) / 3, not / 2
    assert_close(loss, torch.tensor(-1.7 / 3))
    assert_close(stats["behav_imp_weight_mean"], torch.tensor((2 + 0.5 + 20.0855369) / 3))
    assert_close(stats["behav_imp_weight_max"], torch.tensor(20.0855369))
    assert_close(stats["behav_imp_weight_capped_frac"], torch.tensor(1 / 3))
    assert_close(stats["clip_frac"], torch.tensor(0.0))
    assert_close(stats["ratio_mean"], torch.tensor(1.05))  # (1.1 + 1) / 2, over the kept tokens
    loss.backward()
    # dL/dlogp = -A * ratio * w / 3: t0 -1.1 * 2 / 3, t1 +1 * .5 / 3, t2 capped away
    assert_close(logp.grad, torch.tensor([[-2.2 / 3, 0.5 / 3, 0.0]]))
    assert prox.grad is None

    loss, _ = ppo_actor_loss(
        logp, old_logp, adv, mask, prox_logp=prox, behav_imp_weight_cap=5.0, behav_imp_weight_mode="truncate"
    )
    assert_close(loss, torch.tensor((-2.2 + 0.5 - 5.0) / 3))  # t2's weight truncated to the cap

    loss, stats = ppo_actor_loss(logp, old_logp, adv, mask, prox_logp=prox)  # no cap: all 3 count
    assert_close(loss, torch.tensor((-2.2 + 0.5 - 20.0855369) / 3))
    assert_close(stats["behav_imp_weight_mean"], torch.tensor((2 + 0.5 + 20.0855369) / 3))


def test_ppo_actor_loss_sequence_level_behaviour_weights():
    # row 0: token log-weights (prox - old) ln2 and ln8 -> geometric mean exp((ln2 + ln8) / 2) = 4
    # row 1: log-weights 0 and -ln4 (the pad's 99 ignored) -> exp(-ln4 / 2) = 0.5
    # ratio vs prox = 1 everywhere, A = +1 -> L = -w per token; cap 3: row 0 is over it
    ln8 = 3 * LN2
    old_logp = torch.zeros(2, 3)
    prox = torch.tensor([[LN2, ln8, 99.0], [0.0, -2 * LN2, 99.0]])
    logp = prox.clone().requires_grad_()
    adv = torch.ones(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss, stats = ppo_actor_loss(
        logp, old_logp, adv, mask, prox_logp=prox, behav_imp_weight_cap=3.0, behav_imp_weight_mode="seq-mask"
    )
    # row 0 masked (its 2 tokens stay in the denominator): (0 + 0 - .5 - .5) / 4
    assert_close(loss, torch.tensor(-1.0 / 4))
    assert_close(stats["behav_imp_weight_capped_frac"], torch.tensor(0.5))
    assert_close(stats["behav_imp_weight_mean"], torch.tensor((4 + 4 + 0.5 + 0.5) / 4))
    loss, _ = ppo_actor_loss(
        logp,
        old_logp,
        adv,
        mask,
        prox_logp=prox,
        behav_imp_weight_cap=3.0,
        behav_imp_weight_mode="seq-truncate",
    )
    assert_close(loss, torch.tensor((-3 - 3 - 0.5 - 0.5) / 4))  # row 0's weight truncated to 3
    with pytest.raises(ValueError, match="behav_imp_weight_mode must be one of"):
        ppo_actor_loss(logp, old_logp, adv, mask, prox_logp=prox, behav_imp_weight_mode="sequence")


def test_loglinear_proximal_logprobs():
    # trainer at version V = 5; samples of versions 5 (current: alpha 0), 4 (1/2), 2 (3/4)
    alpha = loglinear_alpha(torch.tensor([5, 4, 2]), 5)
    assert_close(alpha, torch.tensor([0.0, 0.5, 0.75]))
    old = torch.tensor([-1.0, -1.0, -2.0])
    cur = torch.tensor([-3.0, -3.0, -1.0], requires_grad=True)
    approx = loglinear_prox_logp(old, cur, alpha)
    assert_close(approx, torch.tensor([-1.0, -2.0, -1.25]))  # -1 + .5 * (-2); -2 + .75 * 1
    assert not approx.requires_grad
    mask = torch.tensor([1.0, 1.0, 0.0])
    errors = prox_approx_errors(approx, torch.tensor([-1.5, -2.0, 7.0]), old, mask)
    assert_close(errors["prox_approx_abs_err"], torch.tensor(0.25))  # (.5 + 0) / 2
    # |e^0 - e^-.5| = .393469 for the first token, 0 for the second
    assert_close(errors["prox_approx_weight_err"], torch.tensor((1 - math.exp(-0.5)) / 2))


def test_mismatch_stats():
    gen = torch.tensor([[-1.0, -2.0, 5.0]])
    train = torch.tensor([[-1.0 + LN2, -2.0, -9.0]])  # the pad (third) ignored
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    stats = mismatch_stats(gen, train, mask)
    assert_close(stats["mismatch_abs_log_ratio"], torch.tensor(LN2 / 2))
    # k3 of KL(gen || train) on gen's samples: log r = gen - train = -ln2: e^ln2 - 1 - ln2 = 1 - ln2
    assert_close(stats["mismatch_kl"], torch.tensor((1 - LN2) / 2))
    exact_zero(mismatch_stats(gen, gen, mask)["mismatch_kl"])


def test_decoupled_loss_with_prox_equal_to_old_is_standard_ppo():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g)
    logp = (old + 0.3 * torch.randn(3, 5, generator=g)).requires_grad_()
    adv = torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        plain, _ = ppo_actor_loss(logp, old, adv, mask, c_clip=3.0, aggregation=aggregation)
        (g_plain,) = torch.autograd.grad(plain, logp)
        decoupled, stats = ppo_actor_loss(
            logp, old, adv, mask, c_clip=3.0, aggregation=aggregation, prox_logp=old, behav_imp_weight_cap=2.0
        )
        (g_dec,) = torch.autograd.grad(decoupled, logp)
        assert_close(decoupled, plain)
        assert_close(g_dec, g_plain)
        assert_close(stats["behav_imp_weight_mean"], torch.tensor(1.0))
        assert_close(stats["behav_imp_weight_capped_frac"], torch.tensor(0.0))


def test_ppo_actor_loss_seq_mean_aggregation():
    # row 0: 2 tokens with L = -1 (ratio 1, A = 1); row 1: 1 token with L = 2 (ratio 1, A = -2)
    logp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-2.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = ppo_actor_loss(logp, torch.zeros(2, 2), adv, mask, aggregation="token-mean")
    assert_close(loss, torch.tensor(0.0))  # (-1 - 1 + 2) / 3
    loss, _ = ppo_actor_loss(logp, torch.zeros(2, 2), adv, mask, aggregation="seq-mean-token-mean")
    assert_close(loss, torch.tensor(0.5))  # (-1 + 2) / 2


def test_ppo_actor_loss_all_masked():
    logp, old_logp, adv, _ = actor_batch()
    loss, stats = ppo_actor_loss(logp, old_logp, adv, torch.zeros(1, 7), c_clip=3.0)
    exact_zero(loss.detach())
    for value in stats.values():
        exact_zero(value)
    loss.backward()
    exact_zero(logp.grad)


# ----------------------------------------------------------------------------- critic_loss


def test_critic_loss_values_stats_and_gradient():
    # eps .2
    # t  v    v_old  R    v_clip  (v-R)^2  (v_clip-R)^2  L=max/2  clipped?
    # 0  1.0  1.0    2.0  1.0     1.0      1.0           .5       no (tie)
    # 1  1.5  1.0    2.0  1.2     .25      .64           .32      yes
    # 2  1.5  1.0    1.0  1.2     .25      .04           .125     no
    # 3  0.0  1.0    0.0  0.8     0.0      .64           .32      yes
    # 4  pad
    values = torch.tensor([[1.0, 1.5, 1.5, 0.0, 9.0]], requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, 1.0, 9.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 2.0, 1.0, 0.0, -9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.float32)
    loss, stats = critic_loss(values, old_values, returns, mask, value_eps_clip=0.2)
    assert_close(loss, torch.tensor(1.265 / 4))  # (.5 + .32 + .125 + .32) / 4
    assert_close(stats["value_clip_frac"], torch.tensor(0.5))
    assert_close(stats["value_mean"], torch.tensor(1.0))  # (1 + 1.5 + 1.5 + 0) / 4
    assert_close(stats["return_mean"], torch.tensor(1.25))  # (2 + 2 + 1 + 0) / 4
    loss.backward()
    # dL/dv = (v - R) / 4 on the unclipped branch, 0 where the clipped branch wins
    assert_close(values.grad, torch.tensor([[-0.25, 0.0, 0.125, 0.0, 0.0]]))
    assert old_values.grad is None
    assert returns.grad is None

    loss, _ = critic_loss(values, old_values, returns, mask, value_eps_clip=None)
    assert_close(loss, torch.tensor(1.5 / 8))  # (1 + .25 + .25 + 0) / 2 / 4


# ----------------------------------------------------------------------------- entropy


def test_entropy_from_logits():
    logits = torch.tensor(
        [
            [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf]],  # ln 4, ln 2 (masked vocab)
            [[1000.0, 1000.0, -1000.0, -1000.0], [math.log(3.0), 0.0, -math.inf, -math.inf]],
        ],
        requires_grad=True,
    )
    # p = [.75, .25]: -(.75 ln .75 + .25 ln .25) = .2157616 + .3465736 = .5623351
    expected = torch.tensor([[1.3862944, LN2], [LN2, 0.5623351]])
    out = entropy_from_logits(logits)
    assert out.shape == (2, 2)
    assert_close(out, expected)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert_close(entropy_from_logits(torch.tensor([0.0, -1e4])), torch.tensor(0.0))


# ----------------------------------------------------------------------------- KL controllers


def test_fixed_kl_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_steps=1000)
    assert ctl.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.05


def test_adaptive_kl_controller_updates_and_resumes_exactly():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)  # err = 9/6 - 1 = .5 -> clip .2; 0.1 * (1 + .2 * .1) = .102
    assert ctl.value == pytest.approx(0.102, rel=1e-12)
    ctl.update(current_kl=3.0, n_steps=500)  # err = -.5 -> -.2; .102 * (1 - .2 * .05) = .10098
    assert ctl.value == pytest.approx(0.10098, rel=1e-12)

    resumed = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    ctl.update(current_kl=6.6, n_steps=10000)  # err = .1 (inside the clip); .10098 * 1.1 = .111078
    resumed.update(current_kl=6.6, n_steps=10000)
    assert ctl.value == pytest.approx(0.111078, rel=1e-12)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(init_kl_coef=0.1, target=0.0, horizon=10000)


def test_log_ratio_is_clamped_and_counted():
    # log r = 30 with A < 0: exp(30) = 1e13 unclamped; the clamp at 20 keeps it finite and kills its grad
    logp = torch.tensor([[30.0, 0.1]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0]])
    loss, stats = ppo_actor_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    assert_close(loss, torch.tensor((math.exp(20.0) + math.exp(0.1)) / 2))
    assert_close(stats["log_ratio_clamped_frac"], torch.tensor(0.5))
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_sequence_level_importance_ratio_gspo():
    # seq 0: log r = [.1, .3] -> s = e^.2 = 1.2214 > 1.2: clipped (A = +1), loss -1.2 on both tokens, no grad
    # seq 1: log r = [-.1]    -> s = e^-.1 = .9048: loss -.9048, d/dlogp = -s (per token, before the mean)
    logp = torch.tensor([[0.1, 0.3], [-0.1, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.ones(2, 2)
    loss, stats = ppo_actor_loss(
        logp, torch.zeros(2, 2), adv, mask, importance_ratio="sequence", aggregation="seq-mean-token-mean"
    )
    s1 = math.exp(-0.1)
    assert_close(loss, torch.tensor((-1.2 - s1) / 2))
    assert_close(stats["clip_frac"], torch.tensor(2 / 3))  # both tokens of seq 0
    loss.backward()
    assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-s1 / 2, 0.0]]))
    # with every token of a sequence at the same log-ratio, the sequence ratio is the token ratio
    same = torch.full((1, 3), 0.05, requires_grad=True)
    a, _ = ppo_actor_loss(
        same, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3), importance_ratio="sequence"
    )
    b, _ = ppo_actor_loss(same, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3))
    assert_close(a, b)

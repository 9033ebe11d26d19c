"""Algorithm variants in registries: the named estimators equal the knobs they stand for, CISPO against a
hand-computed example, names checked by `areal check` and listed by `areal list`."""

from __future__ import annotations

import pytest
import torch

from arealcli.runtime.interfaces import variants as V
from arealcli.schema.components.interfaces import PPOActorArgs
from arealcli.schema.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES

SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # (B,) two groups of three
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
MASK = torch.tensor([[1.0, 1.0, 0.0]] * 6)  # (B, T)
GAE = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))


def args(**kw) -> PPOActorArgs:
    return PPOActorArgs(generation={"n": 3}, **kw)


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("grpo", {}),
        ("dr_grpo", {"group_std": "none"}),
        ("rloo", {"group_std": "none", "leave_one_out": True}),
        ("lite_ppo", {"group_std": "batch"}),
    ],
)
def test_named_estimators_are_the_group_knobs(name, knobs):
    named = ADVANTAGES.get(name).load()(SCORES, GAE, MASK, GROUPS, args(adv_norm=name))
    group = ADVANTAGES.get("group").load()(SCORES, GAE, MASK, GROUPS, args(adv_norm="group", **knobs))
    assert torch.allclose(named, group)
    assert ADVANTAGES.get(name).group_based


def test_rloo_by_hand():
    adv = V.rloo(SCORES, GAE, MASK, GROUPS, args(adv_norm="rloo"))
    # group 0: scores 1, 0, 0 -> 1 - 0, 0 - 0.5, 0 - 0.5; group 1: all 1 -> 0
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    assert torch.all(adv[:, 2] == 0)  # outside the mask


def test_cispo_by_hand():
    """L = -sg(clip(r, 1 - eps, 1 + eps)) * A * logp, token mean; the gradient reaches clipped tokens."""
    logp = torch.log(torch.tensor([[0.5, 0.9]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.9]]))  # ratios 2.0 (clipped to 1.2) and 1.0
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    loss, stats = V.cispo(logp, old, adv, mask, args(eps_clip=0.2))
    expected = -(1.2 * 1.0 * logp[0, 0] + 1.0 * -1.0 * logp[0, 1]) / 2
    assert torch.allclose(loss, expected)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.6, 0.5]]))  # the clipped token still learns
    assert float(stats["clip_frac"]) == pytest.approx(0.5)
    ppo_loss, _ = V.ppo(logp.detach().requires_grad_(), old, adv, mask, args(eps_clip=0.2))
    assert float(ppo_loss.detach()) != pytest.approx(float(loss.detach()))


def test_gspo_is_ppo_with_a_sequence_ratio():
    logp, old = torch.randn(2, 3), torch.randn(2, 3)
    adv, mask = torch.randn(2, 3), torch.ones(2, 3)
    a, b = (
        V.gspo(logp, old, adv, mask, args()),
        V.ppo(logp, old, adv, mask, args(importance_ratio="sequence")),
    )
    assert torch.allclose(a[0], b[0])


def test_kl_estimators_are_registered_functions():
    logp, ref = torch.tensor([0.0, -1.0]), torch.tensor([-0.5, -0.5])
    assert torch.allclose(KL_ESTIMATORS.get("k1").load()(logp, ref), torch.tensor([0.5, -0.5]))
    assert torch.allclose(KL_ESTIMATORS.get("abs").load()(logp, ref), torch.tensor([0.5, 0.5]))
    assert set(POLICY_LOSSES.names()) >= {"ppo", "gspo", "cispo"}


def test_unknown_names_are_refused_with_a_suggestion(ws, cli):
    import yaml
    from test_async import grpo

    path = grpo(ws)
    raw = yaml.safe_load(path.read_text())
    raw["dataflow"]["actor"].update({"policy_loss": "cipso", "adv_norm": "dr-grpo", "kl_estimator": "k4"})
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    result = cli("check", path)
    assert result.exit_code == 2
    out = " ".join(result.stderr.split())
    assert "unknown policy loss 'cipso'; did you mean 'cispo'?" in out
    assert "unknown advantage estimator 'dr-grpo'; did you mean 'dr_grpo'?" in out
    assert "unknown KL estimator 'k4'" in out


def test_a_group_estimator_needs_groups():
    with pytest.raises(ValueError, match="adv_norm=rloo needs generation.n >= 2"):
        PPOActorArgs(adv_norm="rloo")
    with pytest.raises(ValueError, match="group_std=batch chooses adv_norm=group's std"):
        args(adv_norm="grpo", group_std="batch")

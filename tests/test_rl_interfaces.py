"""The RL interfaces on a tiny model: data alignment, advantages, and that training moves the right way."""

from __future__ import annotations

import copy

import pytest
import torch

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
from arealcli.runtime.interfaces.ppo_critic import PPOCriticInterface
from arealcli.runtime.interfaces.returns import ReturnsInterface
from arealcli.runtime.interfaces.reward import RewardInterface
from arealcli.runtime.interfaces.rl_common import compute_returns, response_view, to_packed
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.models.value_head import with_value_head
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import (
    PPOActorArgs,
    PPOCriticArgs,
    ReturnsArgs,
    RewardArgs,
    RewardShaping,
)
from tests.conftest import tiny_module, with_returns

SPEC = FinetuneSpec(1, 8, 8, 100)


def engine_model(tok, module, lr=1e-2, optimizer="adamw"):
    args = HFBackendArgs(device="cpu", optimizer={"lr": lr, "type": optimizer, "gradient_clipping": None})
    return HFBackend(args).initialize(Model("actor", module, tok), SPEC)


def prompts(tok, texts):
    ids = [torch.tensor(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return SequenceSample.from_lists(
        list(range(len(texts))), {"packed_prompts": ids}, {"prompt": texts, "answers": [["7"]] * len(texts)}
    )


@pytest.fixture
def actor(char_tok):
    return engine_model(char_tok, tiny_module(char_tok, seed=1, tie_word_embeddings=False))


def test_generate_logprobs_align_with_recomputed_logprobs(char_tok, actor):
    iface = PPOActorInterface(PPOActorArgs(generation={"n": 3, "max_new_tokens": 5}, adv_norm="none"))
    torch.manual_seed(0)
    out = iface.generate(actor, prompts(char_tok, ["3+4=", "1+1=", "9+0="]), MicroBatchSpec())
    assert out.bs == 9 and out.ids[:3] == [(0, 0), (0, 1), (0, 2)]
    recomputed = iface.inference(actor, out, MicroBatchSpec(n_mbs=2)).data["packed_logprobs"]
    gen, mask = response_view(out.data["packed_logprobs"], out)
    rec, _ = response_view(recomputed, out)
    # the behaviour log-probs sit at the positions that predict each response token
    torch.testing.assert_close(gen[mask], rec[mask], atol=1e-4, rtol=0)
    prompt_lens = [int(m.sum()) for m in out.unpack("prompt_mask")]
    seqs = out.unpack("packed_input_ids")
    assert mask.sum(-1).tolist() == [len(x) - p for x, p in zip(seqs, prompt_lens, strict=True)]
    no_eos = out.data["seq_no_eos_mask"].bool()
    assert all(mask[i].sum() == 5 for i in range(9) if no_eos[i])


def test_response_view_round_trip(char_tok, actor):
    iface = PPOActorInterface(PPOActorArgs(generation={"n": 2, "max_new_tokens": 4}, adv_norm="none"))
    out = iface.generate(actor, prompts(char_tok, ["12+3=", "4="]), MicroBatchSpec())
    x = torch.randn(out.data["packed_input_ids"].shape[0])
    view, mask = response_view(x, out)
    back = to_packed(view, out)
    act = back != 0
    torch.testing.assert_close(back[act], x[act])
    assert int(mask.sum()) == int(act.sum())


def _rollout(char_tok, actor, rewards, n=4):
    """Generated samples with the given rewards, and the `returns` call's advantages (GAE lambda 1)."""
    iface = PPOActorInterface(PPOActorArgs(generation={"n": n, "max_new_tokens": 3}))
    data = iface.generate(actor, prompts(char_tok, ["5+2=", "3+3="]), MicroBatchSpec())
    data.data["rewards"] = torch.tensor(rewards, dtype=torch.float32)
    data.seqlens["rewards"] = [1] * data.bs
    return iface, with_returns(data, max_new_tokens=3)


def test_train_steps_need_the_returns_call(char_tok, actor):
    iface, data = _rollout(char_tok, actor, [1.0] * 8)
    bare = data.select(data.keys - {"advantages", "returns", "seq_scores"})
    with pytest.raises(RuntimeError, match="ppo_actor's train_step needs advantages, returns, seq_scores"):
        iface.train_step(actor, bare, MicroBatchSpec())


def test_identical_rewards_in_every_group_give_no_update(char_tok):
    model = engine_model(char_tok, tiny_module(char_tok, seed=2), optimizer="sgd")
    iface, data = _rollout(char_tok, model, [1.0] * 8)
    before = copy.deepcopy(model.module.module.state_dict())
    stats = iface.train_step(model, data, MicroBatchSpec())
    assert stats["adv_abs"] == 0.0
    for k, v in model.module.module.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_grpo_step_raises_logprob_of_rewarded_samples(char_tok):
    model = engine_model(char_tok, tiny_module(char_tok, seed=3), lr=5e-3, optimizer="sgd")
    iface, data = _rollout(char_tok, model, [1, 0, 0, 0, 0, 0, 0, 1])
    lp_before, mask = response_view(
        iface.inference(model, data, MicroBatchSpec()).data["packed_logprobs"], data
    )
    stats = iface.train_step(model, data, MicroBatchSpec(n_mbs=3))
    lp_after, _ = response_view(iface.inference(model, data, MicroBatchSpec()).data["packed_logprobs"], data)
    delta = ((lp_after - lp_before) * mask).sum(-1)  # (B,) change of each sequence's log-prob
    assert delta[0] > 0 and delta[7] > 0
    assert delta[[1, 2, 3, 4, 5, 6]].mean() < 0
    assert model.version.global_step == 1 and stats["n_updates"] == 1


def test_dynamic_sampling_trains_on_the_groups_that_differ_only(char_tok):
    """DAPO's dynamic sampling: a group whose samples all score the same is dropped from the loss; with
    every group dropped, no optimizer step runs."""
    model = engine_model(char_tok, tiny_module(char_tok, seed=3), lr=5e-3, optimizer="sgd")
    iface, data = _rollout(char_tok, model, [1, 0, 0, 0, 1, 1, 1, 1])  # group 1 all the same
    iface = PPOActorInterface(iface.args.model_copy(update={"dynamic_sampling": True}))
    stats = iface.train_step(model, data, MicroBatchSpec())
    assert stats["dynamic_sampling_kept"] == 0.5 and stats["n_updates"] == 1
    _, same = _rollout(char_tok, model, [1.0] * 8)
    before = copy.deepcopy(model.module.module.state_dict())
    stats = iface.train_step(model, same, MicroBatchSpec())
    assert stats["dynamic_sampling_kept"] == 0.0 and stats["n_updates"] == 0
    assert all(torch.equal(v, before[k]) for k, v in model.module.module.state_dict().items())


def test_critic_learns_returns(char_tok, actor):
    iface, data = _rollout(char_tok, actor, [1, 1, 1, 1, 0, 0, 0, 0])  # learnable from the prompt
    # treat every response as finished: a truncated one bootstraps from the critic's own final value
    data.data["seq_no_eos_mask"] = torch.zeros(data.bs)
    critic_module = with_value_head(tiny_module(char_tok, seed=4), seed=0)
    critic = engine_model(char_tok, critic_module, lr=1e-2)
    c = PPOCriticInterface(PPOCriticArgs(gae_lambda=1.0, value_eps_clip=10.0))

    def value_error():  # mean squared error of the values at action positions vs the returns
        data.update_(c.inference(critic, data, MicroBatchSpec()))
        v, m = response_view(data.data["values"], data)
        target = data.data["rewards"][:, None].expand_as(m)
        return float(((v - target)[m] ** 2).mean())

    errors = [value_error()]
    for _ in range(25):
        c.train_step(critic, data, MicroBatchSpec(n_mbs=2))
        errors.append(value_error())
    assert errors[-1] < 0.3 * errors[0], errors
    # with gamma = lambda = 1 and no KL the return of every token is the sequence's score
    r = compute_returns(data, RewardShaping(), 1.0, 0.0)
    torch.testing.assert_close(r.returns[r.mask], data.data["rewards"][:, None].expand_as(r.mask)[r.mask])


def test_reward_interface_scores_with_registered_function(char_tok):
    seqs = [
        torch.tensor(char_tok("2+5=7", add_special_tokens=False)["input_ids"] + [char_tok.eos_token_id]),
        torch.tensor(char_tok("2+5=8", add_special_tokens=False)["input_ids"]),
    ]
    pm = [torch.tensor([True] * 4 + [False] * (len(s) - 4)) for s in seqs]
    data = SequenceSample.from_lists(
        [0, 1], {"packed_input_ids": seqs, "prompt_mask": pm}, {"answers": [["7"], ["7"]]}
    )
    out = RewardInterface(RewardArgs(reward_fn="exact_match")).inference(
        Model("r", None, char_tok), data, MicroBatchSpec()
    )
    assert out.data["rewards"].tolist() == [1.0, 0.0]


def test_returns_are_computed_once_for_actor_and_critic(char_tok, actor):
    """The `returns` call: one adaptive KL controller; the actor and the critic use its coefficient and
    its advantages / returns (before, the critic used the fixed initial coefficient)."""
    _, data = _rollout(char_tok, actor, [1, 0, 0, 0, 0, 0, 0, 1])
    ref = engine_model(char_tok, tiny_module(char_tok, seed=9, tie_word_embeddings=False))
    ref_iface = PPOActorInterface(PPOActorArgs(generation={"n": 4, "max_new_tokens": 3}))
    ref_lp = ref_iface.inference(ref, data, MicroBatchSpec())
    data.data["packed_ref_logprobs"] = ref_lp.data["packed_logprobs"]
    data.seqlens["packed_ref_logprobs"] = ref_lp.seqlens["packed_logprobs"]
    shaping = {"kl_ctl": 0.5, "kl_in_reward": True}
    returns = ReturnsInterface(
        ReturnsArgs(shaping=shaping, adaptive_kl_target=1e-3, adaptive_kl_horizon=10, max_new_tokens=3)
    )
    first = returns.inference(None, data, MicroBatchSpec())
    assert first.meta["kl_coef"][0] == 0.5 and first.stats["kl_ref"] > 1e-3
    second = returns.inference(None, data, MicroBatchSpec())
    coef = second.meta["kl_coef"][0]
    assert coef > 0.5  # the controller raised it (KL above target)
    data.update_(second)

    # by hand: the KL in the reward with the controller's current coefficient, GAE with lambda 1
    want = compute_returns(
        data.select(
            [
                "packed_input_ids",
                "prompt_mask",
                "packed_logprobs",
                "seq_no_eos_mask",
                "rewards",
                "packed_ref_logprobs",
            ]
        ),
        ReturnsArgs(shaping=shaping).shaping,
        1.0,
        coef,
        3,
    )
    got, _ = response_view(data.data["returns"], data)
    torch.testing.assert_close(got[want.mask], want.returns[want.mask])

    actor_iface = PPOActorInterface(
        PPOActorArgs(
            generation={"n": 4, "max_new_tokens": 3}, adv_norm="batch", shaping={"kl_in_reward": True}
        )
    )
    stats = actor_iface.train_step(actor, data, MicroBatchSpec())
    assert stats["kl_coef"] == coef  # the actor follows the returns call's controller

    critic = engine_model(char_tok, with_value_head(tiny_module(char_tok, seed=4), seed=0))
    data.update_(PPOCriticInterface(PPOCriticArgs()).inference(critic, data, MicroBatchSpec()))
    data.data["returns"] = torch.full_like(data.data["returns"], 0.25)  # what the critic is given
    cstats = PPOCriticInterface(PPOCriticArgs()).train_step(critic, data, MicroBatchSpec())
    assert abs(cstats["returns_mean"] - 0.25) < 1e-6  # it trains on the provided returns


def _decoupled(method: str, **extra) -> PPOActorInterface:
    args = {"generation": {"n": 4, "max_new_tokens": 3}, "use_decoupled_loss": True, **extra}
    return PPOActorInterface(PPOActorArgs(prox_logp_method=method, **args))


def test_proximal_logprob_methods(char_tok):
    """loglinear needs no forward pass: on samples of the current weights it is the behaviour log-probs
    (= rollout, bit for bit); on older samples it interpolates by version; metrics logs its error."""
    model = engine_model(char_tok, tiny_module(char_tok, seed=3), lr=5e-3, optimizer="sgd")
    _, data = _rollout(char_tok, model, [1, 0, 0, 0, 0, 0, 0, 1])
    prox = _decoupled("recompute").inference(model, data, MicroBatchSpec()).data["packed_logprobs"]
    data.data["packed_prox_logprobs"] = prox
    data.seqlens["packed_prox_logprobs"] = list(data.seqlens["packed_input_ids"])

    def step(method: str, version: int = 0, **extra):
        m = copy.deepcopy(model)
        m.version.global_step = version
        stats = _decoupled(method, **extra).train_step(m, data, MicroBatchSpec())
        return stats, m.module.module.state_dict()

    rollout, w_rollout = step("rollout")
    loglinear, w_loglinear = step("loglinear")
    assert all(torch.equal(w_rollout[k], v) for k, v in w_loglinear.items())
    assert loglinear["behav_imp_weight_mean"] == pytest.approx(1.0)

    metrics, _ = step("metrics")  # alpha = 0: the approximation is the behaviour log-probs
    assert metrics["prox_approx_abs_err"] == pytest.approx(metrics["mismatch_abs_log_ratio"], rel=1e-6)
    assert metrics["mismatch_abs_log_ratio"] < 1e-4  # same weights: numeric mismatch only

    # samples 2 versions old: alpha = (2 - 0) / (3 - 0); the weight is exp(alpha (log pi - log pi_b))
    stale, _ = step("loglinear", version=2)
    old, mask = response_view(data.data["packed_logprobs"], data)
    now, _ = response_view(prox, data)
    want = torch.exp(2 / 3 * (now - old))[mask].mean()
    assert stale["behav_imp_weight_mean"] == pytest.approx(float(want), rel=1e-5)
    assert stale["version_lag"] == 2


def test_prox_logp_method_needs_the_decoupled_loss():
    with pytest.raises(ValueError, match="set use_decoupled_loss: true"):
        PPOActorArgs(prox_logp_method="loglinear")


def test_the_ppo_loss_takes_the_chunked_output():
    """The update passes its loss as a partial (the step's KL coefficient bound): it must still get the
    LMOutput (log-probs chunk by chunk), not materialized full-vocabulary logits."""
    import functools

    from arealcli.runtime.engines.lm_output import LMOutput, outputs_for

    iface = PPOActorInterface(PPOActorArgs())
    lm = LMOutput.from_logits(torch.randn(5, 11))
    assert outputs_for(functools.partial(iface._loss_fn, kl_coef=0.1), lm) is lm
    assert isinstance(outputs_for(lambda out, mb: out, lm), torch.Tensor)  # an unmarked loss: logits

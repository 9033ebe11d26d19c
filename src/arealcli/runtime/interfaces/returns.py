"""Rewards to advantages and returns, once per step, for the actor and the critic alike.

    shaped score = clip((score - bias) * scale, +-clip)   (+ no-EOS zeroing, DAPO overlong penalty)
    r_t          = -kl_coef * (old_logp_t - ref_logp_t) on every token when the KL is in the reward,
                   + the shaped score on the last response token
    advantages   = GAE(r, V, gamma, gae_lambda)              -> the actor (which then normalizes them)
    returns      = GAE(r, V, gamma, returns_lambda) + V      -> the critic's targets

One adaptive KL controller (Ziegler et al.: err = clip(kl / target - 1, +-0.2), kl_coef *= 1 + err *
n / horizon) lives here; its coefficient travels with the batch (`kl_coef`), so the actor's KL loss and
the critic's targets use the same value. The grpo and ppo presets add this call (`returns`) after the
reference and value inference.
"""

from __future__ import annotations

from arealcli.runtime import distributed
from arealcli.runtime.algo import functional as F
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.rl_common import compute_returns, to_packed
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import ReturnsArgs


class ReturnsInterface(ModelInterface):
    """Shaped rewards, the KL penalty and GAE, computed once for the actor and the critic."""

    Args = ReturnsArgs
    needs_model = False
    training_side = True  # its KL controller follows the trainer (asynchronous rollout)

    def __init__(self, args: ReturnsArgs):
        super().__init__(args)
        self.kl_ctl = F.kl_controller(args.shaping.kl_ctl, args.adaptive_kl_target, args.adaptive_kl_horizon)

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        return self.advantages_and_returns(data)

    def advantages_and_returns(self, data: SequenceSample) -> SequenceSample:
        """GAE advantages (the actor's), returns (the critic's targets) and shaped sequence scores, under
        this step's KL coefficient; then the adaptive controller takes the step's KL."""
        a = self.args
        kl_coef = self.kl_ctl.value
        r = compute_returns(data, a.shaping, a.gae_lambda, kl_coef, a.max_new_tokens, a.returns_lambda)
        lens = list(data.seqlens["packed_input_ids"])
        out = SequenceSample(
            data.ids,
            {"advantages": lens, "returns": lens, "seq_scores": [1] * data.bs},
            {
                "advantages": to_packed(r.advantages, data),
                "returns": to_packed(r.returns, data),
                "seq_scores": r.scores.float(),
            },
            {"kl_coef": [kl_coef] * data.bs},
        )
        out.stats = {"kl_coef": kl_coef, "score_shaped": float(r.scores.mean())}
        if r.kl is not None:
            kl_sum, n = distributed.all_reduce([float((r.kl * r.mask).sum()), float(data.bs)])
            out.stats["kl_ref"] = float(F.masked_mean(r.kl, r.mask))
            if a.adaptive_kl_target is not None:
                self.kl_ctl.update(kl_sum / n, n_steps=int(n))  # the same controller on every rank
        return out

    def state_dict(self) -> dict:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])

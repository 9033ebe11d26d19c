"""The PPO critic: values of every state, trained with the clipped value loss on GAE returns."""

from __future__ import annotations

import torch

from arealcli.runtime.algo import functional as F
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.interfaces.rl_common import (
    final_state_values,
    given_returns,
    response_view,
    shuffled_minibatches,
    to_packed,
)
from arealcli.runtime.models.model import Model
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import PPOCriticArgs


class PPOCriticInterface(ModelInterface):
    """PPO critic: value inference and the clipped value loss."""

    Args = PPOCriticArgs

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        values = model.module.forward(data, mb_spec)  # (tokens,): V of the state after each token
        return SequenceSample(
            data.ids, {"values": list(data.seqlens["packed_input_ids"])}, {"values": values.float().cpu()}
        )

    def train_step(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> dict[str, float]:
        a = self.args
        r = given_returns(data, "ppo_critic's train_step")  # the same as the actor's
        train = data.select(["packed_input_ids", "prompt_mask"])
        for key, padded in (
            ("returns", r.returns),
            ("old_values", r.values),
            ("action_mask", r.mask.float()),
        ):
            train.data[key] = to_packed(padded, data)
            train.seqlens[key] = list(train.seqlens["packed_input_ids"])
        train.data["ended"] = 1.0 - data.data["seq_no_eos_mask"].float()  # (B,) 1 where the response hit EOS
        train.seqlens["ended"] = [1] * train.bs
        stats: dict[str, float] = {}
        n = 0
        for epoch in range(a.sample_reuse):
            for idx in shuffled_minibatches(
                train.bs, a.n_minibatches, model.version.global_step * 1000 + epoch
            ):
                s = model.module.train_batch(
                    train.subset(idx),
                    mb_spec,
                    self._loss_fn,
                    lambda mb: float(mb.data["action_mask"].sum()),
                    version_steps=model.version.global_step,
                    lr_scale=a.lr_scale,
                )
                for k, v in s.items():
                    stats[k] = stats.get(k, 0.0) + v
                n += 1
        model.inc_version()
        out = {k: v / max(n, 1) for k, v in stats.items()}
        out["returns_mean"] = float(F.masked_mean(r.returns, r.mask))
        return out

    def _loss_fn(self, values: torch.Tensor, mb: SequenceSample):
        v, _ = response_view(values.float(), mb)  # (B, T)
        old, _ = response_view(mb.data["old_values"].to(values.device), mb)
        ret, _ = response_view(mb.data["returns"].to(values.device), mb)
        mask, _ = response_view(mb.data["action_mask"].to(values.device), mb)
        loss, stats = F.critic_loss(v, old, ret, mask, value_eps_clip=self.args.value_eps_clip)
        # A terminal state (after EOS) has value 0. Training that anchors the final-state values, which
        # truncated responses bootstrap from and which no action position trains otherwise (without it
        # they drift with the shared network and the returns chase them).
        ended = mb.data["ended"].to(values.device)  # (B,)
        final = final_state_values(values.float(), mb)  # (B,)
        terminal = (final.pow(2) * ended).sum() / ended.sum().clamp(min=1) / 2
        stats["terminal_value_loss"] = terminal.detach()
        return loss + terminal, stats

"""Score responses with a registered reward function (no weights: a rule, a verifier, your code), or
with a reward service over HTTP (`remote_reward`, protocol 1 of runtime/rewards/remote.py)."""

from __future__ import annotations

import os

import torch

from arealcli.errors import UserError
from arealcli.runtime.data.responses import decode_responses
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.models.model import Model
from arealcli.runtime.registry import get_reward
from arealcli.runtime.rewards.remote import RemoteReward
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import RemoteRewardArgs, RewardArgs


class RewardInterface(ModelInterface):
    """Score responses with a registered reward function (rule-based or your own)."""

    Args = RewardArgs
    needs_model = False

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        prompts, responses = decode_responses(model.tokenizer, data)
        scores = get_reward(self.args.reward_fn)(prompts, responses, data.meta["answers"])
        if len(scores) != data.bs:
            raise RuntimeError(
                f"reward {self.args.reward_fn!r} returned {len(scores)} scores for {data.bs} responses"
            )
        return SequenceSample(
            data.ids, {"rewards": [1] * data.bs}, {"rewards": torch.tensor(scores, dtype=torch.float32)}
        )


class RemoteRewardInterface(ModelInterface):
    """Score responses with a reward service over HTTP (a sandbox, a grader on another machine)."""

    Args = RemoteRewardArgs
    needs_model = False

    def __init__(self, args: RemoteRewardArgs):
        super().__init__(args)
        key = os.environ.get(args.api_key_env) if args.api_key_env else None
        if args.api_key_env and not key:
            raise UserError(
                f"remote_reward: the environment variable {args.api_key_env} (api_key_env) is not set"
            )
        self.client = RemoteReward(
            args.url, key, args.timeout_s, args.retries, args.batch_size, args.concurrency
        )

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        prompts, responses = decode_responses(model.tokenizer, data)
        scores, info = self.client(prompts, responses, data.meta["answers"])
        out = SequenceSample(
            data.ids, {"rewards": [1] * data.bs}, {"rewards": torch.tensor(scores, dtype=torch.float32)}
        )
        names = sorted({k for d in info for k in d})  # per-sample numbers the service sent: their means
        out.stats = {
            f"info/{k}": sum(d[k] for d in info if k in d) / sum(k in d for d in info) for k in names
        }
        return out

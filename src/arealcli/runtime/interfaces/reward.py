"""Score responses with a registered reward function (no weights: a rule, a verifier, your code)."""

from __future__ import annotations

import torch

from arealcli.runtime.data.responses import decode_responses
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.models.model import Model
from arealcli.runtime.registry import get_reward
from arealcli.schema.components.engine import MicroBatchSpec
from arealcli.schema.components.interfaces import RewardArgs


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

"""Score responses with a registered reward function (no weights: a rule, a verifier, your code), with
a reward service over HTTP (`remote_reward`, protocol 1 of runtime/rewards/remote.py), or with a judge
model asked about each response (`judge_reward`, runtime/rewards/judge.py)."""

from __future__ import annotations

import torch

from arealcli.runtime.data.responses import decode_responses
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface, key_from_env
from arealcli.runtime.models.model import Model
from arealcli.runtime.registry import get_reward
from arealcli.runtime.rewards.judge import Ask, Judge, ask_url
from arealcli.runtime.rewards.remote import RemoteReward
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.interfaces import (
    EnvRewardArgs,
    JudgeRewardArgs,
    JudgeSettings,
    RemoteRewardArgs,
    RewardArgs,
)


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
        return _rewards(data, list(scores))


def _rewards(data: SequenceSample, scores: list[float]) -> SequenceSample:
    return SequenceSample(
        data.ids, {"rewards": [1] * data.bs}, {"rewards": torch.tensor(scores, dtype=torch.float32)}
    )


class EnvRewardInterface(ModelInterface):
    """The rewards an environment gave its episodes (`env_rewards`, made by the generating call's
    workflow), as they are."""

    Args = EnvRewardArgs
    needs_model = False

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        return _rewards(data, data.data["env_rewards"].float().tolist())


class RemoteRewardInterface(ModelInterface):
    """Score responses with a reward service over HTTP (a sandbox, a grader on another machine)."""

    Args = RemoteRewardArgs
    needs_model = False

    def __init__(self, args: RemoteRewardArgs):
        super().__init__(args)
        key = key_from_env(args.api_key_env, "remote_reward")
        self.client = RemoteReward(
            args.url, key, args.timeout_s, args.retries, args.batch_size, args.concurrency
        )

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        prompts, responses = decode_responses(model.tokenizer, data)
        scores, info = self.client(prompts, responses, data.meta["answers"])
        out = _rewards(data, scores)
        names = sorted({k for d in info for k in d})  # per-sample numbers the service sent: their means
        out.stats = {
            f"info/{k}": sum(d[k] for d in info if k in d) / sum(k in d for d in info) for k in names
        }
        return out


def ask_model(model: Model, settings: JudgeSettings) -> Ask:
    """Ask a model of the recipe: greedy generation on its backend, `batch_size` requests per call."""
    gconfig = GenerationHyperparameters(n=1, max_new_tokens=settings.max_new_tokens, greedy=True)
    tok = model.tokenizer

    def ask(requests: list[str]) -> list[str]:
        out: list[str] = []
        for start in range(0, len(requests), settings.batch_size):
            chunk = requests[start : start + settings.batch_size]
            ids = [torch.tensor(tok(r, add_special_tokens=False)["input_ids"]) for r in chunk]
            batch = SequenceSample.from_lists(list(range(len(chunk))), {"packed_prompts": ids})
            result = model.module.generate(batch, MicroBatchSpec(), tok, gconfig)
            out += [tok.decode(list(g), skip_special_tokens=True) for g in result.output_ids]
        return out

    return ask


class JudgeRewardInterface(ModelInterface):
    """Score responses with a judge: the call's model (or a server at `url`) asked with a template, its
    greedy reply read by the parse rule. Metrics: `unparsable` (replies the rule could not read),
    `cached` (share answered from earlier identical requests), `score` (mean of the read scores)."""

    Args = JudgeRewardArgs
    needs_model = False  # a URL judge needs none; `areal check` asks for one otherwise

    def __init__(self, args: JudgeRewardArgs):
        super().__init__(args)
        self.judge: Judge | None = None
        if args.url is not None:
            self.judge = Judge(args, ask_url(args.url, args, key_from_env(args.api_key_env, "judge_reward")))
        self.notes: list[str] = []
        self._noted = False

    def inference(self, model: Model, data: SequenceSample, mb_spec: MicroBatchSpec) -> SequenceSample:
        if self.judge is None:
            self.judge = Judge(self.args, ask_model(model, self.args))
        prompts, responses = decode_responses(model.tokenizer, data)
        answers = data.meta.get("answers") or [[] for _ in range(data.bs)]
        verdicts = self.judge(prompts, responses, answers)
        if verdicts.note is not None and not self._noted:  # said once; counted every step
            self.notes.append(verdicts.note)
            self._noted = True
        out = _rewards(data, verdicts.scores)
        out.stats = verdicts.stats
        return out

    def take_notes(self) -> list[str]:
        """Console lines since the last call (the trainer says them)."""
        notes, self.notes = self.notes, []
        return notes

"""`areal eval --reward judge`: responses scored by the recipe's judge (its `reward: {judge: ...}`), as
training scores them: the same template, parse rule and unreadable-reply policy. A URL judge is asked
over HTTP; a judge that is a model of the recipe is loaded from its `path` and asked in this process (on
the hf engine, whatever backend served it in training)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from arealcli.errors import UserError


def judge_of(recipe: Any, where: str) -> tuple[Any, str | None]:
    """The recipe's judge: its JudgeRewardArgs and, for a model of the recipe, its model folder."""
    from arealcli.schema.components.interfaces import JudgeRewardArgs

    calls = (
        [c for c in recipe.dataflow.calls if isinstance(c.interface.args, JudgeRewardArgs)] if recipe else []
    )
    if not calls:
        raise UserError(
            f"--reward judge: {where} has no judge (a preset's `reward: {{judge: ...}}`); give a recipe "
            "that has one with --recipe"
        )
    call = calls[0]
    args = call.interface.args
    if args.url is not None:
        if args.api_key_env and not os.environ.get(args.api_key_env):
            raise UserError(
                f"--reward judge: the environment variable {args.api_key_env} (api_key_env) is not set"
            )
        return args, None
    spec = recipe.models[call.model]
    if spec.path is None:
        raise UserError(
            f"--reward judge: the judge {call.model!r} of {where} has no `path` to load it from (it is built "
            "from `config` or another model)"
        )
    return args, str(spec.path)


@dataclass
class JudgeScorer:
    """A reward function `(prompts, responses, answers) -> scores` asking the judge; loads it at the
    first call, counts the replies it could not read."""

    args: Any  # JudgeRewardArgs
    model_dir: str | None
    tokenizer: Any
    device: str = "cpu"
    unparsable: int = 0
    _judge: Any = field(default=None, repr=False)
    _local: Any = field(default=None, repr=False)

    def __call__(self, prompts: list[str], responses: list[str], answers: list[list[str]]) -> list[float]:
        if self._judge is None:
            self._judge = self._make()
        verdicts = self._judge(prompts, responses, answers)
        self.unparsable += int(verdicts.stats["unparsable"])
        return verdicts.scores

    def _make(self) -> Any:
        from arealcli.runtime.rewards.judge import Judge, ask_url

        if self.model_dir is None:
            key = os.environ.get(self.args.api_key_env) if self.args.api_key_env else None
            return Judge(self.args, ask_url(self.args.url, self.args, key))
        from arealcli.runtime.evaluate.targets import LocalTarget
        from arealcli.runtime.interfaces.reward import ask_model

        self._local = LocalTarget(self.model_dir, self.tokenizer, "cuda" if self.device == "cuda" else "cpu")
        return Judge(self.args, ask_model(self._local.model, self.args))

    def binary(self) -> bool:
        """Is every score 0 or 1 (labels scored 0/1, an unreadable reply too), so a mean is an accuracy?"""
        labels = self.args.parse.labels
        fallback = self.args.unparsable_score
        return labels is not None and set(labels.values()) <= {0.0, 1.0} and fallback in (None, 0.0, 1.0)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None

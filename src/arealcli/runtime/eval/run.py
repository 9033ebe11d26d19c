"""Held-out evaluation: a target's greedy decoding and n samples per prompt, scored by a reward function
(`areal eval`, and held-out evaluation with samples during training). A target has `generate(batch,
gconfig) -> [Generated]`: `EngineTarget` here (a model of this process), and `areal eval`'s model
folders and OpenAI-compatible endpoints (runtime/evaluate/targets.py).

The local path is the one held-out evaluation takes during training: the prompts in the recipe's
`eval_dataset` batches, each batch one `generate` call of the `hf` engine, scored by the same reward;
so a run's final checkpoint evaluated greedily gives the run's final held-out score exactly. Endpoints get
the same prompts as token ids (`/v1/completions`, one request per prompt with `n`), so the tokenizer is
the recipe's on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.eval.metrics import PromptResult
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec


@dataclass
class Generated:
    ids: list[int]
    text: str
    truncated: bool  # cut at max_new_tokens
    reward: float | None = None  # an environment's score of the episode (an environment workflow's)


class EngineTarget:
    """A model of this process generating as the PPO actor does: `generate` calls of its engine, or
    episodes of a workflow (`episodes(batch, gconfig)`; the response is the final answer)."""

    def __init__(self, model: Any, episodes: Callable[[SequenceSample, Any], SequenceSample] | None = None):
        self.model, self.tokenizer, self.episodes = model, model.tokenizer, episodes

    def generate(self, batch: SequenceSample, g: GenerationHyperparameters) -> list[Generated]:
        if self.episodes is not None:
            from arealcli.runtime.data.responses import decode_responses

            data = self.episodes(batch, g)
            _, texts = decode_responses(self.tokenizer, data)
            out = []
            rewards = data.unpack("env_rewards") if "env_rewards" in data.keys else [None] * data.bs
            for ids, pm, cut, text, reward in zip(
                data.unpack("packed_input_ids"),
                data.unpack("prompt_mask"),
                data.unpack("seq_no_eos_mask"),
                texts,
                rewards,
                strict=True,
            ):
                scored = None if reward is None else float(reward.item())
                out.append(Generated(ids[~pm.bool()].tolist(), text, bool(cut.item()), scored))
            return out
        gen = self.model.module.generate(batch, MicroBatchSpec(), self.tokenizer, g)
        return [
            Generated(list(ids), self.tokenizer.decode(ids, skip_special_tokens=True), bool(cut))
            for ids, cut in zip(gen.output_ids, gen.no_eos, strict=True)
        ]

    def close(self) -> None:
        pass


def answer_extractor(reward: str) -> Callable[[str], str | None]:
    """The answer a response gives, for majority votes: the math reward's extraction (normalized) for
    math-like rewards, else the stripped response."""
    if reward in ("math", "partial_credit"):
        from arealcli.runtime.rewards.math_verifier import extract_answer, normalize_answer

        def math_answer(text: str) -> str | None:
            found = extract_answer(text)
            return normalize_answer(found) if found is not None else None

        return math_answer
    return lambda text: text.strip() or None


@dataclass
class EvalPlan:
    reward: str
    greedy: GenerationHyperparameters | None  # None: no greedy pass
    sampled: GenerationHyperparameters | None  # None: no samples (n = 0)
    seed: int = 0
    scorer: Callable[..., Any] | None = None  # scores in place of the registered reward (a judge)


def evaluate(
    target: Any,
    batches: Iterable[SequenceSample],
    plan: EvalPlan,
    progress: Callable[[int], None] | None = None,
) -> list[PromptResult]:
    """Every prompt of `batches`: greedy (one batch, one call, as in training), then n samples."""
    import torch

    with torch.random.fork_rng(devices=[]):  # the caller's random stream (a training run's) is untouched
        torch.manual_seed(plan.seed)
        return _evaluate(target, batches, plan, progress)


def _evaluate(target, batches, plan: EvalPlan, progress) -> list[PromptResult]:
    from arealcli.runtime.registry import get_reward
    from arealcli.schema.components.interfaces import ENVIRONMENT

    if plan.scorer is None and plan.reward == ENVIRONMENT:  # the environment scored each episode
        reward_fn, extract = None, answer_extractor(plan.reward)
    else:
        reward_fn, extract = plan.scorer or get_reward(plan.reward), answer_extractor(plan.reward)

    def score(prompts: list, out: list[Generated], answers: list) -> list:
        if reward_fn is not None:
            return reward_fn(prompts, [o.text for o in out], answers)
        if any(o.reward is None for o in out):
            raise UserError(
                "eval_reward_fn environment needs an environment workflow that scores its episodes"
            )
        return [o.reward for o in out]

    results: list[PromptResult] = []
    for batch in batches:
        prompts, answers = batch.meta["prompt"], batch.meta["answers"]
        rows = [PromptResult(p, list(a)) for p, a in zip(prompts, answers, strict=True)]
        if plan.greedy is not None:
            out = target.generate(batch, plan.greedy)
            scores = score(prompts, out, answers)
            for row, o, s in zip(rows, out, scores, strict=True):
                row.greedy, row.greedy_reward = o.text, float(s)
        if plan.sampled is not None:
            n = plan.sampled.n
            out = target.generate(batch.repeat_interleave(n), plan.sampled)
            scores = score(
                [p for p in prompts for _ in range(n)], out, [a for a in answers for _ in range(n)]
            )
            for i, row in enumerate(rows):
                mine = out[i * n : (i + 1) * n]
                row.responses = [o.text for o in mine]
                row.rewards = [float(s) for s in scores[i * n : (i + 1) * n]]
                row.extracted = [extract(o.text) for o in mine]
                row.lengths = [len(o.ids) for o in mine]
                row.truncated = [o.truncated for o in mine]
        results.extend(rows)
        if progress is not None:
            progress(len(rows))
    return results

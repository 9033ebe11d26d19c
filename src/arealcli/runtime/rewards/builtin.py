"""Built-in reward functions: `fn(prompts, responses, answers) -> list[float]`, one score per response."""

from __future__ import annotations

from collections.abc import Sequence


def math_reward(
    prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]
) -> list[float]:
    """1 if the response's final answer equals a reference (numeric/symbolic, with a timeout), else 0."""
    from arealcli.runtime.rewards.math_verifier import math_reward as verify

    return verify(responses, answers)


def exact_match(
    prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]
) -> list[float]:
    """1 if the stripped response equals a stripped reference answer, else 0."""
    return [float(r.strip() in {a.strip() for a in refs}) for r, refs in zip(responses, answers, strict=True)]

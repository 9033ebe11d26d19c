"""The metrics of `areal eval` (and of held-out evaluation with samples), from per-prompt results.

For a prompt with n sampled responses of which c are correct (reward 1 of a 0/1 reward):
    avg@k   mean reward of its first k samples                      (any reward)
    pass@k  1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement,
            hold a correct one (the unbiased estimator of Chen et al. 2021; 1 when n - c < k)
    maj@k   1 if the most frequent extracted answer among its first k samples is a correct one (ties:
            the answer seen first); responses without an extractable answer never win the vote
Each metric is the mean over prompts of the per-prompt value; its 95% interval is a bootstrap over the
prompts (percentiles 2.5 and 97.5 of `n_boot` resamples, seeded). Also: the greedy score, the mean
length of sampled responses in tokens and the share cut at max_new_tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k)/C(n, k), computed as a product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_correct(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 when the most frequent answer (ties: the earliest) is a correct one."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return 1.0 if any(ok for a, ok in zip(answers, correct, strict=True) if a == winner) else 0.0


@dataclass
class PromptResult:
    """One prompt: its greedy response and its sampled ones, scored."""

    UNIT = "prompts"  # what the table counts

    prompt: str
    answers: list[str]
    greedy: str | None = None
    greedy_reward: float | None = None
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    extracted: list[str | None] = field(default_factory=list)  # each response's answer, for maj@k
    lengths: list[int] = field(default_factory=list)  # tokens
    truncated: list[bool] = field(default_factory=list)

    def correct(self) -> list[bool]:
        return [r >= 1.0 - 1e-9 for r in self.rewards]

    def row(self) -> dict[str, Any]:
        """Its line of `results.json`'s `per_prompt`."""
        out: dict[str, Any] = {"prompt": self.prompt, "answers": self.answers}
        if self.greedy_reward is not None:
            out["greedy_correct"] = self.greedy_reward >= 1.0 - 1e-9
            out["greedy_reward"] = self.greedy_reward
        if self.rewards:
            out.update({"n": len(self.rewards), "correct": sum(self.correct())})
            out["mean_reward"] = sum(self.rewards) / len(self.rewards)
        return out

    def sample_row(self) -> dict[str, Any]:
        """Its line of the samples file: the responses and their rewards."""
        return {
            "prompt": self.prompt,
            "answers": self.answers,
            "greedy": self.greedy,
            "greedy_reward": self.greedy_reward,
            "completions": self.responses,
            "rewards": self.rewards,
        }


def per_prompt_values(results: list[PromptResult], ks: list[int], binary: bool) -> dict[str, list[float]]:
    """Every metric's per-prompt values (its mean over prompts is the metric)."""
    values: dict[str, list[float]] = {}
    if results and results[0].greedy_reward is not None:
        values["greedy_accuracy" if binary else "greedy_reward"] = [r.greedy_reward or 0.0 for r in results]
    if not results or not results[0].rewards:
        return values
    n = len(results[0].rewards)
    for k in ks:
        values[f"avg@{k}"] = [sum(r.rewards[:k]) / k for r in results]
        if binary:
            values[f"pass@{k}"] = [pass_at_k(n, sum(r.correct()), k) for r in results]
            values[f"maj@{k}"] = [majority_correct(r.extracted[:k], r.correct()[:k]) for r in results]
    values["response_tokens"] = [sum(r.lengths) / len(r.lengths) for r in results]
    values["truncated"] = [sum(r.truncated) / len(r.truncated) for r in results]
    return values


def summarize(
    results: list[PromptResult], ks: list[int], binary: bool, n_boot: int = 1000, seed: int = 0
) -> dict[str, Any]:
    """`{metric: mean, metric_ci95: [lo, hi], ...}` over the prompts."""
    return bootstrap_means(per_prompt_values(results, ks, binary), n_boot, seed)


def bootstrap_means(values: dict[str, list[float]], n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """`{metric: mean, metric_ci95: [lo, hi], ...}` of per-item values (every list one item each)."""
    import numpy as np

    out: dict[str, Any] = {}
    m = len(next(iter(values.values()))) if values else 0
    # one set of resamples for every metric (rows: resamples, columns: the items drawn)
    picks = np.random.default_rng(seed).integers(0, m, size=(n_boot, m)) if m else None
    for name, vals in values.items():
        out[name] = sum(vals) / m if m else float("nan")
        if picks is not None:
            means = np.sort(np.asarray(vals, dtype=np.float64)[picks].mean(axis=1))
            lo, hi = means[int(0.025 * (n_boot - 1))], means[int(math.ceil(0.975 * (n_boot - 1)))]
            out[f"{name}_ci95"] = [float(lo), float(hi)]
    return out

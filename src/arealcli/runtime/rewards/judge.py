"""Rewards from a judge: a language model asked, with a prompt template, about each response.

    template  "{prompt}{response}?"             fields {prompt}, {response}, {answer} (the first
                                                reference answer, "" when there is none)
    parse     {labels: {Y: 1, N: 0}}            the reply starts with a label (the longest that fits,
                                                followed by the end or a non-alphanumeric character)
              {number: [0, 10]}                 the first number of the reply, within the range
              {regex: 'Score: (\\d+)', ...}      searched in the reply; its first group (or the match)
                                                is then read as the label or the number

The judge is a model of the recipe, asked on its own backend (in-process, a launched `areal serve` or
vLLM server, any generator), or an OpenAI-compatible server at a URL (POST URL/v1/completions, greedy:
temperature 0). Every request is greedy, so identical requests get identical replies: each distinct
request is asked once and its reply kept (an LRU cache of `cache_size` replies). A reply the rule cannot
read is never a silent 0: it is counted (`unparsable` of the call's metrics), said on the console, and
scored `unparsable_score`; without one the run stops (exit 2) naming the reply and the setting.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.rewards.remote import post_json
from arealcli.schema.components.interfaces import JudgeParse, JudgeSettings

NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")

Ask = Callable[[list[str]], list[str]]  # requests -> the judge's replies, in order


class JudgeError(RuntimeError):
    """The judge did not score a batch: unreachable, refused, or an answer outside OpenAI's format."""


class UnreadableReply(UserError):
    """A judge's reply that its parse rule cannot read, with no `unparsable_score`: the recipe's to mend
    (greedy replies come back the same, so the run is not retried)."""


@dataclass(frozen=True)
class Rule:
    """A parse rule (JudgeParse) ready to read replies."""

    labels: dict[str, float] | None
    number: tuple[float, float] | None
    regex: re.Pattern[str] | None

    @classmethod
    def of(cls, parse: JudgeParse) -> Rule:
        return cls(
            (  # longest first: the longest label that fits the reply wins
                dict(sorted(parse.labels.items(), key=lambda kv: -len(kv[0])))
                if parse.labels is not None
                else None
            ),
            (parse.number[0], parse.number[1]) if parse.number is not None else None,
            re.compile(parse.regex) if parse.regex is not None else None,
        )

    def score(self, reply: str) -> float | None:
        """The reply's score, or None when the rule cannot read it."""
        text = reply
        if self.regex is not None:
            match = self.regex.search(reply)
            if match is None:
                return None
            text = match.group(1) if match.re.groups else match.group(0)
            if text is None:  # an optional group that did not take part
                return None
        text = text.strip()
        if self.labels is not None:
            for label in self.labels:  # longest first (Rule.of)
                if text.startswith(label) and (len(text) == len(label) or not text[len(label)].isalnum()):
                    return self.labels[label]
            return None
        found = NUMBER.fullmatch(text) if self.regex is not None else NUMBER.search(text)
        if found is None:
            return None
        value = float(found.group(0))
        if not math.isfinite(value):
            return None
        if self.number is not None and not self.number[0] <= value <= self.number[1]:
            return None
        return value

    def describe(self) -> str:
        parts = []
        if self.regex is not None:
            parts.append(f"regex {self.regex.pattern!r}")
        if self.labels is not None:
            parts.append(f"labels {', '.join(self.labels)}")
        if self.number is not None:
            parts.append(f"a number in [{self.number[0]:g}, {self.number[1]:g}]")
        return " then ".join(parts) or "a number"


@dataclass
class Verdicts:
    scores: list[float]
    stats: dict[str, float]
    note: str | None  # one console line about unreadable replies, or None


@dataclass
class Judge:
    """Scores (prompt, response, answers) by asking `ask` with the template and reading the reply."""

    settings: JudgeSettings
    ask: Ask
    _cache: OrderedDict[str, str] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        self.rule = Rule.of(self.settings.parse)

    def render(self, prompt: str, response: str, answers: Sequence[str]) -> str:
        return self.settings.template.format(
            prompt=prompt, response=response, answer=answers[0] if answers else ""
        )

    def replies(self, requests: list[str]) -> tuple[list[str], int]:
        """The judge's reply to each request (each distinct one asked once), and how many came from the
        cache."""
        fresh = [r for r in dict.fromkeys(requests) if r not in self._cache]
        asked = dict(zip(fresh, self.ask(fresh) if fresh else [], strict=True))
        hits = sum(r in self._cache for r in requests)
        out = [asked[r] if r in asked else self._cache[r] for r in requests]
        if self.settings.cache_size:
            for r in requests:
                if r in self._cache:
                    self._cache.move_to_end(r)
            self._cache.update(asked)
            while len(self._cache) > self.settings.cache_size:
                self._cache.popitem(last=False)
        return out, hits

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]
    ) -> Verdicts:
        requests = [self.render(p, r, a) for p, r, a in zip(prompts, responses, answers, strict=True)]
        replies, hits = self.replies(requests)
        read = [self.rule.score(reply) for reply in replies]
        bad = [i for i, s in enumerate(read) if s is None]
        stats = {
            "unparsable": float(len(bad)),
            "cached": hits / max(len(requests), 1),
        }
        note = None
        if bad:
            i = bad[0]
            example = f"e.g. {replies[i]!r} to {requests[i]!r}"
            fallback = self.settings.unparsable_score
            if fallback is None:
                raise UnreadableReply(
                    f"the judge's reply to {len(bad)} of {len(requests)} requests cannot be read as "
                    f"{self.rule.describe()}: {example}; set the judge's unparsable_score to score such "
                    "replies instead of stopping"
                )
            note = (
                f"the judge's reply to {len(bad)} of {len(requests)} requests cannot be read as "
                f"{self.rule.describe()} (scored {fallback:g}, unparsable_score; counted as "
                f"unparsable): {example}"
            )
        fallback = self.settings.unparsable_score or 0.0
        scores = [fallback if s is None else s for s in read]
        nums = [s for s in read if s is not None]
        if nums:
            stats["score"] = sum(nums) / len(nums)
        return Verdicts(scores, stats, note)


def completion_texts(raw: bytes, n: int, url: str) -> list[str]:
    """The `n` choices' texts of an OpenAI completions answer, in prompt order (JudgeError if malformed)."""
    try:
        choices = json.loads(raw)["choices"]
        by_index = {int(c["index"]): c["text"] for c in choices}
        texts = [by_index[i] for i in range(n)]
    except (ValueError, KeyError, TypeError) as e:
        raise JudgeError(
            f"the judge {url} answered outside OpenAI's completions format ({type(e).__name__}: {e}): "
            f"{raw[:200]!r}"
        ) from None
    if not all(isinstance(t, str) for t in texts):
        raise JudgeError(f"the judge {url} answered choices whose text is not a string: {raw[:200]!r}")
    return texts


def ask_url(url: str, settings: JudgeSettings, api_key: str | None) -> Ask:
    """Ask an OpenAI-compatible server: POST URL/v1/completions with `batch_size` prompts per request,
    temperature 0, at most `concurrency` requests in flight, each retried as reward services are."""
    endpoint = url.rstrip("/") + "/v1/completions"
    pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="judge")

    def one(chunk: list[str]) -> list[str]:
        body: dict[str, Any] = {"prompt": chunk, "max_tokens": settings.max_new_tokens, "temperature": 0}
        if settings.model_name is not None:
            body["model"] = settings.model_name
        raw = post_json(
            endpoint,
            json.dumps(body).encode(),
            api_key,
            settings.timeout_s,
            settings.retries,
            0.5,
            "the judge",
            JudgeError,
        )
        return completion_texts(raw, len(chunk), endpoint)

    def ask(requests: list[str]) -> list[str]:
        step = settings.batch_size
        chunks = [requests[i : i + step] for i in range(0, len(requests), step)]
        return [text for texts in pool.map(one, chunks) for text in texts]

    return ask

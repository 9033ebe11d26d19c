"""Log-probs of given token sequences from an OpenAI-compatible server: a distillation teacher served
elsewhere (`areal serve`, vLLM, SGLang).

Each request is POST URL/v1/completions {"prompt": [[ids], ...], "echo": true, "logprobs": 0,
"max_tokens": 1, "temperature": 1}: the server scores the prompt tokens in one forward pass and returns
`choices[i].logprobs.token_logprobs`, log p(x_t | x_<t) for each token of sequence i (null for the first,
which nothing predicts), then the one token it generated, which is dropped. Sequences go as token ids, so
the server never tokenizes: the teacher must share the run's vocabulary. A sequence's log-probs come back
shifted to the trainer's convention: position t holds log p(x_{t+1} | x_<=t), the last position 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arealcli.runtime.rewards.remote import post_json


class TeacherError(RuntimeError):
    """A served teacher did not score a batch: unreachable, refused, or an answer without log-probs."""


@dataclass
class RemoteLogprobs:
    url: str  # base URL; requests go to URL/v1/completions
    api_key: str | None = None
    model_name: str | None = None
    timeout_s: float = 120.0
    retries: int = 3
    batch_size: int = 16
    concurrency: int = 4
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __call__(self, seqs: Sequence[list[int]]) -> list[list[float]]:
        """Per sequence, log p(x_{t+1} | x_<=t) at each position t (0 at the last)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="teacher")
        chunks = [list(seqs[i : i + self.batch_size]) for i in range(0, len(seqs), self.batch_size)]
        return [lp for part in self._pool.map(self._one, chunks) for lp in part]

    def _one(self, seqs: list[list[int]]) -> list[list[float]]:
        endpoint = self.url.rstrip("/") + "/v1/completions"
        body: dict[str, Any] = {
            "prompt": seqs,
            "echo": True,
            "logprobs": 0,
            "max_tokens": 1,
            "temperature": 1.0,
        }
        if self.model_name is not None:
            body["model"] = self.model_name
        raw = post_json(
            endpoint,
            json.dumps(body).encode(),
            self.api_key,
            self.timeout_s,
            self.retries,
            0.5,
            "the teacher",
            TeacherError,
        )
        return shifted_logprobs(raw, seqs, endpoint)


def shifted_logprobs(raw: bytes, seqs: list[list[int]], endpoint: str) -> list[list[float]]:
    """The answer's prompt log-probs of each sequence, shifted (TeacherError when they are missing or the
    server scored other tokens)."""
    try:
        choices = {int(c["index"]): c for c in json.loads(raw)["choices"]}
        out = []
        for i, ids in enumerate(seqs):
            c = choices[i]
            echoed = c.get("prompt_token_ids")
            if echoed is not None and list(echoed) != list(ids):
                raise TeacherError(
                    f"the teacher {endpoint} scored other tokens than it was sent (sequence {i}: "
                    f"{len(echoed)} tokens back for {len(ids)})"
                )
            given = c["logprobs"]["token_logprobs"][: len(ids)]
            if len(given) != len(ids) or not all(
                isinstance(x, int | float) and math.isfinite(x) for x in given[1:]
            ):
                raise TeacherError(
                    f"the teacher {endpoint} returned {len(given)} prompt log-probs for {len(ids)} tokens "
                    "(it must support `echo` with `logprobs` on /v1/completions)"
                )
            out.append([float(x) for x in given[1:]] + [0.0])
        return out
    except TeacherError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise TeacherError(
            f"the teacher {endpoint} answered without prompt log-probs ({type(e).__name__}: {e}): {raw[:200]!r}"
        ) from None

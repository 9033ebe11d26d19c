"""Rewards computed by a service: a small JSON-over-HTTP protocol, its client and a reference server.

A sandbox, a grader or any reward that lives on another machine scores a batch of samples:

    POST /score                                   Authorization: Bearer KEY (when the server has one)
    {"protocol": 1,
     "samples": [{"prompt": "max(3,9,4)=", "response": "9", "answers": ["9"]}, ...]}

    200 {"scores": [1.0, ...],                    one finite number per sample, in order
         "info": [{"tests_passed": 3}, ...]}      optional: per-sample numbers, logged as their means

    GET /health -> 200 {"status": "ok", "protocol": 1}     (no key)

Any other answer is an error: 4xx (a request the service refuses: not retried, its message shown) and
429 / 5xx / a broken connection / a timeout (retried with backoff, then an error naming the URL).
`make_server` serves any reward function `fn(prompts, responses, answers) -> list[float]` this way
(`areal serve-reward NAME`); `RemoteReward` is the client the `remote_reward` interface uses.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PROTOCOL = 1
MAX_BODY = 16 << 20  # bytes of one request the reference server reads
RETRY_STATUS = {429, 500, 502, 503, 504}

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[Sequence[str]]], Sequence[float]]


class RemoteRewardError(RuntimeError):
    """A reward service did not score a batch: refused, unreachable after the retries, or a bad answer."""


class ProtocolError(ValueError):
    """A request or an answer that is not protocol 1 (the message says what is wrong)."""


def request_body(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]) -> bytes:
    samples = [
        {"prompt": p, "response": r, "answers": list(a)}
        for p, r, a in zip(prompts, responses, answers, strict=True)
    ]
    return json.dumps({"protocol": PROTOCOL, "samples": samples}).encode()


def parse_request(body: bytes) -> tuple[list[str], list[str], list[list[str]]]:
    """The prompts, responses and reference answers of a request body (ProtocolError if malformed)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"the body is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("protocol") != PROTOCOL:
        raise ProtocolError(f'the body must be an object with "protocol": {PROTOCOL}')
    samples = data.get("samples")
    if not isinstance(samples, list):
        raise ProtocolError('"samples" must be a list')
    prompts, responses, answers = [], [], []
    for i, s in enumerate(samples):
        if (
            not isinstance(s, dict)
            or not isinstance(s.get("prompt"), str)
            or not isinstance(s.get("response"), str)
        ):
            raise ProtocolError(f'samples[{i}] needs "prompt" and "response" strings')
        refs = s.get("answers", [])
        if not isinstance(refs, list) or not all(isinstance(a, str) for a in refs):
            raise ProtocolError(f"samples[{i}].answers must be a list of strings")
        prompts.append(s["prompt"])
        responses.append(s["response"])
        answers.append(refs)
    return prompts, responses, answers


def parse_scores(body: bytes, n: int) -> tuple[list[float], list[dict[str, float]]]:
    """Scores (n finite numbers) and per-sample info (numbers only) of an answer (ProtocolError if not)."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError(f"the answer is not JSON: {body[:200]!r}") from None
    scores = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(scores, list) or len(scores) != n:
        got = f"{len(scores)} scores" if isinstance(scores, list) else 'no "scores" list'
        raise ProtocolError(f"the answer has {got} for {n} samples")
    if not all(isinstance(s, int | float) and not isinstance(s, bool) and math.isfinite(s) for s in scores):
        raise ProtocolError(
            f"scores must be finite numbers: {[s for s in scores if not isinstance(s, int | float)][:3] or scores[:3]}"
        )
    info = data.get("info") or [{} for _ in scores]
    if not isinstance(info, list) or len(info) != n or not all(isinstance(d, dict) for d in info):
        raise ProtocolError(f'"info" must be a list of {n} objects')
    numbers = [
        {k: float(v) for k, v in d.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for d in info
    ]
    return [float(s) for s in scores], numbers


@dataclass
class RemoteReward:
    """Scores samples through a reward service: batches of at most `batch_size` samples, at most
    `concurrency` requests at once, each with `timeout_s` and `retries` retries (backoff 0.5 s, doubling)."""

    url: str  # the service's base URL; requests go to URL/score
    api_key: str | None = None
    timeout_s: float = 60.0
    retries: int = 3
    batch_size: int = 256
    concurrency: int = 4
    backoff_s: float = 0.5
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def __call__(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]
    ) -> tuple[list[float], list[dict[str, float]]]:
        chunks = [
            range(i, min(i + self.batch_size, len(prompts))) for i in range(0, len(prompts), self.batch_size)
        ]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="remote-reward")
        results = list(
            self._pool.map(
                lambda c: self.score_batch(
                    [prompts[i] for i in c], [responses[i] for i in c], [answers[i] for i in c]
                ),
                chunks,
            )
        )
        return [s for r in results for s in r[0]], [d for r in results for d in r[1]]

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Sequence[str]]
    ) -> tuple[list[float], list[dict[str, float]]]:
        url = self.url.rstrip("/") + "/score"
        raw = post_json(
            url,
            request_body(prompts, responses, answers),
            self.api_key,
            self.timeout_s,
            self.retries,
            self.backoff_s,
            "the reward service",
        )
        try:
            return parse_scores(raw, len(prompts))
        except ProtocolError as e:
            raise RemoteRewardError(
                f"the reward service {url} answered outside protocol {PROTOCOL}: {e}"
            ) from None


def post_json(
    url: str,
    body: bytes,
    api_key: str | None,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    what: str,
    error: type[RuntimeError] = RemoteRewardError,
) -> bytes:
    """POST a JSON body, retried with backoff (backoff_s, doubling) on 429, 5xx, a lost connection or a
    timeout; the answer's body (at most MAX_BODY bytes). Any other refusal, or no answer after the
    retries, raises `error` naming `what` and the URL."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    last = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                raw: bytes = answer.read(MAX_BODY + 1)
                return raw
        except urllib.error.HTTPError as e:
            detail = e.read(2000).decode(errors="replace").strip()
            last = f"HTTP {e.code}{': ' + detail if detail else ''}"
            if e.code not in RETRY_STATUS:
                raise error(f"{what} {url} refused the batch: {last}") from None
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            last = str(getattr(e, "reason", e)) or type(e).__name__
    raise error(f"{what} {url} did not answer after {retries + 1} tries: {last}")


def check_key(given: str | None, key: str | None) -> bool:
    """Is the `Authorization` header `given` the bearer of `key` (always, without a key)?"""
    if not key:
        return True
    return given is not None and hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def make_server(
    fn: RewardFn, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None
) -> ThreadingHTTPServer:
    """A reward service of `fn` (protocol 1) bound to host:port, not yet serving (`serve_forever`). A
    function returning `(scores, info)` sends per-sample info too."""
    lock = threading.Lock()  # one batch at a time through fn (reward functions need not be thread-safe)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 60  # an idle or stalled connection is dropped

        def log_message(self, format: str, *args: Any) -> None:  # quiet: a line per request is noise
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok", "protocol": PROTOCOL})
            else:
                self._send(404, {"error": f"no such path {self.path!r}: POST /score, GET /health"})

        def do_POST(self) -> None:
            if self.path != "/score":
                self._send(404, {"error": f"no such path {self.path!r}: POST /score, GET /health"})
                return
            if not check_key(self.headers.get("Authorization"), api_key):
                self._send(401, {"error": "a valid key is needed (Authorization: Bearer KEY)"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._send(411, {"error": "Content-Length is needed"})
                return
            if length < 0 or length > MAX_BODY:
                self.close_connection = True
                self._send(413, {"error": f"a request body is at most {MAX_BODY} bytes"})
                return
            try:
                prompts, responses, answers = parse_request(self.rfile.read(length))
            except ProtocolError as e:
                self._send(400, {"error": str(e)})
                return
            try:
                with lock:
                    out = fn(prompts, responses, answers)
            except Exception as e:  # the reward's own failure: the client retries a 500
                self._send(500, {"error": f"the reward function failed: {type(e).__name__}: {e}"})
                return
            scores, info = out if isinstance(out, tuple) else (out, None)
            payload: dict[str, Any] = {"scores": [float(s) for s in scores]}
            if info is not None:
                payload["info"] = info
            self._send(200, payload)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server

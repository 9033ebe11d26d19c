"""An async client of SGLang-protocol generation servers.

- One `/generate` request per prompt group (`n` samples), many in flight (`max_concurrent_requests`).
- Load balancing: each request goes to the server with the fewest requests in flight.
- Connection failures (refused, reset, a server that died mid-request, HTTP 5xx) move the request to
  another server, with exponential backoff when none is left; a read timeout is an error at once. Every
  failure is bounded: never a hang.
- A server that is alive but stops answering (stopped, hung): while a request waits, its /health is
  probed every `health_interval_s`; no answer for `stall_timeout_s` gives the server up for good and
  the request goes to another one (or fails with that reason), long before `request_timeout_s`.
- A sample aborted by a weight update is re-sent with the tokens it generated appended to the prompt and
  `max_new_tokens` reduced by as many (GroupGenerator); its output and log-probs are the concatenation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from arealcli.runtime.engines.inference import (  # noqa: F401  (Sample, EventLoopThread: re-exported)
    EventLoopThread,
    GenerationServerError,
    GroupGenerator,
    Sample,
)
from arealcli.runtime.wire.sglang import Completion, generate_payload, parse_completion

logger = logging.getLogger(__name__)


@dataclass
class _Server:
    address: str
    requests: int = 0  # sent so far (tie-break of the load balancer)
    in_flight: int = 0
    down_until: float = 0.0  # after a connection failure, others are preferred until then
    stale: bool = False  # missed a weight update, or stopped answering: never used again
    healthy_at: float = 0.0  # when /health last answered (monotonic)
    probed_at: float = 0.0  # when the last /health probe started
    probe: Any = None  # the /health probe in flight (an asyncio task), shared by every watcher

    @property
    def url(self) -> str:
        return f"http://{self.address}"


def _describe(e: BaseException) -> str:
    """The root cause in a few words ("connection refused" rather than a wrapper's text)."""
    cause: BaseException | None = e
    for _ in range(8):
        if cause is None:
            break
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, ConnectionResetError):
            return "connection reset by the server"
        if isinstance(cause, socket.gaierror):
            return f"cannot resolve the host ({cause.strerror})"
        cause = getattr(cause, "os_error", None) or cause.__cause__ or cause.__context__
    if isinstance(e, aiohttp.ServerDisconnectedError):
        return "the server closed the connection without answering"
    return str(e) or type(e).__name__


@dataclass
class _Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error_message(self) -> str:
        try:
            body = self.json()
        except ValueError:
            return self.body[:500].decode(errors="replace")
        if isinstance(body, dict):
            err = body.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if "message" in body:
                return str(body["message"])
        return str(body)[:500]


class _Retryable(Exception):
    """A connection-level failure (refused, reset, died mid-request, HTTP 5xx): try another server."""


# aiohttp's connect timeout is a ServerTimeoutError like a read timeout; only the latter is fatal
_CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())


class GenerationClient(GroupGenerator):
    def __init__(
        self,
        addresses: list[str],
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_concurrent_requests: int = 256,
        max_abort_resends: int = 8,
        why_down: Callable[[str], str | None] | None = None,
        stall_timeout_s: float = 30.0,
        health_interval_s: float = 5.0,
    ):
        if not addresses:
            raise ValueError("a generation client needs at least one server address")
        self.servers = [_Server(a) for a in addresses]
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.max_concurrent_requests, self.max_abort_resends = max_concurrent_requests, max_abort_resends
        self.stall_timeout_s, self.health_interval_s = (
            stall_timeout_s,
            min(health_interval_s, stall_timeout_s),
        )
        self.why_down = why_down or (lambda address: None)  # e.g. "the process exited (code -9); log: ..."
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ plumbing

    def _http(self) -> aiohttp.ClientSession:
        """The session (created inside the running loop). aiohttp, not httpx: with many requests in
        flight httpx's connection pool costs ~10 ms a request (encode/httpx#3215)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrent_requests + len(self.servers)),
                timeout=aiohttp.ClientTimeout(
                    total=self.request_timeout_s, sock_connect=self.connect_timeout_s
                ),
            )
            self._sem = asyncio.Semaphore(self.max_concurrent_requests)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(
        self, method: str, url: str, payload: Any = None, timeout: float | None = None
    ) -> _Answer:
        """One HTTP exchange; connection-level failures become _Retryable, a read timeout TimeoutError."""
        session = self._http()
        kwargs: dict[str, Any] = {} if payload is None else {"json": payload}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout_s)
        try:
            async with session.request(method, url, **kwargs) as resp:
                answer = _Answer(resp.status, await resp.read())
        except _CONNECT_TIMEOUT as e:
            raise _Retryable(f"no connection within connect_timeout_s={self.connect_timeout_s:g} s") from e
        except (aiohttp.ServerTimeoutError, asyncio.TimeoutError):
            raise TimeoutError from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            raise _Retryable(_describe(e)) from e
        if answer.status >= 500:
            raise _Retryable(f"HTTP {answer.status}: {answer.error_message()}")
        return answer

    async def _send_watched(self, s: _Server, method: str, path: str, payload: Any = None) -> _Answer:
        """`_send` to `s`, watching the server while the answer is awaited: a server whose /health has not
        answered for `stall_timeout_s` (alive but not answering: stopped, hung) is given up for good
        (_Retryable), however long the request itself may legitimately take (`request_timeout_s`)."""
        task = asyncio.ensure_future(self._send(method, s.url + path, payload))
        s.healthy_at = max(s.healthy_at, time.monotonic())  # the stall window starts with the request
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.health_interval_s)
                if done:
                    return task.result()
                if time.monotonic() - await self._healthy_at(s) > self.stall_timeout_s:
                    s.stale = True
                    raise _Retryable(
                        f"stopped answering: no /health answer for {self.stall_timeout_s:g} s (stall_timeout_s); "
                        "the server is alive but stuck, or overloaded"
                    )
        finally:
            if not task.done():
                task.cancel()

    async def _healthy_at(self, s: _Server) -> float:
        """When `s` last answered /health; probes it (one probe at a time, shared) when due."""
        now = time.monotonic()
        if (s.probe is None or s.probe.done()) and now - s.probed_at >= self.health_interval_s:
            s.probed_at = now
            s.probe = asyncio.ensure_future(self._probe(s))
        if s.probe is not None and not s.probe.done():
            await asyncio.wait({s.probe}, timeout=self.health_interval_s)
        return s.healthy_at

    async def _probe(self, s: _Server) -> None:
        try:
            answer = await self._send("GET", s.url + "/health", timeout=self.health_interval_s)
        except (_Retryable, TimeoutError):
            return
        if answer.status == 200:
            s.healthy_at = time.monotonic()

    def _pick(self, tried: set[str]) -> _Server | None:
        live = [s for s in self.servers if not s.stale]
        now = time.monotonic()
        up = [s for s in live if s.down_until <= now]
        pool = [s for s in up if s.address not in tried] or up or live
        return min(pool, key=lambda s: (s.in_flight, s.requests)) if pool else None

    def _failure(self, s: _Server, why: str) -> str:
        down = self.why_down(s.address)
        return f"{s.address}: {why}" + (f" ({down})" if down else "")

    async def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST to the least-loaded server; on connection failures, to another one (with backoff)."""
        errors: list[str] = []
        tried: set[str] = set()
        for attempt in range(self.max_retries + 1):
            s = self._pick(tried)
            if s is None:
                break
            tried.add(s.address)
            s.in_flight += 1
            s.requests += 1
            try:
                answer = await self._send_watched(s, "POST", path, payload)
            except TimeoutError:
                raise GenerationServerError(
                    f"{path} on {s.address} got no answer within request_timeout_s={self.request_timeout_s:g} s; "
                    "the server may be overloaded or stuck (raise request_timeout_s for long generations)"
                ) from None
            except _Retryable as e:  # refused, reset, the server died mid-request, HTTP 5xx
                errors.append(self._failure(s, str(e)))
            else:
                return _json_or_raise(answer, s.address, path)
            finally:
                s.in_flight -= 1
            s.down_until = time.monotonic() + self.retry_backoff_s * 2**attempt
            if attempt < self.max_retries and not any(
                x.down_until <= time.monotonic() for x in self.servers if not x.stale
            ):
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise GenerationServerError(
            f"{path} failed on every generation server after {len(errors)} attempt(s): " + "; ".join(errors)
            if errors
            else f"{path}: no generation server left (all missed a weight update or failed)"
        )

    # ------------------------------------------------------------------ generation

    async def request(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Completion]:
        """One /generate request for `n` samples of `prompt` (re-sending aborted ones is GroupGenerator's)."""
        self._http()
        assert self._sem is not None
        async with self._sem:
            out = await self.post("/generate", generate_payload(prompt, params, n))
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise GenerationServerError(f"/generate returned {len(items)} samples for n={n}")
        return [_parse(item) for item in items]

    # ------------------------------------------------------------------ control

    async def check_all(self) -> list[dict[str, Any]]:
        """Every server answers /health and /get_model_info; a clear error names those that do not."""

        async def one(s: _Server) -> dict[str, Any]:
            try:
                for path in ("/health", "/get_model_info"):
                    answer = await self._send("GET", s.url + path, timeout=self.connect_timeout_s)
                    if answer.status != 200:
                        raise _Retryable(f"{path} answered HTTP {answer.status}")
                return answer.json()
            except (_Retryable, TimeoutError, ValueError) as e:
                why = str(e) or f"no answer within connect_timeout_s={self.connect_timeout_s:g} s"
                raise GenerationServerError(
                    f"cannot use the generation server at {s.address}: {why}. Is it running? "
                    "(start one with `areal serve --model DIR --port N`, or set `launch:` in the backend args)"
                ) from None

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def update_weights(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """POST /update_weights_from_disk to every server. A server that cannot be reached is dropped for
        good (it would generate with old weights); an error if one refuses or none is left."""
        live = [s for s in self.servers if not s.stale]

        async def one(s: _Server) -> Any:
            answer = await self._send_watched(s, "POST", "/update_weights_from_disk", payload)
            return _json_or_raise(answer, s.address, "/update_weights_from_disk", allow_400=True)

        results = await asyncio.gather(*(one(s) for s in live), return_exceptions=True)
        failures, answers = [], []
        for s, r in zip(live, results, strict=True):
            if isinstance(r, _Retryable):
                s.stale = True
                logger.warning("dropping generation server %s", self._failure(s, str(r)))
            elif isinstance(r, TimeoutError):
                failures.append(
                    f"{s.address}: no answer within request_timeout_s={self.request_timeout_s:g} s"
                )
            elif isinstance(r, BaseException):
                failures.append(f"{s.address}: {r}")
            elif not r.get("success"):
                failures.append(f"{s.address}: {r.get('message')}")
            else:
                answers.append(r)
        if failures:
            raise GenerationServerError("weight update failed: " + "; ".join(failures))
        if not answers:
            raise GenerationServerError(
                "weight update reached no generation server: " + ", ".join(s.address for s in self.servers)
            )
        return answers


def _parse(item: Any) -> Completion:
    try:
        return parse_completion(item)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise GenerationServerError(f"unexpected /generate response: {e}") from None


def _json_or_raise(answer: _Answer, address: str, path: str, allow_400: bool = False) -> Any:
    if answer.status >= 400 and not (allow_400 and answer.status == 400):
        raise GenerationServerError(
            f"{address} refused {path} (HTTP {answer.status}): {answer.error_message()}"
        )
    try:
        return answer.json()
    except ValueError:
        raise GenerationServerError(
            f"{address} answered {path} with non-JSON: {answer.body[:200]!r}"
        ) from None

"""An async client of SGLang-protocol generation servers.

- One `/generate` request per prompt group (`n` samples), many in flight (`max_concurrent_requests`).
- Load balancing: each request goes to the server with the fewest requests in flight.
- Connection failures (refused, reset, a server that died mid-request, HTTP 5xx, and HTTP 429: a server
  at its limit of requests in flight) move the request to another server, with exponential backoff when
  none is left; a read timeout is an error at once. Every failure is bounded: never a hang.
- The key (`api_key`) rides on each request that needs it, never on a /health probe: a probe goes to a
  server that may have died, whose port anything may hold since.
- A server that is alive but stops answering (stopped, hung): while a request waits, its /health is
  probed every `health_interval_s`; no answer for `stall_timeout_s` gives the server up for good and
  the request goes to another one (or fails with that reason), long before `request_timeout_s`.
- Launched servers (a `Supervisor`) are watched while idle too (process alive, /health answering): one
  that died or hung is restarted in the background, given the newest weight update before it serves
  again, and the requests it held go to the others or wait for it (`events`, `restarts`, `time_lost_s`
  say what happened). Servers given by address are not restarted: when none is left, the client waits
  up to `reconnect_timeout_s` for one to answer again, gives it the newest weights, and goes on.
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
    abandon,
    all_or_none,
)
from arealcli.runtime.wire.auth import bearer
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
    recovering: Any = None  # the restart (or reconnection) in flight, an asyncio task
    update: Any = None  # the weight update it holds (None: its initial weights)

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
    """A connection-level failure (refused, reset, died mid-request, HTTP 5xx or 429): try another server.
    `stalled`: the server is alive but stopped answering (a supervised one is restarted); `answered`: it
    answered, with an HTTP 5xx or 429 (alive: never a reason to restart it)."""

    def __init__(self, message: str, stalled: bool = False, answered: bool = False):
        super().__init__(message)
        self.stalled, self.answered = stalled, answered


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
        supervisor: Any = None,
        reconnect_timeout_s: float = 60.0,
        api_key: str | None = None,
        adapter: str | None = None,
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
        self.supervisor = supervisor  # launcher.Supervisor of launched servers: restarts them
        if supervisor is not None:
            self.why_down = supervisor.why_down
        self.reconnect_timeout_s = reconnect_timeout_s
        self.headers = bearer(api_key)
        self.adapter = adapter  # a served LoRA adapter's name: every request is generated with it
        self.current_update: Any = None  # the newest weight update: a restarted server gets it
        self.events: list[str] = []  # restarts and reconnections, for the console (taken by the trainer)
        self.restarts, self.time_lost_s = 0, 0.0
        self.fatal: GenerationServerError | None = None  # a server given up for good: every request fails
        self._watcher: Any = None
        self._reconnecting: Any = None  # the wait for a server given by address to answer again
        self._reconnected_at = -1e9
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ plumbing

    def _http(self) -> aiohttp.ClientSession:
        """The session (created inside the running loop). aiohttp, not httpx: with many requests in
        flight httpx's connection pool costs ~10 ms a request (encode/httpx#3215)."""
        if self._session is None:
            # no key on the session: `_send` adds it to each request that needs it (never to a probe)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrent_requests + len(self.servers)),
                timeout=aiohttp.ClientTimeout(
                    total=self.request_timeout_s, sock_connect=self.connect_timeout_s
                ),
            )
            self._sem = asyncio.Semaphore(self.max_concurrent_requests)
        return self._session

    async def aclose(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(
        self, method: str, url: str, payload: Any = None, timeout: float | None = None, keyed: bool = True
    ) -> _Answer:
        """One HTTP exchange, carrying the key unless `keyed` is False (/health probes); connection-level
        failures (and HTTP 5xx, 429) become _Retryable, a read timeout TimeoutError."""
        session = self._http()
        kwargs: dict[str, Any] = {} if payload is None else {"json": payload}
        if keyed and self.headers:
            kwargs["headers"] = self.headers
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
        if answer.status >= 500 or answer.status == 429:  # 429: at its limit of requests in flight
            raise _Retryable(f"HTTP {answer.status}: {answer.error_message()}", answered=True)
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
                stalled = time.monotonic() - await self._healthy_at(s) > self.stall_timeout_s
                if task.done():  # it ended while /health was probed: its own outcome is the answer
                    return task.result()
                if stalled:
                    if not self._supervised(s):
                        s.stale = True
                    raise _Retryable(
                        f"stopped answering: no /health answer for {self.stall_timeout_s:g} s (stall_timeout_s); "
                        "the server is alive but stuck, or overloaded",
                        stalled=True,
                    )
        finally:
            abandon(task)

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
        """One /health probe (a task nobody may await: it never raises), without the key. Any failure is no
        answer."""
        try:
            answer = await self._send("GET", s.url + "/health", timeout=self.health_interval_s, keyed=False)
        except Exception:  # noqa: BLE001  (refused, reset, timed out, the session closed: not healthy)
            return
        if answer.status == 200:
            s.healthy_at = time.monotonic()

    def _pick(self, tried: set[str]) -> _Server | None:
        live = [s for s in self.servers if not s.stale and not _busy(s.recovering)]
        now = time.monotonic()
        up = [s for s in live if s.down_until <= now]
        pool = [s for s in up if s.address not in tried] or up or live
        return min(pool, key=lambda s: (s.in_flight, s.requests)) if pool else None

    def _failure(self, s: _Server, why: str) -> str:
        down = self.why_down(s.address)
        return f"{s.address}: {why}" + (f" ({down})" if down else "")

    async def post(self, path: str, payload: dict[str, Any], reconnect: bool = True) -> Any:
        """POST to the least-loaded server; on connection failures, to another one (with backoff). A
        supervised server that died or hung is restarted meanwhile (not counted as an attempt)."""
        errors: list[str] = []
        tried: set[str] = set()
        attempt = 0
        while attempt <= self.max_retries:
            if self.fatal is not None:
                raise self.fatal
            s = self._pick(tried)
            if s is None:
                if await self._await_recovery():
                    tried.clear()
                    continue
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
            except _Retryable as e:  # refused, reset, the server died mid-request, HTTP 5xx or 429
                errors.append(self._failure(s, str(e)))
                # before any await: other requests keep off this server while it is looked at
                s.down_until = time.monotonic() + self.retry_backoff_s * 2**attempt
                if await self._should_restart(s, e):
                    self._start_recovery(s, str(e))
                    continue
            else:
                return _json_or_raise(answer, s.address, path)
            finally:
                s.in_flight -= 1
            if attempt < self.max_retries and not any(
                x.down_until <= time.monotonic() for x in self.servers if not x.stale
            ):
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            attempt += 1
        if reconnect and self.supervisor is None and await self._reconnect():
            return await self.post(
                path, payload, reconnect=False
            )  # one answers again, with the newest weights
        raise GenerationServerError(
            f"{path} failed on every generation server after {len(errors)} attempt(s): " + "; ".join(errors)
            if errors
            else f"{path}: no generation server left (all missed a weight update or failed)"
        )

    # ------------------------------------------------------------------ recovery

    def _supervised(self, s: _Server) -> bool:
        return self.supervisor is not None and self.supervisor.owns(s.address)

    async def _should_restart(self, s: _Server, e: _Retryable) -> bool:
        """A supervised server that stopped answering, or whose process exited (the connection may
        break a moment before the process can be reaped: look again for a second)."""
        if not self._supervised(s) or e.answered:
            return False
        if e.stalled:
            return True
        for _ in range(5):
            if self.supervisor.why_down(s.address) is not None:
                return True
            await asyncio.sleep(0.2)
        return False

    def _start_recovery(self, s: _Server, why: str) -> None:
        """Restart `s` in the background (once, however many requests saw it fail)."""
        if not _busy(s.recovering):
            s.recovering = asyncio.ensure_future(self._restart(s, why))

    async def _await_recovery(self) -> bool:
        """Wait for the restarts in flight; True when a server is usable again. A restart that gave up
        makes every request fail with its reason."""
        pending = [s.recovering for s in self.servers if _busy(s.recovering)]
        if not pending:
            return False
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if self.fatal is not None:
            raise self.fatal
        return True

    async def _restart(self, s: _Server, why: str) -> None:
        assert self.supervisor is not None
        t0 = time.monotonic()
        label = self.supervisor.label(s.address)
        down = self.supervisor.why_down(s.address)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(
                self.supervisor.thread, self.supervisor.restart, s.address, down or why
            )
        except GenerationServerError as e:
            self._give_up(s, e)
            return
        except Exception as e:  # noqa: BLE001  (a task nobody awaits: its failure becomes every request's)
            self._give_up(s, GenerationServerError(f"generation server {label} could not be restarted"), e)
            return
        s.healthy_at, s.down_until, s.update = time.monotonic(), 0.0, None
        try:
            await self._catch_up(s)
        except GenerationServerError as e:
            self._give_up(s, e)
            return
        except (_Retryable, TimeoutError) as e:
            self._give_up(
                s, GenerationServerError(f"generation server {label} failed right after a restart: {e}")
            )
            return
        except Exception as e:  # noqa: BLE001  (as above)
            why = f"generation server {label} was restarted, then failed while loading the newest weights"
            self._give_up(s, GenerationServerError(why), e)
            return
        lost = time.monotonic() - t0
        self.restarts += 1
        self.time_lost_s += lost
        held = f", weights v{_version_of(s.update)} loaded" if s.update is not None else ""
        self.events.append(
            f"generation server {label}: {down or why}; restarted in {lost:.1f} s{held} "
            f"(restart {len(self.supervisor.restarted_at)} of at most {self.supervisor.max_restarts} within "
            f"{self.supervisor.window_s:g} s); the run goes on"
        )

    def _give_up(self, s: _Server, error: GenerationServerError, cause: BaseException | None = None) -> None:
        """`s` is not used again and every request fails with `error` (`cause`: an unexpected exception,
        named in the message)."""
        if cause is not None:
            error = GenerationServerError(f"{error}: {type(cause).__name__}: {cause}")
            error.__cause__ = cause
        s.stale = True
        self.fatal = error

    async def _catch_up(self, s: _Server) -> None:
        """Give `s` the newest weight update (again, should another arrive meanwhile)."""
        while self.current_update is not None and s.update is not self.current_update:
            update = self.current_update
            await self._apply_update(s, update)
            s.update = update

    async def _apply_update(self, s: _Server, update: Any) -> None:
        """Load weight update `update` (what `update_weights` was given) on the one server `s`."""
        path = _update_path(update)
        answer = await self._send_watched(s, "POST", path, update)
        result = _json_or_raise(answer, s.address, path, allow_400=True)
        if not result.get("success"):
            raise GenerationServerError(f"{s.address}: {_message(result)}")

    async def _reconnect(self) -> bool:
        """No server given by address answers: wait up to `reconnect_timeout_s` for one to answer
        /health again, give it the newest weights, and use it (True); False when none came back. The
        requests that fail together wait on one reconnection."""
        if self.reconnect_timeout_s <= 0:
            return False
        if time.monotonic() - self._reconnected_at < 2.0:
            return True  # another request just brought a server back
        if not _busy(self._reconnecting):
            self._reconnecting = asyncio.ensure_future(self._find_server())
        return await asyncio.shield(self._reconnecting)

    async def _find_server(self) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.reconnect_timeout_s:
            for s in self.servers:
                try:
                    answer = await self._send(
                        "GET", s.url + "/health", timeout=self.connect_timeout_s, keyed=False
                    )
                except (_Retryable, TimeoutError):
                    continue
                if answer.status != 200:
                    continue
                s.update = None  # it may have been restarted (its initial weights): load the newest again
                try:
                    await self._catch_up(s)
                except (_Retryable, TimeoutError, GenerationServerError):
                    continue
                s.stale, s.down_until, s.healthy_at = False, 0.0, time.monotonic()
                self._reconnected_at = time.monotonic()
                lost = time.monotonic() - t0
                self.time_lost_s += lost
                self.events.append(
                    f"generation server {s.address} answers again after {lost:.0f} s; the run goes on"
                )
                return True
            await asyncio.sleep(1.0)
        return False

    def watch(self) -> None:
        """Start watching the supervised servers while idle (on the running loop)."""
        if self.supervisor is not None and self._watcher is None:
            now = time.monotonic()
            for s in self.servers:
                s.healthy_at = now
            self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """Every `health_interval_s`: a supervised server whose process exited, or whose /health has not
        answered for `stall_timeout_s`, is restarted before a request has to find out."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for s in self.servers:
                if s.stale or _busy(s.recovering) or not self._supervised(s):
                    continue
                try:
                    down = self.supervisor.why_down(s.address)
                    if down is not None:
                        self._start_recovery(s, down)
                    elif time.monotonic() - await self._healthy_at(s) > self.stall_timeout_s:
                        self._start_recovery(
                            s, f"stopped answering /health for {self.stall_timeout_s:g} s (stall_timeout_s)"
                        )
                except Exception:  # the watcher must outlive any one probe's surprise
                    logger.exception("watching generation server %s", s.address)

    def take_events(self) -> list[str]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ generation

    async def request(self, prompt: list[int], params: dict[str, Any], n: int) -> list[Completion]:
        """One /generate request for `n` samples of `prompt` (re-sending aborted ones is GroupGenerator's)."""
        self._http()
        assert self._sem is not None
        async with self._sem:
            out = await self.post("/generate", generate_payload(prompt, params, n, self.adapter))
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise GenerationServerError(f"/generate returned {len(items)} samples for n={n}")
        return [_parse(item) for item in items]

    # ------------------------------------------------------------------ control

    async def check_all(self) -> list[dict[str, Any]]:
        """Every server answers /health and /get_model_info; a clear error names those that do not."""

        async def one(s: _Server) -> dict[str, Any]:
            try:
                for path in ("/health", "/get_model_info"):  # /health without the key: a probe
                    keyed = path != "/health"
                    answer = await self._send(
                        "GET", s.url + path, timeout=self.connect_timeout_s, keyed=keyed
                    )
                    if answer.status != 200:
                        raise _Retryable(f"{path} answered HTTP {answer.status}")
                return answer.json()
            except (_Retryable, TimeoutError, ValueError) as e:
                why = str(e) or f"no answer within connect_timeout_s={self.connect_timeout_s:g} s"
                raise GenerationServerError(
                    f"cannot use the generation server at {s.address}: {why}. Is it running? "
                    "(start one with `areal serve --model DIR --port N`, or set `launch:` in the backend args)"
                ) from None

        infos = await all_or_none([one(s) for s in self.servers])
        self.watch()
        return infos

    async def update_weights(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """POST /update_weights_from_disk (or, for an adapter served by name, /load_lora_adapter) to every
        server. A server that cannot be reached is dropped for good (it would generate with old weights)
        unless it is supervised: then it is restarted and gets these weights before it serves again. An
        error if one refuses or none is left."""
        if self.fatal is not None:
            raise self.fatal
        self.current_update = payload
        live = [s for s in self.servers if not s.stale and not _busy(s.recovering)]
        path = _update_path(payload)

        async def one(s: _Server) -> Any:
            answer = await self._send_watched(s, "POST", path, payload)
            return _json_or_raise(answer, s.address, path, allow_400=True)

        results = await asyncio.gather(*(one(s) for s in live), return_exceptions=True)
        failures, answers = [], []
        for s, r in zip(live, results, strict=True):
            if isinstance(r, _Retryable) and await self._should_restart(s, r):
                self._start_recovery(s, str(r))  # it gets this update once it is back
            elif isinstance(r, _Retryable):
                s.stale = True
                logger.warning("dropping generation server %s", self._failure(s, str(r)))
            elif isinstance(r, TimeoutError):
                failures.append(
                    f"{s.address}: no answer within request_timeout_s={self.request_timeout_s:g} s"
                )
            elif isinstance(r, BaseException):
                failures.append(f"{s.address}: {r}")
            elif not r.get("success"):
                failures.append(f"{s.address}: {_message(r)}")
            else:
                s.update = payload
                answers.append(r)
        if failures:
            raise GenerationServerError("weight update failed: " + "; ".join(failures))
        if not answers and not any(_busy(s.recovering) for s in self.servers):
            raise GenerationServerError(
                "weight update reached no generation server: " + ", ".join(s.address for s in self.servers)
            )
        return answers


def _update_path(update: dict[str, Any]) -> str:
    """The endpoint of a weight update: an adapter served by name, or the whole weights."""
    return "/load_lora_adapter" if "lora_name" in update else "/update_weights_from_disk"


def _message(answer: dict[str, Any]) -> Any:
    """Why an update failed (SGLang's weight answers say `message`, its adapter answers `error_message`)."""
    return answer.get("message") or answer.get("error_message")


def _busy(task: Any) -> bool:
    return task is not None and not task.done()


def _version_of(update: Any) -> Any:
    """The policy version a weight update carries (SGLang's payload, or vLLM's (path, version))."""
    if isinstance(update, dict):
        return update.get("weight_version")
    return update[1] if isinstance(update, tuple) else "?"


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

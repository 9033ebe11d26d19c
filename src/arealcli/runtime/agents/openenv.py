"""Episodes in an OpenEnv environment: the environment resets, the model acts, the environment steps.

OpenEnv (openenv-core) serves an environment over HTTP and WebSocket: `/health`, and `/ws`, where one
connection is one environment instance (its HTTP `/reset` and `/step` build a fresh one per request, so
episodes use the socket). The messages are JSON:

    >> {"type": "reset", "data": {...reset kwargs}}   << {"type": "observation", "data": {"observation": {...},
    >> {"type": "step", "data": {...action fields}}                                 "reward": r, "done": d}}
    >> {"type": "close"}                              << {"type": "error", "data": {"message", "code"}}

Sessions stay open between episodes (a reset starts the next one on the same environment instance):
a pool of them, on an event loop of the workflow's own; generation runs in the caller's thread.

One episode per prompt, the prompts of a batch turn by turn (each turn one batched generate call on the
model's engine, as `tool_use` does):

    observation <- reset(reset_args)                      the episode's prompt: the observation, rendered
    repeat up to max_turns:
        text <- generate(tokens)                          (mask: True)
        observation, reward, done <- step(action of text)
        if done: stop; else tokens += rendered observation   (mask: False)

The episode's reward is the sum of its step rewards (`Episode.reward`; the dataflow's `env_reward` call
reads it). A step the environment refuses (an action that does not validate) ends the episode with the
rewards so far and counts in `env/errors`. The server is given (`url`) or started with the run (`app`:
uvicorn on a free local port, stopped with the workflow).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.agents.workflows import Episode, generate_turn
from arealcli.runtime.clients.launcher import child_env, die_with_parent
from arealcli.runtime.engines.inference import EventLoopThread
from arealcli.schema.components.engine import GenerationHyperparameters
from arealcli.schema.components.workflows import OpenEnvArgs

logger = logging.getLogger(__name__)


class EnvironmentError_(RuntimeError):
    """The environment refused a message (its `error` reply) or did not answer in time."""


class EnvServer:
    """An environment server started with the run: `python -m uvicorn APP` on a free local port, with this
    process's module path (the current directory, beside the recipe); stopped by `stop`."""

    def __init__(self, app: str, start_timeout_s: float, app_dir: str | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        path = [app_dir] if app_dir else []
        path += [p for p in sys.path if p and os.path.isdir(p)]
        env = {**child_env(), "PYTHONPATH": os.pathsep.join(path)}  # no key of the run's
        cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--log-level", "warning"]
        self.log = tempfile.TemporaryFile("w+")  # its output: a pipe nobody read would fill and stop it
        # started from a thread of its own that lives as long as it: the child gets SIGTERM when the
        # thread that started it ends (`die_with_parent`), so not when a rollout or eval thread ends, but
        # when the run does, however it ends
        started: list[subprocess.Popen | BaseException] = []
        ready, self._done = threading.Event(), threading.Event()

        def keep() -> None:
            try:
                started.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        stdout=self.log,
                        stderr=subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                        preexec_fn=die_with_parent,
                    )
                )
            except BaseException as e:  # raised below, in the caller
                started.append(e)
            ready.set()
            self._done.wait()

        threading.Thread(target=keep, name=f"env-server-{self.port}", daemon=True).start()
        ready.wait()
        if isinstance(started[0], BaseException):
            raise started[0]
        self.proc = started[0]
        atexit.register(self.stop)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().strip().splitlines()
                raise UserError(
                    f"the environment server {app} exited: {err[-1] if err else self.proc.returncode}"
                )
            if _healthy(self.url):
                return
            time.sleep(0.2)
        self.stop()
        raise UserError(
            f"the environment server {app} did not answer {self.url}/health in {start_timeout_s:g} s"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._done.set()
        self.log.close()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


class Session:
    """One environment instance: a WebSocket to the server's `/ws`."""

    def __init__(self, ws, timeout_s: float):
        self.ws, self.timeout_s = ws, timeout_s

    async def ask(self, kind: str, data: dict[str, Any]) -> tuple[dict[str, Any], float | None, bool]:
        """(observation, reward, done) of a reset or step."""
        await self.ws.send_str(json.dumps({"type": kind, "data": data}))
        try:
            msg = await asyncio.wait_for(self.ws.receive(), self.timeout_s)
        except TimeoutError:
            raise EnvironmentError_(f"no answer to {kind} within {self.timeout_s:g} s") from None
        try:
            reply = json.loads(msg.data)
        except (TypeError, ValueError):
            raise EnvironmentError_(f"the environment's answer to {kind} is not JSON ({msg.type})") from None
        body = reply.get("data") or {}
        if reply.get("type") == "error":
            raise EnvironmentError_(f"{kind}: {body.get('message', 'error')} ({body.get('code', '')})")
        observation = body.get("observation") or {}
        reward = body.get("reward")
        return observation, float(reward) if isinstance(reward, int | float) else None, bool(body.get("done"))

    async def close(self) -> None:
        try:
            await self.ws.send_str(json.dumps({"type": "close"}))
        finally:
            await self.ws.close()


class SessionPool:
    """Open sessions kept between waves and steps (a connection costs more than a reset), on an event
    loop of their own; a session that failed is closed, not reused."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.loop = EventLoopThread()
        self.idle: list[Session] = []
        self.http: Any = None
        self.closed = False

    def run(self, coro) -> Any:
        return self.loop.run(coro)

    async def take(self, n: int) -> list[Session]:
        import aiohttp

        if self.http is None:  # no cap on connections: each session holds one (aiohttp's default is 100)
            self.http = aiohttp.ClientSession(trust_env=False, connector=aiohttp.TCPConnector(limit=0))
        ws_url = (
            ("wss://" if self.url.startswith("https://") else "ws://") + self.url.split("://", 1)[1] + "/ws"
        )
        timeout = aiohttp.ClientWSTimeout(ws_receive=self.timeout_s, ws_close=self.timeout_s)

        async def connect() -> Session:
            ws = await asyncio.wait_for(
                self.http.ws_connect(ws_url, max_msg_size=0, timeout=timeout), self.timeout_s
            )
            return Session(ws, self.timeout_s)

        reused, self.idle = self.idle[:n], self.idle[n:]
        return reused + list(await asyncio.gather(*(connect() for _ in range(n - len(reused)))))

    async def give_back(self, sessions: list[Session], failed: set[int]) -> None:
        await asyncio.gather(
            *(s.close() for i, s in enumerate(sessions) if i in failed), return_exceptions=True
        )
        self.idle += [s for i, s in enumerate(sessions) if i not in failed]

    async def _close_all(self) -> None:
        await asyncio.gather(*(s.close() for s in self.idle), return_exceptions=True)
        self.idle = []
        if self.http is not None:
            await self.http.close()

    def close(self) -> None:
        """Close the sessions and the loop (a few seconds at most; again: nothing)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.run(self._close_all(), timeout=5)
        except Exception:  # the server went away first: nothing to close politely
            pass
        self.loop.close()


class OpenEnvWorkflow:
    """Episodes in an OpenEnv environment (see the module doc)."""

    Args = OpenEnvArgs

    def __init__(self, args: OpenEnvArgs):
        self.args = args
        self.server: EnvServer | None = None
        self.pool: SessionPool | None = None
        self._lock = threading.Lock()

    def url(self) -> str:
        if self.args.url is not None:
            return self.args.url.rstrip("/")
        if self.server is not None and not self.server.alive:  # it died: started again, said once
            logger.warning("the environment server %s exited; starting it again", self.args.app)
            self._drop_pool()
            self.server.stop()
            self.server = None
        if self.server is None:
            assert self.args.app is not None
            self.server = EnvServer(self.args.app, self.args.start_timeout_s, self.args.app_dir)
        return self.server.url

    def sessions(self) -> SessionPool:
        with self._lock:  # the rollout thread and an evaluation may both ask
            url = self.url()
            if self.pool is None or self.pool.url != url:
                self._drop_pool()
                self.pool = SessionPool(url, self.args.timeout_s)
                atexit.register(
                    self.pool.close
                )  # while its loop's thread still runs (before the server stops)
            return self.pool

    def _drop_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def close(self) -> None:
        self._drop_pool()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def render(self, observation: dict[str, Any]) -> str:
        fields = {**observation, "observation": json.dumps(observation, sort_keys=True)}
        try:
            return self.args.observation_template.format(**fields)
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(
                f"openenv observation_template {self.args.observation_template!r} does not fit the observation "
                f"(fields {sorted(observation)}): {e}"
            ) from None

    def action(self, text: str) -> dict[str, Any]:
        if self.args.action_field is not None:
            return {self.args.action_field: text.strip()}
        try:
            action = json.loads(text)
        except ValueError:
            return {"_unparsed": text}  # refused by the environment: an error, the episode ends
        return action if isinstance(action, dict) else {"_unparsed": text}

    def run(
        self, engine, tokenizer, prompts: list[list[int]], gconfig: GenerationHyperparameters
    ) -> list[Episode]:
        texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        episodes: list[Episode] = []
        for start in range(0, len(prompts), self.args.sessions):
            episodes += self._wave(engine, tokenizer, texts[start : start + self.args.sessions], gconfig)
        return episodes

    def _wave(self, engine, tokenizer, texts: list[str], gconfig) -> list[Episode]:
        """The episodes of `texts`, each on a session of the pool; generation runs here, in the caller's
        thread, the environment's messages on the pool's loop."""
        a = self.args
        pool = self.sessions()
        episodes = [Episode(metrics={"steps": 0.0, "errors": 0.0}) for _ in texts]
        eos = {tokenizer.eos_token_id, *gconfig.stop_token_ids}
        sessions = pool.run(pool.take(len(texts)))
        failed: set[int] = set()

        async def ask_all(calls: list[tuple[int, str, dict]]) -> list[Any]:
            return await asyncio.gather(*(sessions[i].ask(k, d) for i, k, d in calls), return_exceptions=True)

        try:
            starts = pool.run(ask_all([(i, "reset", self._reset_args(t)) for i, t in enumerate(texts)]))
            for i, start in enumerate(starts):
                if isinstance(start, BaseException):
                    failed.add(i)
                    raise start
                episodes[i].prompt = tokenizer(self.render(start[0]), add_special_tokens=False)["input_ids"]
                episodes[i].reward = 0.0
            active = list(range(len(texts)))
            for turn in range(a.max_turns):
                active = [i for i in active if len(episodes[i].tokens) < a.max_total_tokens]
                if not active:
                    break
                prompts = [ep.prompt or [] for ep in episodes]
                new, _ = generate_turn(
                    engine, tokenizer, episodes, active, prompts, gconfig, a.max_total_tokens
                )
                steps = []
                for i, ids in zip(active, new, strict=True):
                    ep = episodes[i]
                    ep.no_eos = not (ids and ids[-1] in eos)
                    text = tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
                    steps.append((i, "step", self.action(text)))
                results = pool.run(ask_all(steps))
                still = []
                for i, result in zip(active, results, strict=True):
                    ep = episodes[i]
                    ep.metrics["steps"] += 1
                    if isinstance(result, EnvironmentError_):
                        ep.metrics["errors"] += 1
                        failed.add(i)  # its session is closed, not reused
                        continue
                    if isinstance(result, BaseException):
                        failed.add(i)
                        raise result
                    obs, reward, done = result
                    ep.reward = (ep.reward or 0.0) + (reward or 0.0)
                    if done or turn == a.max_turns - 1:  # over: no observation to show
                        continue
                    shown = tokenizer(self.render(obs), add_special_tokens=False)["input_ids"]
                    ep.inserted(shown[: a.max_total_tokens - len(ep.tokens)])
                    still.append(i)
                active = still
        except BaseException:
            failed.update(range(len(sessions)))  # the wave failed: none is reused
            raise
        finally:
            pool.run(pool.give_back(sessions, failed))
        return episodes

    def _reset_args(self, prompt: str) -> dict[str, Any]:
        return {
            k: v.format(prompt=prompt) if isinstance(v, str) else v for k, v in self.args.reset_args.items()
        }

"""Episodes of a verifiers environment (verifiers >= 0.4, `verifiers.v1`), run unchanged.

verifiers runs an episode as its env's `run(task, agents)`: each agent (a role) is a harness program that
talks to the model through the rollout's interception server, which forwards every call to a client
endpoint (`vf.ModelContext(model, client=EvalClientConfig(base_url), sampling)`) and records the trace;
the task's `@vf.reward` / `@vf.metric` methods then score the trace. Here:

    the endpoint     an OpenAI-compatible `chat/completions` this workflow serves on 127.0.0.1 (aiohttp, on
                     an event loop of its own), behind a key of its own; the model name of an episode's
                     calls says which episode they belong to (`policy@RUN.I`: verifiers keeps one client
                     per endpoint address, open as long as the env serves, so the address stays one); each
                     request goes to that episode's in-process `AgentClient`, whose requests
                     are gathered into batched generate calls on the model's engine (runtime/agents/agent.py)
                     and recorded with their token ids and log-probs
    the harness      `arealcli_chat` unless the recipe names another: verifiers' `null` chat program, run in
                     this process (no interpreter per rollout)
    the episode      the recorded requests as one trained sequence (each request must extend the previous
                     one); its reward the trace's (the weighted sum of its rewards); its rewards and metrics
                     as `env/NAME`; an episode verifiers reports failed counts in `env/errors` and scores 0

Sampling follows the recipe's `generation` (the recorded log-probs must be the policy's): the env's own
sampling settings are replaced by the recipe's.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.agents.agent import AgentClient, Completion, _Batcher
from arealcli.runtime.agents.workflows import Episode
from arealcli.runtime.data.verifiers_configs import env_config, import_verifiers
from arealcli.runtime.engines.inference import EventLoopThread
from arealcli.schema.components.engine import GenerationHyperparameters
from arealcli.schema.components.workflows import VerifiersArgs

logger = logging.getLogger(__name__)

_DROPPED = {"stream", "stream_options", "user", "metadata", "store"}  # transport, not sampling


def _message(c: Completion) -> dict[str, Any]:
    choice = c.choices[0]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": choice.message.content if choice.message else choice.text,
    }
    calls = choice.message.tool_calls if choice.message else None
    if calls:
        message["tool_calls"] = [
            {
                "id": t.id,
                "type": "function",
                "function": {"name": t.function.name, "arguments": t.function.arguments},
            }
            for t in calls
        ]
    return message


def _usage(c: Completion) -> dict[str, int]:
    u = c.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
    }


def _share_tls_contexts() -> None:
    """httpx builds a new TLS context for every client (it reads the CA bundle: ~10 ms of CPU), and an
    episode makes two (verifiers' relay to the endpoint, the harness's OpenAI client), both speaking plain
    HTTP to this machine: most of an episode's cost. Clients built with the same default settings share one
    context instead, in this process (a context serves any number of connections and threads)."""
    import httpx._transports.default as transport

    build = transport.create_ssl_context
    if getattr(build, "shared", False):
        return
    made: dict[tuple[Any, ...], Any] = {}
    lock = threading.Lock()

    def create(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if cert is not None or not isinstance(verify, bool | str):  # a context of the caller's own
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (verify, trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        with lock:
            if key not in made:
                made[key] = build(verify=verify, cert=None, trust_env=trust_env)
            return made[key]

    create.shared = True  # type: ignore[attr-defined]
    transport.create_ssl_context = create


class Endpoint:
    """The chat endpoint of the run's episodes (see the module doc)."""

    def __init__(self, loop: EventLoopThread):
        self.loop = loop
        self.key = secrets.token_urlsafe(24)
        self.key_var = f"AREAL_VERIFIERS_KEY_{uuid.uuid4().hex[:8].upper()}"
        os.environ[self.key_var] = self.key  # verifiers' client config names the variable holding its key
        self.runs: dict[str, list[AgentClient]] = {}
        # every waiting request holds a thread until its batch is generated: as many as episodes run
        self.threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=4096, thread_name_prefix="vf-request"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.runner: Any = None
        loop.run(self._start())

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @staticmethod
    def model(name: str, run: str, episode: int) -> str:
        """The model name episode `episode` of `run` calls (verifiers sends the rollout's model name)."""
        return f"{name}@{run}.{episode}"

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        def error(status: int, message: str) -> Any:
            return web.json_response(
                {"error": {"message": message, "type": "invalid_request_error"}}, status=status
            )

        if request.headers.get("Authorization", "") != f"Bearer {self.key}":
            return error(401, "a key of this run is needed")
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        run, _, episode = str(body.get("model", "")).rpartition("@")[2].partition(".")
        clients = self.runs.get(run)
        i = int(episode) if episode.isdigit() else -1
        if clients is None or not 0 <= i < len(clients):
            return error(404, "no such episode (it has ended)")
        stream = bool(body.get("stream"))
        kwargs = {k: v for k, v in body.items() if k not in _DROPPED}
        try:
            out = await asyncio.get_running_loop().run_in_executor(
                self.threads, clients[i]._create, True, kwargs
            )
        except UserError as e:
            return error(400, str(e))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choice, message = out.choices[0], _message(out)
        finish = choice.finish_reason
        head = {"id": rid, "created": created, "model": body.get("model") or "policy"}
        if not stream:
            return web.json_response(
                {
                    **head,
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": _usage(out),
                }
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)

        async def send(choices: list[dict[str, Any]], **more: Any) -> None:
            chunk = {**head, "object": "chat.completion.chunk", "choices": choices, **more}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        delta: dict[str, Any] = {"role": "assistant", "content": message["content"] or ""}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        await send([{"index": 0, "delta": delta, "finish_reason": None}])
        await send([{"index": 0, "delta": {}, "finish_reason": finish}])
        if (body.get("stream_options") or {}).get("include_usage"):
            await send([], usage=_usage(out))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        self.threads.shutdown(wait=False, cancel_futures=True)
        os.environ.pop(self.key_var, None)


class VerifiersWorkflow:
    """Episodes of a verifiers environment (see the module doc)."""

    Args = VerifiersArgs
    takes_tasks = True  # run() is given each prompt's task (the `verifiers` dataset's meta key `task`)

    def __init__(self, args: VerifiersArgs):
        self.args = args
        self.loop: EventLoopThread | None = None
        self.endpoint: Endpoint | None = None
        self.env: Any = None
        self._serving: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the environment

    def config(self) -> Any:
        """The env's config, each role running `arealcli_chat` unless it says."""
        return env_config(self.args.env, self.args.env_dir)

    def _started(self) -> tuple[EventLoopThread, Endpoint]:
        with self._lock:  # the rollout thread and an evaluation may both ask
            if self.loop is None or self.endpoint is None:
                vf = import_verifiers()
                config = self.config()
                _share_tls_contexts()
                self.loop = EventLoopThread()
                self.endpoint = Endpoint(self.loop)
                self.env = vf.load_environment(config)
                self._serving = self.env.serving()
                self.loop.run(self._serving.__aenter__())
                atexit.register(self.close)
            return self.loop, self.endpoint

    def close(self) -> None:
        if self.loop is None:
            return
        loop, endpoint, serving = self.loop, self.endpoint, self._serving
        self.loop = self.endpoint = self._serving = None

        async def stop() -> None:
            try:
                if serving is not None:
                    await serving.__aexit__(None, None, None)
            finally:
                if endpoint is not None:
                    await endpoint.close()

        try:
            loop.run(stop(), timeout=10)
        except Exception:  # stopping anyway
            pass
        loop.close()

    # ------------------------------------------------------------------ episodes

    def run(
        self,
        engine,
        tokenizer,
        prompts: list[list[int]],
        gconfig: GenerationHyperparameters,
        tasks: list[dict[str, Any]] | None = None,
    ) -> list[Episode]:
        if tasks is None or len(tasks) != len(prompts):
            raise UserError(
                "the verifiers workflow runs the tasks of a `verifiers` dataset (its rows carry the tasks); "
                "the dataset has none"
            )
        vf = import_verifiers()
        loop, endpoint = self._started()
        a = self.args
        batcher = _Batcher(engine, tokenizer, len(prompts), a.episode_timeout_s)
        clients = [AgentClient(batcher, i, p, gconfig, a) for i, p in enumerate(prompts)]
        run = uuid.uuid4().hex[:12]
        endpoint.runs[run] = clients
        sampling: dict[str, Any] = {"temperature": 0.0 if gconfig.greedy else gconfig.temperature}
        if gconfig.top_p < 1.0:
            sampling["top_p"] = gconfig.top_p
        task_cls = type(self.env.taskset).task_type()
        data_cls = task_cls.data_type()

        async def one(i: int) -> Any:
            try:
                task = task_cls(data_cls.model_validate(tasks[i]), self.env.config.taskset.task)
                (slot,) = self.env.slots(task)
                ctx = vf.ModelContext(
                    model=endpoint.model(a.model_name, run, i),
                    client=vf.EvalClientConfig(base_url=endpoint.url, api_key_var=endpoint.key_var),
                    sampling=vf.SamplingConfig(**sampling),
                )
                return await self.env.run_slot(slot, ctx)
            finally:
                batcher.finished(i)

        async def every() -> list[Any]:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))), return_exceptions=True)

        future = loop.submit(every())
        try:
            batcher.serve()  # generation here, in the caller's thread, until every episode has finished
            results = future.result()
        except BaseException:
            future.cancel()
            raise
        finally:
            endpoint.runs.pop(run, None)
        return [self._episode(c, r) for c, r in zip(clients, results, strict=True)]

    def _episode(self, client: AgentClient, result: Any) -> Episode:
        """The trained sequence of one episode, scored by its trace."""
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        failed = isinstance(result, Exception) or not getattr(result, "ok", False)
        if not client.requests:
            why = result if isinstance(result, Exception) else _errors(result)
            raise UserError(f"a verifiers episode made no request to the model: {why}")
        ep = client.episode()
        ep.metrics["errors"] = float(failed)
        traces = [] if isinstance(result, Exception) else list(result.traces)
        trace = next((t for t in traces if t.agent.trainable), traces[0] if traces else None)
        ep.reward = 0.0
        if trace is not None:
            for name, value in (trace.metrics or {}).items():
                if value is not None:
                    ep.metrics[name] = float(value)
            for name, r in (trace.rewards or {}).items():
                if r is not None:
                    ep.metrics[name] = float(r.score)
            ep.reward = 0.0 if failed else float(trace.reward or 0.0)
        if failed:
            logger.warning(
                "a verifiers episode failed: %s", result if isinstance(result, Exception) else _errors(result)
            )
        return ep


def _errors(episode: Any) -> str:
    errors = [*getattr(episode, "errors", []), *(e for t in getattr(episode, "traces", []) for e in t.errors)]
    return "; ".join(str(getattr(e, "message", e)) for e in errors[:3]) or "no error recorded"

"""The HTTP face of `areal serve`: SGLang's native endpoints, and OpenAI's, on an aiohttp server.

    POST /generate                   generate (single, batch, n > 1; logprobs)
    POST /update_weights_from_disk   {model_path, abort_all_requests?, weight_version?, flush_cache?}
    POST /abort_request              {abort_all: true}
    POST /slow_down                  {forward_sleep_time: seconds | null}  (SGLang's test hook)
    GET  /health, /health_generate   200 once the model is loaded
    GET  /get_model_info, /model_info
    GET  /get_server_info, /server_info  (internal_states: the scheduler's counters, see `scheduler`)
    GET|POST /flush_cache            nothing is cached across requests: always succeeds
    POST /v1/completions, /v1/chat/completions, GET /v1/models   OpenAI-compatible (openai_api)

One event-loop thread serves every connection (no thread per connection: on a busy CPU, handing requests
between many threads costs more than generating) and does all per-request work: JSON, tokenizing,
detokenizing, responses. The scheduler's thread only runs the model and sampling (continuous batching:
requests join the running batch between decoding steps), and wakes the waiting requests through the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import json
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

from aiohttp import web

from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.sampling import StopTexts
from arealcli.runtime.generation.scheduler import Scheduler, Sequence
from arealcli.runtime.wire.openai import (
    Choice,
    OpenAIRequest,
    completion_response,
    finish_of,
    models_response,
    parse_chat_request,
    parse_completion_request,
)
from arealcli.runtime.wire.sglang import ProtocolError, generate_response, parse_generate

logger = logging.getLogger(__name__)


class GenerationService:
    """The endpoints, as methods: body (parsed JSON) -> (status, JSON payload, or text when a str)."""

    weights_dir: str | None = None  # set by make_app: where /update_weights_from_disk may load from

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, max_n: int = 64):
        self.runner, self.scheduler = runner, scheduler
        self.max_n = max_n  # samples per prompt in one request
        self.served_model_name = runner.model_path
        self.tokenizer_path = runner.tokenizer_path
        self.shutting_down = False

    async def generate(self, body: Any) -> tuple[int, Any]:
        t0 = time.perf_counter()
        req = parse_generate(body)
        self._check_size(len(req.prompts), req.sampling[0].n)
        r = self.runner
        per_prompt: list[list[Sequence]] = []
        for prompt, sampling, rid in zip(req.prompts, req.sampling, req.rids, strict=True):
            ids = prompt if isinstance(prompt, list) else r.encode(prompt)
            if not ids:
                raise ProtocolError("a prompt encodes to no tokens; give at least one")
            if sampling.stop and r.tokenizer is None:
                raise ProtocolError(
                    f"{r.model_path} has no tokenizer: stop texts need one (use stop_token_ids)"
                )
            if max(ids) >= r.vocab_size:
                raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
            if len(ids) >= r.context_length:
                raise ProtocolError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({r.context_length} tokens)."
                )
            max_new = min(sampling.max_new_tokens, r.context_length - len(ids))
            rids = [rid] if sampling.n == 1 else [f"{rid}-{j}" for j in range(sampling.n)]
            per_prompt.append([Sequence(x, ids, sampling, max_new) for x in rids])
        seqs = [s for group in per_prompt for s in group]
        errors = await self._run(seqs)
        if errors:
            return 500, {"error": {"message": errors[0]}}
        latency = time.perf_counter() - t0
        out = []
        for group, want_logprob in zip(per_prompt, req.return_logprob, strict=True):
            for s in group:
                texts = r.token_texts(s.output_ids) if want_logprob and req.return_text_in_logprobs else None
                out.append(
                    generate_response(
                        s.rid,
                        s.output_ids,
                        s.logprobs if want_logprob else None,
                        s.finished_as,
                        len(s.prompt),
                        s.weight_version,
                        r.decode(s.output_ids),
                        latency,
                        texts,
                    )
                )
        return 200, out if req.is_batch or len(out) > 1 else out[0]

    def _check_size(self, prompts: int, n: int) -> None:
        """A request asks for at most `max_n` samples per prompt and `max_batch_size` prompts."""
        if n > self.max_n:
            raise ProtocolError(
                f"n={n} exceeds this server's limit of {self.max_n} samples per prompt (areal serve --max-n)"
            )
        if prompts > self.scheduler.max_batch_size:
            raise ProtocolError(
                f"the request has {prompts} prompts; this server takes at most {self.scheduler.max_batch_size} "
                "in one request (areal serve --max-batch-size)"
            )

    async def _run(self, seqs: list[Sequence]) -> list[str]:
        """Generate `seqs` (batched with whatever else is waiting); their errors."""
        loop = asyncio.get_running_loop()
        waits = []
        for s in seqs:
            done = loop.create_future()
            s.on_done = lambda done=done: loop.call_soon_threadsafe(_resolve, done)
            waits.append(done)
        self.scheduler.submit(seqs)
        await asyncio.gather(*waits)
        return [s.error for s in seqs if s.error]

    # ------------------------------------------------------------------ OpenAI-compatible

    def _prompt_ids(self, prompt: list[int] | str) -> list[int]:
        r = self.runner
        ids = prompt if isinstance(prompt, list) else r.encode(prompt)
        if not ids:
            raise ProtocolError("a prompt encodes to no tokens; give at least one")
        if max(ids) >= r.vocab_size or min(ids) < 0:
            raise ProtocolError(f"token id {max(ids)} is out of the vocabulary (size {r.vocab_size})")
        if len(ids) >= r.context_length:
            raise ProtocolError(
                f"the prompt ({len(ids)} tokens) leaves no room in the model's context ({r.context_length} tokens)"
            )
        return ids

    def _render_chat(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        tok = self.runner.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ProtocolError(
                "the served tokenizer has no chat template: use /v1/completions with a rendered prompt"
            )
        try:
            rendered = tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # the template's own checks (roles, order) raise
            raise ProtocolError(f"the chat template cannot render these messages: {e}") from None
        return self._prompt_ids(tok.encode(rendered, add_special_tokens=False))

    async def _openai(self, req: OpenAIRequest) -> tuple[int, Any]:
        """Every prompt's n choices; a sample aborted by a weight update is continued on the new weights."""
        r = self.runner
        self._check_size(len(req.prompts), req.sampling.n)
        prompts = [self._prompt_ids(p) for p in req.prompts]
        choices: list[Choice] = []
        for ids in prompts:
            room = r.context_length - len(ids)
            max_new = min(req.sampling.max_new_tokens, room)
            seqs = [Sequence(f"oai-{j}", ids, req.sampling, max_new) for j in range(req.sampling.n)]
            out: list[list[int]] = [[] for _ in seqs]
            lps: list[list[float]] = [[] for _ in seqs]
            versions: list[list[str]] = [[] for _ in seqs]
            finish: list[str] = ["length"] * len(seqs)
            pending = list(range(len(seqs)))
            for _ in range(100):  # each round: what is left after an abort
                errors = await self._run([seqs[j] for j in pending])
                if errors:
                    return 500, {"error": {"message": errors[0]}}
                again = []
                for j in pending:
                    s = seqs[j]
                    out[j] += s.output_ids
                    lps[j] += s.logprobs
                    versions[j].append(s.weight_version)
                    finish[j] = s.finished_as["type"]
                    left = max_new - len(out[j])
                    if finish[j] == "abort" and left > 0:
                        sampling = dataclasses.replace(
                            s.sampling, min_new_tokens=max(0, req.sampling.min_new_tokens - len(out[j]))
                        )
                        seqs[j] = Sequence(s.rid, ids + out[j], sampling, left)
                        again.append(j)
                    elif finish[j] == "abort":
                        finish[j] = "length"
                pending = again
                if not pending:
                    break
            else:
                return 503, {"error": {"message": "requests kept being aborted (weight updates); try again"}}
            texts = StopTexts(req.stop_texts, r.decode) if req.stop_texts else None
            for j in range(len(seqs)):
                end = texts.first_end(out[j]) if texts is not None else None  # a stop across an abort
                if end is not None:
                    out[j], lps[j], finish[j] = out[j][:end], lps[j][:end], "stop"
                reason, stopped_by, text = finish_of(
                    out[j], finish[j], r.decode, req.stop_texts, req.stop_ids
                )
                texts_of = (r.token_texts(out[j]) or [""] * len(out[j])) if req.logprobs else []
                choices.append(Choice(ids, out[j], lps[j], reason, stopped_by, text, texts_of, versions[j]))
        return 200, completion_response(req, choices, self.served_model_name, sum(len(p) for p in prompts))

    async def completions(self, body: Any) -> tuple[int, Any]:
        return await self._openai(parse_completion_request(body))

    async def chat_completions(self, body: Any) -> tuple[int, Any]:
        tok = self.runner.tokenizer
        template = getattr(tok, "chat_template", None) if tok is not None else None
        return await self._openai(parse_chat_request(body, self._render_chat, template))

    async def models(self, body: Any) -> tuple[int, Any]:
        return 200, models_response(self.served_model_name)

    async def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return 400, {
                "success": False,
                "message": "model_path (a string) is required",
                "num_paused_requests": 0,
            }
        if self.weights_dir is not None and not _below(body["model_path"], self.weights_dir):
            return 403, {
                "success": False,
                "message": f"this server loads weights only from below {self.weights_dir}",
                "num_paused_requests": 0,
            }
        _injected_death_on_update()
        version = body.get("weight_version")
        ok, message = await asyncio.to_thread(  # waits for the running batch: off the event loop
            self.scheduler.update_weights,
            body["model_path"],
            None if version is None else str(version),
            bool(body.get("abort_all_requests")),
        )
        if ok:
            self.served_model_name = body["model_path"]  # SGLang moves the served name with the weights
        return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}

    async def abort_request(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not body.get("abort_all"):
            raise ProtocolError('the embedded server aborts only all requests: send {"abort_all": true}')
        self.scheduler.abort_all("Aborted by abort_request")
        return 200, ""

    async def slow_down(self, body: Any) -> tuple[int, Any]:
        """SGLang's test hook: sleep `forward_sleep_time` seconds before every decode step (null = off)."""
        sleep = body.get("forward_sleep_time") if isinstance(body, dict) else None
        if sleep is not None and (isinstance(sleep, bool) or not isinstance(sleep, int | float) or sleep < 0):
            raise ProtocolError(f"forward_sleep_time must be a non-negative number or null (got {sleep!r})")
        self.scheduler.forward_sleep_s = float(sleep or 0.0)
        return 200, None

    async def health(self, body: Any) -> tuple[int, Any]:
        return (503 if self.shutting_down else 200), ""

    async def model_info(self, body: Any) -> tuple[int, Any]:
        return 200, {
            "model_path": self.runner.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.runner.model_type,
            "architectures": self.runner.architectures,
        }

    async def server_info(self, body: Any) -> tuple[int, Any]:
        sch = self.scheduler
        return 200, {
            "model_path": self.runner.model_path,
            "batch_window_ms": sch.batch_window_s * 1000,
            "max_batch_size": sch.max_batch_size,
            "internal_states": [dict(sch.stats)],  # forward passes, samples, tokens so far
            "version": "arealcli-embedded",
        }

    async def flush_cache(self, body: Any) -> tuple[int, Any]:
        return 200, "Cache flushed.\n"


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


ROUTES = [
    ("POST", "/generate", "generate"),
    ("PUT", "/generate", "generate"),
    ("POST", "/update_weights_from_disk", "update_weights_from_disk"),
    ("POST", "/abort_request", "abort_request"),
    ("POST", "/slow_down", "slow_down"),
    ("GET", "/slow_down", "slow_down"),
    ("GET", "/health", "health"),
    ("GET", "/health_generate", "health"),
    ("GET", "/get_model_info", "model_info"),
    ("GET", "/model_info", "model_info"),
    ("GET", "/get_server_info", "server_info"),
    ("GET", "/server_info", "server_info"),
    ("GET", "/flush_cache", "flush_cache"),
    ("POST", "/flush_cache", "flush_cache"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("GET", "/v1/models", "models"),
]


def _respond(status: int, payload: Any) -> web.Response:
    if isinstance(payload, str):
        return web.Response(status=status, text=payload)
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json")


MAX_JSON_DEPTH = 32  # the deepest request (chat messages with tool calls and schemas) needs about 10
_TOO_DEEP = object()


def _too_deep(value: Any, raw: bytes) -> bool:
    """Whether JSON data nests deeper than MAX_JSON_DEPTH (iteratively: no recursion on hostile input).
    A body with no more brackets than the cap cannot be deeper: the walk is skipped (most requests)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend(
                (c, depth + 1)
                for c in (v.values() if isinstance(v, dict) else v)
                if isinstance(c, dict | list)
            )
    return False


# Endpoints that change what the server does for everyone: the admin key (when set) guards them.
CONTROL = {"update_weights_from_disk", "abort_request", "slow_down", "flush_cache"}
OPEN = {"health"}  # answered without a key (liveness probes)


@dataclasses.dataclass(frozen=True)
class Keys:
    """Who may call: `api` for every endpoint but /health, `admin` (default: the API key) for CONTROL.
    `weights_dir`: /update_weights_from_disk loads only from below it (servers launched by a run)."""

    api: str | None = None
    admin: str | None = None
    weights_dir: str | None = None

    def refusal(self, name: str, header: str | None) -> tuple[int, str] | None:
        """(401 or 403, why) when a request with Authorization `header` may not call endpoint `name`."""
        if self.api is None or name in OPEN:
            return None
        given = header[7:] if header is not None and header.startswith("Bearer ") else None
        admin = self.admin or self.api
        if name in CONTROL:
            if given is not None and hmac.compare_digest(given.encode(), admin.encode()):
                return None
            if given is not None and hmac.compare_digest(given.encode(), self.api.encode()):
                return 403, f"/{name} needs the admin key (areal serve --admin-key), not the API key"
            return 401, "a valid key is required: Authorization: Bearer KEY"
        if given is not None and (
            hmac.compare_digest(given.encode(), self.api.encode())
            or hmac.compare_digest(given.encode(), admin.encode())
        ):
            return None
        return 401, "a valid API key is required: Authorization: Bearer KEY"


def make_app(service: GenerationService, max_body_mb: int = 16, keys: Keys | None = None) -> web.Application:
    keys = keys or Keys()
    service.weights_dir = keys.weights_dir

    def route(name: str):
        method = getattr(service, name)

        async def handle(request: web.Request) -> web.Response:
            refused = keys.refusal(name, request.headers.get("Authorization"))
            if refused is not None:  # logged without the key
                logger.warning("%s %s from %s: %s", refused[0], request.path, request.remote, refused[1])
                return _respond(refused[0], {"error": {"message": refused[1]}})
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return _respond(
                    413,
                    {
                        "error": {
                            "message": f"the body is larger than this server's limit of {max_body_mb} MiB "
                            "(areal serve --max-body-mb)"
                        }
                    },
                )
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as e:
                return _respond(400, {"error": {"message": f"the body is not valid JSON: {e}"}})
            except RecursionError:
                body = _TOO_DEEP
            if body is _TOO_DEEP or _too_deep(body, raw):
                return _respond(
                    400,
                    {"error": {"message": f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep"}},
                )
            try:
                return _respond(*await method(body))
            except (ProtocolError, ValueError) as e:
                return _respond(400, {"error": {"message": str(e)}})
            except Exception as e:  # a bug or a device error: the client sees it, the server keeps serving
                traceback.print_exc()
                return _respond(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

        return handle

    app = web.Application(client_max_size=max_body_mb << 20)
    for method, path, name in ROUTES:
        app.router.add_route(method, path, route(name))
    return app


def _below(path: str, root: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


class GenerationServer:
    """A bound socket, the service behind it, and the loop that serves it (`serve_forever`)."""

    def __init__(
        self,
        service: GenerationService,
        sock: socket.socket,
        log_requests: bool,
        max_body_mb: int = 16,
        keys: Keys | None = None,
    ):
        self.service, self.sock, self.log_requests = service, sock, log_requests
        self.max_body_mb, self.keys = max_body_mb, keys

    @property
    def server_address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    async def _serve(self, on_ready) -> None:
        if self.log_requests:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
        access_log = logging.getLogger("aiohttp.access") if self.log_requests else None
        runner = web.AppRunner(make_app(self.service, self.max_body_mb, self.keys), access_log=access_log)
        await runner.setup()
        await web.SockSite(runner, self.sock, backlog=1024).start()
        if on_ready is not None:
            on_ready(*self.server_address)
        try:
            await asyncio.Event().wait()  # until cancelled (Ctrl-C) or killed
        finally:
            self.service.shutting_down = True
            self.service.scheduler.stop()
            await runner.cleanup()

    def serve_forever(self, on_ready=None) -> None:
        try:
            asyncio.run(self._serve(on_ready))
        finally:
            with contextlib.suppress(OSError):
                self.sock.close()


def make_server(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    device: str = "auto",
    dtype: str = "float32",
    batch_window_ms: float = 5.0,
    max_batch_size: int = 256,
    weight_version: str = "default",
    log_requests: bool = False,
    max_n: int = 64,
    max_body_mb: int = 16,
    keys: Keys | None = None,
) -> GenerationServer:
    """Load the model, bind the socket (port 0 = any free port) and start the batching loop."""
    runner = ModelRunner(model_path, device, dtype)
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    scheduler = Scheduler(runner, batch_window_ms / 1000, max_batch_size, weight_version, continuous=True)
    scheduler.start()
    # What exists now (the model, torch, transformers: ~400k objects) lives as long as the server: out
    # of the collector's reach, a full collection walks only requests' objects. Walking them all took
    # 0.3-0.5 s per full collection under load, during which neither thread runs.
    gc.collect()
    gc.freeze()
    return GenerationServer(
        GenerationService(runner, scheduler, max_n), sock, log_requests, max_body_mb, keys
    )


def serve_forever(server: GenerationServer, on_ready=None) -> None:
    server.serve_forever(on_ready)


# Fault injection for the fault-matrix tests: `AREALCLI_FAULT_DIE_ON_UPDATE=N:MARKER` makes the server kill
# itself (SIGKILL) in its Nth weight update, once (MARKER, a file, records that it happened).
_UPDATES = [0]


def _injected_death_on_update() -> None:
    spec = os.environ.get("AREALCLI_FAULT_DIE_ON_UPDATE")
    if not spec:
        return
    at, _, marker = spec.partition(":")
    _UPDATES[0] += 1
    if _UPDATES[0] == int(at) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

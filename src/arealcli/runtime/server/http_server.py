"""The HTTP face of `areal serve`: SGLang's native endpoints over the standard library's threaded server.

    POST /generate                   generate (single, batch, n > 1; logprobs)
    POST /update_weights_from_disk   {model_path, abort_all_requests?, weight_version?, flush_cache?}
    POST /abort_request              {abort_all: true}
    GET  /health, /health_generate   200 once the model is loaded
    GET  /get_model_info, /model_info
    GET|POST /flush_cache            nothing is cached across requests: always succeeds

Every connection gets a thread that parks on its samples' events; the scheduler batches them.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from arealcli.runtime.server.model_runner import ModelRunner
from arealcli.runtime.server.protocol import ProtocolError, generate_response, parse_generate
from arealcli.runtime.server.scheduler import Scheduler, Sequence


class GenerationService:
    """The endpoints, as plain methods: body (parsed JSON) -> (status, JSON payload or text)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler
        self.served_model_name = runner.model_path
        self.tokenizer_path = runner.tokenizer_path
        self.shutting_down = False

    def generate(self, body: Any) -> tuple[int, Any]:
        t0 = time.perf_counter()
        req = parse_generate(body)
        r = self.runner
        per_prompt: list[list[Sequence]] = []
        for prompt, sampling, rid in zip(req.prompts, req.sampling, req.rids, strict=True):
            ids = prompt if isinstance(prompt, list) else r.encode(prompt)
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
        self.scheduler.submit(seqs)
        for s in seqs:
            s.done.wait()
        errors = [s.error for s in seqs if s.error]
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
                        s.finish,
                        len(s.prompt),
                        s.weight_version,
                        r.decode(s.output_ids),
                        latency,
                        texts,
                    )
                )
        return 200, out if req.is_batch or len(out) > 1 else out[0]

    def update_weights_from_disk(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return 400, {"success": False, "message": "model_path (a string) is required", "num_paused_requests": 0}
        version = body.get("weight_version")
        ok, message = self.scheduler.update_weights(
            body["model_path"], None if version is None else str(version), bool(body.get("abort_all_requests"))
        )
        if ok:
            self.served_model_name = body["model_path"]  # SGLang moves the served name with the weights
        return (200 if ok else 400), {"success": ok, "message": message, "num_paused_requests": 0}

    def abort_request(self, body: Any) -> tuple[int, Any]:
        if not isinstance(body, dict) or not body.get("abort_all"):
            raise ProtocolError("the embedded server aborts only all requests: send {\"abort_all\": true}")
        self.scheduler.abort_all("Aborted by abort_request")
        return 200, ""

    def health(self, body: Any) -> tuple[int, Any]:
        return (503 if self.shutting_down else 200), ""

    def model_info(self, body: Any) -> tuple[int, Any]:
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

    def flush_cache(self, body: Any) -> tuple[int, Any]:
        return 200, "Cache flushed.\n"


ROUTES = {
    ("POST", "/generate"): "generate",
    ("PUT", "/generate"): "generate",
    ("POST", "/update_weights_from_disk"): "update_weights_from_disk",
    ("POST", "/abort_request"): "abort_request",
    ("GET", "/health"): "health",
    ("GET", "/health_generate"): "health",
    ("GET", "/get_model_info"): "model_info",
    ("GET", "/model_info"): "model_info",
    ("GET", "/flush_cache"): "flush_cache",
    ("POST", "/flush_cache"): "flush_cache",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connections
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the stdlib's name)
        if self.server.log_requests:
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        name = ROUTES.get((method, path))
        if name is None:
            known = any(p == path for _, p in ROUTES)
            self._send(405 if known else 404, {"detail": "Method Not Allowed" if known else "Not Found"})
            return
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError as e:
            self._send(400, {"error": {"message": f"the body is not valid JSON: {e}"}})
            return
        try:
            status, payload = getattr(self.server.service, name)(body)
        except (ProtocolError, ValueError) as e:
            status, payload = 400, {"error": {"message": str(e)}}
        except Exception as e:  # a bug or a device error: the client sees it, the server keeps serving
            status, payload = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        if isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain; charset=utf-8"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address, service: GenerationService, log_requests: bool):
        self.service, self.log_requests = service, log_requests
        super().__init__(address, _Handler)


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
) -> _Server:
    """Load the model, start the batching loop and bind the socket (port 0 = any free port)."""
    runner = ModelRunner(model_path, device, dtype)
    scheduler = Scheduler(runner, batch_window_ms / 1000, max_batch_size, weight_version)
    scheduler.start()
    return _Server((host, port), GenerationService(runner, scheduler), log_requests)


def serve_forever(server: _Server, on_ready=None) -> None:
    host, port = server.server_address[:2]
    if on_ready is not None:
        on_ready(host, port)
    sys.stdout.flush()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.service.shutting_down = True
        server.service.scheduler.stop()
        server.server_close()

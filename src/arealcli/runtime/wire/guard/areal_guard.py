"""The guard of the vLLM and SGLang servers a run launches: ASGI middleware added to their apps.

vLLM (KeyGuard, loaded with vLLM's `--middleware areal_guard.KeyGuard`) checks its key (VLLM_API_KEY)
only on paths under /v1 (and a few other prefixes); with VLLM_SERVER_DEV_MODE=1, which weight updates
need, /pause, /resume, /collective_rpc, /sleep, /reset_prefix_cache, /invocations, /tokenize ... would
answer anyone who reaches the port. KeyGuard wants `Authorization: Bearer KEY` on every path but /health:

- inference paths (USER_PREFIXES, USER_PATHS) take the API key (VLLM_API_KEY) or the admin key;
- every other path (control and development endpoints, and any path vLLM adds later) takes the admin key
  (AREAL_ADMIN_KEY; default: the API key, as for `areal serve`): 403 with the API key, 401 without a key;
- `GET /health` with the header CHALLENGE_HEADER (a nonce) is answered with PROOF_HEADER, the HMAC-SHA256
  of `NONCE|PORT` under the API key (PORT: the one the server listens on, the ASGI scope's `server`): the
  launcher sends the key only to a server that proves it holds it, on the port it was launched on.

SGLang keys every path itself (`--api-key`); SGLangGuard, added to SGLang's app by guard_sglang (the
launcher's wrapper calls it before SGLang starts), answers the same /health challenge and lets
/update_weights_from_disk load only from below the run's weights folder (AREAL_WEIGHTS_DIR), refusing
symlinks on the way and in the folder.

Keys come from the environment only (a command line is visible to `ps`); without VLLM_API_KEY KeyGuard
refuses to start. Comparison is constant-time (SHA-256 digests compared with hmac.compare_digest).

It runs inside the server's Python environment, where arealcli need not be installed: standard library
only, nothing from arealcli (proof() repeats arealcli.runtime.wire.auth.proof; a test checks they agree).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

API_KEY_ENV = "VLLM_API_KEY"
ADMIN_KEY_ENV = "AREAL_ADMIN_KEY"
SGLANG_KEY_ENV = "AREAL_API_KEY"  # what the launcher's SGLang wrapper hands to --api-key
WEIGHTS_DIR_ENV = "AREAL_WEIGHTS_DIR"
CHALLENGE_HEADER = "X-Areal-Challenge"
PROOF_HEADER = "X-Areal-Proof"
MAX_NONCE = 128  # longer challenges are not answered

OPEN_PATHS = frozenset({"/health"})  # liveness probes need no key
USER_PREFIXES = ("/v1/", "/v2/", "/inference/", "/cohere/")
USER_PATHS = frozenset(
    {
        "/v1",
        "/tokenize",
        "/detokenize",
        "/invocations",
        "/ping",
        "/version",
        "/load",
        "/metrics",
        "/pooling",
        "/classify",
        "/score",
        "/rerank",
        "/tokenizer_info",
        "/ready",
        "/readyz",
    }
)
ADMIN_UNDER_USER = frozenset(  # control endpoints under the inference prefixes
    {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/inference/v1/abort_requests"}
)


def proof(key: str, nonce: str, port: int | str) -> str:
    """HMAC-SHA256 of `NONCE|PORT` under `key`, hex (the same as arealcli.runtime.wire.auth.proof)."""
    return hmac.new(key.encode(), f"{nonce}|{int(port)}".encode(), hashlib.sha256).hexdigest()


def listening_port(scope) -> int | None:
    """The port the server took this request on (the ASGI scope's `server`; None on a Unix socket)."""
    server = scope.get("server")
    return server[1] if isinstance(server, (list, tuple)) and len(server) == 2 and server[1] else None


def needs(path: str) -> str | None:
    """Which key `path` wants: None (open), "user" (API or admin key) or "admin"."""
    if path in OPEN_PATHS:
        return None
    trimmed = path.rstrip("/") or "/"
    if trimmed in ADMIN_UNDER_USER:
        return "admin"
    if trimmed in USER_PATHS or path.startswith(USER_PREFIXES):
        return "user"
    return "admin"


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_digest(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """SHA-256 of the key the (first) Authorization header carries, or None (absent or not Bearer)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, key = value.partition(b" ")
            return _digest(key.strip()) if scheme.lower() == b"bearer" and key.strip() else None
    return None


def header(headers: list[tuple[bytes, bytes]], wanted: bytes) -> bytes | None:
    return next((v for n, v in headers if n.lower() == wanted), None)


class KeyGuard:
    """Pure ASGI middleware (vLLM adds it with `app.add_middleware(KeyGuard)`, outermost of its own)."""

    def __init__(self, app) -> None:
        api = os.environ.get(API_KEY_ENV)
        if not api:
            raise RuntimeError(f"areal_guard: {API_KEY_ENV} is not set; refusing to serve without a key")
        admin = os.environ.get(ADMIN_KEY_ENV) or api
        self.app, self._proof_key = app, api
        self._user = (_digest(api.encode()), _digest(admin.encode()))
        self._admin = _digest(admin.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan: nothing to guard
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "") or "") or "/"
        headers = scope.get("headers") or []
        need = needs(path)
        if need is None:
            await self.app(scope, receive, with_proof(self._proof_key, scope, send))
            return
        key = bearer_digest(headers)
        if key is None or not self._matches(key, self._user):
            await _refuse(scope, send, 401, "a valid API key is required: Authorization: Bearer KEY")
        elif need == "admin" and not self._matches(key, (self._admin,)):
            await _refuse(scope, send, 403, f"{path} is a control endpoint: it takes the admin key")
        else:
            await self.app(scope, receive, send)

    @staticmethod
    def _matches(key: bytes, allowed: tuple[bytes, ...]) -> bool:
        ok = False
        for digest in allowed:  # every comparison made: no early exit
            ok |= hmac.compare_digest(key, digest)
        return ok


def with_proof(key: str | None, scope, send):
    """`send`, adding PROOF_HEADER (proof of `key` on the port the request came in on) to the response
    when the request carries a challenge."""
    nonce = header(scope.get("headers") or [], CHALLENGE_HEADER.lower().encode())
    port = listening_port(scope)
    if key is None or nonce is None or port is None or not 0 < len(nonce) <= MAX_NONCE:
        return send
    answer = proof(key, nonce.decode("latin-1"), port).encode()

    async def send_with_proof(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (PROOF_HEADER.encode(), answer)]}
        await send(message)

    return send_with_proof


async def _refuse(scope, send, status: int, message: str) -> None:
    """401/403 with a JSON error (HTTP), or closing the handshake (WebSocket: the client sees 403)."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    kind = "Unauthorized" if status == 401 else "Forbidden"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------- SGLang

UPDATE_PATH = "/update_weights_from_disk"
MAX_UPDATE_BODY = 1 << 20  # a weight update's body is a path and a few fields


def below(path: str, root: str) -> str | None:
    """Why `path` is not a folder below `root` that may be loaded from (None when it is): resolved, it
    must lie below `root`; no part of it below `root` may be a symlink, nor any entry of the folder.
    (SGLang opens the files later: a swap between this check and its loading is not caught here.)"""
    real_root = os.path.realpath(root)
    given = os.path.abspath(path)
    if os.path.commonpath([os.path.realpath(given), real_root]) != real_root:
        return f"this server loads weights only from below {root}"
    part = given
    while os.path.realpath(part) != real_root:  # each part from `given` up to `root`
        if os.path.islink(part):
            return f"{part} is a symlink: this server loads weights only from real folders below {root}"
        if os.path.dirname(part) == part:
            break
        part = os.path.dirname(part)
    try:
        with os.scandir(given) as entries:
            linked = sorted(e.name for e in entries if e.is_symlink())
    except OSError as e:
        return f"cannot read {path}: {e.strerror}"
    return f"{path} holds symlinks ({', '.join(linked[:3])}): refused" if linked else None


async def _buffered(receive, limit: int) -> tuple[bytes | None, object]:
    """The request body (None beyond `limit` bytes) and a `receive` that replays it to the app."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, receive
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            return None, receive
        more = message.get("more_body", False)
    body, sent = b"".join(chunks), False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # what comes after the body: a disconnect

    return body, replay


def refused_update(body: bytes | None, weights_dir: str) -> str | None:
    """Why a /update_weights_from_disk body is refused (None: allowed)."""
    try:
        parsed = json.loads(body) if body is not None else None
    except (ValueError, UnicodeDecodeError):
        parsed = None
    path = parsed.get("model_path") if isinstance(parsed, dict) else None
    if not isinstance(path, str) or not path:
        return "model_path (a string, in a JSON body of at most 1 MiB) is required"
    return below(path, weights_dir)


class SGLangGuard:
    """ASGI middleware on SGLang's app: the /health challenge answered with the proof of `key`, and weight
    updates only from below `weights_dir` (when given). SGLang's own middleware checks the key."""

    def __init__(self, app, key: str | None, weights_dir: str | None) -> None:
        self.app, self.key, self.weights_dir = app, key, weights_dir

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "") or "") or "/"
        if path in OPEN_PATHS:
            await self.app(scope, receive, with_proof(self.key, scope, send))
            return
        if self.weights_dir is not None and path.rstrip("/") == UPDATE_PATH:
            body, receive = await _buffered(receive, MAX_UPDATE_BODY)
            why = refused_update(body, self.weights_dir)
            if why is not None:
                await _answer(send, 403, {"success": False, "message": why, "num_paused_requests": 0})
                return
        await self.app(scope, receive, send)


async def _answer(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guard_sglang(key: str | None, weights_dir: str | None) -> None:
    """Add SGLangGuard to SGLang's app (sglang.srt.entrypoints.http_server.app), before SGLang starts
    it. Refuses (SystemExit, which ends the launch clearly) when that app cannot be found: this SGLang
    is laid out differently, and it would run without the guard."""
    try:
        from sglang.srt.entrypoints import http_server
    except ImportError as e:
        raise SystemExit(f"areal_guard: cannot import sglang.srt.entrypoints.http_server ({e})") from None
    app = getattr(http_server, "app", None)
    if app is None or not hasattr(app, "add_middleware"):
        raise SystemExit("areal_guard: sglang.srt.entrypoints.http_server has no app to guard")
    app.add_middleware(SGLangGuard, key=key, weights_dir=weights_dir)

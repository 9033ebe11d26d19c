"""The key reaches only the server it was made for: a launched server proves it holds the run's key
(`GET /health` with a nonce, answered with an HMAC of the nonce and the server's port) before the
launcher or the trainer sends the key anywhere, so a process squatting the port never sees it, nor can
it relay the challenge to another server of the run; key variables of the trainer's own environment (a
shell's AREAL_ADMIN_KEY, ...) do not reach launched servers; the client's /health probes carry no key.
Real processes and real HTTP throughout."""

from __future__ import annotations

import http.client
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from arealcli.runtime.backends.sglang import SGLangBackend
from arealcli.runtime.clients import launcher
from arealcli.runtime.launchers.health import wait_healthy
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.wire.auth import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    CHALLENGE_HEADER,
    PROOF_HEADER,
    VLLM_API_KEY_ENV,
    WEIGHTS_DIR_ENV,
    fresh_key,
    proves,
)
from arealcli.schema.components.backends import SGLangBackendArgs
from tests.conftest import tiny_module

SHELL_KEYS = {ADMIN_KEY_ENV: "shell-admin-key", API_KEY_ENV: "shell-api-key", VLLM_API_KEY_ENV: "shell-vllm"}


class Squatter:
    """A process that took a port first: answers 200 to every GET and POST, recording what it was sent.
    With `relay_to` (HOST:PORT), it forwards each request there instead (headers and body) and answers
    with what came back, headers included (`relayed`: the answers' headers)."""

    def __init__(self, relay_to: str | None = None):
        seen: list[tuple[str, str, dict[str, str], bytes]] = []
        relayed: list[dict[str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
                status, headers, body = 200, {"Content-Type": "application/json"}, b'{"status": "ok"}'
                if relay_to is not None:
                    status, headers, body = self._relay(seen[-1])
                    relayed.append(headers)
                self.send_response(status)
                for name, value in headers.items():
                    if name.lower() not in ("content-length", "date", "server", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _relay(self, request) -> tuple[int, dict[str, str], bytes]:
                method, path, headers, body = request
                host, port = relay_to.rsplit(":", 1)
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    forwarded = {k: v for k, v in headers.items() if k.lower() != "host"}
                    conn.request(method, path, body=body or None, headers=forwarded)
                    r = conn.getresponse()
                    return r.status, dict(r.getheaders()), r.read()
                finally:
                    conn.close()

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.seen, self.relayed = seen, relayed
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def saw(self, secret: str) -> bool:
        return any(secret in repr(item) for item in self.seen)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def squatter():
    s = Squatter()
    yield s
    s.close()


def embedded(**kw) -> SGLangBackendArgs:
    options = {"startup_timeout_s": 120.0, **kw}
    return SGLangBackendArgs(launch="embedded", device="cpu", extra_args=["--num-threads", "1"], **options)


def test_a_squatted_port_fails_the_launch_clearly_and_never_sees_the_key(squatter, char_tok, tmp_path):
    """The trainer's own launch path (backend.initialize): the embedded server cannot bind the port the
    recipe fixed (base_port), something else answers there; the run stops with a clear error and the
    squatter got no key, on /health or on any other request."""
    backend = SGLangBackend(embedded(base_port=squatter.port))
    with pytest.raises(launcher.LaunchError) as err:
        backend.initialize(
            Model("gen", tiny_module(char_tok), char_tok), FinetuneSpec(1, 8, 8, 100, str(tmp_path))
        )
    message = str(err.value)
    assert f"port {squatter.port} is taken" in message and "another process" in message, message
    assert squatter.seen, "the launcher should have challenged the squatter"
    assert all(path == "/health" and method == "GET" for method, path, _, _ in squatter.seen)
    assert all("authorization" not in {h.lower() for h in headers} for _, _, headers, _ in squatter.seen)
    assert backend.api_key is not None and not squatter.saw(backend.api_key)
    assert all(CHALLENGE_HEADER in headers for _, _, headers, _ in squatter.seen)
    assert not backend.servers  # stopped


def test_an_impostor_is_waited_out_then_named(squatter, tmp_path):
    """While the real server is still starting (here: a process that never binds), something answering
    /health without the proof is not taken for it; at the startup timeout, the error names the port."""
    key = fresh_key()
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    servers = launcher.launch(
        embedded(base_port=squatter.port, startup_timeout_s=3),
        "unused",
        tmp_path,
        "gen",
        command=lambda port, i: sleeper,
        secrets={API_KEY_ENV: key},
    )
    try:
        with pytest.raises(launcher.LaunchError) as err:
            launcher.wait_ready(servers, 3)
    finally:
        launcher.stop(servers)
    message = str(err.value)
    assert f"something answers /health on port {squatter.port} without the proof" in message, message
    assert "another process, or the server without its key guard" in message
    assert "the key was not sent there" in message
    assert len(squatter.seen) >= 2 and not squatter.saw(key)  # it kept asking, keyless


def test_a_shell_key_does_not_reach_launched_servers(monkeypatch, char_tok, tmp_path):
    """AREAL_ADMIN_KEY, AREAL_API_KEY and VLLM_API_KEY in the trainer's environment (a user's shell) are
    replaced by the run's key: the launched server proves the run's key, the run's own weight update
    goes through (a shell admin key used to make it 403), and the shell's keys open nothing. A restart
    proves itself again."""
    for name, value in SHELL_KEYS.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "run"
    module = tiny_module(char_tok)
    gen = SGLangBackend(embedded()).initialize(
        Model("gen", module, char_tok), FinetuneSpec(1, 8, 8, 100, str(run_dir))
    )
    backend = gen.backend
    try:
        (server,) = backend.servers
        assert server.key == backend.api_key and server.key_env == API_KEY_ENV
        environ = Path(f"/proc/{server.proc.pid}/environ").read_bytes().decode(errors="replace")
        assert all(value not in environ for value in SHELL_KEYS.values())
        assert f"{API_KEY_ENV}={backend.api_key}" in environ
        assert f"{WEIGHTS_DIR_ENV}={(run_dir / 'weights').resolve()}" in environ

        weights = run_dir / "weights" / "gen" / "step_1"
        module.save_pretrained(weights)
        char_tok.save_pretrained(weights)
        backend.update_weights(gen, str(weights), 1)  # the run's own update: admin endpoint, run's key
        url = f"http://{server.address}"
        info = httpx.get(url + "/get_model_info", headers={"Authorization": f"Bearer {backend.api_key}"})
        assert info.status_code == 200
        for value in SHELL_KEYS.values():
            r = httpx.post(
                url + "/update_weights_from_disk",
                json={"model_path": str(weights), "weight_version": "2"},
                headers={"Authorization": f"Bearer {value}"},
                timeout=30,
            )
            assert r.status_code == 401, (value, r.status_code)

        backend.servers[0] = launcher.restart(server, 120, "the test restarts it")
        fresh = backend.servers[0]
        assert fresh.proc.pid != server.proc.pid and fresh.key == backend.api_key
        nonce = "n-1"
        r = httpx.get(url + "/health", headers={CHALLENGE_HEADER: nonce}, timeout=30)
        assert r.status_code == 200 and proves(
            backend.api_key, nonce, fresh.port, r.headers.get(PROOF_HEADER)
        )
    finally:
        backend.destroy(gen)


def process_env(pid: int) -> dict[str, str]:
    """The environment a running process was started with (/proc/PID/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_a_launched_process_gets_the_runs_key_and_none_of_the_shells(monkeypatch, tmp_path):
    """launch()'s server process (a sleeper here) starts without the trainer's key variables (AREAL_*,
    VLLM_API_KEY, the cluster key) and with the run's key; other variables (fault injection) still reach it."""
    for name, value in {**SHELL_KEYS, WEIGHTS_DIR_ENV: "/elsewhere", "AREALCLI_CLUSTER_KEY": "c"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AREALCLI_FAULT_DIE_ON_UPDATE", "1")  # not a key: fault injection still reaches
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    (server,) = launcher.launch(
        embedded(),
        "unused",
        tmp_path,
        "gen",
        command=lambda port, i: sleeper,
        secrets={VLLM_API_KEY_ENV: "run-key"},
    )
    try:
        env = process_env(server.proc.pid)
    finally:
        launcher.stop([server])
    assert env[VLLM_API_KEY_ENV] == "run-key" and env["AREALCLI_FAULT_DIE_ON_UPDATE"] == "1"
    assert not {API_KEY_ENV, ADMIN_KEY_ENV, WEIGHTS_DIR_ENV, "AREALCLI_CLUSTER_KEY"} & set(env)
    assert env["PATH"] == os.environ["PATH"] and env == server.env
    assert server.key == "run-key" and server.key_env == VLLM_API_KEY_ENV
    assert launcher.key_variable({VLLM_API_KEY_ENV: "a"}) == VLLM_API_KEY_ENV
    assert launcher.key_variable({API_KEY_ENV: "a", WEIGHTS_DIR_ENV: "/w"}) == API_KEY_ENV
    assert launcher.key_variable(None) is None


# --------------------------------------------------------------------------- SGLang (a stand-in)

# SGLang does not install here: a stand-in laid out as SGLang 0.5 is (a module-level Starlette app in
# sglang.srt.entrypoints.http_server, served by sglang.launch_server, which keys every path but /health
# with --api-key), run by the launcher's own wrapper (SGLANG_WITH_KEY) in vLLM's virtualenv (Starlette,
# uvicorn). What it shows: the wrapper adds our guard to that app before it starts.
STANDIN_HTTP_SERVER = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

async def health(request):
    return Response(status_code=200)

async def update(request):
    body = await request.json()
    return JSONResponse({"success": True, "message": "loaded " + body["model_path"], "num_paused_requests": 0})

app = Starlette(routes=[Route("/health", health), Route("/update_weights_from_disk", update, methods=["POST"])])
"""
STANDIN_LAUNCH_SERVER = """
import argparse, uvicorn
from starlette.responses import JSONResponse
from sglang.srt.entrypoints.http_server import app

class Keyed:  # SGLang's add_api_key_middleware: every path but /health wants the key
    def __init__(self, app, key):
        self.app, self.key = app, key
    async def __call__(self, scope, receive, send):
        wanted = ("Bearer " + self.key).encode()
        if scope["type"] == "http" and scope["path"] != "/health" and dict(scope["headers"]).get(b"authorization") != wanted:
            return await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)

parser = argparse.ArgumentParser()
parser.add_argument("--host"); parser.add_argument("--port", type=int); parser.add_argument("--api-key")
args, _ = parser.parse_known_args()
app.add_middleware(Keyed, key=args.api_key)
uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
"""


@pytest.fixture
def sglang_standin(tmp_path, monkeypatch) -> str:
    """The stand-in package on PYTHONPATH; returns the python that runs it (vLLM's virtualenv)."""
    from tests.test_vllm import require_vllm

    python = require_vllm()
    root = tmp_path / "standin"
    for pkg in ("sglang", "sglang/srt", "sglang/srt/entrypoints"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
    (root / "sglang/srt/entrypoints/http_server.py").write_text(STANDIN_HTTP_SERVER)
    (root / "sglang/launch_server.py").write_text(STANDIN_LAUNCH_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(root))
    return python


def test_the_sglang_wrapper_proves_the_key_and_confines_weight_updates(sglang_standin, tmp_path):
    weights = tmp_path / "run" / "weights"
    (weights / "step_1").mkdir(parents=True)
    (weights / "step_1" / "model.safetensors").write_bytes(b"x")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (weights / "swapped").symlink_to(outside, target_is_directory=True)  # a folder swapped for a symlink
    (weights / "alias").symlink_to(weights / "step_1", target_is_directory=True)  # even one inside
    (weights / "linked").mkdir()
    (weights / "linked" / "model.safetensors").symlink_to(outside / "model.safetensors")
    key = "-" + fresh_key()  # a key may start with '-' (URL-safe base64): still SGLang's --api-key value
    args = SGLangBackendArgs(launch="sglang", python=sglang_standin, startup_timeout_s=120)
    secrets = {API_KEY_ENV: key, WEIGHTS_DIR_ENV: str(weights)}
    servers = launcher.launch(args, str(weights / "step_1"), tmp_path / "logs", "sgl", secrets=secrets)
    try:
        launcher.wait_ready(servers, 120)  # only a server that proves the key gets through
        (server,) = servers
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "areal_guard" in cmdline

        def update(path: Path | str, with_key: bool = True) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if with_key else {}
            body = {"model_path": str(path), "weight_version": "1"}
            return httpx.post(f"http://{server.address}/update_weights_from_disk", json=body, headers=headers)

        ok = update(weights / "step_1")
        assert ok.status_code == 200 and ok.json()["message"] == f"loaded {weights / 'step_1'}", ok.text
        assert update(weights / "step_1", with_key=False).status_code == 401
        for path, why in [
            (outside, "only from below"),
            (weights / "step_1" / ".." / ".." / "..", "only from below"),
            (weights / "swapped", "only from below"),
            (weights / "alias", "is a symlink"),
            (weights / "linked", "holds symlinks"),
            (weights / "missing", "cannot read"),
        ]:
            r = update(path)
            assert r.status_code == 403 and why in r.json()["message"], (path, r.text)
            assert r.json()["success"] is False
        r = httpx.post(
            f"http://{server.address}/update_weights_from_disk",
            content=b"not json",
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 403 and "model_path" in r.json()["message"]
    finally:
        launcher.stop(servers)


def test_the_sglang_wrapper_refuses_an_sglang_it_cannot_guard(tmp_path, monkeypatch):
    """No sglang.srt.entrypoints.http_server.app (another layout): the server does not start unguarded."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text("print('started unguarded')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), API_KEY_ENV: "k-1"}
    out = subprocess.run(
        [sys.executable, "-c", launcher.SGLANG_WITH_KEY, "--port", "1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode != 0 and "started unguarded" not in out.stdout
    assert "cannot import sglang.srt.entrypoints.http_server" in out.stderr, out.stderr


# --------------------------------------------------------------------------- relays, cluster servers, probes


def test_a_relayed_proof_from_another_server_of_the_run_is_refused(model_dir, tmp_path):
    """Every server of a run holds the same key. A process squatting one server's port (say while that
    server restarts) forwards the launcher's challenge to another, real, server of the run and relays its
    answer, proof included: that proof names the other server's port, so it is refused, and the key is
    never sent to the relay."""
    key = fresh_key()
    (real,) = launcher.launch(
        embedded(), str(model_dir), tmp_path / "real", "real", secrets={API_KEY_ENV: key}
    )
    relay = Squatter(relay_to=real.address)
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    try:
        launcher.wait_ready([real], 120)  # the real server proves itself on its own port
        (squatted,) = launcher.launch(
            embedded(base_port=relay.port, startup_timeout_s=3),
            "unused",
            tmp_path / "squatted",
            "gen",
            command=lambda port, i: sleeper,
            secrets={API_KEY_ENV: key},
        )
        try:
            with pytest.raises(launcher.LaunchError) as err:
                launcher.wait_ready([squatted], 3)
        finally:
            launcher.stop([squatted])
        assert f"port {relay.port} without the proof" in str(err.value), err.value
        assert relay.relayed and all(PROOF_HEADER in h for h in relay.relayed)  # the real server answered
        assert not relay.saw(key)
        assert all("authorization" not in {h.lower() for h in headers} for _, _, headers, _ in relay.seen)
        with httpx.Client(trust_env=False, timeout=30) as client:  # the real one is still taken for itself
            assert launcher.identify(client, real.address, key) == "ready"
            assert launcher.identify(client, f"127.0.0.1:{relay.port}", key) == "impostor"
    finally:
        relay.close()
        launcher.stop([real])


def test_a_cluster_launcher_waits_for_the_proof_not_a_bare_200(squatter):
    """launchers/health (the Slurm script's wait, the Ray launcher's on each node): a 200 without the proof
    of the job's key is not a server of the job; the key is not sent there."""
    key = fresh_key()
    why = wait_healthy([f"127.0.0.1:{squatter.port}"], 2, key=key)
    assert why is not None and f"port {squatter.port} without the proof" in why, why
    assert squatter.seen and not squatter.saw(key)
    assert all(CHALLENGE_HEADER in headers for _, _, headers, _ in squatter.seen)
    assert wait_healthy([f"127.0.0.1:{squatter.port}"], 2) is None  # no key: a 200 is enough


def test_health_probes_carry_no_key(squatter, loop):
    """After a server dies, anything may take its port: the client's /health probes (while a request
    waits, while idle, while waiting for a server to come back, and check_all's first step) carry no key."""
    key = fresh_key()
    client = loop.client(
        [f"127.0.0.1:{squatter.port}"],
        api_key=key,
        connect_timeout_s=5,
        reconnect_timeout_s=5,
        health_interval_s=1,
    )
    s = client.servers[0]
    loop.run(client._probe(s), timeout=30)
    assert s.healthy_at > 0  # it answered
    assert loop.run(client.check_all(), timeout=30) == [{"status": "ok"}]  # /get_model_info: keyed
    client.current_update = {"model_path": "/nowhere", "weight_version": "1"}  # what a reconnection loads
    loop.run(client._find_server(), timeout=30)
    health = [headers for method, path, headers, _ in squatter.seen if path == "/health"]
    assert len(health) >= 3
    assert all("authorization" not in {h.lower() for h in headers} for headers in health)
    keyed = [path for _, path, headers, _ in squatter.seen if "authorization" in {h.lower() for h in headers}]
    assert keyed and "/health" not in keyed  # requests other than probes do carry it

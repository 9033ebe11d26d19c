"""Start generation servers as child processes and wait until they answer `/health`.

`launch: sglang` runs `python -m sglang.launch_server` (GPU machines; server i gets GPUs
i*tp_size ... via --base-gpu-id); `launch: embedded` runs `areal serve` (this package, CPU or GPU).
Each server logs to `<log_dir>/<name>-<i>.log`, runs in its own process group (Ctrl-C reaches the
trainer, which stops them), and gets SIGTERM if the trainer process dies (Linux).

Placement: with `cpus`, server i runs on its share of them (its CPU affinity, set in the child before
the server program starts; an embedded server also takes one torch thread per core); without, on the
cores the trainer had before its own placement pinned it. With `devices`, it sees only its share of the
GPUs (CUDA_VISIBLE_DEVICES, ids counted among the GPUs visible here).

Keys: a server's key reaches it through its environment only, and the launcher sends it nowhere before
the server has proved it holds it: `GET /health` with a fresh nonce (CHALLENGE_HEADER, no key) must come
back 200 with proof(key, nonce, port) (PROOF_HEADER), `port` the one the server was launched on. A process
that took the port first cannot answer so, nor relay the challenge to another server of the run (whose
proof names its own port); the launcher keeps asking until the real server answers or the startup time is
up. Key variables of the
trainer's own environment (AREAL_*, VLLM_API_KEY, the cluster key) never reach a server: it gets the
run's, or none.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from arealcli.runtime.wire.auth import (
    API_KEY_ENV,
    CHALLENGE_HEADER,
    CLUSTER_KEY_ENV,
    PROOF_HEADER,
    VLLM_API_KEY_ENV,
    WEIGHTS_DIR_ENV,
    fresh_nonce,
    proves,
)
from arealcli.runtime.wire.guard import GUARD_DIR
from arealcli.schema.checks.placement import UNPLACED_CPUS_ENV, parse_ids
from arealcli.schema.components.backends import SGLangBackendArgs, VLLMBackendArgs
from arealcli.schema.components.engine import MAX_SAMPLES_PER_PROMPT


class LaunchError(RuntimeError):
    """A server did not start; the message carries the end of its log."""


@dataclass
class ServerProcess:
    address: str
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]
    cmd: list[str] = field(default_factory=list)  # how it was started: a restart runs the same again
    env: dict[str, str] = field(default_factory=dict)
    cpus: set[int] | None = None
    key_env: str | None = None  # the variable of `env` that holds its key (None: an unkeyed server)

    @property
    def key(self) -> str | None:
        """The key the server was given (what it must prove it holds before it is used)."""
        return self.env.get(self.key_env) if self.key_env else None

    @property
    def port(self) -> str:
        return self.address.rsplit(":", 1)[1]

    def exited(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def why_down(self) -> str | None:
        code = self.exited()
        return None if code is None else f"its process exited with code {code}; log: {self.log_path}"


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# `python -m sglang.launch_server ARGS`, given its --api-key from the environment (AREAL_API_KEY) inside
# the process: the key is never on a command line, which every user of the machine can read (`ps`). Before
# SGLang starts, our guard (wire/guard/areal_guard.py, standalone: SGLang's Python may lack arealcli) is
# added to SGLang's app: it answers the launcher's /health challenge with the proof of the key, and lets
# weight updates load only from below AREAL_WEIGHTS_DIR (the run's weights folder).
SGLANG_WITH_KEY = (
    f"import os, runpy, sys; sys.path.insert(0, {str(GUARD_DIR)!r}); import areal_guard; "
    f"key = os.environ.pop('{API_KEY_ENV}', None); "
    f"areal_guard.guard_sglang(key, os.environ.pop('{WEIGHTS_DIR_ENV}', None)); "
    "sys.argv = ['sglang.launch_server'] + sys.argv[1:] + (['--api-key=' + key] if key else []); "
    "runpy.run_module('sglang.launch_server', run_name='__main__')"
)


def server_command(args: SGLangBackendArgs, model_path: str, port: int, index: int) -> list[str]:
    """The command line of server `index` (launch: sglang or embedded)."""
    python = args.python or sys.executable
    if args.launch == "sglang":
        cmd = [
            python,
            "-c",
            SGLANG_WITH_KEY,
            "--model-path",
            model_path,
            "--host",
            args.host,
            "--port",
            str(port),
            "--tp-size",
            str(args.tp_size),
            "--base-gpu-id",
            str(0 if args.devices is not None else index * args.tp_size),  # placed: it sees its own only
            "--skip-tokenizer-init",
            "--dtype",
            args.dtype,
        ]
        if args.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
        if args.context_length is not None:
            cmd += ["--context-length", str(args.context_length)]
    else:
        cmd = [python, "-m", "arealcli.main", "serve", "--model", model_path, "--host", args.host]
        cmd += ["--port", str(port), "--device", args.device]
        cmd += ["--dtype", "float32" if args.dtype == "auto" else args.dtype]
        cmd += ["--max-n", str(MAX_SAMPLES_PER_PROMPT)]  # a recipe's generation.n is bounded already
        cmd += ["--max-requests", str(max_requests(args))]
        cpus = args.server_cpus(index)
        if cpus:
            cmd += ["--num-threads", str(len(cpus))]
    return cmd + list(args.extra_args)


SERVE_MAX_REQUESTS = 1024  # `areal serve --max-requests`'s default


def max_requests(args: SGLangBackendArgs) -> int:
    """An embedded server's limit of requests in flight (429 beyond): at least as many as the client
    sends at once (`max_concurrent_requests`, over all servers), so the run's own requests are never
    refused."""
    return max(SERVE_MAX_REQUESTS, args.max_concurrent_requests)


try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG, _SIGTERM = 1, int(signal.SIGTERM)


def die_with_parent() -> None:
    """Runs in the child between fork and exec (so: no imports, no locks): SIGTERM when the parent dies."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, _SIGTERM)


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    """What runs in a server's child process before exec: die with the parent, run on `cpus`."""

    def setup() -> None:
        die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)  # the child has one thread: this is the process's mask

    return setup


# Variables of the trainer's environment that would give a server a key of their own (`areal serve` reads
# AREAL_API_KEY / AREAL_ADMIN_KEY, vLLM VLLM_API_KEY; the run's cluster key): a server gets the run's or none.
# An inherited admin key, say, would make the run's own weight updates fail with 403.
KEY_PREFIXES = ("AREAL_",)
KEY_VARIABLES = frozenset({VLLM_API_KEY_ENV, CLUSTER_KEY_ENV})


def child_env() -> dict[str, str]:
    """This process's environment without its key variables (KEY_PREFIXES, KEY_VARIABLES): what a server
    starts from, before the run's own variables (its key) are added."""
    env = {k: v for k, v in os.environ.items() if not (k.startswith(KEY_PREFIXES) or k in KEY_VARIABLES)}
    return {**env, "PYTHONUNBUFFERED": "1"}


def key_variable(secrets: dict[str, str] | None) -> str | None:
    """Which of `secrets` is the key a server proves it holds (vLLM's own variable, else ours)."""
    return next((k for k in (VLLM_API_KEY_ENV, API_KEY_ENV) if secrets and secrets.get(k)), None)


def visible_devices(devices: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for GPUs given as indices among those visible to this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else None
    if ids is not None and max(devices) >= len(ids):
        raise LaunchError(
            f"devices {devices}: only {len(ids)} GPU(s) visible (CUDA_VISIBLE_DEVICES={visible})"
        )
    return ",".join(ids[d] if ids is not None else str(d) for d in devices)


def check_cpus(cpus: list[int]) -> None:
    """Refuse cores this process cannot run on (before its own placement) before a server starts on them."""
    unplaced = os.environ.get(UNPLACED_CPUS_ENV)
    if unplaced:
        allowed = parse_ids(unplaced)
    else:
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(cpus)
    if not set(cpus) <= allowed:
        missing = sorted(set(cpus) - allowed)
        raise LaunchError(f"cpus {missing} are not available here: this process may run on {sorted(allowed)}")


def launch(
    args: SGLangBackendArgs | VLLMBackendArgs,
    model_path: str,
    log_dir: Path,
    name: str,
    command: Callable[[int, int], list[str]] | None = None,
    extra_env: Callable[[int], dict[str, str]] | None = None,
    secrets: dict[str, str] | None = None,
) -> list[ServerProcess]:
    """Start `args.num_servers` servers; `command(port, index)` and `extra_env(index)` override the
    sglang/embedded command line and add environment variables (other server kinds, e.g. vllm).
    `secrets` (an API key) go to every server through its environment only, never its command line; key
    variables this process inherited do not (child_env). The servers are not usable before wait_ready."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    for i in range(args.num_servers):
        port = args.base_port + i if args.base_port is not None else free_port(args.host)
        log_path = log_dir / f"{name}-{i}.log"
        if command is not None:
            cmd = command(port, i)
        else:
            assert isinstance(args, SGLangBackendArgs)
            cmd = server_command(args, model_path, port, i)
        env = child_env()
        cpus, devices = args.server_cpus(i), args.server_devices(i)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices)
        env.update(extra_env(i) if extra_env is not None else {})
        env.update(secrets or {})  # last: extra_env cannot replace the run's key
        if cpus:
            check_cpus(cpus)
        elif os.environ.get(UNPLACED_CPUS_ENV):  # not the trainer's cores it was started from
            cpus = sorted(parse_ids(os.environ[UNPLACED_CPUS_ENV]))
        try:
            cpu_set = set(cpus) if cpus else None
            servers.append(_start(f"{args.host}:{port}", cmd, env, cpu_set, log_path, key_variable(secrets)))
        except LaunchError:
            stop(servers)
            raise
    return servers


def _start(
    address: str,
    cmd: list[str],
    env: dict[str, str],
    cpus: set[int] | None,
    log_path: Path,
    key_env: str | None = None,
) -> ServerProcess:
    log = open(log_path, "ab")  # noqa: SIM115  (closed in stop())
    log.write(("$ " + " ".join(cmd) + "\n").encode())
    log.flush()
    try:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: Ctrl-C reaches the trainer, which stops us
            preexec_fn=_child_setup(cpus),
        )
    except OSError as e:
        log.close()
        raise LaunchError(f"cannot run {cmd[0]}: {e}") from None
    return ServerProcess(address, proc, log_path, log, cmd, env, cpus, key_env)


def restart(server: ServerProcess, startup_timeout_s: float, why: str) -> ServerProcess:
    """Kill `server` (SIGKILL to its process group: also a stopped or hung one), start the same command
    on the same address, CPUs and devices (its log goes on in the same file), and wait for /health."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    server.log_file.write(f"\n# arealcli: restarting this server: {why}\n".encode())
    server.log_file.close()
    fresh = _start(server.address, server.cmd, server.env, server.cpus, server.log_path, server.key_env)
    try:
        wait_ready([fresh], startup_timeout_s)
    except LaunchError:
        stop([fresh])
        raise
    return fresh


def wait_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    """Poll every server's /health until each answers 200 and, when it has a key, proves it holds that key
    (see the module's docstring); a dead process or the timeout is an error. No request of this function
    carries a key: until a server has proved itself, another process may hold its port."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    impostors: set[str] = set()  # addresses where something answered without the proof
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for s in list(pending):
                if s.exited() is not None:
                    raise LaunchError(_exited(s, s.address in impostors))
                answer = identify(client, s.address, s.key)
                if answer == "ready":
                    pending.remove(s)
                elif answer == "impostor":
                    impostors.add(s.address)
            if pending and time.monotonic() > deadline:
                raise LaunchError(_timed_out(pending[0], timeout_s, pending[0].address in impostors))
            if pending:
                time.sleep(0.2)


def identify(client: httpx.Client, address: str, key: str | None) -> str | None:
    """What answers /health at `address` (HOST:PORT): "ready" (200, and with a key a valid proof of it for
    that port), "impostor" (an answer without the proof, or with a wrong one: whatever holds the port, or
    relays another server's answer), or None (no answer yet). The request carries no key."""
    nonce, port = fresh_nonce(), address.rsplit(":", 1)[1]
    try:
        r = client.get(f"http://{address}/health", headers={CHALLENGE_HEADER: nonce} if key else {})
    except httpx.HTTPError:
        return None
    if key is None:
        return "ready" if r.status_code == 200 else None
    answer = r.headers.get(PROOF_HEADER)
    if proves(key, nonce, port, answer):
        return "ready" if r.status_code == 200 else None
    return "impostor" if r.status_code == 200 or answer is not None else None


def unproven(port: str) -> str:
    """What an answer without the proof of the key means (the launcher's error messages)."""
    return (
        f"something answers /health on port {port} without the proof of the run's key (another process, or "
        "the server without its key guard); the key was not sent there"
    )


def _exited(s: ServerProcess, impostor: bool) -> str:
    """Why a server's process ended while starting: its exit code, a taken port said plainly, its log."""
    tail = s.log_tail()
    if "address already in use" in tail.lower():
        why = f"; port {s.port} is taken: another process listens on {s.address}"
        why += (f"; {unproven(s.port)}" if impostor else "") + "; stop it, or use another port"
    else:
        why = f"; {unproven(s.port)}" if impostor else ""
    return (
        f"generation server {s.address} exited with code {s.exited()} while starting{why}; "
        f"log {s.log_path} ends with:\n{tail}"
    )


def _timed_out(s: ServerProcess, timeout_s: float, impostor: bool) -> str:
    if impostor:
        return (
            f"generation server {s.address}: {unproven(s.port)}. The server did not prove itself within "
            f"startup_timeout_s={timeout_s:g} s: stop that process or use another port (or, if it is this "
            f"server, see why it lacks its key); log {s.log_path} ends with:\n{s.log_tail()}"
        )
    return (
        f"generation server {s.address} did not answer /health within startup_timeout_s="
        f"{timeout_s:g} s; log {s.log_path} ends with:\n{s.log_tail()}"
    )


def stop(servers: list[ServerProcess], grace_s: float = 10.0) -> None:
    """SIGTERM each server's process group, SIGKILL what is left after `grace_s`."""
    for s in servers:
        if s.exited() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for s in servers:
        try:
            s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        s.log_file.close()


class Supervisor:
    """Restarts the launched servers of one model that died or hung, at most `max_restarts` times in any
    `window_s` seconds; one more failure in the window is given up (GenerationServerError).

    Restarts run on a thread of the supervisor's own that lives as long as the servers (a child started
    from a thread gets SIGTERM when that thread ends: `die_with_parent`)."""

    def __init__(
        self,
        servers: list[ServerProcess],
        name: str,
        startup_timeout_s: float,
        max_restarts: int = 3,
        window_s: float = 3600.0,
    ):
        import concurrent.futures
        import threading

        self.servers, self.name = servers, name  # the backend's list: replaced in place on a restart
        self.startup_timeout_s, self.max_restarts, self.window_s = startup_timeout_s, max_restarts, window_s
        self.restarted_at: list[float] = []
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-supervisor")
        self._lock = threading.Lock()

    def owns(self, address: str) -> bool:
        return any(s.address == address for s in self.servers)

    def label(self, address: str) -> str:
        """`actor_gen-0 (127.0.0.1:4321)`: the server as its log file names it."""
        for s in self.servers:
            if s.address == address:
                return f"{s.log_path.stem} ({address})"
        return address

    def why_down(self, address: str) -> str | None:
        """Why the server at `address` is down (its exit code and log), or None while its process lives."""
        return next((s.why_down() for s in self.servers if s.address == address), None)

    def log_path(self, address: str) -> Path | None:
        return next((s.log_path for s in self.servers if s.address == address), None)

    def restart(self, address: str, why: str) -> None:
        """Blocking (run it on `self.thread`): kill and start the server again, wait until it answers."""
        from arealcli.runtime.engines.inference import GenerationServerError

        with self._lock:
            now = time.monotonic()
            self.restarted_at = [t for t in self.restarted_at if now - t < self.window_s]
            if len(self.restarted_at) >= self.max_restarts:
                log = "" if "log:" in why else f"; log: {self.log_path(address)}"
                raise GenerationServerError(
                    f"generation server {self.label(address)} failed again ({why}{log}) after "
                    f"{len(self.restarted_at)} restart(s) within {self.window_s:g} s; not restarting it again "
                    f"(max_restarts={self.max_restarts})"
                )
            self.restarted_at.append(now)
            i = next(k for k, s in enumerate(self.servers) if s.address == address)
            try:
                self.servers[i] = restart(self.servers[i], self.startup_timeout_s, why)
            except LaunchError as e:
                raise GenerationServerError(
                    f"generation server {self.label(address)} could not be restarted: {e}"
                ) from None

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)

"""Start generation servers as child processes and wait until they answer `/health`.

`launch: sglang` runs `python -m sglang.launch_server` (GPU machines; server i gets GPUs
i*tp_size ... via --base-gpu-id); `launch: embedded` runs `areal serve` (this package, CPU or GPU).
Each server logs to `<log_dir>/<name>-<i>.log`, runs in its own process group (Ctrl-C reaches the
trainer, which stops them), and gets SIGTERM if the trainer process dies (Linux).

Placement: with `cpus`, server i runs on its share of them (its CPU affinity, set in the child before
the server program starts; an embedded server also takes one torch thread per core); without, on the
cores the trainer had before its own placement pinned it. With `devices`, it sees only its share of the
GPUs (CUDA_VISIBLE_DEVICES, ids counted among the GPUs visible here).
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

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


def server_command(args: SGLangBackendArgs, model_path: str, port: int, index: int) -> list[str]:
    """The command line of server `index` (launch: sglang or embedded)."""
    python = args.python or sys.executable
    if args.launch == "sglang":
        cmd = [
            python,
            "-m",
            "sglang.launch_server",
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
        cpus = args.server_cpus(index)
        if cpus:
            cmd += ["--num-threads", str(len(cpus))]
    return cmd + list(args.extra_args)


try:
    import ctypes

    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG, _SIGTERM = 1, int(signal.SIGTERM)


def _die_with_parent() -> None:
    """Runs in the child between fork and exec (so: no imports, no locks): SIGTERM when the parent dies."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, _SIGTERM)


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    """What runs in a server's child process before exec: die with the parent, run on `cpus`."""

    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)  # the child has one thread: this is the process's mask

    return setup


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
) -> list[ServerProcess]:
    """Start `args.num_servers` servers; `command(port, index)` and `extra_env(index)` override the
    sglang/embedded command line and add environment variables (other server kinds, e.g. vllm)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[ServerProcess] = []
    for i in range(args.num_servers):
        port = args.base_port + i if args.base_port is not None else free_port(args.host)
        log_path = log_dir / f"{name}-{i}.log"
        log = open(log_path, "ab")  # noqa: SIM115  (closed in stop())
        if command is not None:
            cmd = command(port, i)
        else:
            assert isinstance(args, SGLangBackendArgs)
            cmd = server_command(args, model_path, port, i)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        cpus, devices = args.server_cpus(i), args.server_devices(i)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices)
        env.update(extra_env(i) if extra_env is not None else {})
        if cpus:
            check_cpus(cpus)
        elif os.environ.get(UNPLACED_CPUS_ENV):  # not the trainer's cores it was started from
            cpus = sorted(parse_ids(os.environ[UNPLACED_CPUS_ENV]))
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
                preexec_fn=_child_setup(set(cpus) if cpus else None),
            )
        except OSError as e:
            log.close()
            stop(servers)
            raise LaunchError(f"cannot run {cmd[0]}: {e}") from None
        servers.append(ServerProcess(f"{args.host}:{port}", proc, log_path, log))
    return servers


def wait_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    """Poll every server's /health until all answer 200; a dead process or the timeout is an error."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for s in list(pending):
                if s.exited() is not None:
                    raise LaunchError(
                        f"generation server {s.address} exited with code {s.exited()} while starting; "
                        f"log {s.log_path} ends with:\n{s.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"http://{s.address}/health").status_code == 200:
                        pending.remove(s)
            if pending and time.monotonic() > deadline:
                s = pending[0]
                raise LaunchError(
                    f"generation server {s.address} did not answer /health within startup_timeout_s="
                    f"{timeout_s:g} s; log {s.log_path} ends with:\n{s.log_tail()}"
                )
            if pending:
                time.sleep(0.2)


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

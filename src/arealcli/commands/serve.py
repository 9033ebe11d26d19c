"""`areal serve --model DIR`: an embedded generation server speaking SGLang's native HTTP protocol and
OpenAI's (/v1/completions, /v1/chat/completions, /v1/models)."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path

import typer

from arealcli.commands.common import console, fail
from arealcli.runtime.wire.auth import ADMIN_KEY_ENV, API_KEY_ENV, WEIGHTS_DIR_ENV


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def serve(
    model: Path = typer.Option(
        ..., "--model", "--model-path", metavar="DIR", help="Hugging Face model directory to serve."
    ),
    host: str = typer.Option("127.0.0.1", metavar="HOST", help="Interface to listen on."),
    port: int = typer.Option(30000, metavar="PORT", help="Port; 0 picks a free one (printed when ready)."),
    device: Device = typer.Option(Device.auto, help="auto = cuda when available, else cpu."),
    dtype: Dtype = typer.Option(Dtype.float32, help="Weights and compute dtype."),
    batch_window_ms: float = typer.Option(
        5.0,
        min=0,
        help="Batch requests that arrive within this long of each other (waiting at most 10x this long).",
    ),
    max_batch_size: int = typer.Option(
        256, min=1, help="Most samples in one generate call, and most prompts in one request."
    ),
    max_n: int = typer.Option(64, min=1, help="Most samples per prompt (n) in one request."),
    max_body_mb: int = typer.Option(16, min=1, help="Largest request body in MiB (larger: 413)."),
    max_connections: int = typer.Option(
        1024,
        min=1,
        help="Most open connections (lowered to fit the open-file limit); at the cap the longest-idle one is "
        "closed for a new one.",
    ),
    max_requests: int = typer.Option(
        1024,
        min=1,
        help="Most generation requests in flight (beyond: 429); /health and control endpoints are not counted.",
    ),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY_ENV,
        metavar="KEY",
        help="Require Authorization: Bearer KEY on every endpoint but /health (prefer the AREAL_API_KEY "
        "variable: a command line is visible to `ps`).",
    ),
    admin_key: str = typer.Option(
        None,
        "--admin-key",
        envvar=ADMIN_KEY_ENV,
        metavar="KEY",
        help="The key of the control endpoints (weight updates, abort, slow_down, flush_cache); default: "
        "the API key. Read from AREAL_ADMIN_KEY when that is set: a server started where it is exported "
        "requires it on those endpoints (the startup line says so).",
    ),
    allow_unauthenticated: bool = typer.Option(
        False,
        "--allow-unauthenticated",
        metavar="",
        help="Listen on an address other machines reach without a key (refused otherwise).",
    ),
    weight_version: str = typer.Option("default", help="weight_version reported until an update sets one."),
    num_threads: int = typer.Option(
        0, min=0, help="torch CPU threads (0 = torch's default; 1 is fastest for small models on busy CPUs)."
    ),
    log_requests: bool = typer.Option(False, "--log-requests", help="Log every HTTP request.", metavar=""),
) -> None:
    """Serve a model for generation: OpenAI's API under /v1 (completions, chat) and SGLang's native protocol.

    What `launch: embedded` starts for training; a stand-in for SGLang where it does not run (CPU).
    Requests that arrive together run as one batched generate call.

    Examples:
    areal serve --model runs/quickstart/checkpoints/step_00000250/actor
    areal serve --model runs/quickstart/checkpoints/step_00000250/actor --port 0
    areal serve --model /models/Qwen2.5-0.5B --device cuda --dtype bfloat16
    """
    if not (model / "config.json").is_file():
        raise fail([f"--model {model}: not a Hugging Face model directory (no config.json)"])
    if admin_key is not None and api_key is None:
        raise fail(["--admin-key needs --api-key (or AREAL_API_KEY): the other endpoints would be open"])
    if api_key is None and not allow_unauthenticated and not _loopback(host):
        raise fail(
            [
                f"--host {host}: other machines can reach this address, and the server has no key. Set "
                "AREAL_API_KEY (or --api-key), or pass --allow-unauthenticated to serve without one"
            ]
        )
    from arealcli.runtime.serve.http_server import Keys, make_server, serve_forever

    if num_threads:
        import torch

        torch.set_num_threads(num_threads)

    try:
        server = make_server(
            str(model.resolve()),
            host,
            port,
            device.value,
            dtype.value,
            batch_window_ms,
            max_batch_size,
            weight_version,
            log_requests,
            max_n,
            max_body_mb,
            Keys(api_key, admin_key),
            os.environ.get(WEIGHTS_DIR_ENV),  # set for the servers a run launches
            max_connections,
            max_requests,
        )
    except OSError as e:
        raise fail([str(e)]) from None

    def ready(h: str, p: int) -> None:
        console.print(
            f"serving {model} at http://{h}:{p} (SGLang native protocol; OpenAI-compatible under /v1)",
            highlight=False,
        )
        console.print(_keys_line(api_key, admin_key), highlight=False)

    try:
        serve_forever(server, ready)
    except KeyboardInterrupt:
        console.print("stopped")


def _keys_line(api_key: str | None, admin_key: str | None) -> str:
    """Which keys the server asks for (never the keys): a 403 on a weight update is then explained."""
    if api_key is None:
        return "no key (AREAL_API_KEY unset): every endpoint answers whoever can reach this address"
    if admin_key is None or admin_key == api_key:
        return "keyed: every endpoint but /health needs the API key (AREAL_API_KEY)"
    return (
        "keyed: every endpoint but /health needs the API key (AREAL_API_KEY); weight updates, abort, "
        "slow_down and flush_cache need the admin key (AREAL_ADMIN_KEY or --admin-key)"
    )


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

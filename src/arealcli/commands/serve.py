"""`areal serve --model DIR`: an embedded generation server speaking SGLang's native HTTP protocol and
OpenAI's (/v1/completions, /v1/chat/completions, /v1/models)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from arealcli.commands.common import Device, Dtype, fail, say
from arealcli.errors import UserError
from arealcli.runtime.wire.auth import ADMIN_KEY_ENV, API_KEY_ENV

Model = Annotated[
    Path,
    typer.Option("--model", "--model-path", metavar="DIR", help="Hugging Face model directory to serve."),
]
Host = Annotated[str, typer.Option(metavar="HOST", help="Interface to listen on.")]
Port = Annotated[int, typer.Option(metavar="PORT", help="Port; 0 picks a free one (printed when ready).")]
DeviceOpt = Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")]
DtypeOpt = Annotated[Dtype, typer.Option(help="Weights and compute dtype.")]
BatchWindow = Annotated[
    float,
    typer.Option(
        min=0,
        help="Batch requests that arrive within this long of each other (waiting at most 10x this long).",
    ),
]
MaxBatchSize = Annotated[
    int, typer.Option(min=1, help="Most samples in one generate call, and most prompts in one request.")
]
MaxN = Annotated[int, typer.Option(min=1, help="Most samples per prompt (n) in one request.")]
MaxBodyMb = Annotated[int, typer.Option(min=1, help="Largest request body in MiB (larger: 413).")]
MaxConnections = Annotated[
    int,
    typer.Option(
        min=1,
        help="Most open connections (lowered to fit the open-file limit); at the cap the longest-idle one is "
        "closed for a new one.",
    ),
]
MaxRequests = Annotated[
    int,
    typer.Option(
        min=1,
        help="Most generation requests in flight (beyond: 429); /health and control endpoints are not counted.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar=API_KEY_ENV,
        metavar="KEY",
        help="Require Authorization: Bearer KEY on every endpoint but /health (prefer the AREAL_API_KEY "
        "variable: a command line is visible to `ps`).",
    ),
]
AdminKey = Annotated[
    str | None,
    typer.Option(
        "--admin-key",
        envvar=ADMIN_KEY_ENV,
        metavar="KEY",
        help="The key of the control endpoints (weight updates, abort, slow_down, flush_cache); default: "
        "the API key. Read from AREAL_ADMIN_KEY when that is set: a server started where it is exported "
        "requires it on those endpoints (the startup line says so).",
    ),
]
AllowUnauthenticated = Annotated[
    bool,
    typer.Option(
        "--allow-unauthenticated",
        metavar="",
        help="Listen on an address other machines reach without a key (refused otherwise).",
    ),
]
WeightVersion = Annotated[str, typer.Option(help="weight_version reported until an update sets one.")]
NumThreads = Annotated[
    int,
    typer.Option(
        min=0, help="torch CPU threads (0 = torch's default; 1 is fastest for small models on busy CPUs)."
    ),
]
Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="NAME=DIR",
        help="Also serve the LoRA adapter in DIR (peft's format) as model NAME, over the same base weights; "
        "repeat for more. Requests pick one by name (OpenAI `model`, SGLang `lora_path`).",
    ),
]
ToolCallParser = Annotated[
    str | None,
    typer.Option(
        "--tool-call-parser",
        metavar="FORMAT",
        help="How the model writes tool calls: hermes, llama3_json, mistral or qwen3_coder (default: the one "
        "its chat template teaches).",
    ),
]
LogRequests = Annotated[bool, typer.Option("--log-requests", help="Log every HTTP request.", metavar="")]


def serve(
    model: Model,
    host: Host = "127.0.0.1",
    port: Port = 30000,
    device: DeviceOpt = Device.auto,
    dtype: DtypeOpt = Dtype.float32,
    batch_window_ms: BatchWindow = 5.0,
    max_batch_size: MaxBatchSize = 256,
    max_n: MaxN = 64,
    max_body_mb: MaxBodyMb = 16,
    max_connections: MaxConnections = 1024,
    max_requests: MaxRequests = 1024,
    api_key: ApiKey = None,
    admin_key: AdminKey = None,
    allow_unauthenticated: AllowUnauthenticated = False,
    weight_version: WeightVersion = "default",
    num_threads: NumThreads = 0,
    log_requests: LogRequests = False,
    lora: Lora = None,
    tool_call_parser: ToolCallParser = None,
) -> None:
    """Serve a model for generation: OpenAI's API under /v1 (completions, chat) and SGLang's native protocol.

    What `launch: embedded` starts for training; a stand-in for SGLang where it does not run (CPU).
    Requests that arrive together run as one batched generate call.

    Examples:
    areal serve --model runs/quickstart/checkpoints/step_00000250/actor
    areal serve --model runs/quickstart/checkpoints/step_00000250/actor --port 0
    areal serve --model /models/Qwen2.5-0.5B --device cuda --dtype bfloat16
    areal serve --model /models/Qwen2.5-0.5B --lora math=runs/a/adapter --lora code=runs/b/adapter
    """
    from arealcli.runtime.serve import start

    flags = start.ServeFlags(  # the parameters above, in their order
        model, host, port, device.value, dtype.value, batch_window_ms, max_batch_size, max_n, max_body_mb,
        max_connections, max_requests, api_key, admin_key, allow_unauthenticated, weight_version,
        num_threads, log_requests, lora or [], tool_call_parser,
    )  # fmt: skip
    try:
        start.refuse(flags)
        server = start.server(flags)  # bound, its model loaded
    except (UserError, OSError) as e:
        raise fail(e.lines if isinstance(e, UserError) else [str(e)]) from None

    def ready(h: str, p: int) -> None:
        say(f"serving {model} at http://{h}:{p} (SGLang native protocol; OpenAI-compatible under /v1)")
        if lora:
            say("LoRA adapters, by model name: " + ", ".join(o.partition("=")[0] for o in lora))
        say(start.keys_line(api_key, admin_key))

    try:
        server.serve_forever(ready)
    except KeyboardInterrupt:
        say("stopped")

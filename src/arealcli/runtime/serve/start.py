"""`areal serve`'s start: its flags (`ServeFlags`), the refusals before anything loads (`refuse`), the
server bound and its model loaded (`server`), and the line that says which keys it asks for."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from arealcli.errors import UserError
from arealcli.runtime.serve.chat import is_loopback_host
from arealcli.runtime.wire.auth import WEIGHTS_DIR_ENV


@dataclass
class ServeFlags:
    """`areal serve`'s command line, as given."""

    model: Path
    host: str
    port: int
    device: str
    dtype: str
    batch_window_ms: float
    max_batch_size: int
    max_n: int
    max_body_mb: int
    max_connections: int
    max_requests: int
    api_key: str | None
    admin_key: str | None
    allow_unauthenticated: bool
    weight_version: str
    num_threads: int
    log_requests: bool
    lora: list[str]  # NAME=DIR, each a LoRA adapter served beside the base
    tool_call_parser: str | None = None  # how the model writes tool calls (None: its template's format)


def adapters_of(f: ServeFlags) -> list[tuple[str, str]]:
    """--lora NAME=DIR options as (name, folder); UserError on a malformed one, a name given twice or
    the served model's, and a folder that is not a peft adapter."""
    from arealcli.runtime.generation.adapters import NAME, adapter_files

    out: list[tuple[str, str]] = []
    for option in f.lora:
        name, eq, folder = option.partition("=")
        if not eq or not name or not folder:
            raise UserError(f"--lora {option}: give NAME=DIR (an adapter folder served as model NAME)")
        if not NAME.match(name):
            raise UserError(f"--lora {option}: the name may use letters, digits and _ . : - (at most 100)")
        if name in (n for n, _ in out):
            raise UserError(f"--lora {option}: the name {name} is given twice")
        missing = adapter_files(folder)
        if missing:
            raise UserError(
                f"--lora {option}: {folder} is not a LoRA adapter folder (peft's format): no {', '.join(missing)}"
            )
        out.append((name, str(Path(folder).resolve())))
    return out


def refuse(f: ServeFlags) -> None:
    """UserError (exit 2) on a folder that is not a model, an admin key alone, a reachable address
    without a key, a --lora option that cannot be served or an unknown --tool-call-parser."""
    if not (f.model / "config.json").is_file():
        raise UserError(f"--model {f.model}: not a Hugging Face model directory (no config.json)")
    adapters_of(f)
    from arealcli.runtime.wire.tool_calls import FORMATS  # no torch: a refusal comes at once

    if f.tool_call_parser is not None and f.tool_call_parser not in FORMATS:
        known = ", ".join(sorted(FORMATS))
        raise UserError(f"--tool-call-parser {f.tool_call_parser}: not a known format ({known})")
    if f.admin_key is not None and f.api_key is None:
        raise UserError("--admin-key needs --api-key (or AREAL_API_KEY): the other endpoints would be open")
    if f.api_key is None and not f.allow_unauthenticated and not is_loopback_host(f.host):
        raise UserError(
            f"--host {f.host}: other machines can reach this address, and the server has no key. Set "
            "AREAL_API_KEY (or --api-key), or pass --allow-unauthenticated to serve without one"
        )


def server(f: ServeFlags):
    """The bound server, its model loaded (torch's thread count set first); OSError when it cannot
    listen. (The server's module, torch with it, is imported only here: a refusal comes at once.)"""
    from arealcli.runtime.generation.adapters import AdapterError
    from arealcli.runtime.serve.http_server import Keys, make_server

    if f.num_threads:
        import torch

        torch.set_num_threads(f.num_threads)
    try:
        return make_server(
            str(f.model.resolve()),
            host=f.host,
            port=f.port,
            device=f.device,
            dtype=f.dtype,
            batch_window_ms=f.batch_window_ms,
            max_batch_size=f.max_batch_size,
            weight_version=f.weight_version,
            log_requests=f.log_requests,
            max_n=f.max_n,
            max_body_mb=f.max_body_mb,
            keys=Keys(f.api_key, f.admin_key),
            weights_dir=os.environ.get(WEIGHTS_DIR_ENV),  # set for the servers a run launches
            max_connections=f.max_connections,
            max_requests=f.max_requests,
            adapters=adapters_of(f),
            tool_format=f.tool_call_parser,
        )
    except AdapterError as e:
        raise UserError(f"--lora: {e}") from None


def keys_line(api_key: str | None, admin_key: str | None) -> str:
    """Which keys the server asks for (never the keys): a 403 on a weight update is then explained."""
    if api_key is None:
        return "no key (AREAL_API_KEY unset): every endpoint answers whoever can reach this address"
    if admin_key is None or admin_key == api_key:
        return "keyed: every endpoint but /health needs the API key (AREAL_API_KEY)"
    return (
        "keyed: every endpoint but /health needs the API key (AREAL_API_KEY); weight updates, abort, "
        "slow_down and flush_cache need the admin key (AREAL_ADMIN_KEY or --admin-key)"
    )

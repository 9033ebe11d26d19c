"""`areal serve-reward NAME`: a registered reward function as a reward service (protocol 1: POST /score,
GET /health), for recipes whose `reward: {url: ...}` scores on another machine."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from arealcli.commands.common import fail, say
from arealcli.commands.serve import ApiKey, Host, Port
from arealcli.errors import UserError


def serve_reward(
    reward: Annotated[
        str, typer.Argument(metavar="NAME", help="A registered reward (`areal list rewards`).")
    ],
    host: Host = "127.0.0.1",
    port: Port = 8100,
    api_key: ApiKey = None,
    imports: Annotated[
        list[str] | None,
        typer.Option("--import", metavar="MODULE", help="Plugin modules that register the reward first."),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option(help="Serve a non-loopback --host without a key (anyone who reaches it may score)."),
    ] = False,
) -> None:
    """Serve a reward function over HTTP: a batch of samples in, one score per sample out.

    The protocol (POST /score with {"protocol": 1, "samples": [{"prompt", "response", "answers"}]},
    answered {"scores": [...]}) is in the manual's "Rewards from a service"; a recipe scores with it by
    `reward: {url: http://HOST:PORT}`.

    Examples:
    areal serve-reward math
    AREAL_API_KEY=secret areal serve-reward my_grader --import my_rewards --host 0.0.0.0 --port 8100
    """
    try:
        server = start_service(reward, host, port, api_key, imports or [], allow_unauthenticated)
    except UserError as e:
        raise fail(str(e).splitlines()) from None
    bound = server.server_address[1]
    keyed = (
        "keyed: POST /score needs the key (AREAL_API_KEY)"
        if api_key
        else "no key: anyone who reaches it may score"
    )
    say(f"reward {reward!r} served at http://{host}:{bound} (POST /score, GET /health); {keyed}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def start_service(
    reward: str, host: str, port: int, api_key: str | None, imports: list[str], allow_unauthenticated: bool
) -> Any:
    """`areal serve-reward`: the registered reward `reward` bound as a service; UserError (exit 2) for an
    unknown reward, a plugin that does not import, a reachable address without a key or a busy port."""
    from arealcli.runtime.registry import get_reward
    from arealcli.runtime.serve.chat import is_loopback_host
    from arealcli.schema.registry import REWARDS, RegistryError, import_plugins

    try:
        errors = import_plugins(imports)
        if errors:
            raise UserError("\n".join(errors))
        REWARDS.get(reward)
    except RegistryError as e:
        raise UserError(f"{e} (`areal list rewards`)") from None
    if api_key is None and not allow_unauthenticated and not is_loopback_host(host):
        raise UserError(
            f"--host {host}: other machines can reach this address, and the service has no key. Set "
            "AREAL_API_KEY (or --api-key), or pass --allow-unauthenticated to serve without one"
        )
    try:
        from arealcli.runtime.rewards.remote import make_server

        return make_server(get_reward(reward), host, port, api_key)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

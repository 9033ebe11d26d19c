"""Wait until generation servers started elsewhere answer `/health` and prove they hold the job's key.

`python -m arealcli.runtime.launchers.health --timeout S [--pid PID ...] MODEL=HOST:PORT ...`: once
every address answers 200 with the proof of the key in CLUSTER_KEY_ENV (when set; the launcher's check:
clients/launcher.identify, so the trainer never sends the key to a process squatting a server's port),
prints {"MODEL": ["HOST:PORT", ...]} (JSON, the trainer's SERVERS_ENV) and exits 0; exits 1 saying which
server when one of the processes `PID` (the job steps that run the servers) ends first or the time is
up. The Slurm script runs this before the trainer; the Ray launcher calls wait_healthy on each node.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable

import httpx

from arealcli.runtime.clients.launcher import identify, unproven
from arealcli.runtime.wire.auth import CLUSTER_KEY_ENV


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    return True


def wait_healthy(
    addresses: list[str],
    timeout_s: float,
    alive: Callable[[], bool] = lambda: True,
    key: str | None = None,
) -> str | None:
    """None once every address answers /health with 200 (and, given `key`, proves it holds it); else why
    not (the process ended, or the time). No request carries the key."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    impostors: set[str] = set()
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for address in list(pending):
                answer = identify(client, address, key)
                if answer == "ready":
                    pending.remove(address)
                elif answer == "impostor":
                    impostors.add(address)
            if not pending:
                return None
            first = pending[0]
            why = f"; {unproven(first.rsplit(':', 1)[1])}" if first in impostors else ""
            if not alive():
                return f"the server at {first} ended before it answered /health{why}"
            if time.monotonic() > deadline:
                return f"the server at {first} did not answer /health within {timeout_s:g} s{why}"
            time.sleep(0.5)
    return None


def main(argv: list[str] | None = None) -> int:
    import json

    parser = argparse.ArgumentParser(prog="python -m arealcli.runtime.launchers.health")
    parser.add_argument("servers", nargs="+", metavar="MODEL=HOST:PORT")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--pid", type=int, action="append", default=[], help="a server's process")
    a = parser.parse_args(argv)
    by_model: dict[str, list[str]] = {}
    for server in a.servers:
        model, _, address = server.rpartition("=")
        by_model.setdefault(model, []).append(address)
    addresses = [x for xs in by_model.values() for x in xs]
    key = os.environ.get(CLUSTER_KEY_ENV) or None  # the Slurm script's: the servers' key
    why = wait_healthy(addresses, a.timeout, lambda: all(_alive(pid) for pid in a.pid), key)
    if why is not None:
        print(f"areal: {why} (its log is under the run directory's logs/)", file=sys.stderr)
        return 1
    print(json.dumps(by_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

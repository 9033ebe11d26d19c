"""Wait until generation servers started elsewhere answer `/health`.

`python -m arealcli.runtime.launchers.health --timeout S [--pid PID ...] MODEL=HOST:PORT ...`: once
every address answers 200, prints {"MODEL": ["HOST:PORT", ...]} (JSON, the trainer's SERVERS_ENV) and
exits 0; exits 1 saying which server when one of the processes `PID` (the job steps that run the
servers) ends first or the time is up. The Slurm script runs this before the trainer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable

import httpx


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
    addresses: list[str], timeout_s: float, alive: Callable[[], bool] = lambda: True
) -> str | None:
    """None once every address answers /health with 200; else why not (the process ended, or the time)."""
    deadline = time.monotonic() + timeout_s
    pending = list(addresses)
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while pending:
            for address in list(pending):
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"http://{address}/health").status_code == 200:
                        pending.remove(address)
            if not pending:
                return None
            if not alive():
                return f"the server at {pending[0]} ended before it answered /health"
            if time.monotonic() > deadline:
                return f"the server at {pending[0]} did not answer /health within {timeout_s:g} s"
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
    why = wait_healthy(addresses, a.timeout, lambda: all(_alive(pid) for pid in a.pid))
    if why is not None:
        print(f"areal: {why} (its log is under the run directory's logs/)", file=sys.stderr)
        return 1
    print(json.dumps(by_model))
    return 0


if __name__ == "__main__":
    sys.exit(main())

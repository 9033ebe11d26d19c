"""`areal train RECIPE --launcher ray`: the job on a running Ray cluster (`--address` or RAY_ADDRESS).

One placement group, one bundle per node of the plan (`STRICT_SPREAD`: each bundle on its own Ray
node; `cluster.cpus_per_node` and `gpus_per_node` CPUs and GPUs each, one CPU by default). Node i of
`cluster.allocation` is bundle i. On each bundle a `NodeRunner` actor starts that node's processes as
children of its own: the generation servers first (on a free port of the node, its address as Ray
knows it), then, once they answer /health and prove they hold the job's key (launchers/health), `areal
train --nnodes K --node-rank r` on each trainer node (rendezvous on the first), with the servers'
addresses and key in its environment. A server starts from the node's environment without its key
variables (a shell's AREAL_ADMIN_KEY, ...: clients/launcher.child_env), plus the job's key. The driver
prints the first trainer node's output as it comes, and on Ctrl-C (or when the trainer ends) stops
every process (SIGTERM, then SIGKILL), the actors and the placement group. Each process also logs to
RUN/logs/ on its node: `trainer-R.log` (node-rank R), `MODEL-I.log` (server I of MODEL).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arealcli.errors import UserError
from arealcli.runtime.launchers.plan import ClusterPlan
from arealcli.runtime.run.launch import PREPARED_ENV, RESUME_FLAGS_ENV
from arealcli.runtime.run.session import SERVERS_ENV
from arealcli.runtime.wire.auth import CLUSTER_KEY_ENV, fresh_key

PLACEMENT_TIMEOUT_S = 60.0
STOP_GRACE_S = 120.0  # a trainer stopped by SIGTERM saves a checkpoint first


@dataclass
class RayJob:
    plan: ClusterPlan
    trainer_command: list[str]
    run_dir: Path
    resume_flags: str = ""
    address: str | None = None


def process_env(env: dict[str, str], server: bool) -> dict[str, str]:
    """The environment of a process NodeRunner starts: this node's with `env` added; a server's starts
    from this node's without its key variables (clients/launcher.child_env), so that only the job's key
    reaches it (an inherited admin key, say, would make the run's weight updates fail with 403)."""
    if server:
        from arealcli.runtime.clients.launcher import child_env

        return {**child_env(), **env}
    return {**os.environ, **env}


class NodeRunner:
    """Runs processes on one node (a Ray actor in the job's placement group)."""

    def __init__(self, node: int, run_dir: str):
        self.node, self.run_dir = node, Path(run_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    def ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from arealcli.runtime.clients.launcher import free_port

        return free_port(self.ip())

    def start(self, name: str, cmd: list[str], env: dict[str, str], server: bool = False) -> int:
        """Start `cmd` with `env` added (process_env); its output is appended to RUN/logs/NAME.log (a
        resumed run's follows the first's). Returns where its output starts in that file."""
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            start = out.tell()
            self.procs[name] = subprocess.Popen(
                cmd,
                env=process_env(env, server),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self.logs[name] = log
        return start

    def wait_healthy(self, address: str, name: str, timeout_s: float, key: str | None = None) -> str | None:
        """None once the server at `address` answers /health with the proof of `key`; else why not."""
        from arealcli.runtime.launchers.health import wait_healthy

        return wait_healthy([address], timeout_s, lambda: self.procs[name].poll() is None, key)

    def read(self, name: str, offset: int) -> tuple[str, int, int | None]:
        """(new output since `offset`, the new offset, the exit code once it ended)."""
        code = self.procs[name].poll()
        with open(self.logs[name], "rb") as f:
            f.seek(offset)
            data = f.read()
        return data.decode(errors="replace"), offset + len(data), code

    def signal(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)

    def stop(self, grace_s: float) -> dict[str, int | None]:
        """SIGTERM every process, SIGKILL what is left after `grace_s`; their exit codes."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.signal(signal.SIGKILL)
        return {name: p.wait() for name, p in self.procs.items()}


def _connect(address: str | None) -> None:
    try:
        import ray
    except ImportError:
        raise UserError("--launcher ray needs ray: pip install 'arealcli[ray]'") from None
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise UserError("--launcher ray: give the cluster with --address HOST:PORT or RAY_ADDRESS")
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False, configure_logging=False)
    except Exception as e:  # noqa: BLE001  (ray raises ConnectionError and others)
        raise UserError(f"--launcher ray: cannot connect to the Ray cluster at {address}: {e}") from None


def _placement(plan: ClusterPlan):
    import ray
    from ray.util.placement_group import placement_group

    bundle: dict[str, float] = {"CPU": float(plan.cpus_per_node or 1)}
    if plan.gpus_per_node:
        bundle["GPU"] = float(plan.gpus_per_node)
    pg = placement_group([dict(bundle) for _ in range(plan.nodes)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        ray.util.remove_placement_group(pg)
        raise UserError(
            f"--launcher ray: the job needs {plan.nodes} node(s) with {bundle} each; the cluster has "
            f"{len(alive)} alive node(s) and could not place them within {PLACEMENT_TIMEOUT_S:g} s"
        )
    return pg, bundle


def run_on_ray(job: RayJob, echo: Callable[[str], None], say: Callable[[str], None]) -> int:
    """Run the whole job; the first trainer node's exit code (130 after Ctrl-C, 143 after SIGTERM)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connect(job.address)
    stopped_by = signal.SIGINT

    def on_term(sig: int, _frame: object) -> None:  # SIGTERM stops the job as Ctrl-C does (Ray's own
        nonlocal stopped_by  # handler, installed by ray.init, would only dump a stack)
        stopped_by = signal.SIGTERM
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    plan = job.plan
    pg, bundle = _placement(plan)
    runner_cls: Any = ray.remote(NodeRunner)
    runners: list[Any] = [
        runner_cls.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        ).remote(i, str(job.run_dir.resolve()))
        for i in range(plan.nodes)
    ]
    try:
        ips = ray.get([r.ip.remote() for r in runners])
        say(
            f"Ray: {plan.nodes} node(s) placed: " + ", ".join(f"node {i} at {ip}" for i, ip in enumerate(ips))
        )
        key = fresh_key()
        servers = _start_servers(job, runners, ips, key, say)
        return _run_trainer(job, runners, ips, key, servers, echo, say)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the teardown short
        why = "interrupted" if stopped_by == signal.SIGINT else "terminated"
        say(f"{why}: stopping the trainer and the servers")
        first = plan.trainer_nodes[0]
        with contextlib.suppress(Exception):
            ray.get(runners[first].stop.remote(STOP_GRACE_S), timeout=STOP_GRACE_S + 10)
            text = ray.get(runners[first].read.remote("trainer-0", 0))[0]  # its last words: the stop message
            echo("\n".join(text.rstrip().splitlines()[-3:]) + "\n")
        return 128 + stopped_by
    finally:
        with contextlib.suppress(Exception):
            ray.get([r.stop.remote(STOP_GRACE_S) for r in runners], timeout=STOP_GRACE_S + 10)
        for r in runners:
            with contextlib.suppress(Exception):
                ray.kill(r)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(pg)
        ray.shutdown()


def _start_servers(job: RayJob, runners, ips: list[str], key: str, say) -> dict[str, list[str]]:
    import ray

    started = []
    for task in job.plan.servers:
        runner = runners[task.node]
        port = task.port or ray.get(runner.free_port.remote())
        address = f"{ips[task.node]}:{port}"
        env = {**task.env, task.key_env: key}
        ray.get(runner.start.remote(task.name, task.command_at(ips[task.node], port), env, True))
        started.append((task, address))
    by_model: dict[str, list[str]] = {}
    for task, address in started:
        why = ray.get(runners[task.node].wait_healthy.remote(address, task.name, 600.0, key))
        if why is not None:
            raise UserError(f"{task.model} server {task.index}: {why} (log: {job.run_dir}/logs/)")
        by_model.setdefault(task.model, []).append(address)
    if started:
        say("servers up: " + ", ".join(f"{m} at {', '.join(a)}" for m, a in by_model.items()))
    return by_model


def _run_trainer(job: RayJob, runners, ips, key, servers, echo, say) -> int:
    import ray

    plan = job.plan
    first = plan.trainer_nodes[0]
    master_port = ray.get(runners[first].free_port.remote())
    env = {PREPARED_ENV: "1", RESUME_FLAGS_ENV: job.resume_flags, CLUSTER_KEY_ENV: key}
    if servers:
        env[SERVERS_ENV] = json.dumps(servers)
    offsets: dict[int, int] = {}  # by node-rank: where this run's output starts in its log
    for rank, node in enumerate(plan.trainer_nodes):
        cmd = [*job.trainer_command, f"--node-rank={rank}", f"--master-addr={ips[first]}"]
        start = runners[node].start.remote(f"trainer-{rank}", [*cmd, f"--master-port={master_port}"], env)
        offsets[rank] = ray.get(start)
    codes: dict[int, int | None] = dict.fromkeys(offsets)
    while True:
        for rank, node in enumerate(plan.trainer_nodes):
            if codes[rank] is None:
                read = runners[node].read.remote(f"trainer-{rank}", offsets[rank])
                text, offsets[rank], codes[rank] = ray.get(read)
                if rank == 0 and text:
                    echo(text)
        if codes[0] is not None or any(c not in (None, 0) for c in codes.values()):
            break
        time.sleep(0.5)
    failed = [(rank, c) for rank, c in codes.items() if c not in (None, 0)]
    if codes[0] is None and failed:
        rank, code = failed[0]
        say(
            f"the trainer on node {plan.trainer_nodes[rank]} failed (exit code {code}); its log: "
            f"{job.run_dir}/logs/trainer-{rank}.log"
        )
        return code or 1
    return codes[0] or 0

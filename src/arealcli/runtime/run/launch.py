"""`areal train --nproc-per-node N [--nnodes M ...]`: start the torch.distributed workers ourselves.

The parent process (one per node) runs torch's elastic agent (`elastic_launch`, what `torchrun` uses)
with a static rendezvous at `master_addr:master_port`; it spawns N workers, each of which initializes
the process group (gloo on CPU, NCCL for GPUs plus gloo for CPU tensors) and runs the trainer.

Failure handling: when a worker fails, the agent stops every other worker (SIGTERM, then SIGKILL) and
we report the failed worker's traceback once, picking the root cause over the "connection closed"
errors its peers may raise in the meantime. The agent itself restarts nothing: `areal train` launches
the whole group again from the last checkpoint (`trainer.recover`, runtime/run/failures.py), which
also knows when not to (no checkpoint yet, the same failure twice). Ctrl-C stops every worker.
Nothing here imports torch at module level: `areal train --help` stays fast.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

# The last line(s) of a worker traceback that ended in a UserError (see arealcli.errors).
_USER_ERROR = re.compile(r"^arealcli\.errors\.\w+: (.*)\Z", re.MULTILINE | re.DOTALL)
# Messages of errors a healthy worker raises because a peer died (not the root cause).
_PEER_ERRORS = re.compile(
    r"DistNetworkError|DistBackendError|Connection (closed|reset) by peer|Broken pipe|NCCL|gloo",
    re.IGNORECASE,
)


# Set by the cluster launchers (runtime/launchers) for the `areal train` they start on each node:
PREPARED_ENV = "AREALCLI_RUN_PREPARED"  # "1": the launcher made the run directory; leave it as it is
RESUME_FLAGS_ENV = "AREALCLI_RESUME_FLAGS"  # the launcher's flags, for the command that continues a run


@dataclass
class WorkerJob:
    """What every worker needs to rebuild the run (the recipe is validated again in the worker, which
    also imports its plugins)."""

    recipe_path: str
    overrides: list[str]
    run_dir: str
    resume: bool


@dataclass
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    run_id: str = "areal"  # the rendezvous key prefix: the same on every node

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class LaunchResult:
    exit_code: int
    global_step: int | None = None  # rank 0's last step, on success
    error: str | None = None  # the failed worker's traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(job: WorkerJob, spec: LaunchSpec) -> LaunchResult:
    """Run the workers of this node to completion (blocking)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in list(logging.root.manager.loggerDict):  # torch sets a level on each module's logger
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # we report failures ourselves, once
    port = spec.master_port or (free_port() if spec.nnodes == 1 else 29500)
    # Like torchrun: do not let N workers each start one thread per core.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // spec.nproc_per_node)))
    config = LaunchConfig(
        min_nodes=spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc_per_node,
        run_id=spec.run_id,
        rdzv_backend="static",
        rdzv_endpoint=f"{spec.master_addr}:{port}",
        rdzv_configs={"rank": spec.node_rank, "timeout": 900},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(config, run_worker)(job)
    except ChildFailedError as e:
        message = root_cause(e)
        user = _USER_ERROR.search(message)  # bad input: its message alone, exit 2 as in one process
        return LaunchResult(2, error=user.group(1).strip()) if user else LaunchResult(1, error=message)
    except SignalException as e:
        return LaunchResult(128 + int(e.sigval))
    except KeyboardInterrupt:
        return LaunchResult(130)
    return LaunchResult(0, global_step=min(results.values()) if results else None)


def root_cause(e) -> str:
    """The failed worker's traceback: the earliest failure, preferring a real error over a peer's
    'connection closed' that followed it."""
    failures = sorted(
        e.failures.items(),
        key=lambda kv: (kv[1].timestamp, bool(_PEER_ERRORS.search(_message(kv[1]))), kv[0]),
    )
    rank, failure = failures[0]
    for r, f in failures:
        if not _PEER_ERRORS.search(_message(f)):
            rank, failure = r, f
            break
    data = failure.error_file_data or {}
    info = data.get("message", {}) if isinstance(data.get("message"), dict) else {}
    trace = (info.get("extraInfo") or {}).get("py_callstack") or _message(failure)
    trace = _drop_wrapper_frames(trace)
    return f"worker rank {rank} failed (exit code {failure.exitcode}); all workers were stopped.\n{trace}"


def _message(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    return str(msg or f"exit code {failure.exitcode} (signal or crash; no Python error)")


def _drop_wrapper_frames(trace: str) -> str:
    """Remove torch elastic's `record` wrapper frame (its File line and the lines below it)."""
    out: list[str] = []
    skipping = False
    for line in trace.rstrip().splitlines():
        if line.startswith("  File "):
            skipping = "elastic/multiprocessing/errors" in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out)


# ----------------------------------------------------------------------------------------- worker


def run_worker(job: WorkerJob) -> int:
    """One rank: join the process group, train, leave. Returns the last global step."""
    import signal

    import torch
    import torch.distributed as dist

    # Ctrl-C (or the agent passing it on) ends a worker at once, even inside a blocking collective,
    # where a Python KeyboardInterrupt would wait for peers forever. Checkpoints are atomic: safe.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # fixed: the thread policy stays off in workers
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    try:
        return _train(job, dist.get_rank())
    finally:
        dist.destroy_process_group()


def _train(job: WorkerJob, rank: int) -> int:
    from rich.console import Console
    from rich.text import Text

    from arealcli.runtime.run.driver import Display, run
    from arealcli.schema.validate import load_valid_recipe

    recipe_path = Path(job.recipe_path)
    recipe, _ = load_valid_recipe(recipe_path, job.overrides)  # checked by the launching command already
    display = None
    if rank == 0:  # rank 0 reports
        console = Console(emoji=False, highlight=False)
        display = Display(console, lambda note: console.print(Text(f"note: {note}")))
    return run(recipe, recipe_path, Path(job.run_dir), job.resume, display).global_step

"""`areal train RECIPE [overrides] [--resume] [--overwrite] [--output-dir DIR] [--nproc-per-node N ...]`:
parses the flags and hands the run to its supervisor (runtime/run/supervise.py) or a cluster launcher."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from arealcli.commands.common import (
    fail,
    flag,
    load_recipe,
    overrides_argument,
    recipe_argument,
    voice,
)
from arealcli.errors import UserError
from arealcli.runtime.agents.reachable import workflow_problems
from arealcli.runtime.data.images import image_problems
from arealcli.runtime.data.verifiers_configs import verifiers_problems
from arealcli.runtime.run import supervise
from arealcli.runtime.run.launch import LaunchSpec
from arealcli.runtime.run.session import apply_permissions, restores_umask, run_dir_for
from arealcli.runtime.run.supervise import ClusterFlags, Invocation
from arealcli.schema.paths import path_problems

Resume = Annotated[bool, flag("--resume", "Continue from the run directory's last checkpoint.")]
Overwrite = Annotated[
    bool, flag("--overwrite", "Delete the existing run directory (one areal train made) first.")
]
OutputDir = Annotated[
    Path | None,
    typer.Option("--output-dir", "-o", metavar="DIR", help="Run directory (default runs/<experiment>)."),
]
DryRun = Annotated[
    bool,
    flag("--dry-run", "Check the recipe, overrides and run directory, say what would run, and stop."),
]
NprocPerNode = Annotated[
    int,
    typer.Option(
        "--nproc-per-node", min=1, metavar="N", help="Worker processes on this node (data-parallel ranks)."
    ),
]
Nnodes = Annotated[
    int | None,
    typer.Option(
        "--nnodes",
        min=1,
        metavar="N",
        help="Nodes: local: run the same command on each; slurm/ray: the job's (default cluster.nodes).",
    ),
]
NodeRank = Annotated[
    int, typer.Option("--node-rank", min=0, metavar="N", help="This node's rank, 0..nnodes-1.")
]
MasterAddr = Annotated[str, typer.Option("--master-addr", metavar="HOST", help="Address of node 0.")]
MasterPort = Annotated[
    int | None,
    typer.Option(
        "--master-port",
        metavar="PORT",
        help="Rendezvous port on node 0 (default: a free port; 29500 multi-node).",
    ),
]
Launcher = Annotated[
    str,
    typer.Option(
        "--launcher",
        metavar="local|slurm|ray",
        help="local: processes on this machine; slurm: submit an sbatch job; ray: run on a Ray cluster "
        "(recipe `cluster:` places servers and trainer by node).",
    ),
]
Address = Annotated[
    str | None,
    typer.Option("--address", metavar="HOST:PORT", help="--launcher ray: the cluster (default RAY_ADDRESS)."),
]
Wait = Annotated[
    bool,
    flag("--wait", "--launcher slurm: follow the job's trainer log until it ends, and exit with its code."),
]


@restores_umask
def train(
    recipe: Path = recipe_argument(),
    overrides: list[str] = overrides_argument(),
    resume: Resume = False,
    overwrite: Overwrite = False,
    output_dir: OutputDir = None,
    dry_run: DryRun = False,
    nproc_per_node: NprocPerNode = 1,
    nnodes: Nnodes = None,
    node_rank: NodeRank = 0,
    master_addr: MasterAddr = "127.0.0.1",
    master_port: MasterPort = None,
    launcher: Launcher = "local",
    address: Address = None,
    wait: Wait = False,
) -> None:
    """Train: build the models and run the recipe's dataflow every step.

    Examples:
    areal train recipes/quickstart.yaml
    areal train recipes/sft-quickstart.yaml trainer.max_steps=40 -o runs/sft-short
    areal train recipes/quickstart.yaml --resume trainer.max_steps=300
    areal train recipes/quickstart-server.yaml --launcher slurm --nnodes 2 --dry-run
    """
    if launcher not in ("local", "slurm", "ray"):
        raise fail([f"--launcher {launcher!r}: choose local, slurm or ray"])
    resolved, src = load_recipe(recipe, overrides or [])
    problems = path_problems(resolved, recipe.resolve().parent)
    errors = [f"{src.where(p.where)}: {'.'.join(map(str, p.where))}: {p.message}" for p in problems]
    errors += image_problems(resolved, recipe.resolve().parent)
    errors += workflow_problems(resolved)
    errors += verifiers_problems(resolved)
    if errors:
        raise fail(errors)
    run_dir = run_dir_for(resolved, output_dir)
    apply_permissions(resolved.trainer.permissions)  # before anything is written (workers inherit it)
    spec = LaunchSpec(nproc_per_node, nnodes or 1, node_rank, master_addr, master_port)
    if launcher == "local" and node_rank >= spec.nnodes:
        raise fail([f"--node-rank {node_rank} must be below --nnodes {spec.nnodes}"])
    cluster = ClusterFlags(launcher, nnodes, nproc_per_node, address, wait)
    flags = supervise.local_flags(spec) if launcher == "local" else cluster.argv()
    default_dir = run_dir_for(resolved, None)
    job = Invocation(recipe, overrides or [], run_dir, default_dir, flags, resume, overwrite, dry_run)
    try:
        if launcher == "local":
            supervise.start(resolved, job, spec, voice())
        else:
            from arealcli.runtime.launchers.start import start

            start(resolved, job, cluster, voice())
    except UserError as e:
        raise fail(e.lines) from None
    except supervise.RunEnded as e:
        raise typer.Exit(e.code) from None

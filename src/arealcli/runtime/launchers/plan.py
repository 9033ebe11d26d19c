"""What a multi-node job runs on each node: a recipe's `cluster` section and the command line, resolved.

Nodes are numbered 0..nodes-1 in the order the scheduler lists them (Slurm's node list, Ray's alive
nodes with the head first). `cluster.allocation` puts the servers of a generation model on some nodes
(server i of the model on its i-th node, round robin) and the trainer ranks on others; by default the
trainer takes every node no server was given (every node when servers were given all). Each trainer
node runs `areal train --nnodes K --node-rank r` (torch's elastic agent, `--nproc-per-node` ranks),
rendezvous on the first trainer node; each server is one process, started before the trainer, which
finds the addresses in its environment (runtime/run/session.given_servers).

Server commands carry two placeholders, HOST and PORT, filled in where the node is known.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from arealcli.errors import UserError
from arealcli.runtime.clients import launcher
from arealcli.runtime.wire.auth import API_KEY_ENV, VLLM_API_KEY_ENV, WEIGHTS_DIR_ENV
from arealcli.schema.components.backends import SGLangBackendArgs, VLLMBackendArgs
from arealcli.schema.recipe import TRAINER, ClusterSpec, Recipe

HOST, PORT = "@HOST@", "@PORT@"  # placeholders in a server's command line


@dataclass
class ServerTask:
    """One generation server of a model, on one node."""

    model: str
    index: int  # among the model's servers
    node: int
    command: list[str]  # with HOST and PORT placeholders
    env: dict[str, str]  # what it needs beside its key (no secrets here: this goes into scripts)
    key_env: str  # the variable it reads its API key from
    port: int | None  # fixed by the recipe (base_port), else chosen by the launcher
    gpus: int = 0
    kind: str = "embedded"  # embedded | sglang | vllm

    @property
    def name(self) -> str:
        return f"{self.model}-{self.index}"

    def command_at(self, host: str, port: int) -> list[str]:
        return [host if w == HOST else str(port) if w == PORT else w for w in self.command]


@dataclass
class ClusterPlan:
    nodes: int
    nproc_per_node: int
    trainer_nodes: list[int]
    servers: list[ServerTask] = field(default_factory=list)
    cpus_per_node: int | None = None
    gpus_per_node: int = 0

    @property
    def world(self) -> int:
        return self.nproc_per_node * len(self.trainer_nodes)

    def servers_on(self, node: int) -> list[ServerTask]:
        return [s for s in self.servers if s.node == node]

    def describe(self) -> list[str]:
        """One line per node: what runs there."""
        lines = []
        for n in range(self.nodes):
            what = [f"{s.model} server {s.index}" for s in self.servers_on(n)]
            if n in self.trainer_nodes:
                rank = self.trainer_nodes.index(n)
                what.append(f"trainer node-rank {rank} ({self.nproc_per_node} process(es))")
            lines.append(f"node {n}: " + (", ".join(what) or "idle"))
        return lines


def make_plan(recipe: Recipe, run_dir: Path, nnodes: int | None, nproc_per_node: int) -> ClusterPlan:
    """The plan for this recipe; UserError when the nodes given do not fit the allocation."""
    cluster = recipe.cluster or ClusterSpec()
    allocation = cluster.allocation
    named = {i for ids in allocation.values() for i in ids}
    nodes = nnodes or cluster.nodes or (max(named) + 1 if named else 1)
    if cluster.nodes is not None and nnodes is not None and nnodes != cluster.nodes:
        raise UserError(f"--nnodes {nnodes} differs from the recipe's cluster.nodes: {cluster.nodes}")
    if named and max(named) >= nodes:
        raise UserError(
            f"cluster.allocation names node {max(named)}, but the job has {nodes} node(s) (0..{nodes - 1}); "
            "give --nnodes or cluster.nodes"
        )
    trainer = allocation.get(TRAINER)
    if trainer is None:
        servers_only = {i for key, ids in allocation.items() if key != TRAINER for i in ids}
        trainer = [n for n in range(nodes) if n not in servers_only] or list(range(nodes))
    plan = ClusterPlan(nodes, nproc_per_node, list(trainer), [], cluster.cpus_per_node, cluster.gpus_per_node)
    for model, ids in allocation.items():
        if model != TRAINER:
            plan.servers += server_tasks(recipe, model, ids, run_dir)
    return plan


def server_tasks(recipe: Recipe, model: str, nodes: list[int], run_dir: Path) -> list[ServerTask]:
    """The servers of `model` (its backend's `num_servers`, at least one per node: areal check), round
    robin over `nodes`."""
    args = recipe.models[model].backend.args
    weights = str(initial_weights_dir(run_dir, model))
    tasks = []
    for i in range(args.num_servers):
        node, local = nodes[i % len(nodes)], i // len(nodes)
        here = sum(1 for j in range(args.num_servers) if nodes[j % len(nodes)] == node)  # servers on it
        mine = args.model_copy(update={"host": HOST, "num_servers": here, "cpus": None, "devices": None})
        port = args.base_port + local if args.base_port is not None else None
        if isinstance(args, VLLMBackendArgs):
            from arealcli.runtime.backends.base import source_lora
            from arealcli.runtime.backends.vllm import PYTHON_ENV, server_command, server_env

            python = args.python_executable or os.environ.get(PYTHON_ENV) or "python"
            lora = source_lora(recipe, model) if args.lora_updates == "adapters" else None
            rank = lora.rank if lora is not None else None
            cmd = server_command(mine, python, weights, 0, rank)
            env, key_env, kind, gpus = (
                server_env(mine, local, lora=rank is not None),
                VLLM_API_KEY_ENV,
                "vllm",
                args.tensor_parallel_size,
            )
        else:
            assert isinstance(args, SGLangBackendArgs)
            cmd = launcher.server_command(mine, weights, 0, local)
            env = {WEIGHTS_DIR_ENV: str((run_dir / "weights").resolve())}  # embedded, and our SGLang guard
            key_env, kind = API_KEY_ENV, str(args.launch)
            gpus = args.tp_size if args.launch == "sglang" or args.device == "cuda" else 0
        cmd[cmd.index("--port") + 1] = PORT
        env["PYTHONUNBUFFERED"] = "1"
        tasks.append(ServerTask(model, i, node, cmd, env, key_env, port, gpus, kind))
    return tasks


def initial_weights_dir(run_dir: Path, model: str) -> Path:
    """Where a launcher exports a model's initial weights for its servers (as the trainer would)."""
    return (run_dir / "weights" / model / "init").resolve()


def export_initial_weights(recipe: Recipe, recipe_path: Path, run_dir: Path, models: list[str]) -> None:
    """Write the initial weights of `models` (HF format, with the tokenizer) for their servers to start
    from: the modules the trainer would build (seeded), so a server holds the same weights here as one
    the trainer launches itself."""
    from transformers.utils import logging as hf_logging

    from arealcli.runtime.models.weights import export_hf
    from arealcli.runtime.run.trainer import initial_module, recipe_tokenizer

    hf_logging.disable_progress_bar()
    recipe_dir = recipe_path.resolve().parent
    tokenizer = recipe_tokenizer(recipe, recipe_dir)
    for model in models:
        module = initial_module(recipe, recipe_dir, tokenizer, model)
        export_hf(module, tokenizer, initial_weights_dir(run_dir, model))


def areal_command() -> list[str]:
    """How a node runs `areal` (this Python, this package: the same installation on a shared file system)."""
    return [sys.executable, "-m", "arealcli.main"]


def trainer_command(
    recipe_path: Path, overrides: list[str], run_dir: Path, resume: bool, plan: ClusterPlan
) -> list[str]:
    """The `areal train` of one trainer node, without --node-rank / --master-addr / --master-port (the
    launcher adds those)."""
    cmd = [*areal_command(), "train", str(recipe_path.resolve()), *overrides, "-o", str(run_dir.resolve())]
    if resume:
        cmd.append("--resume")
    return cmd + [f"--nproc-per-node={plan.nproc_per_node}", f"--nnodes={len(plan.trainer_nodes)}"]

"""`cluster.allocation`: every key is `trainer` or a generation model whose servers a launcher can start."""

from __future__ import annotations

from typing import Any

from arealcli.schema.checks.context import Graph
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import TRAINER
from arealcli.schema.source import mapping_at


def launches_servers(args: Any) -> bool:
    """Backend args of a server fleet (sglang, vllm) that starts its servers itself (`launch`)."""
    return hasattr(args, "addresses") and bool(getattr(args, "launch", None))


def check_cluster(g: Graph) -> list[Problem]:
    cluster = mapping_at(g.data, "cluster")
    allocation = mapping_at(cluster, "allocation")
    problems = []
    for key, ids in allocation.items():
        where = ("cluster", "allocation", key)
        if key == TRAINER:
            continue
        if key not in g.names:
            known = ", ".join([TRAINER, *g.names])
            problems.append(Problem(where, f"no model named {key!r} (the keys are: {known})", key))
            continue
        args: Any = g.typed.get(("models", key, "backend"))
        if args is None:
            continue  # its backend's own problems are reported there
        if not launches_servers(args):
            problems.append(
                Problem(
                    where,
                    f"model {key!r} has no servers to place: the allocation places generation servers "
                    "that the run starts (backend sglang or vllm with `launch`); servers given by "
                    "`addresses` already run somewhere",
                    key,
                )
            )
        elif args.cpus is not None or args.devices is not None:
            problems.append(
                Problem(
                    ("models", key, "backend", "args", "cpus" if args.cpus is not None else "devices"),
                    f"model {key!r}'s servers are placed by node (cluster.allocation.{key}): they get "
                    "their nodes' CPUs and GPUs; drop `cpus` / `devices`",
                )
            )
        elif isinstance(ids, list) and args.num_servers < len(ids):
            problems.append(
                Problem(
                    ("models", key, "backend", "args", "num_servers"),
                    f"{args.num_servers} server(s) for the {len(ids)} nodes of cluster.allocation.{key}: "
                    f"set num_servers to at least {len(ids)} (one server per node or more)",
                )
            )
    return problems

"""`areal train --launcher slurm|ray`: the plan and the sbatch script (here), and real runs on a
one-machine Slurm and a two-node local Ray cluster (slow, in test_launchers_cluster.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from arealcli.main import app

REPO = Path(__file__).resolve().parents[1]
SERVER_RECIPE = REPO / "recipes" / "quickstart-server.yaml"


def train(*args: str):
    return CliRunner().invoke(app, ["train", *map(str, args)], env={"COLUMNS": "200"})


def dry_run(tmp_path: Path, *args: str) -> str:
    result = train(SERVER_RECIPE, *args, "--dry-run", "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "run").exists()  # nothing written
    return result.output


def script_of(output: str) -> str:
    return output[output.index("#!/bin/bash") :]


def test_slurm_dry_run_prints_nodes_steps_and_rendezvous(tmp_path):
    cluster = (
        "cluster={allocation: {actor_gen: [0], trainer: [1, 2]}, slurm: {partition: gpu, time: '2:00:00'}}"
    )
    out = dry_run(tmp_path, cluster, "--launcher", "slurm", "--nnodes", "3", "--nproc-per-node", "2")
    script = script_of(out)
    assert "#SBATCH --nodes=3" in script and "#SBATCH --partition=gpu" in script
    assert "#SBATCH --time=2:00:00" in script and "#SBATCH --signal=B:USR1@300" in script
    # the plan, node by node
    assert "#   node 0: actor_gen server 0" in script
    assert "#   node 1: trainer node-rank 0 (2 process(es))" in script
    assert "#   node 2: trainer node-rank 1 (2 process(es))" in script
    # the server's own step on node 0, then the wait for its /health
    server = next(line for line in script.splitlines() if line.startswith("srun") and "actor_gen-0" in line)
    assert '--nodelist="${NODES[0]}"' in server and "--nodes=1" in server
    assert "arealcli.runtime.launchers.health" in script
    # the trainer: one step over nodes 1 and 2, two ranks each, rendezvous on node 1
    trainer = next(line for line in script.splitlines() if line.startswith("srun") and "trainer" in line)
    assert '--nodelist="${NODES[1]},${NODES[2]}"' in trainer and "--nodes=2" in trainer
    assert "--open-mode=append" in server and "--open-mode=append" in trainer  # a resume keeps the logs
    assert 'MASTER_ADDR=$(node_addr "${NODES[1]}")' in script
    assert '--nproc-per-node=2 --nnodes=2 --node-rank="$SLURM_PROCID"' in script
    assert '--master-addr="$0" --master-port="$1"' in script
    # valid bash, and no key in it (made in the job)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "AREALCLI_CLUSTER_KEY=$(" in script and "token_urlsafe" in script


def test_slurm_dry_run_without_allocation_runs_the_trainer_on_every_node(tmp_path):
    script = script_of(dry_run(tmp_path, "--launcher", "slurm", "--nnodes", "2"))
    assert "srun" in script and "arealcli.runtime.launchers.health" not in script  # no server steps
    assert '--nodelist="${NODES[0]},${NODES[1]}"' in script
    assert "--nnodes=2" in script


def test_ray_dry_run_says_what_runs_where(tmp_path):
    out = dry_run(tmp_path, "cluster={allocation: {actor_gen: [0]}}", "--launcher", "ray", "--nnodes", "2")
    assert "node 0: actor_gen server 0" in out and "node 1: trainer node-rank 0" in out


@pytest.mark.parametrize(
    "cluster, message",
    [
        ("{allocation: {actor: [0]}}", "model 'actor' has no servers to place"),
        ("{allocation: {nobody: [0]}}", "no model named 'nobody'"),
        ("{nodes: 2, allocation: {actor_gen: [2]}}", "node 2 does not exist in a 2-node job"),
        ("{allocation: {actor_gen: [0, 0]}}", "named twice"),
        ("{allocation: {actor_gen: [0, 1]}}", "1 server(s) for the 2 nodes of cluster.allocation.actor_gen"),
    ],
)
def test_bad_allocations_are_recipe_errors(tmp_path, cluster, message):
    result = CliRunner().invoke(app, ["check", str(SERVER_RECIPE), f"cluster={cluster}"])
    assert result.exit_code == 2 and message in result.output, result.output


def test_nodes_that_do_not_fit(tmp_path):
    result = train(SERVER_RECIPE, "cluster={nodes: 3}", "--launcher", "slurm", "--nnodes", "2", "--dry-run")
    assert result.exit_code == 2 and "--nnodes 2 differs from the recipe's cluster.nodes: 3" in result.output
    result = train(SERVER_RECIPE, "--launcher", "pbs", "--dry-run")
    assert result.exit_code == 2 and "choose local, slurm or ray" in result.output


def test_the_trainer_connects_to_servers_a_launcher_started(monkeypatch):
    from arealcli.runtime.run.session import CLUSTER_KEY_ENV, SERVERS_ENV, given_servers
    from arealcli.schema.source import load_recipe_source
    from arealcli.schema.validate import validate

    recipe = validate(load_recipe_source(SERVER_RECIPE))
    spec = recipe.models["actor_gen"].backend
    assert given_servers("actor_gen", spec) is spec  # nothing started elsewhere: launched here
    monkeypatch.setenv(SERVERS_ENV, json.dumps({"actor_gen": ["10.1.2.3:20001"]}))
    args = given_servers("actor_gen", spec).args
    assert args.launch is None and args.addresses == ["10.1.2.3:20001"]
    assert args.api_key_env == CLUSTER_KEY_ENV
    assert recipe.models["actor_gen"].backend.args.launch == "embedded"  # the recipe is unchanged


def test_initial_weights_a_launcher_exports_are_the_trainers(ws, tmp_path):
    """A launcher exports the servers' step-0 weights (seeded, built anew in the launcher's process): they
    equal the weights a trainer built by its own setup holds before its first step."""
    import torch
    from safetensors.torch import load_file

    from arealcli.runtime.launchers.plan import export_initial_weights, initial_weights_dir
    from arealcli.runtime.run.trainer import Trainer
    from arealcli.schema.source import load_recipe_source
    from arealcli.schema.validate import validate

    path = ws.recipe(trainer={"max_steps": 1, "tensorboard": False})
    recipe = validate(load_recipe_source(path))
    export_initial_weights(recipe, path, tmp_path / "launch", ["default"])
    exported = load_file(str(initial_weights_dir(tmp_path / "launch", "default") / "model.safetensors"))
    trainer = Trainer(recipe, path.parent, tmp_path / "run")
    trainer.setup()
    try:
        state = trainer.models["default"].module.module.state_dict()
    finally:
        trainer.close()
    assert exported and all(torch.equal(exported[k], state[k]) for k in exported)


def test_a_cluster_dry_run_refuses_the_run_directory_a_run_would_refuse(tmp_path):
    """`--launcher slurm --dry-run` checks the run directory as the run itself would (a folder of the
    user's own is never taken), and writes nothing."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    result = train(SERVER_RECIPE, "--launcher", "slurm", "--nnodes", "2", "--dry-run", "-o", mine)
    assert result.exit_code == 2, result.output
    assert "#!/bin/bash" not in result.output
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


SHELL_KEYS = {"AREAL_ADMIN_KEY": "shell-admin", "AREAL_API_KEY": "shell-api", "VLLM_API_KEY": "shell-vllm"}


def test_a_slurm_server_step_gets_the_jobs_key_and_none_of_the_shells(tmp_path):
    """sbatch runs the script with the submitter's environment: the server step's own shell drops the
    inherited key variables (a shell AREAL_ADMIN_KEY would make the run's weight updates fail with 403)
    and exports the job's key under the server's variable. The step's body is run here by bash, with a
    command that prints the environment it was given."""
    import shlex
    import sys

    from arealcli.runtime.launchers.plan import HOST, PORT, ClusterPlan, ServerTask
    from arealcli.runtime.launchers.slurm import _server_step
    from arealcli.runtime.wire.auth import CLUSTER_KEY_ENV

    script = script_of(dry_run(tmp_path, "cluster={allocation: {actor_gen: [0]}}", "--launcher", "slurm"))
    assert 'unset "${!AREAL_@}" VLLM_API_KEY;' in script

    printer = [
        sys.executable,
        "-c",
        "import json, os, sys; print(json.dumps([dict(os.environ), sys.argv[1:]]))",
    ]
    task = ServerTask(
        "m", 0, 0, [*printer, HOST, PORT], {"AREAL_WEIGHTS_DIR": "/run/weights"}, "AREAL_API_KEY", 20001
    )
    line = next(x for x in _server_step(task, ClusterPlan(1, 1, [0], [task])) if "bash -c" in x)
    bash, flag, body, *_ = shlex.split(line)
    env = {
        "PATH": os.environ["PATH"],
        **SHELL_KEYS,
        "AREAL_OTHER": "x",
        CLUSTER_KEY_ENV: "job-key",
        "KEEP": "1",
    }
    out = subprocess.run([bash, flag, body, "10.0.0.1", "20001"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    got, argv = json.loads(out.stdout)
    assert argv == ["10.0.0.1", "20001"]
    assert (
        got["AREAL_API_KEY"] == "job-key"
        and got["AREAL_WEIGHTS_DIR"] == "/run/weights"
        and got["KEEP"] == "1"
    )
    assert not {"AREAL_ADMIN_KEY", "VLLM_API_KEY", "AREAL_OTHER", CLUSTER_KEY_ENV} & set(got)


def test_a_ray_server_gets_the_jobs_key_and_none_of_the_nodes(monkeypatch):
    """NodeRunner's environment for a server: the node's without its key variables, plus the job's; the
    trainer's keeps the node's environment (its own settings) with the job's variables added."""
    from arealcli.runtime.launchers.ray import process_env

    for name, value in {**SHELL_KEYS, "AREALCLI_CLUSTER_KEY": "old"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("KEEP", "1")
    server = process_env({"VLLM_API_KEY": "job-key", "AREAL_WEIGHTS_DIR": "/w"}, server=True)
    assert (
        server["VLLM_API_KEY"] == "job-key" and server["AREAL_WEIGHTS_DIR"] == "/w" and server["KEEP"] == "1"
    )
    assert not {"AREAL_ADMIN_KEY", "AREAL_API_KEY", "AREALCLI_CLUSTER_KEY"} & set(server)
    trainer = process_env({"AREALCLI_CLUSTER_KEY": "job-key"}, server=False)
    assert trainer["AREALCLI_CLUSTER_KEY"] == "job-key" and trainer["KEEP"] == "1"

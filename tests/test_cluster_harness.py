"""The local clusters the launcher tests run on (tests/cluster_fixtures.py): two Slurm nodes, two Ray nodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_fixtures import ray_cluster, slurm_cluster  # noqa: F401

pytestmark = pytest.mark.slow


def run(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_srun_runs_one_task_on_each_node(slurm_cluster):  # noqa: F811
    proc = run("srun", "-N2", "-n2", "bash", "-c", "echo $SLURMD_NODENAME")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["n1", "n2"]


def test_sbatch_wait_of_a_two_node_job(slurm_cluster, tmp_path):  # noqa: F811
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -N2 -n2\n"
        "srun -N1 -n1 -w n1 bash -c 'echo step $SLURMD_NODENAME' &\n"
        "srun -N1 -n1 -w n2 bash -c 'echo step $SLURMD_NODENAME'\n"
        "wait\n"
    )
    proc = run("sbatch", "--wait", "--parsable", "-o", str(tmp_path / "job.out"), str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    assert sorted((tmp_path / "job.out").read_text().split()) == ["n1", "n2", "step", "step"]
    info = run("scontrol", "show", "job", "-o", job_id).stdout
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, info


RAY_PROBE = """
import json, os, ray
ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
print(json.dumps([n["Resources"] for n in ray.nodes() if n["Alive"]]))
"""


def test_ray_has_two_nodes_with_their_resources(ray_cluster):  # noqa: F811
    proc = run(sys.executable, "-c", RAY_PROBE, timeout=120)
    assert proc.returncode == 0, proc.stderr
    nodes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(nodes) == 2
    assert sorted(k for n in nodes for k in n if k.startswith("node_")) == ["node_a", "node_b"]
    assert all(n["CPU"] == 1 for n in nodes)

"""Session fixtures: a two-node Slurm cluster and a two-node Ray cluster on this machine, for the launcher tests.

Import them into a test module (tests/ is on sys.path, as for ``_dist_helpers``)::

    from cluster_fixtures import ray_cluster, slurm_cluster  # noqa: F401

``slurm_cluster`` runs ``scripts/local_slurm.sh`` (slurmctld + slurmd n1, n2 on 127.0.0.1, one CPU each, partition
``debug``; needs root and ``apt-get install slurm-wlm munge``) and yields ``{"SLURM_CONF": ...}``.
``ray_cluster`` runs ``scripts/local_ray.sh`` (a head with resource ``node_a`` and a second node with ``node_b``,
one CPU each, Ray of this interpreter) and yields ``{"RAY_ADDRESS": "127.0.0.2:PORT"}``.
Each is started once per session, in a temporary directory, and stopped at its end; for that long its variables
are also set in ``os.environ`` (the launcher reads them in the subprocesses it starts), and restored after.
When a cluster cannot start, the tests that use it skip, with the script's one-line reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _reason(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stderr or "").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _cluster(script: str, work: Path, timeout: float) -> Iterator[dict[str, str]]:
    """Start the cluster of `script` in `work`, export its variables for the session, stop it after."""
    env = {**os.environ, "PYTHON": sys.executable}
    path = SCRIPTS / script
    try:
        proc = subprocess.run(
            ["bash", str(path), "start", str(work)], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        subprocess.run(["bash", str(path), "stop", str(work)], env=env, capture_output=True, timeout=120)
        pytest.skip(f"{script}: no cluster after {timeout:.0f}s")
    if proc.returncode != 0:
        subprocess.run(["bash", str(path), "stop", str(work)], env=env, capture_output=True, timeout=120)
        pytest.skip(_reason(proc))
    exported: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            exported[key.strip()] = value.strip()
    saved = {key: os.environ.get(key) for key in exported}
    os.environ.update(exported)
    try:
        yield exported
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        subprocess.run(["bash", str(path), "stop", str(work)], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A local two-node Slurm cluster (n1, n2); yields {"SLURM_CONF": path}, also set in os.environ."""
    yield from _cluster("local_slurm.sh", tmp_path_factory.mktemp("slurm"), timeout=90)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A local two-node Ray cluster (node_a, node_b); yields {"RAY_ADDRESS": host:port}, also set in os.environ."""
    yield from _cluster("local_ray.sh", tmp_path_factory.mktemp("ray"), timeout=150)

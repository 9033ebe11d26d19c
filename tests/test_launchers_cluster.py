"""`areal train --launcher slurm|ray` on real clusters on this machine: a two-node Slurm (slurmctld and
two slurmd, scripts/local_slurm.sh) and a two-node Ray (scripts/local_ray.sh). Each runs a 2-process
SFT (one rank per node) that must end with the weights of `--nproc-per-node 2` here, and a GRPO run
whose generation server has a node, and a job step or Ray actor, of its own. Skipped, with the reason,
where a cluster cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_fixtures import ray_cluster, slurm_cluster  # noqa: F401
from conftest import Workspace
from safetensors.torch import load_file
from test_cli_subprocess import areal_command

from arealcli.runtime.run import checkpoint as ckpt

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SERVER_RECIPE = REPO / "recipes" / "quickstart-server.yaml"
GRPO = [  # 4 supervised steps, then 4 GRPO steps on the server's samples
    "trainer.max_steps=8",
    "dataflow.sft_warmup_steps=4",
    "trainer.eval_every_n_steps=null",
    "trainer.eval_at_start=false",
    "trainer.save_every_n_steps=4",
    "trainer.tensorboard=false",
    "trainer.log_every_n_steps=1",
]
SERVER_ON_NODE_0 = "cluster={allocation: {actor_gen: [0], trainer: [1]}}"


def areal(*args, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [*areal_command(), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def weights(run: Path, step: int, model: str) -> dict:
    return load_file(str(run / "checkpoints" / ckpt.step_dir_name(step) / model / "model.safetensors"))


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not (a[k] == b[k]).all()]
    assert not different, different


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def no_process_left(run: Path) -> None:
    """No server or trainer of this run still runs."""
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    left = [line for line in ps.splitlines() if str(run) in line and "arealcli" in line]
    assert not left, left


@pytest.fixture(scope="module")
def sft_ws(tmp_path_factory) -> tuple[Workspace, Path]:
    """A 6-step SFT (batch 8, 2 micro-batches per rank) and its run with 2 processes here."""
    ws = Workspace(tmp_path_factory.mktemp("sft"))
    recipe = ws.recipe(trainer={"max_steps": 6, "save_every_n_steps": 6, "tensorboard": False})
    areal("train", recipe, "-o", ws.root / "local", "--nproc-per-node", "2", cwd=ws.root)
    return ws, recipe


@pytest.fixture(scope="module")
def grpo_local(tmp_path_factory) -> Path:
    """The GRPO run with the server the trainer launches itself, on this machine."""
    root = tmp_path_factory.mktemp("grpo")
    areal("train", SERVER_RECIPE, *GRPO, "-o", root / "local", cwd=root)
    return root / "local"


def check_grpo(run: Path, local: Path) -> None:
    """The server ran in its own process on node 0 and served the RL steps; the supervised part of the
    run is bit-identical to the local launcher's (sampling on a server is not: requests batch as they
    come)."""
    assert "serving" in (run / "logs" / "actor_gen-0.log").read_text()
    got = rows(run)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert all(r["actor_gen/generated_tokens"] > 0 for r in got[4:])
    assert_same_weights(weights(run, 4, "actor"), weights(local, 4, "actor"))
    no_process_left(run)


# --------------------------------------------------------------------------------------------- slurm


def test_slurm_two_node_sft_equals_two_local_processes(slurm_cluster, sft_ws):  # noqa: F811
    ws, recipe = sft_ws
    run = ws.root / "slurm"
    out = areal("train", recipe, "-o", run, "--launcher", "slurm", "--nnodes", "2", "--wait", cwd=ws.root)
    assert "submitted Slurm job" in out.stdout and "completed" in out.stdout
    script = (run / "launch" / "slurm.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "--nnodes=2" in script
    assert (run / "logs" / "trainer-0.log").is_file() and (run / "logs" / "trainer-1.log").is_file()
    assert [r["sft/loss"] for r in rows(run)] == [r["sft/loss"] for r in rows(ws.root / "local")]
    assert_same_weights(weights(run, 6, "default"), weights(ws.root / "local", 6, "default"))


def test_slurm_grpo_with_the_server_in_its_own_step(slurm_cluster, grpo_local, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    args = [SERVER_RECIPE, *GRPO, SERVER_ON_NODE_0, "-o", run, "--launcher", "slurm", "--wait"]
    out = areal("train", *args, cwd=tmp_path)
    assert "node 0: actor_gen server 0" in out.stdout and "done: 8 steps" in out.stdout
    check_grpo(run, grpo_local)
    script = (run / "launch" / "slurm.sh").read_text()
    key = os.environ.get("AREALCLI_CLUSTER_KEY")
    assert key is None or key not in script


def test_slurm_scancel_stops_the_trainer_with_a_checkpoint(slurm_cluster, sft_ws):  # noqa: F811
    """scancel signals every step: the trainer stops, keeps its last complete checkpoint, says how to
    continue (with the launcher's flags), and the resumed job finishes the run from there."""
    ws, recipe = sft_ws
    run = ws.root / "cancelled"
    long = ["trainer.max_steps=100000", "trainer.save_every_n_steps=20"]
    out = areal("train", recipe, *long, "-o", run, "--launcher", "slurm", cwd=ws.root)
    job = out.stdout.split("submitted Slurm job ")[1].split(":")[0]
    log = run / "logs" / "trainer-0.log"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and ckpt.latest_checkpoint(run / "checkpoints", cleanup=False) is None:
        time.sleep(0.5)
    assert ckpt.latest_checkpoint(run / "checkpoints", cleanup=False), "no checkpoint within 3 minutes"
    subprocess.run(["scancel", job], check=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "continue with" not in log.read_text():
        time.sleep(0.5)
    text = log.read_text()
    assert "terminated (SIGTERM): the last complete checkpoint is kept: step " in text, text[-2000:]
    assert f"--resume -o {run} --launcher=slurm" in text
    kept = int(text.split("the last complete checkpoint is kept: step ")[1].split(",")[0])
    assert kept % 20 == 0 and kept > 0
    resumed = areal("train", recipe, *long, f"trainer.max_steps={kept + 10}", "-o", run, "--resume",
                    "--launcher", "slurm", "--wait", cwd=ws.root, timeout=600)  # fmt: skip
    assert "completed" in resumed.stdout
    assert [r["step"] for r in rows(run)][-11:] == list(range(kept, kept + 11))
    assert (
        "terminated (SIGTERM)" in log.read_text()
    )  # the first job's log is kept: the resumed one follows it
    assert "terminated (SIGTERM)" not in resumed.stdout  # --wait shows this job's output only
    no_process_left(run)


# ----------------------------------------------------------------------------------------------- ray


def test_ray_two_node_sft_equals_two_local_processes(ray_cluster, sft_ws):  # noqa: F811
    ws, recipe = sft_ws
    run = ws.root / "ray"
    out = areal("train", recipe, "-o", run, "--launcher", "ray", "--nnodes", "2", cwd=ws.root)
    assert "Ray: 2 node(s) placed" in out.stderr + out.stdout and "done: 6 steps" in out.stdout
    assert (run / "logs" / "trainer-1.log").is_file()
    assert [r["sft/loss"] for r in rows(run)] == [r["sft/loss"] for r in rows(ws.root / "local")]
    assert_same_weights(weights(run, 6, "default"), weights(ws.root / "local", 6, "default"))
    # a resume on Ray: one more step; its log follows the first run's, and only its own output is shown
    more = areal(
        "train", recipe, "trainer.max_steps=7", "-o", run, "--resume", "--launcher", "ray", cwd=ws.root
    )
    assert rows(run)[-1]["step"] == 7
    assert "done: 6 steps" not in more.stdout
    assert "done: 6 steps" in (run / "logs" / "trainer-0.log").read_text()


def test_ray_grpo_with_the_server_on_its_own_node(ray_cluster, grpo_local, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    out = areal("train", SERVER_RECIPE, *GRPO, SERVER_ON_NODE_0, "-o", run, "--launcher", "ray", cwd=tmp_path)
    assert "servers up: actor_gen at 127." in out.stdout + out.stderr and "done: 8 steps" in out.stdout
    check_grpo(run, grpo_local)


@pytest.mark.parametrize(
    "sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_ray_ctrl_c_or_sigterm_tears_everything_down(ray_cluster, tmp_path, sig, code, said):  # noqa: F811
    """Ctrl-C (or SIGTERM) of `areal train --launcher ray`: the trainer stops and says so, and no server,
    trainer, actor or placement group of the run is left on the cluster."""
    run = tmp_path / "run"
    args = ["train", SERVER_RECIPE, *GRPO, SERVER_ON_NODE_0, "trainer.max_steps=2000", "-o", run]
    args += ["--launcher", "ray"]
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*areal_command(), *map(str, args)], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None and not (run / "metrics.jsonl").is_file():
        time.sleep(0.5)
    if not (run / "metrics.jsonl").is_file():
        proc.kill()
        pytest.fail("the run never started:\n" + proc.communicate()[0][-3000:])
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == code, out[-3000:]
    assert f"{said}: stopping the trainer and the servers" in out
    assert "terminated (SIGTERM): " in out  # the trainer's own last words
    no_process_left(run)
    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR")
    try:
        from ray.util import placement_group_table

        assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    finally:
        ray.shutdown()

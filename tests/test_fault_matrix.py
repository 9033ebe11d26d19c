"""The fault matrix, end to end through `areal train` (slow: each case trains a short run, some twice).

Every run here finishes by itself, exit 0, with one metrics row per step and no process left behind:
- a launched generation server killed (-9) during the SFT warm-up, during RL, and during a weight update;
  stopped (SIGSTOP) during RL: restarted with the newest weights, one console line each and nothing
  else (no traceback, no asyncio "never retrieved"); what the run wrote, server logs included, private;
- a reward function that raises once: the run starts again from its last checkpoint (trainer.recover)
  and ends with the weights of an uninterrupted run, bit for bit (resume is exact);
- one rank of a 2-process SFT run killed (-9): the same, for the whole process group.
A run with a launched server cannot end with an uninterrupted run's weights: the server samples from a
process-wide random stream, which a restart re-seeds, so the re-sent requests draw other samples.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SHORT = [
    "trainer.max_steps=16",
    "dataflow.sft_warmup_steps=4",
    "trainer.eval_every_n_steps=null",
    "trainer.eval_at_start=false",
    "trainer.save_every_n_steps=4",
    "trainer.log_every_n_steps=1",
    "trainer.tensorboard=false",
]


def start(recipe: Path, run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(recipe), "-o", str(run_dir), *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        cwd=REPO,
    )


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step for r in rows(run_dir)):
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def server_pids(run_dir: Path) -> list[int]:
    found = subprocess.run(["pgrep", "-f", f"serve --model {run_dir}"], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def assert_clean_run(run_dir: Path, steps: int) -> None:
    assert [r["step"] for r in rows(run_dir)] == list(range(1, steps + 1))  # one row per step
    assert server_pids(run_dir) == []  # nothing left behind


def final_weights(run_dir: Path, step: int, model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = run_dir / "checkpoints" / f"step_{step:08d}" / model
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


QUICKSTART_SERVER = REPO / "recipes" / "quickstart-server.yaml"


def assert_quiet_recovery(out: str) -> None:
    """Recovery is one line: no traceback, no asyncio "Task exception was never retrieved" (the requests
    a dead server held are retried, and their failures reported once, by the client)."""
    assert "Traceback" not in out and "never retrieved" not in out, out
    assert sum("restarted in" in line for line in out.splitlines()) == 1, out


def assert_private(run_dir: Path) -> None:
    """Everything the run wrote (server logs, weights, checkpoints, samples) is its user's alone."""
    found = {p: p.stat().st_mode & 0o777 for p in [run_dir, *run_dir.rglob("*")] if not p.is_symlink()}
    assert {str(p): oct(m) for p, m in found.items() if m & 0o077} == {}


@pytest.mark.parametrize(
    ("when", "sig", "stall_timeout_s"),
    [
        ("warmup", signal.SIGKILL, None),
        ("rl", signal.SIGKILL, None),
        ("rl", signal.SIGSTOP, 3),
        # requests held past a /health probe (interval 5 s) while the stopped server is killed: each used
        # to print "Task exception was never retrieved" with its traceback (64 of them, ~500 lines)
        ("rl", signal.SIGSTOP, 10),
    ],
)
def test_a_launched_server_that_fails_is_restarted_and_the_run_goes_on(tmp_path, when, sig, stall_timeout_s):
    run_dir = tmp_path / "run"
    stall = [f"models.actor_gen.backend.args.stall_timeout_s={stall_timeout_s}"] if stall_timeout_s else []
    proc = start(QUICKSTART_SERVER, run_dir, *SHORT, *stall, "trainer.samples_every_n_steps=8")
    try:
        wait_for_step(proc, run_dir, 2 if when == "warmup" else 7)
        (pid,) = server_pids(run_dir)
        os.kill(pid, sig)
        out = finish(proc)
    finally:
        proc.kill()
    assert_quiet_recovery(out)
    (restarted,) = [line for line in out.splitlines() if "restarted in" in line]
    said = "exited with code -9" if sig == signal.SIGKILL else "stopped answering"
    assert said in restarted, restarted
    assert rows(run_dir)[-1]["faults/server_restarts"] == 1
    assert_clean_run(run_dir, 16)
    assert_private(run_dir)


def test_a_server_that_dies_during_a_weight_update_is_restarted(tmp_path):
    """Fault injected on purpose: the embedded server kills itself on its 6th weight update (once)."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "died"
    env = {"AREALCLI_FAULT_DIE_ON_UPDATE": f"6:{marker}"}
    out = finish(start(QUICKSTART_SERVER, run_dir, *SHORT, env=env))
    assert marker.exists()  # it did die in the update
    assert_quiet_recovery(out)
    assert rows(run_dir)[-1]["faults/server_restarts"] == 1
    assert_clean_run(run_dir, 16)


FLAKY_REWARD = '''
"""The math reward, except that it raises once, on its Nth call (fault injection)."""
import os
from pathlib import Path

from arealcli.runtime.registry import register_reward
from arealcli.runtime.rewards.builtin import math_reward

calls = 0


def flaky(prompts, responses, answers):
    global calls
    calls += 1
    marker = Path(os.environ["FLAKY_MARKER"])
    if calls == int(os.environ["FLAKY_AT"]) and not marker.exists():
        marker.touch()
        raise RuntimeError("the reward service is down")
    return math_reward(prompts, responses, answers)


register_reward("flaky", flaky)
'''


def test_a_reward_function_that_raises_once_is_recovered_from_the_last_checkpoint(tmp_path):
    recipe = tmp_path / "quickstart.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text().replace("../data/", f"{REPO}/data/")
    recipe.write_text(text)
    (tmp_path / "flaky_reward.py").write_text(textwrap.dedent(FLAKY_REWARD))
    args = [*SHORT, "dataflow.reward.reward_fn=flaky", "imports=[flaky_reward]"]
    env = {"FLAKY_AT": "7", "FLAKY_MARKER": str(tmp_path / "raised"), "PYTHONPATH": str(tmp_path)}
    out = finish(start(recipe, tmp_path / "faulty", *args, env=env))
    assert (tmp_path / "raised").exists()
    recovering = [line for line in out.splitlines() if line.startswith("recovering:")]
    assert len(recovering) == 1 and "the reward service is down" in recovering[0], out
    assert "from the checkpoint of step 8" in recovering[0]
    assert "the reward service is down" in (tmp_path / "faulty" / "logs" / "crash.log").read_text()
    assert_clean_run(tmp_path / "faulty", 16)

    env["FLAKY_AT"] = "0"  # never raises: the uninterrupted run
    finish(start(recipe, tmp_path / "plain", *args, env=env))
    a, b = final_weights(tmp_path / "faulty", 16, "actor"), final_weights(tmp_path / "plain", 16, "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_failure_is_not_retried_without_a_checkpoint_and_says_how_to_continue(tmp_path):
    recipe = tmp_path / "quickstart.yaml"
    recipe.write_text((REPO / "recipes" / "quickstart.yaml").read_text().replace("../data/", f"{REPO}/data/"))
    (tmp_path / "flaky_reward.py").write_text(textwrap.dedent(FLAKY_REWARD))
    args = [
        *SHORT,
        "trainer.save_every_n_steps=null",
        "dataflow.reward.reward_fn=flaky",
        "imports=[flaky_reward]",
    ]
    env = {"FLAKY_AT": "2", "FLAKY_MARKER": str(tmp_path / "raised"), "PYTHONPATH": str(tmp_path)}
    proc = start(recipe, tmp_path / "run", *args, env=env)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "Traceback" not in out
    assert "training failed at step 6: RuntimeError: the reward service is down" in out
    assert "this looks like a bug" in out and "crash.log" in out
    assert "no checkpoint was written yet" in out
    assert "start again with: areal train" in out


def test_a_killed_rank_of_a_two_process_run_is_recovered(ws):
    recipe = ws.recipe(
        trainer={"max_steps": 12, "save_every_n_steps": 4, "log_every_n_steps": 1, "tensorboard": False}
    )
    run_dir = ws.root / "faulty"
    proc = start(recipe, run_dir, "--nproc-per-node=2")
    try:
        wait_for_step(proc, run_dir, 6)
        # the workers: what torch's elastic agent (in `areal train` itself) spawned through multiprocessing
        found = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "spawn_main"], capture_output=True, text=True
        )
        workers = [int(p) for p in found.stdout.split()]
        assert len(workers) == 2, found
        os.kill(workers[-1], signal.SIGKILL)
        out = finish(proc)
    finally:
        proc.kill()
    assert sum(line.startswith("recovering:") for line in out.splitlines()) == 1, out
    assert [r["step"] for r in rows(run_dir)] == list(range(1, 13))
    plain = ws.root / "plain"
    finish(start(recipe, plain, "--nproc-per-node=2"))
    a, b = final_weights(run_dir, 12, "default"), final_weights(plain, 12, "default")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

"""The thread policy: torch's thread count follows the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from arealcli.runtime.run import threads

BUSY = "import time\nend = time.time() + 60\nwhile time.time() < end: pass\n"


def test_a_busy_neighbour_takes_a_thread_away():
    policy = threads.ThreadPolicy(interval_s=0.0)
    if policy.cpus < 2 or not threads.enabled():
        pytest.skip("needs two CPUs and Linux's /proc")
    before = torch.get_num_threads()
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(policy.cpus)]
    try:
        time.sleep(0.5)
        policy.update()
        time.sleep(1.0)
        n = policy.update()  # measured over the last second: every core busy with a neighbour
        assert policy.other_load > policy.cpus - 1.5, policy.other_load
        assert n == 1 and torch.get_num_threads() == 1
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        torch.set_num_threads(before)


def test_off_when_the_user_chose(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert not threads.enabled()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("AREALCLI_THREAD_POLICY", "off")
    assert not threads.enabled()


def test_available_cpus_is_the_affinity():
    import os

    assert threads.available_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.slow
def test_the_same_run_beside_a_busy_process_gives_the_same_numbers(ws):
    """`trainer.threads: auto` (the default) fixes torch's thread count for the run: a neighbour that
    keeps a core busy slows the run, it does not change its results (and it is said once). Threads that
    wait passively (the default) give the same numbers as spinning ones."""
    import json
    import os

    import yaml
    from test_async import grpo

    if threads.available_cpus() < 2 or not threads.enabled():
        pytest.skip("needs two CPUs, Linux's /proc and no OMP_NUM_THREADS")
    recipe = yaml.safe_load(grpo(ws, reward_fn="math").read_text())  # registered in every process
    recipe["trainer"].update({"max_steps": 4, "eval_every_n_steps": None, "save_every_n_steps": None})
    path = ws.text("fixed.yaml", yaml.safe_dump(recipe, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}

    def train(run: str, more: dict[str, str] | None = None) -> tuple[list[dict], str]:
        done = subprocess.run(
            [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(ws.root / run)],
            capture_output=True, text=True, timeout=600, env={**env, **(more or {})}, cwd=ws.root,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(x) for x in (ws.root / run / "metrics.jsonl").read_text().splitlines()]
        return rows, done.stdout + done.stderr

    alone, _ = train("alone")
    spinning, _ = train("spinning", {"OMP_WAIT_POLICY": "ACTIVE"})
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(threads.available_cpus() - 1)]
    try:
        time.sleep(0.5)
        busy, said = train("busy")
    finally:
        for h in hogs:
            h.kill()
            h.wait()

    def numbers(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if not k.startswith(("timing/", "sys/other_load"))} for r in rows]

    assert numbers(busy) == numbers(alone)
    assert numbers(spinning) == numbers(alone)  # passive waiting (the default) changes no number
    assert all(r["sys/torch_threads"] == threads.available_cpus() for r in busy)
    assert "other processes are using about" in " ".join(said.split())


# After one parallel matmul the main thread sleeps: OpenMP worker threads that wait actively keep
# spinning (CPU time grows while nothing runs); passive ones sleep. Prints the CPU seconds of the sleep.
SPIN_PROBE = (
    "import time, arealcli, torch\n"
    "torch.set_num_threads(2)\n"
    "a = torch.ones(512, 512)\n"
    "for _ in range(20): a @ a\n"
    "t0 = time.process_time(); time.sleep(1.0); print(time.process_time() - t0)\n"
)


def _spin_seconds(policy: str | None) -> float:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", SPIN_PROBE], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_openmp_threads_wait_passively_unless_the_user_chose():
    """arealcli sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP: idle worker threads sleep
    instead of spinning on the cores a neighbour needs. A policy the user set is kept."""
    if threads.available_cpus() < 2:
        pytest.skip("needs two CPUs")
    active, passive = _spin_seconds("ACTIVE"), _spin_seconds(None)
    assert active > 0.1, f"spinning threads used only {active:.3f} CPU s in 1 s of sleep"
    assert passive < 0.05, f"the default let idle threads use {passive:.3f} CPU s in 1 s of sleep"
    done = subprocess.run(
        [sys.executable, "-c", "import os, arealcli; print(os.environ['OMP_WAIT_POLICY'])"],
        capture_output=True, text=True, env={"OMP_WAIT_POLICY": "ACTIVE", "PATH": ""},
    )  # fmt: skip
    assert done.stdout.strip() == "ACTIVE"

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
    keeps a core busy slows the run, it does not change its results (and it is said once)."""
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

    def train(run: str) -> tuple[list[dict], str]:
        done = subprocess.run(
            [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(ws.root / run)],
            capture_output=True, text=True, timeout=600, env=env, cwd=ws.root,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [json.loads(x) for x in (ws.root / run / "metrics.jsonl").read_text().splitlines()]
        return rows, done.stdout + done.stderr

    alone, _ = train("alone")
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
    assert all(r["sys/torch_threads"] == threads.available_cpus() for r in busy)
    assert "other processes are using about" in " ".join(said.split())

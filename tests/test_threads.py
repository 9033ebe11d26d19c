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

"""How many torch threads to train with: the cores this process may use that others are not using.

torch starts one OpenMP thread per physical core and its threads wait for each other at every parallel
region, spinning. When another process takes a core, one of them is descheduled and the others spin
until the OS gives it back: steps take many times longer than the lost core explains (measured with
bench/shared_machine.py). So the trainer measures, every `interval_s`, how much CPU other processes used
(the machine's busy time from /proc/stat minus this process's own), and sets torch's thread count to the
cores left, at least one: all of them on an idle machine, fewer beside a neighbour.

Off when the user chose a count (OMP_NUM_THREADS) or set AREALCLI_THREAD_POLICY=off; Linux only.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup CPU quota (containers)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:  # cgroup v2: "max 100000" or "<quota> <period>"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def _sample() -> tuple[float, float, float] | None:
    """(machine busy ticks, machine total ticks, this process's ticks), or None off Linux."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields), float(own[11]) + float(own[12])  # utime + stime


def enabled() -> bool:
    return (
        "OMP_NUM_THREADS" not in os.environ
        and os.environ.get("AREALCLI_THREAD_POLICY", "on") != "off"
        and _sample() is not None
    )


class ThreadPolicy:
    def __init__(self, interval_s: float = 5.0):
        self.cpus = available_cpus()
        self.machine_cpus = os.cpu_count() or self.cpus
        self.interval_s = interval_s
        self.threads: int | None = None
        self.other_load = 0.0
        self._last = _sample()
        self._last_t = time.monotonic()

    def measure_now(self, seconds: float = 0.2) -> int:
        """Sample over `seconds` right away (at start: before our own work), then apply."""
        time.sleep(seconds)
        self._last_t = 0.0
        return self.update()

    def update(self) -> int:
        """Re-measure if `interval_s` has passed; set and return torch's thread count."""
        import torch

        now = time.monotonic()
        if self.threads is not None and now - self._last_t < self.interval_s:
            return self.threads
        current = _sample()
        if current is not None and self._last is not None:
            busy, total, own = (c - p for c, p in zip(current, self._last, strict=True))
            if total > 0:
                # total ticks are summed over every CPU of the machine: busy share x CPUs = cores in use
                others = max(0.0, (busy - own) / total * self.machine_cpus)
                self.other_load = others
        self._last, self._last_t = current, now
        threads = max(1, min(self.cpus, round(self.cpus - self.other_load)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

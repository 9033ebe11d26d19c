"""How many torch threads to train with: the cores this process may use that others are not using.

torch starts one OpenMP thread per physical core and its threads wait for each other at every parallel
region, spinning. When another process takes a core, one of them is descheduled and the others spin
until the OS gives it back: steps take many times longer than the lost core explains (measured with
bench/shared_machine.py). So the trainer measures, every `interval_s`, how much CPU other processes used
(the machine's busy time from /proc/stat minus this process's own), and sets torch's thread count to the
cores left, at least one: all of them on an idle machine, fewer beside a neighbour.

The default (`trainer.threads: auto`) fixes the count for the run instead (`FixedThreads`): the cores
this process may use, so the same command gives the same numbers beside a busy neighbour; the measured
load is only said. The load-following policy below is `trainer.threads: adaptive`.

Off when the user chose a count (OMP_NUM_THREADS) or set AREALCLI_THREAD_POLICY=off; Linux only.

Placement (`cpus` of the training backends) comes first: `place_trainer` pins every thread of the
process to those cores and sets torch's thread count to their number; the policy then measures the
load on those cores only and never goes above their number. Threads started later inherit the mask of
the thread that starts them, so the `local` generator's thread, which pins itself to its own `cpus`,
takes the torch (OpenMP) worker threads it starts with it. Launched servers are separate processes,
pinned by their launcher; one without `cpus` of its own gets the cores the trainer had before its
placement (AREALCLI_UNPLACED_CPUS, set here), not the trainer's.

What a placement does not separate inside one process: the Python interpreter lock (the training and
generation threads take turns running Python), memory bandwidth and caches, and torch's process-wide
pools (the inter-op pool, MKL's own threads) that are started by whichever thread first needs them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from arealcli.errors import UserError


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


def _busy_total(fields: list[float]) -> tuple[float, float]:
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


def _ticks(stat: str) -> float:
    """utime + stime of a /proc/<pid>[/task/<tid>]/stat line."""
    rest = stat.rsplit(")", 1)[1].split()
    return float(rest[11]) + float(rest[12])


def _sample(cores: frozenset[int] | None = None) -> tuple[float, float, float] | None:
    """(busy ticks, total ticks, this process's ticks) of the machine, or of `cores` alone (then this
    process's ticks are those of its threads pinned inside them); None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        if cores is None:
            busy, total = _busy_total([float(x) for x in lines[0].split()[1:]])
            return busy, total, _ticks(Path("/proc/self/stat").read_text())
        busy = total = 0.0
        for line in lines[1:]:
            name, *values = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                b, t = _busy_total([float(x) for x in values])
                busy, total = busy + b, total + t
        return busy, total, _own_ticks(cores)
    except (OSError, IndexError, ValueError):
        return None


def _own_ticks(cores: frozenset[int]) -> float:
    """CPU ticks of this process's threads whose affinity lies within `cores`."""
    own = 0.0
    for task in Path("/proc/self/task").iterdir():
        try:
            if set(os.sched_getaffinity(int(task.name))) <= cores:
                own += _ticks((task / "stat").read_text())
        except (OSError, ValueError):  # the thread ended meanwhile
            pass
    return own


def pin_process(cpus: Iterable[int]) -> None:
    """Run every thread of this process on `cpus` (threads started later inherit it from their parent)."""
    mask = set(cpus)
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def trainer_placement(recipe: Any) -> tuple[list[int] | None, list[int] | None]:
    """(cpus, devices) of the training process: those of every model whose backend computes in it
    (scope "process"; they take turns on the same thread, so their cores are one set)."""
    cpus: list[int] | None = None
    devices: list[int] | None = None
    for spec in recipe.models.values():
        args = spec.backend.args
        if spec.base_of is not None or getattr(type(args), "placement_scope", None) != "process":
            continue
        if args.cpus is not None:
            cpus = sorted(set(cpus or []) | set(args.cpus))
        if args.devices is not None:
            devices = list(dict.fromkeys((devices or []) + list(args.devices)))
    return cpus, devices


def place_trainer(recipe: Any) -> list[int] | None:
    """Apply the training process's placement; returns the cores of this process (None: not placed).

    With several processes on a node (`--nproc-per-node`), local rank i takes part i of the cores
    (`share`) and the i-th of the devices (modulo their number).
    """
    import torch

    from arealcli.schema.checks.placement import UNPLACED_CPUS_ENV, compact, usable_cpus
    from arealcli.schema.components.backends import share

    cpus, devices = trainer_placement(recipe)
    rank, ranks = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = share(cpus, rank, ranks) if cpus else None
    if mine:
        os.environ.setdefault(UNPLACED_CPUS_ENV, compact(usable_cpus() or mine))  # for unplaced servers
        try:
            pin_process(mine)
        except OSError as e:
            raise UserError(
                f"cannot run the trainer on cores {compact(mine)}: {e.strerror} (this process may run on "
                f"cores {compact(usable_cpus() or [])})"
            ) from None
        torch.set_num_threads(len(mine))
    if devices and torch.cuda.is_available():
        torch.cuda.set_device(devices[rank % len(devices)])
    return mine


def enabled() -> bool:
    return (
        "OMP_NUM_THREADS" not in os.environ
        and os.environ.get("AREALCLI_THREAD_POLICY", "on") != "off"
        and _sample() is not None
    )


class ThreadPolicy:
    """torch threads = the cores left by other processes: of the machine, or of `cores` when the
    trainer is placed (then at most their number)."""

    def __init__(self, interval_s: float = 5.0, cores: Iterable[int] | None = None):
        self.cores = frozenset(cores) if cores else None
        self.cpus = len(self.cores) if self.cores else available_cpus()
        self.machine_cpus = len(self.cores) if self.cores else os.cpu_count() or self.cpus
        self.interval_s = interval_s
        self.threads: int | None = None
        self.other_load = 0.0
        self._last = _sample(self.cores)
        self._last_t = time.monotonic()

    def measure_now(self, seconds: float = 0.2) -> int:
        """Sample over `seconds` right away (at start: before our own work), then apply."""
        time.sleep(seconds)
        self._last_t = 0.0
        return self.update()

    def measure(self) -> float:
        """Cores busy with other processes since the last sample (kept as `other_load`)."""
        current = _sample(self.cores)
        if current is not None and self._last is not None:
            busy, total, own = (c - p for c, p in zip(current, self._last, strict=True))
            if total > 0:
                # total ticks are summed over every CPU counted: busy share x CPUs = cores in use
                self.other_load = max(0.0, (busy - own) / total * self.machine_cpus)
        self._last = current
        return self.other_load

    def update(self) -> int:
        """Re-measure if `interval_s` has passed; set and return torch's thread count."""
        import torch

        now = time.monotonic()
        if self.threads is not None and now - self._last_t < self.interval_s:
            return self.threads
        self.measure()
        self._last_t = now
        threads = max(1, min(self.cpus, round(self.cpus - self.other_load)))
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads


class FixedThreads:
    """The default (`trainer.threads: auto` or N): one torch thread count for the whole run, whatever
    else runs, so a run's numbers depend on the machine and the count, never on a neighbour's load.
    `other_load` is the busy cores measured once at the start (said on the console, not followed)."""

    def __init__(self, threads: int, other_load: float):
        import torch

        torch.set_num_threads(threads)
        self.threads = threads
        self.other_load = other_load

    def update(self) -> int:
        return self.threads


def measure_other_load(cores: Iterable[int] | None = None, seconds: float = 0.2) -> float:
    """Cores busy with other processes over `seconds` (of the machine, or of `cores`); 0 off Linux."""
    probe = ThreadPolicy(cores=cores)
    time.sleep(seconds)
    return probe.measure()


def last_thread_count(run_dir: Path) -> int | None:
    """The torch thread count a run logged last (`sys/torch_threads` in metrics.jsonl), for a resume."""
    import json

    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            value = json.loads(line).get("sys/torch_threads")
        except ValueError:
            continue
        if value:
            return int(value)
    return None


def thread_setting(setting: int | str, cores: list[int] | None, run_dir: Path, resume: bool) -> Any:
    """The training process's thread count for `trainer.threads` (None when OMP_NUM_THREADS or
    AREALCLI_THREAD_POLICY=off decides): an adaptive ThreadPolicy, or FixedThreads — `auto` is the cores
    this process may use (the placed ones when placed), a resumed run keeps the count it ran with."""
    if not enabled():
        return None
    if setting == "adaptive":
        policy = ThreadPolicy(cores=cores)
        policy.measure_now()
        return policy
    if isinstance(setting, int):
        count = setting
    else:
        count = (last_thread_count(run_dir) if resume else None) or (
            len(cores) if cores else available_cpus()
        )
    return FixedThreads(count, measure_other_load(cores))

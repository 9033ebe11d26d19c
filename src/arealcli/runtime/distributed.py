"""Data parallelism helpers: this process's rank and world, its slice of a batch, reductions.

Every helper gives the single-process answer when torch.distributed is not initialized, so the
trainer and the interfaces call them unconditionally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from arealcli.runtime.data.sample import SequenceSample


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> int:
    return dist.get_world_size() if initialized() else 1


# This rank's place among the data-parallel ranks, when not every rank is one (tensor/pipeline
# parallel backends declare it with `set_data_parallel`); None = every rank is a DP rank.
_data_parallel: tuple[int, int] | None = None


def set_data_parallel(dp_rank_: int, dp_world_: int) -> None:
    """Declare this rank's data-parallel rank and size (ranks of one model-parallel group share data)."""
    global _data_parallel
    _data_parallel = (dp_rank_, dp_world_)


def dp_rank() -> int:
    return _data_parallel[0] if _data_parallel else rank()


def dp_world() -> int:
    return _data_parallel[1] if _data_parallel else world()


def barrier() -> None:
    if world() > 1:
        dist.barrier()


def comm_device() -> torch.device:
    """Where collective tensors must live: the current GPU for NCCL, else the CPU."""
    if initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of a list of numbers over ranks (float64)."""
    if world() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_object(obj: Any) -> list[Any]:
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def mean_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """Each stat averaged over the ranks that report it (rank 0's key order first); a value every
    rank agrees on is kept as it is (global stats, counters)."""
    if world() == 1:
        return stats
    values: dict[str, list[float]] = {}
    for part in all_gather_object(stats):
        for k, v in part.items():
            values.setdefault(k, []).append(v)
    return {k: v[0] if all(x == v[0] for x in v) else sum(map(float, v)) / len(v) for k, v in values.items()}


def slice_bounds(n: int, rank_: int, world_: int) -> tuple[int, int]:
    """Contiguous, near-even split of n items: rank r gets [start, end); sizes differ by at most 1."""
    base, extra = divmod(n, world_)
    start = rank_ * base + min(rank_, extra)
    return start, start + base + (1 if rank_ < extra else 0)


def dp_slice(batch: SequenceSample) -> SequenceSample:
    """This DP rank's contiguous slice of a global batch (the whole batch in a single process), cut
    between units (`SequenceSample.units`: a preference pair stays on one rank)."""
    w = dp_world()
    if w == 1:
        return batch
    units = batch.units()
    start, end = slice_bounds(len(units), dp_rank(), w)
    return batch.subset([i for unit in units[start:end] for i in unit])

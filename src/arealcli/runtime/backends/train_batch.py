"""The micro-batched, loss-weighted training step shared by the backends.

Each micro-batch's loss is weighted by `loss_weight_fn(mb) / total_weight`, where the total is summed
over all micro-batches and, for `token_normalize_scope="global"`, over all data-parallel ranks. The
result is therefore independent of how the batch is split into micro-batches (and of how samples are
spread over ranks, for "global"). With "dp", every rank normalizes by its own total and the gradients
are averaged over ranks.

Backends whose forward/backward passes are collective (FSDP: every pass all-gathers parameters and
reduce-scatters gradients) pass `pad_run`: every rank then runs the same number of passes (the
maximum micro-batch count over ranks), and a micro-batch with zero weight, or a missing one, becomes a
zero-weight forward + backward of `pad_run()` instead of being skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist

from arealcli.runtime.backends.base import LossFn, LossWeightFn
from arealcli.runtime.data import SequenceSample
from arealcli.schema.components.engine import MicroBatchSpec


def dp_world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(value: float, device, group=None) -> float:
    if dp_world(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


def accumulate_gradients(
    run: Callable[[SequenceSample], torch.Tensor],
    input_: SequenceSample,
    mb_spec: MicroBatchSpec,
    loss_fn: LossFn,
    loss_weight_fn: LossWeightFn,
    token_normalize_scope: str,
    device,
    dp_group=None,
    grads_averaged_over_dp: bool = True,
    autocast: AbstractContextManager | None = None,
    pad_run: Callable[[], torch.Tensor] | None = None,
) -> dict[str, float]:
    """Forward + backward every micro-batch with its weight; returns weighted-mean stats.

    Over several ranks the stats are global: loss and stats weighted by each micro-batch's weight over
    every rank ("dp": the loss is the mean of the ranks' own means), `loss_weight` the global total.
    """
    if token_normalize_scope not in ("global", "dp"):
        raise ValueError(f"token_normalize_scope must be 'global' or 'dp', got {token_normalize_scope!r}")
    mbs, _, _ = input_.split(mb_spec)
    weights = [float(loss_weight_fn(mb)) for mb in mbs]
    local_total = sum(weights)
    world = dp_world(dp_group)
    if token_normalize_scope == "global":
        total = all_reduce_sum(local_total, device, dp_group)
        # Gradient averaging over ranks divides by `world`; undo it so the sum is over global weights.
        scale = world if grads_averaged_over_dp else 1
    else:
        # Each rank's own token mean; the mean over ranks needs a 1/world if the backend only sums grads.
        total, scale = local_total, (1 if grads_averaged_over_dp else 1 / world)
    padded = pad_run is not None and world > 1
    n_passes = int(_all_reduce_max(len(mbs), device, dp_group)) if padded else len(mbs)
    stats: dict[str, float] = {}
    loss_sum = 0.0
    for i in range(n_passes):
        mb, w = (mbs[i], weights[i]) if i < len(mbs) else (None, 0.0)
        if w == 0 or total == 0:
            if padded:  # keep the collectives of every rank in step: a pass that changes nothing
                with autocast or nullcontext():
                    out = pad_run()
                (out.float().sum() * 0.0).backward()
            continue
        with autocast or nullcontext():
            out = run(mb)
            loss, mb_stats = loss_fn(out, mb)
        (loss * (w / total * scale)).backward()
        loss_sum += float(loss.detach()) * w
        for k, v in mb_stats.items():
            stats[k] = stats.get(k, 0.0) + float(v) * w
    out_stats = _reduce_stats(loss_sum, stats, local_total, token_normalize_scope, dp_group)
    out_stats["n_mbs"] = float(len(mbs))
    return out_stats


def _all_reduce_max(value: float, device, group=None) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _reduce_stats(
    loss_sum: float, stats: dict[str, float], local_total: float, scope: str, group=None
) -> dict[str, float]:
    """Weighted sums -> means: over this rank alone, or over every rank of the group."""
    if dp_world(group) == 1:
        denom = local_total if local_total > 0 else 1.0
        out = {k: v / denom for k, v in stats.items()}
        out["loss"] = loss_sum / denom
        out["loss_weight"] = local_total
        return out
    parts: list = [None] * dp_world(group)
    dist.all_gather_object(parts, (loss_sum, stats, local_total), group=group)
    total = sum(p[2] for p in parts)
    denom = total if total > 0 else 1.0
    sums: dict[str, float] = {}
    for _, s, _ in parts:
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + v
    out = {k: v / denom for k, v in sums.items()}
    if scope == "global":
        out["loss"] = sum(p[0] for p in parts) / denom
    else:  # the mean of every rank's own token mean
        out["loss"] = sum(p[0] / p[2] for p in parts if p[2] > 0) / len(parts)
    out["loss_weight"] = total
    return out


def clip_and_step(params, optimizer: torch.optim.Optimizer, max_norm: float | None) -> float:
    """Clip the global gradient norm, step (skipped if the norm is not finite), zero the grads."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if torch.isfinite(torch.tensor(norm_value)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm_value


def average_gradients(params, group=None, bucket_numel: int = 1 << 25) -> None:
    """Average `.grad` over the ranks of `group` (replicated data parallelism without DDP).

    A parameter without a gradient on some rank counts as zeros there. Gradients travel in flat
    buckets of at most `bucket_numel` elements (one all-reduce each).
    """
    world = dp_world(group)
    if world == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        bucket.clear()

    size = 0
    for p in params:
        if bucket and (size + p.numel() > bucket_numel or p.grad.dtype != bucket[0].grad.dtype):
            flush()
            size = 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        flush()

"""The micro-batched, loss-weighted training step shared by the backends.

Each micro-batch's loss is weighted by `loss_weight_fn(mb) / total_weight`, where the total is summed
over all micro-batches and, for `token_normalize_scope="global"`, over all data-parallel ranks. The
result is therefore independent of how the batch is split into micro-batches (and of how samples are
spread over ranks, for "global"). With "dp", every rank normalizes by its own total and the gradients
are averaged over ranks.
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
) -> dict[str, float]:
    """Forward + backward every micro-batch with its weight; returns weighted-mean stats."""
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
    stats: dict[str, float] = {}
    loss_sum = 0.0
    for mb, w in zip(mbs, weights, strict=True):
        if w == 0 or total == 0:
            continue
        with autocast or nullcontext():
            out = run(mb)
            loss, mb_stats = loss_fn(out, mb)
        (loss * (w / total * scale)).backward()
        loss_sum += float(loss.detach()) * w
        for k, v in mb_stats.items():
            stats[k] = stats.get(k, 0.0) + float(v) * w
    denom = local_total if local_total > 0 else 1.0
    out_stats = {k: v / denom for k, v in stats.items()}
    out_stats["loss"] = loss_sum / denom
    out_stats["loss_weight"] = local_total
    out_stats["n_mbs"] = float(len(mbs))
    return out_stats


def clip_and_step(params, optimizer: torch.optim.Optimizer, max_norm: float | None) -> float:
    """Clip the global gradient norm, step (skipped if the norm is not finite), zero the grads."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if torch.isfinite(torch.tensor(norm_value)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm_value

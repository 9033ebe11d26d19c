"""The pipeline schedule of the megatron engine: all forward passes, then all backward passes (GPipe).

Why our own and not megatron's ``get_forward_backward_func``: megatron's schedules need CUDA (they
cannot run on CPU at all) and one fixed activation shape [seq_length, micro_batch_size, hidden] for
every micro-batch, while our micro-batches are packed sequences of varying count and length, padded
per micro-batch. This schedule runs unchanged on gloo (CPU) and NCCL (GPU).

One training step on pipeline stage p of P, micro-batches 0..M-1 (each stage holds the same batch):

    forward,  i = 0..M-1:   x_i = recv from p-1 (first stage: none) -> y_i = stage(x_i)
                            -> send y_i to p+1 (last stage: loss_i = last_stage_fn(y_i), kept)
    backward, i = M-1..0:   last stage: loss_i.backward();  else: dy_i = recv from p+1,
                            y_i.backward(dy_i)  -> send dx_i = x_i.grad to p-1 (first stage: none)

The activation shape is known on every stage from the micro-batch itself: [s, b, h] with s the
longest sequence and b the number of sequences. Every stage keeps all M micro-batches' activations
alive until the backward phase (GPipe's memory cost; megatron's 1F1B would keep at most P). Sends and
receives are blocking and in the same order on both sides, so no stage can wait on one that waits on
it: forward only waits on p-1, backward only on p+1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Stage:
    """This rank's place in its pipeline (global ranks of its neighbours)."""

    first: bool
    last: bool
    prev_rank: int | None
    next_rank: int | None
    last_rank: int  # global rank of the last stage of this pipeline (same TP rank)
    group: Any  # the pipeline process group
    size: int

    @classmethod
    def current(cls) -> Stage:
        from megatron.core import parallel_state as ps

        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        return cls(
            first=first,
            last=last,
            prev_rank=None if first else ps.get_pipeline_model_parallel_prev_rank(),
            next_rank=None if last else ps.get_pipeline_model_parallel_next_rank(),
            last_rank=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
            size=ps.get_pipeline_model_parallel_world_size(),
        )

    def broadcast_from_last(self, obj: Any) -> Any:
        """The last stage's ``obj`` on every stage (a pickled broadcast; keep it small)."""
        if self.size == 1:
            return obj
        box = [obj if self.last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]


def run_schedule(
    stage: Stage,
    mbs: Sequence[Any],
    forward_step: Callable[[Any, torch.Tensor | None], Any],
    last_stage_fn: Callable[[Any, Any], torch.Tensor | None],
    activation_shape: Callable[[Any], tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
    backward: bool,
) -> None:
    """Run ``mbs`` through this stage; with ``backward``, back-propagate them too.

    ``forward_step(mb, x)`` is this stage's forward (``x`` is the received activation, None on the
    first stage). On the last stage ``last_stage_fn(mb, y)`` consumes the output: with ``backward``
    it returns the (already weighted) scalar loss to back-propagate, else it records what it needs.
    """
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    y: torch.Tensor | None  # the stage's output; on the last stage, what last_stage_fn returns
    for mb in mbs:
        x = None
        if not stage.first:
            x = torch.empty(activation_shape(mb), dtype=dtype, device=device)  # [s, b, h]
            dist.recv(x, src=stage.prev_rank)
            x.requires_grad_(backward)
        y = forward_step(mb, x)
        if stage.last:
            y = last_stage_fn(mb, y)
        else:
            dist.send(y.detach().contiguous(), dst=stage.next_rank)
        if backward:
            if y is None:  # the last stage's last_stage_fn returned no loss
                raise RuntimeError("last_stage_fn must return a loss to back-propagate")
            saved.append((x, y))
    if not backward:
        return
    for x, y in reversed(saved):
        if stage.last:
            y.backward()
        else:
            dy = torch.empty_like(y)
            dist.recv(dy, src=stage.next_rank)
            torch.autograd.backward(y, dy)
        if not stage.first:
            assert x is not None  # every stage but the first received its input
            dist.send(x.grad if x.grad is not None else torch.zeros_like(x), dst=stage.prev_rank)

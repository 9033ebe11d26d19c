"""Per-token log-probs and entropy from hidden states and the LM head, chunk by chunk of tokens.

For hidden states h (N, H), the head's weight W (V, H) (and bias b), targets y (N,) and temperature T:

    z_n      = (h_n W^T + b) / T                        the tempered logits of token n, in fp32
    lse_n    = log sum_v exp(z_nv)
    logp_n   = z_n[y_n] - lse_n                         log p(y_n)
    H_n      = lse_n - sum_v p_nv z_nv                  entropy, p_nv = exp(z_nv - lse_n)

computed `chunk_rows` tokens at a time, so at most one chunk of fp32 logits (and its softmax) is ever
alive, never the (N, V) matrix. The backward pass recomputes each chunk's logits from h and W:

    d logp_n / d z_nv = [v = y_n] - p_nv
    d H_n    / d z_nv = -p_nv (log p_nv + H_n)
    dL/dh = (G / T) W,   dL/dW = (G / T)^T h,   dL/db = sum_n (G / T)_n     with G = dL/dz per chunk

Numerics follow the plain formula `log_softmax(logits.float() / T)`: the logits come from the same
matmul in the same dtype (autocast's when it is on, else the inputs'), then are cast to fp32.

Vocab-parallel heads (megatron's tensor parallelism): each rank holds the rows [start, start + V_r) of
W; the maximum, the sum of exponentials, the target logit and sum p z are all-reduced over the
tensor-parallel group, and dL/dh is summed over it (h is replicated there).

`weight=None` means `hidden` already are the logits (N, V): the same chunked formulas, the gradient
going to the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

# Elements of one chunk's fp32 logits (32 Mi floats = 128 MiB): with Qwen's 151,936-token vocabulary
# that is 220 tokens per chunk.
CHUNK_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocab-parallel head: global ids [start, start + size) over `group`."""

    group: Any
    start: int
    size: int


def chunk_rows(vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk: as many as fit `chunk_elements` fp32 logits (at least 1)."""
    return max(1, chunk_elements // max(vocab, 1))


def token_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    *,
    bias: Tensor | None = None,
    with_entropy: bool = True,
    shard: VocabShard | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """(logp (N,), entropy (N,) or None), both fp32; differentiable wrt `hidden`, `weight`, `bias`.

    hidden (N, H) with weight (V, H), or logits (N, V) with `weight=None`; targets (N,) global token ids.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = hidden.shape[-1] if weight is None else weight.shape[0]
    rows = chunk_rows(vocab, chunk_elements)
    logp, ent = _TokenStats.apply(
        hidden, weight, bias, targets, float(temperature), rows, with_entropy, shard
    )
    return logp, (ent if with_entropy else None)


def _compute_dtype(hidden: Tensor, weight: Tensor | None) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on, else the inputs' promotion."""
    if weight is None:
        return hidden.dtype
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _all_reduce(t: Tensor, shard: VocabShard | None, op=dist.ReduceOp.SUM) -> Tensor:
    if shard is not None and dist.get_world_size(shard.group) > 1:
        dist.all_reduce(t, op=op, group=shard.group)
    return t


class _Head:
    """Chunk logits z = (h W^T + b) / T in fp32, with W (and b) cast once to the compute dtype."""

    def __init__(self, hidden: Tensor, weight: Tensor | None, bias: Tensor | None, temperature: float, cd):
        self.cd, self.temperature = cd, temperature
        self.weight = None if weight is None else weight.detach().to(cd)
        self.bias = None if bias is None else bias.detach().to(cd)
        self.hidden = hidden.detach()

    def logits(self, lo: int, hi: int) -> Tensor:  # (C, V) fp32, a new tensor
        h = self.hidden[lo:hi]
        if self.weight is None:
            z = h.float()
            z = z.clone() if z.data_ptr() == h.data_ptr() else z
        else:
            with torch.autocast(h.device.type, enabled=False):
                z = F.linear(h.to(self.cd), self.weight, self.bias).float()
        return z.div_(self.temperature) if self.temperature != 1.0 else z


def _local_targets(targets: Tensor, shard: VocabShard | None, vocab: int) -> tuple[Tensor, Tensor]:
    """Target columns in this rank's logits, and whether this rank holds them."""
    local = targets - (shard.start if shard is not None else 0)
    here = (local >= 0) & (local < vocab)
    return local.clamp(0, max(vocab - 1, 0)), here


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, with_entropy, shard):
        cd = _compute_dtype(hidden, weight)
        head = _Head(hidden, weight, bias, temperature, cd)
        n = hidden.shape[0]
        vocab = hidden.shape[-1] if weight is None else weight.shape[0]
        local, here = _local_targets(targets, shard, vocab)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            z = head.logits(lo, hi)  # (C, V_r)
            zt = (  # the target's logit on the rank that holds it, 0 elsewhere
                z.gather(-1, local[lo:hi, None]).squeeze(-1) * here[lo:hi] if vocab else z.new_zeros(hi - lo)
            )
            if shard is None:
                c_lse = torch.logsumexp(z, -1)  # (C,)
            else:  # max and sum of exponentials over every rank's rows
                m = z.max(-1).values if vocab else z.new_full((hi - lo,), float("-inf"))
                m = _all_reduce(m, shard, dist.ReduceOp.MAX)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                c_lse = m + _all_reduce(z.sub(m[:, None]).exp_().sum(-1), shard).log()
            lse[lo:hi] = c_lse
            logp[lo:hi] = _all_reduce(zt, shard) - c_lse
            if with_entropy:
                p = z.sub(c_lse[:, None]).exp_()  # softmax
                pz = p.mul_(z.clamp_(min=torch.finfo(z.dtype).min)).sum(-1)  # sum_v p z (-inf logits: 0)
                ent[lo:hi] = c_lse - _all_reduce(pz, shard)
                del p
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.rows, ctx.shard, ctx.cd = temperature, rows, shard, cd
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if not ctx.with_entropy:
            g_ent = None
        if g_logp is None and g_ent is None:
            return (None,) * 8
        head = _Head(hidden, weight, bias, ctx.temperature, ctx.cd)
        n = hidden.shape[0]
        vocab = hidden.shape[-1] if weight is None else weight.shape[0]
        local, here = _local_targets(targets, ctx.shard, vocab)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for lo in range(0, n, ctx.rows):
            hi = min(lo + ctx.rows, n)
            g = head.logits(lo, hi).sub_(lse[lo:hi, None])  # (C, V_r) log p
            # dL/dz = -p * (g_logp + g_ent * (log p + H)) + g_logp * onehot(y)
            coef = g.new_zeros(hi - lo) if g_logp is None else g_logp[lo:hi].float()
            if g_ent is None:
                g.exp_().mul_(-coef[:, None])
            else:
                g.clamp_(min=torch.finfo(g.dtype).min)  # -inf logits: p = 0, no NaN
                p = g.exp()
                g.add_(ent[lo:hi, None]).mul_(g_ent[lo:hi, None].float()).add_(coef[:, None]).mul_(p).neg_()
                del p
            if g_logp is not None and vocab:  # + g_logp at the target, on the rank that holds it
                g.scatter_add_(1, local[lo:hi, None], (coef * here[lo:hi])[:, None])
            if ctx.temperature != 1.0:
                g.div_(ctx.temperature)  # d z / d logits = 1 / T
            if weight is None:
                if need_h:
                    grad_h[lo:hi] = g.to(hidden.dtype)
                continue
            gc = g.to(ctx.cd)
            del g
            if need_h:
                gh = gc @ head.weight  # (C, H)
                grad_h[lo:hi] = _all_reduce(gh, ctx.shard).to(hidden.dtype)
            if need_w:  # accumulated in fp32; inside the matmul when it runs in fp32
                hc = head.hidden[lo:hi].to(ctx.cd)
                if gc.dtype == torch.float32:
                    grad_w.addmm_(gc.t(), hc)
                else:
                    grad_w.add_((gc.t() @ hc).float())
            if need_b:
                grad_b.add_(gc.float().sum(0))
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )

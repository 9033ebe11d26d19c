"""Model FLOPs of the work a run does, and the matmul peak of the cores it does it on.

Counted as PaLM's model-FLOPs utilization counts them (dense matmuls only; attention not halved for
causality), for a decoder with N parameters, L layers and hidden size H, over sequences of lengths l_i:

    forward  = 2 * N * sum_i(l_i) + 4 * L * H * sum_i(l_i^2)
    training = 3 * forward                      (backward = 2 x forward)

Generation with a KV cache computes, over a whole sample, what one forward pass over its full sequence
computes (each new token attends to the tokens before it), so a generated sample counts as the forward
pass of its prompt + response. LoRA training is counted as full training (its frozen weights still
need the backward pass through them, only their weight gradients are skipped): an upper bound.

Peak: the best rate of a square fp32 (and bf16, where the CPU has bf16 instructions) matmul on the
threads torch uses now, measured, not read from a data sheet: "share of peak" = achieved / measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class FlopShape:
    params: int  # N: the weights matmuls use (the whole model's, also when this rank holds a shard)
    layers: int  # L
    hidden: int  # H


def shape_of(module: Any) -> FlopShape | None:
    """The shape of a transformers model (or peft's wrapper of one); None for anything else. N counts
    the weights matmuls use: every parameter but the input embedding table (a lookup), which is counted
    once when the output projection shares it (tied embeddings)."""
    config = getattr(module, "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not isinstance(module, torch.nn.Module) or not layers or not hidden:
        return None
    params = sum(p.numel() for p in module.parameters())  # a shared tensor is listed once
    hf: Any = module  # a transformers PreTrainedModel (duck-typed)
    embed = hf.get_input_embeddings() if hasattr(hf, "get_input_embeddings") else None
    output = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if embed is not None and (output is None or output.weight is not embed.weight):
        params -= embed.weight.numel()
    return FlopShape(params, int(layers), int(hidden))


def forward_flops(shape: FlopShape, seqlens: list[int]) -> float:
    """2 N sum(l) + 4 L H sum(l^2): one forward pass over sequences of lengths `seqlens`."""
    return 2.0 * shape.params * sum(seqlens) + 4.0 * shape.layers * shape.hidden * sum(n * n for n in seqlens)


def train_flops(shape: FlopShape, seqlens: list[int]) -> float:
    """Forward + backward (twice the forward) over `seqlens`."""
    return 3.0 * forward_flops(shape, seqlens)


def has_native_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX); without, bf16 is emulated."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def matmul_peak(
    dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.25, device: str = "cpu"
) -> float:
    """The best FLOP/s of a `size` x `size` matmul on `device` (on a CPU: torch's current threads),
    over about `seconds`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b  # warm-up: kernels chosen, pages touched
    sync()
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end or best == float("inf"):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def peaks() -> dict[str, float]:
    """{"fp32": FLOP/s} and "bf16" where the CPU computes it natively."""
    out = {"fp32": matmul_peak(torch.float32)}
    if has_native_bf16():
        out["bf16"] = matmul_peak(torch.bfloat16)
    return out

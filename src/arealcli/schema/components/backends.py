"""Argument models of the built-in backends."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arealcli.schema.base import StrictModel
from arealcli.schema.components.engine import OptimizerConfig

Dtype = Literal["float32", "bfloat16", "float16"]


class HFBackendArgs(StrictModel):
    """The embedded transformers backend: one process, CPU or one GPU."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when available, else cpu."
    )
    dtype: Dtype = Field("float32", description="Parameter and compute dtype.")
    optimizer: OptimizerConfig | None = Field(
        None, description="Optimizer for trained models; null for inference-only models."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory."
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel.")

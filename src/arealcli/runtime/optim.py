"""Optimizer construction and the learning-rate schedule (a pure function of the step)."""

from __future__ import annotations

import math
from typing import TypeVar

import torch

from arealcli.schema.components.engine import OptimizerConfig


def build_optimizer(params, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.type == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


def lr_at(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Learning rate at optimizer step `step` (0-based) of `total_steps`.

    Linear warmup from 0 over `warmup_steps_proportion * total_steps` steps, then constant, linear or
    cosine decay from `lr` to `lr * min_lr_ratio` at the last step.
    """
    total_steps = max(total_steps, 1)
    warmup = int(cfg.warmup_steps_proportion * total_steps)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_scheduler == "linear":
        return floor + (cfg.lr - floor) * (1 - progress)
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


_Optimizer = TypeVar("_Optimizer")


def require_optimizer(
    optimizer: _Optimizer | None, cfg: OptimizerConfig | None
) -> tuple[_Optimizer, OptimizerConfig]:
    """The optimizer of a model being trained and its settings; a model without them cannot be trained."""
    if optimizer is None or cfg is None:
        raise RuntimeError("this model has no optimizer: set `optimizer:` in its backend args to train it")
    return optimizer, cfg


def begin_step(
    optimizer, cfg: OptimizerConfig | None, total_steps: int, version_steps: int, lr_scale: float
) -> float:
    """Set the learning rate of the training step `version_steps` (x lr_scale); a model without an
    optimizer cannot be trained."""
    optimizer, cfg = require_optimizer(optimizer, cfg)
    lr = lr_at(version_steps, total_steps, cfg) * lr_scale
    set_lr(optimizer, lr)
    return lr

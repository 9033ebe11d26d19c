"""One logger, several sinks: JSONL in the run directory, TensorBoard, and the console."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    def write(self, step: int, stats: dict[str, float]) -> None: ...
    def close(self) -> None: ...


class JSONLSink:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)

    def write(self, step: int, stats: dict[str, float]) -> None:
        clean = {
            k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in stats.items()
        }
        self.f.write(json.dumps({"step": step, **clean}) + "\n")

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def write(self, step: int, stats: dict[str, float]) -> None:
        for k, v in stats.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


def tensorboard_sink(log_dir: Path) -> TensorBoardSink | None:
    try:
        return TensorBoardSink(log_dir)
    except ImportError:  # the caller says so
        return None


class WandbSink:
    """Weights & Biases: one run per training run, the resolved recipe as its config."""

    def __init__(self, spec, experiment: str, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            from arealcli.errors import UserError

            raise UserError("trainer.wandb needs the wandb package: pip install 'arealcli[wandb]'") from None
        self.wandb = wandb
        self.run = wandb.init(
            project=spec.project,
            name=spec.name or experiment,
            mode=spec.mode,
            dir=str(run_dir),
            tags=spec.tags,
            config=config,
            resume="allow",
            id=_run_id(run_dir),
        )

    def write(self, step: int, stats: dict[str, float]) -> None:
        self.run.log({k: v for k, v in stats.items() if isinstance(v, int | float)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _run_id(run_dir: Path) -> str:
    """The same W&B run id for a run directory, so --resume continues the same W&B run."""
    import hashlib

    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


class MetricLogger:
    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, stats: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, stats)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def fmt(stats: dict[str, float], keys: list[str]) -> str:
    parts = []
    for k in keys:
        if k in stats:
            v = stats[k]
            parts.append(f"{k.split('/')[-1] if k.count('/') > 1 else k}={v:.4g}")
    return " ".join(parts)

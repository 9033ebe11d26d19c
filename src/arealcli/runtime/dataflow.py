"""Run the algorithm's graph of model function calls (MFCs) over one batch.

Calls run in recipe order (`areal check` guarantees each call's inputs come from the dataset or an
earlier call). A generate call may return more samples than it received (n per prompt); the batch is
then expanded so every response carries its prompt's other keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from arealcli.runtime.data import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.model import Model
from arealcli.schema.recipe import CallSpec


@dataclass
class Call:
    spec: CallSpec
    interface: ModelInterface
    model: Model | None


def expand_to(batch: SequenceSample, out: SequenceSample) -> SequenceSample:
    """Repeat each sample of `batch` to line up with `out`, whose ids are (prompt id, j)."""
    if out.bs == batch.bs:
        return batch
    if out.bs % batch.bs:
        raise ValueError(f"a call returned {out.bs} samples for {batch.bs} inputs")
    expanded = batch.repeat_interleave(out.bs // batch.bs)
    if list(expanded.ids) != list(out.ids):
        raise ValueError("a generate call must return samples with ids (prompt id, j) in prompt order")
    return expanded


def run_calls(calls: list[Call], batch: SequenceSample) -> tuple[SequenceSample, dict[str, float]]:
    stats: dict[str, float] = {}
    for call in calls:
        spec = call.spec
        t0 = time.perf_counter()
        fn = getattr(call.interface, spec.type)
        result = fn(call.model, batch.select(spec.inputs), spec.mb_spec)
        if spec.type == "train_step":
            stats.update({f"{spec.name}/{k}": float(v) for k, v in result.items()})
        else:
            batch = expand_to(batch, result)
            missing = [k for k in spec.outputs if k not in result.keys]
            if missing:
                raise RuntimeError(
                    f"call {spec.name!r} did not produce {missing} (produced {sorted(result.keys)})"
                )
            batch.update_(result.select(spec.outputs))
            stats.update({f"{spec.name}/{k}": float(v) for k, v in getattr(result, "stats", {}).items()})
        stats[f"timing/{spec.name}_s"] = time.perf_counter() - t0
    return batch, stats

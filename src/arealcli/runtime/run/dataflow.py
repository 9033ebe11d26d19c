"""Run the algorithm's graph of model function calls (MFCs) over one batch.

Calls run in recipe order (`areal check` guarantees each call's inputs come from the dataset or an
earlier call). A generate call may return more samples than it received (n per prompt); the batch is
then expanded so every response carries its prompt's other keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.base import ModelInterface
from arealcli.runtime.models import flops
from arealcli.runtime.models.model import Model
from arealcli.runtime.vision import IMAGE_KEYS
from arealcli.schema.recipe import CallSpec

_UNREAD: Any = object()


@dataclass
class Call:
    spec: CallSpec
    interface: ModelInterface
    model: Model  # a call with `model: null` gets a weightless one
    _shape: Any = field(default=_UNREAD, repr=False)

    def flop_shape(self) -> flops.FlopShape | None:
        """The shape its model's FLOPs are counted from, read once (None: the model computes elsewhere,
        a server, or its shape is unknown)."""
        if self._shape is _UNREAD:
            read = getattr(self.model.module, "flop_shape", None)
            self._shape = read() if read is not None else None
        return self._shape


def expand_to(batch: SequenceSample, out: SequenceSample) -> SequenceSample:
    """Repeat each sample of `batch` to line up with `out`, whose ids are (prompt id, j)."""
    if out.bs == batch.bs and list(out.ids) == list(batch.ids):
        return batch
    if out.bs % batch.bs:
        raise ValueError(f"a call returned {out.bs} samples for {batch.bs} inputs")
    expanded = batch.repeat_interleave(out.bs // batch.bs)
    if list(expanded.ids) != list(out.ids):
        raise ValueError("a generate call must return samples with ids (prompt id, j) in prompt order")
    return expanded


def active(spec: CallSpec, step: int) -> bool:
    return spec.start_step <= step and (spec.end_step is None or step < spec.end_step)


def rename(result: SequenceSample, remap: dict[str, str]) -> SequenceSample:
    if not remap:
        return result

    def r(k: str) -> str:
        return remap.get(k, k)

    return SequenceSample(
        result.ids,
        {r(k): v for k, v in result.seqlens.items()},
        {r(k): v for k, v in result.data.items()},
        {r(k): v for k, v in result.meta.items()},
    )


def run_calls(calls: list[Call], batch: SequenceSample, step: int) -> tuple[SequenceSample, dict[str, float]]:
    """Run every call active at `step`; returns the final batch and the flat stats of the step."""
    stats: dict[str, float] = {}
    for call in calls:
        spec = call.spec
        if not active(spec, step):
            continue
        t0 = time.perf_counter()
        fn = getattr(call.interface, spec.type)
        result = fn(call.model, batch.select(spec.inputs), spec.mb_spec)
        if spec.type == "train_step":
            stats.update({f"{spec.name}/{k}": float(v) for k, v in result.items()})
        else:
            result = rename(result, spec.output_key_remap)
            batch = expand_to(batch, result)
            if "packed_input_ids" in spec.outputs and "packed_input_ids" in batch.data:
                # new sequences (generation): per-token keys of the old ones (e.g. the dataset's
                # answer loss_mask) no longer line up with them and are dropped
                old = batch.seqlens["packed_input_ids"]
                stale = {
                    k
                    for k in batch.data
                    if k not in spec.outputs and k not in IMAGE_KEYS and batch.seqlens[k] == old
                }
                batch = batch.select(batch.keys - stale)
            missing = [k for k in spec.outputs if k not in result.keys]
            if missing:
                raise RuntimeError(
                    f"call {spec.name!r} did not produce {missing} (produced {sorted(result.keys)})"
                )
            batch.update_(result.select(spec.outputs))
            stats.update({f"{spec.name}/{k}": float(v) for k, v in getattr(result, "stats", {}).items()})
        stats[f"timing/{spec.name}_s"] = time.perf_counter() - t0
        gflop = call_gflop(call, batch)
        if gflop is not None:
            stats[f"perf/{spec.name}_gflop"] = gflop
    return batch, stats


def feeding_calls(calls: list[Call], call: Call) -> list[Call]:
    """The inference calls before `call` that make what its interface's `evaluate` reads besides the
    dataset's keys (`eval_inputs`: dpo's reference log-probs), in order, to run on held-out batches too."""
    wanted = set(getattr(call.interface, "eval_inputs", ()))
    feeding: list[Call] = []
    for c in reversed(calls[: calls.index(call)]):
        if c.spec.type == "inference" and wanted & set(c.spec.outputs):
            feeding.insert(0, c)
            wanted |= set(c.spec.inputs)  # and what those read in turn
    return feeding


def call_gflop(call: Call, batch: SequenceSample) -> float | None:
    """Model GFLOPs this process computed in `call`, from the batch after it (models/flops.py): training
    counts forward and backward over its sequences (times the passes over the batch, PPO's
    sample_reuse), inference and generation one forward pass over every sequence (a generated sample:
    prompt + response). None when the model computes elsewhere (a server) or its shape is unknown."""
    shape = call.flop_shape()
    lens = batch.seqlens.get("packed_input_ids")
    if shape is None or not lens:
        return None
    if call.spec.type != "train_step":
        return flops.forward_flops(shape, lens) / 1e9
    passes = getattr(getattr(call.interface, "args", None), "sample_reuse", 1)  # PPO epochs
    return passes * flops.train_flops(shape, lens) / 1e9

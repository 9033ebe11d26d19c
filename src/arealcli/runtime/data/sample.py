"""The packed data protocol: a batch of variable-length sequences with no padding.

A `SequenceSample` holds B samples. For every key, the entries of all samples are concatenated along
dim 0 (`data[key]`, e.g. `packed_input_ids` of shape (sum_i L_i,)), and `seqlens[key][i]` is the length
of sample i's entry. Per-sample Python objects (answer strings, group ids, versions) live in `meta`.

Micro-batches are built by `split(MicroBatchSpec)`: samples are spread over bins of balanced token
counts under a token budget (`pack_bins`: as many bins as first-fit-decreasing needs, at least `n_mbs`,
filled longest-first into the lightest bin), and `reorder` undoes the permutation so outputs come back
in the original sample order. Samples that stand next to each other with the same `PAIR` value (meta)
are one unit: `split` (and `distributed.dp_slice`) never separate them, and keep their order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from arealcli.runtime.vision import IMAGE_KEYS
from arealcli.schema.components.datasets import PAIR
from arealcli.schema.components.engine import MicroBatchSpec

# The key whose lengths define a sample's size for packing, when present.
TOKEN_KEYS = ("packed_input_ids", "packed_prompts")


class Keys(dict):
    """A batch's keys -> values: a missing key is an error that lists the keys the batch has."""

    def __missing__(self, key):
        raise KeyError(f"{key!r} is not in this batch; it has {sorted(self)}") from None


@dataclass
class SequenceSample:
    ids: list[Any]
    seqlens: dict[str, list[int]] = field(default_factory=dict)
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)
    # Derived per-batch values (e.g. index tensors) computed once by whoever needs them.
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # A call's own metrics of the batch it produced (logged as `call/key`); empty for other batches.
    stats: dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, Keys):
            self.data = Keys(self.data)
        if not isinstance(self.meta, Keys):
            self.meta = Keys(self.meta)
        for key, lens in self.seqlens.items():
            if len(lens) != len(self.ids):
                raise ValueError(f"key {key!r} has {len(lens)} lengths for {len(self.ids)} samples")
            if key in self.data and self.data[key].shape[0] != sum(lens):
                raise ValueError(f"key {key!r}: {self.data[key].shape[0]} rows, lengths sum to {sum(lens)}")
        for key, values in self.meta.items():
            if len(values) != len(self.ids):
                raise ValueError(f"meta {key!r} has {len(values)} values for {len(self.ids)} samples")

    # ------------------------------------------------------------------ construction / access

    @classmethod
    def from_lists(
        cls, ids: list[Any], tensors: dict[str, list[torch.Tensor]], meta: dict[str, list[Any]] | None = None
    ) -> SequenceSample:
        """Build from one tensor per sample per key."""
        data = {k: torch.cat(v) if v else torch.empty(0) for k, v in tensors.items()}
        seqlens = {k: [t.shape[0] for t in v] for k, v in tensors.items()}
        return cls(list(ids), seqlens, data, dict(meta or {}))

    @property
    def bs(self) -> int:
        return len(self.ids)

    @property
    def keys(self) -> set[str]:
        return set(self.data) | set(self.meta)

    def unpack(self, key: str) -> list[torch.Tensor]:
        """The per-sample entries of `key`."""
        return list(torch.split(self.data[key], self.seqlens[key]))

    def cu_seqlens(self, key: str) -> torch.Tensor:
        lens = torch.tensor(self.seqlens[key], dtype=torch.long)
        return torch.nn.functional.pad(lens.cumsum(0), (1, 0))

    def padded(self, key: str, pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) right-padded copy of `key` and its bool mask."""
        rows = self.unpack(key)
        t = max((r.shape[0] for r in rows), default=0)
        out = self.data[key].new_full((self.bs, t, *self.data[key].shape[1:]), pad_value)
        mask = torch.zeros(self.bs, t, dtype=torch.bool, device=self.data[key].device)
        for i, r in enumerate(rows):
            out[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = True
        return out, mask

    def token_count(self) -> list[int]:
        for key in TOKEN_KEYS:
            if key in self.seqlens:
                return list(self.seqlens[key])
        if not self.seqlens:
            return [1] * self.bs
        return [max(lens[i] for lens in self.seqlens.values()) for i in range(self.bs)]

    def units(self) -> list[list[int]]:
        """The sample indices that must stay together, in order: runs of consecutive samples with the
        same `PAIR` value when the batch has that key, else every sample on its own."""
        if PAIR not in self.meta:
            return [[i] for i in range(self.bs)]
        out: list[list[int]] = []
        for i, pair in enumerate(self.meta[PAIR]):
            if out and self.meta[PAIR][out[-1][-1]] == pair:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    # ------------------------------------------------------------------ selection / merging

    def select(self, keys: list[str] | set[str]) -> SequenceSample:
        """Only `keys` (tensor and meta), and the sequences' images (`IMAGE_KEYS`) when the batch has
        them; missing keys are an error naming what exists."""
        missing = [k for k in keys if k not in self.keys]
        if missing:
            raise KeyError(f"keys {missing} not in the batch (has {sorted(self.keys)})")
        keys = {*keys, *(k for k in IMAGE_KEYS if k in self.data)}
        return SequenceSample(
            list(self.ids),
            {k: list(v) for k, v in self.seqlens.items() if k in keys},
            {k: v for k, v in self.data.items() if k in keys},
            {k: list(v) for k, v in self.meta.items() if k in keys},
        )

    def subset(self, indices: list[int]) -> SequenceSample:
        """The samples at `indices`, in that order."""
        data, seqlens = {}, {}
        for key, tensor in self.data.items():
            parts = self.unpack(key)
            chosen = [parts[i] for i in indices]
            data[key] = torch.cat(chosen) if chosen else tensor[:0]
            seqlens[key] = [self.seqlens[key][i] for i in indices]
        meta = {k: [v[i] for i in indices] for k, v in self.meta.items()}
        return SequenceSample([self.ids[i] for i in indices], seqlens, data, meta)

    def update_(self, other: SequenceSample) -> None:
        """Add `other`'s keys (same samples, same order) to this batch."""
        if list(other.ids) != list(self.ids):
            raise ValueError("update_ needs the same sample ids in the same order")
        self.data.update(other.data)
        self.seqlens.update(other.seqlens)
        self.meta.update(other.meta)

    def repeat_interleave(self, n: int) -> SequenceSample:
        """Each sample n times in a row (for n generations per prompt); ids become (id, j)."""
        idx = [i for i in range(self.bs) for _ in range(n)]
        out = self.subset(idx)
        out.ids = [(self.ids[i], j) for i in range(self.bs) for j in range(n)]
        return out

    @staticmethod
    def gather(samples: list[SequenceSample]) -> SequenceSample:
        """Concatenate batches that have the same keys."""
        if not samples:
            raise ValueError("gather of no samples")
        first = samples[0]
        for s in samples[1:]:
            if set(s.data) != set(first.data) or set(s.meta) != set(first.meta):
                raise ValueError(f"gather: key sets differ ({sorted(first.keys)} vs {sorted(s.keys)})")
        return SequenceSample(
            [i for s in samples for i in s.ids],
            {k: [n for s in samples for n in s.seqlens[k]] for k in first.seqlens},
            {k: torch.cat([s.data[k] for s in samples]) for k in first.data},
            {k: [v for s in samples for v in s.meta[k]] for k in first.meta},
        )

    # ------------------------------------------------------------------ micro-batches

    def split(self, mb_spec: MicroBatchSpec) -> tuple[list[SequenceSample], list[int], list[int]]:
        """Split into micro-batches; returns (mbs, forward_indices, backward_indices).

        `forward_indices` lists original sample indices in micro-batch order; `backward_indices` is
        its inverse, so `SequenceSample.gather(mbs).subset(backward_indices)` is the original order.
        The units of `units()` (a preference pair) are packed whole, never split over micro-batches.
        """
        units, tokens = self.units(), self.token_count()
        sizes = [sum(tokens[i] for i in unit) for unit in units]
        unit_bins = pack_bins(sizes, mb_spec.n_mbs, mb_spec.max_tokens_per_mb)
        bins = [[i for u in b for i in units[u]] for b in unit_bins]  # units in order: sample order kept
        forward = [i for b in bins for i in b]
        backward = [0] * len(forward)
        for pos, i in enumerate(forward):
            backward[i] = pos
        return [self.subset(b) for b in bins], forward, backward


def pack_bins(sizes: list[int], min_bins: int, budget: int | None) -> list[list[int]]:
    """Group item indices into bins of balanced loads.

    The number of bins k is the larger of `min_bins` and the number first-fit-decreasing needs under
    the budget (largest first, into the first bin with room; an item larger than the budget gets a bin
    of its own). The items are then spread over k bins longest-first, each into the lightest bin (ties:
    the bin with fewer items, then the first), and k grows until every bin respects the budget (or holds
    a single item). So the bins' loads differ by at most the largest item, and with one bin per item at
    worst. Bins never empty; indices inside a bin keep their original order; bins are ordered by their
    first index.
    """
    n = len(sizes)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: (-sizes[i], i))
    k = max(min(min_bins, n), first_fit_decreasing_count(sizes, order, budget))
    while True:
        bins = balanced_bins(sizes, order, k)
        fits = budget is None or all(sum(sizes[i] for i in b) <= budget or len(b) == 1 for b in bins)
        if fits or k == n:
            break
        k += 1
    bins = [sorted(b) for b in bins if b]
    return sorted(bins, key=lambda b: b[0])


def first_fit_decreasing_count(sizes: list[int], order: list[int], budget: int | None) -> int:
    """Bins first-fit-decreasing fills under `budget` (`order`: largest first); 1 without a budget."""
    if budget is None:
        return 1
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + sizes[i] <= budget:
                loads[b] += sizes[i]
                break
        else:
            loads.append(sizes[i])
    return len(loads)


def balanced_bins(sizes: list[int], order: list[int], k: int) -> list[list[int]]:
    """Longest-first greedy partition into k bins: each item (in `order`) into the lightest bin."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        b = min(range(k), key=lambda j: (loads[j], len(bins[j]), j))  # empty bins first
        bins[b].append(i)
        loads[b] += sizes[i]
    return bins

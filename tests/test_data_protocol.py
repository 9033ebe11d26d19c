"""The packed data protocol: SequenceSample split / gather / reorder, pack_bins, padded, unpack."""

from __future__ import annotations

import random

import pytest
import torch

from arealcli.runtime.data.sample import SequenceSample, pack_bins
from arealcli.schema.components.engine import MicroBatchSpec


def random_batch(bs: int, seed: int) -> SequenceSample:
    """Several keys with different per-sample lengths and shapes, plus meta."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    ids, prompts, inputs, masks, logits, rewards = [], [], [], [], [], []
    for i in range(bs):
        p, a = rng.randint(1, 9), rng.randint(0, 12)
        ids.append(f"s{i}")
        prompts.append(torch.randint(0, 50, (p,), generator=g))
        inputs.append(torch.cat([prompts[-1], torch.randint(0, 50, (a,), generator=g)]))
        masks.append(torch.arange(p + a) < p)
        logits.append(torch.randn(p + a, 3, generator=g))  # a 2-D key: (tokens, 3)
        rewards.append(torch.randn(1, generator=g))
    return SequenceSample.from_lists(
        ids,
        {
            "packed_prompts": prompts,
            "packed_input_ids": inputs,
            "prompt_mask": masks,
            "logits": logits,
            "rewards": rewards,
        },
        {"answers": [f"answer {i}" for i in range(bs)], "group": [i // 2 for i in range(bs)]},
    )


def assert_same(a: SequenceSample, b: SequenceSample) -> None:
    assert a.ids == b.ids
    assert a.seqlens == b.seqlens
    assert set(a.data) == set(b.data)
    for k in a.data:
        assert torch.equal(a.data[k], b.data[k]), k
    assert a.meta == b.meta


SPECS = [
    MicroBatchSpec(),
    MicroBatchSpec(n_mbs=3),
    MicroBatchSpec(n_mbs=50),
    MicroBatchSpec(max_tokens_per_mb=24),
    MicroBatchSpec(n_mbs=4, max_tokens_per_mb=30),
    MicroBatchSpec(max_tokens_per_mb=5),  # smaller than most samples: one sample per bin
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"n{s.n_mbs}-t{s.max_tokens_per_mb}")
def test_split_gather_reorder_round_trip(seed, spec):
    batch = random_batch(bs=random.Random(seed).randint(1, 17), seed=seed)
    mbs, forward, backward = batch.split(spec)
    assert sorted(forward) == list(range(batch.bs))
    assert [forward[b] for b in backward] == list(range(batch.bs))
    assert sum(mb.bs for mb in mbs) == batch.bs
    assert len(mbs) >= min(spec.n_mbs, batch.bs)
    # Every micro-batch is a valid SequenceSample whose samples are the forward order.
    assert [i for mb in mbs for i in mb.ids] == [batch.ids[i] for i in forward]
    if spec.max_tokens_per_mb is not None:
        for mb in mbs:
            tokens = sum(mb.seqlens["packed_input_ids"])
            assert tokens <= spec.max_tokens_per_mb or mb.bs == 1
    assert_same(SequenceSample.gather(mbs).subset(backward), batch)


def test_split_then_per_sample_outputs_come_back_in_order():
    batch = random_batch(9, seed=11)
    mbs, _, backward = batch.split(MicroBatchSpec(n_mbs=3, max_tokens_per_mb=20))
    per_sample = [x for mb in mbs for x in mb.unpack("packed_input_ids")]
    restored = [per_sample[i] for i in backward]
    for got, want in zip(restored, batch.unpack("packed_input_ids"), strict=True):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- pack_bins


@pytest.mark.parametrize("seed", range(20))
def test_pack_bins_properties(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(0, 40) for _ in range(rng.randint(1, 30))]  # 0: an empty entry
    budget = rng.choice([None, 10, 25, 60, 200])
    min_bins = rng.randint(1, 8)
    bins = pack_bins(sizes, min_bins, budget)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(sizes)))  # every index exactly once
    assert all(b for b in bins)
    assert all(b == sorted(b) for b in bins)  # original order inside a bin
    assert [b[0] for b in bins] == sorted(b[0] for b in bins)
    assert len(bins) >= min(min_bins, len(sizes))
    if budget is not None:
        for b in bins:
            assert sum(sizes[i] for i in b) <= budget or len(b) == 1


def test_pack_bins_balanced_by_hand():
    # First-fit-decreasing needs 3 bins of 8 (6+2, 5+3, 4+1: loads 8, 8, 5). Balanced over 3 bins,
    # largest first into the lightest: 6 -> A; 5 -> B; 4 -> C; 3 -> C (7); 2 -> B (7); 1 -> A (7).
    sizes = [5, 3, 4, 2, 6, 1]
    assert pack_bins(sizes, 1, 8) == [[0, 3], [1, 2], [4, 5]]
    # Without a budget everything fits in one bin; n_mbs forces a balanced split.
    assert pack_bins(sizes, 1, None) == [[0, 1, 2, 3, 4, 5]]
    two = pack_bins(sizes, 2, None)
    assert len(two) == 2
    assert sorted(sum(sizes[i] for i in b) for b in two) == [10, 11]


@pytest.mark.parametrize("seed", range(20))
def test_pack_bins_loads_are_balanced(seed):
    """The loads of the bins differ by at most the largest item (longest-first into the lightest bin),
    with no more bins than first-fit-decreasing needs when the budget allows."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 100) for _ in range(rng.randint(2, 60))]
    budget = rng.choice([None, 150, 400])
    min_bins = rng.randint(1, 6)
    bins = pack_bins(sizes, min_bins, budget)
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= max(sizes)
    if budget is not None:
        ffd: list[int] = []
        for s in sorted(sizes, reverse=True):
            j = next((j for j, load in enumerate(ffd) if load + s <= budget), None)
            if j is None:
                ffd.append(s)
            else:
                ffd[j] += s
        assert len(bins) >= max(min(min_bins, len(sizes)), len(ffd))


def test_pack_bins_oversize_items_get_their_own_bin():
    bins = pack_bins([3, 50, 4, 70, 2], 1, 10)
    assert [1] in bins and [3] in bins
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 4]
    assert len(bins) == 3  # the three small ones share one bin


def test_pack_bins_min_bins_with_a_budget_adds_bins_until_it_fits():
    sizes = [9, 9, 9, 1]
    bins = pack_bins(sizes, 2, 10)  # FFD alone gives 3 bins: already >= 2
    assert len(bins) == 3
    bins = pack_bins([4, 4, 4, 4], 3, 100)  # budget is loose: n_mbs decides
    assert len(bins) == 3
    assert pack_bins([], 4, 10) == []
    # n_mbs is a lower bound even when items are empty (no bin may stay empty while another holds two).
    assert pack_bins([0, 0, 0], 3, None) == [[0], [1], [2]]
    assert pack_bins([5, 0, 0], 3, 10) == [[0], [1], [2]]
    assert pack_bins([5], 4, 1) == [[0]]


# --------------------------------------------------------------------------- padded / unpack / misc


def test_padded_and_unpack():
    batch = random_batch(5, seed=3)
    rows = batch.unpack("packed_input_ids")
    assert [r.shape[0] for r in rows] == batch.seqlens["packed_input_ids"]
    assert torch.equal(torch.cat(rows), batch.data["packed_input_ids"])
    padded, mask = batch.padded("packed_input_ids", pad_value=-7)
    T = max(batch.seqlens["packed_input_ids"])
    assert padded.shape == (5, T) and mask.shape == (5, T) and mask.dtype == torch.bool
    for i, r in enumerate(rows):
        n = r.shape[0]
        assert torch.equal(padded[i, :n], r)
        assert (padded[i, n:] == -7).all()
        assert mask[i, :n].all() and not mask[i, n:].any()
    # The packed order is the row-major order of the mask: padded[mask] re-packs.
    assert torch.equal(padded[mask], batch.data["packed_input_ids"])
    logits, lmask = batch.padded("logits")
    assert logits.shape == (5, T, 3)
    assert torch.equal(logits[lmask], batch.data["logits"])
    cu = batch.cu_seqlens("packed_input_ids")
    assert cu[0] == 0 and cu[-1] == sum(batch.seqlens["packed_input_ids"])


def test_token_count_prefers_input_ids():
    batch = random_batch(4, seed=2)
    assert batch.token_count() == batch.seqlens["packed_input_ids"]
    no_ids = batch.select(["rewards", "answers"])
    assert no_ids.token_count() == [1, 1, 1, 1]
    assert SequenceSample(["a", "b"], meta={"x": [1, 2]}).token_count() == [1, 1]


def test_select_subset_repeat_and_update():
    batch = random_batch(4, seed=5)
    sel = batch.select(["packed_prompts", "answers"])
    assert sel.keys == {"packed_prompts", "answers"}
    with pytest.raises(KeyError, match="not in the batch"):
        batch.select(["nope"])
    rep = batch.repeat_interleave(3)
    assert rep.bs == 12
    assert rep.ids[:4] == [("s0", 0), ("s0", 1), ("s0", 2), ("s1", 0)]
    assert rep.meta["answers"][3] == "answer 1"
    assert torch.equal(rep.unpack("packed_prompts")[5], batch.unpack("packed_prompts")[1])
    extra = SequenceSample.from_lists(batch.ids, {"values": [torch.ones(2)] * 4})
    batch.update_(extra)
    assert "values" in batch.keys
    with pytest.raises(ValueError, match="same sample ids"):
        batch.update_(SequenceSample.from_lists(["x"] * 4, {"v": [torch.ones(1)] * 4}))


def test_validation_errors():
    with pytest.raises(ValueError, match="lengths for"):
        SequenceSample(["a", "b"], {"k": [1]}, {"k": torch.zeros(1)})
    with pytest.raises(ValueError, match="rows, lengths sum"):
        SequenceSample(["a"], {"k": [2]}, {"k": torch.zeros(3)})
    with pytest.raises(ValueError, match="meta"):
        SequenceSample(["a"], meta={"m": [1, 2]})
    a, b = random_batch(2, 0), random_batch(2, 1).select(["packed_prompts"])
    with pytest.raises(ValueError, match="key sets differ"):
        SequenceSample.gather([a, b])

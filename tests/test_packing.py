"""Padding-free micro-batches (`backends.packing`, `hf.run_packed`): sequences packed into rows with
per-sequence position ids give the outputs, losses and gradients of the padded path."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from arealcli.runtime.backends import packing
from arealcli.runtime.backends.hf import choose_layout, run_packed
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, takes_lm_output
from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
from arealcli.runtime.models.value_head import with_value_head
from arealcli.schema.components.engine import MicroBatchSpec, OptimizerConfig
from tests.conftest import tiny_module
from tests.test_engine import make_engine

CPU = torch.device("cpu")


def batch_of(lens: list[int], seed: int = 0, vocab: int = 90) -> SequenceSample:
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lens]
    masks = [torch.arange(n) < n // 3 for n in lens]
    return SequenceSample.from_lists(list(range(len(lens))), {"packed_input_ids": ids, "prompt_mask": masks})


def test_rows_put_every_token_back_in_packed_order():
    lens = [5, 1, 7, 3, 2]
    ids = torch.arange(sum(lens)) + 100
    rows = packing.rows_of(lens, "packed", 8)
    batch = packing.build_rows(ids, lens, rows, with_positions=True)
    assert batch.ids.shape == (3, 7)  # balanced rows (loads 7, 6, 5) within the capacity 8
    torch.testing.assert_close(batch.ids.flatten()[batch.index], ids)  # the packed order, exactly
    assert batch.position_ids is not None
    starts = torch.tensor([0, 5, 6, 13, 16])
    for s, n in zip(starts.tolist(), lens, strict=True):  # each sequence's positions restart at 0
        torch.testing.assert_close(batch.position_ids.flatten()[batch.index[s : s + n]], torch.arange(n))
    padded = packing.build_rows(ids, lens, packing.rows_of(lens, "padded", 8), with_positions=False)
    assert padded.ids.shape == (5, 7) and padded.position_ids is None
    torch.testing.assert_close(padded.ids.flatten()[padded.index], ids)


@pytest.mark.parametrize("attention", ["varlen-sdpa", "sdpa-mask", "eager"])
@pytest.mark.parametrize("lens", [[9, 1, 14, 4, 6], [3], [20, 20, 2, 17], [1, 1, 1]])
def test_packed_rows_equal_padded_rows(char_tok, lens, attention):
    """One packed row with per-sequence SDPA (what our backends run), rows with transformers'
    block-diagonal mask (sdpa or eager): the padded path's outputs, loss and gradients."""
    module = tiny_module(char_tok, seed=1)
    impl = {"varlen-sdpa": packing.attention_implementation("sdpa", module.config), "sdpa-mask": "sdpa"}
    module.config._attn_implementation = impl.get(attention, attention)
    assert (packing.varlen_attention(module) == "sdpa") == (attention == "varlen-sdpa")
    batch = batch_of(lens)
    assert_same_forward(module, batch, {"layout": "padded"}, {"layout": "packed"})


def assert_same_forward(module, batch: SequenceSample, first: dict, second: dict) -> None:
    """`run_packed` with keywords `first` and with `second`: the same hidden states, SFT loss and
    gradients (to float tolerance)."""
    outs = []
    for kwargs in (first, second):
        out = run_packed(module, batch, CPU, **kwargs)
        assert isinstance(out, LMOutput)
        loss, _ = sft_loss(out, batch)
        module.zero_grad()
        loss.backward()
        outs.append((out.hidden.detach(), loss.detach(), [p.grad.clone() for p in module.parameters()]))
    (h0, l0, g0), (h1, l1, g1) = outs
    torch.testing.assert_close(h1, h0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def assert_same_training(first: tuple[dict, dict], second: tuple[dict, dict]) -> None:
    """Two training steps' (stats, named parameters) agree: loss, gradient norm and updated weights."""
    (stats0, params0), (stats1, params1) = first, second
    assert stats1["loss"] == pytest.approx(stats0["loss"], rel=1e-5)
    assert stats1["grad_norm"] == pytest.approx(stats0["grad_norm"], rel=1e-4)
    for name, p in params0.items():
        torch.testing.assert_close(params1[name], p, rtol=1e-4, atol=1e-6)


def padded_engine(engine):
    """The engine forced onto one right-padded row per sequence (the layout before packing)."""
    engine.run_microbatch = lambda mb: run_packed(engine.module, mb, engine.device, layout="padded")
    return engine


@pytest.mark.parametrize(
    "spec", [MicroBatchSpec(), MicroBatchSpec(n_mbs=3), MicroBatchSpec(max_tokens_per_mb=30)]
)
def test_training_step_packed_equals_padded(char_tok, spec):
    base = tiny_module(char_tok, seed=2)
    rng = random.Random(0)
    batch = batch_of([rng.randint(2, 24) for _ in range(9)], seed=3)
    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None)
    results = []
    for force_padded in (True, False):
        engine = make_engine(char_tok, copy.deepcopy(base), opt)
        engine = padded_engine(engine) if force_padded else engine
        stats = engine.train_batch(batch, spec, sft_loss, num_answer_tokens, version_steps=0)
        results.append((stats, dict(engine.module.named_parameters())))
    assert_same_training(*results)


def test_forward_results_come_back_in_input_order(char_tok):
    from arealcli.runtime.interfaces.ppo_actor import next_token_logprobs

    engine = make_engine(char_tok, tiny_module(char_tok, seed=3))
    batch = batch_of([4, 11, 2, 8, 6, 3], seed=4)

    @takes_lm_output
    def logp(out, mb):
        assert isinstance(out, LMOutput)
        return next_token_logprobs(out, mb, 1.0)

    packed = engine.forward(batch, MicroBatchSpec(max_tokens_per_mb=12), post_hook=logp)
    padded = padded_engine(engine).forward(batch, MicroBatchSpec(n_mbs=4), post_hook=logp)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)


def test_layout_choice_and_computed_positions(char_tok):
    module = tiny_module(char_tok, seed=0)
    assert choose_layout(module, [3, 4]) == "packed"
    assert choose_layout(module, [3]) == "padded"  # one sequence: nothing to pack
    assert choose_layout(module, [5, 5, 5]) == "padded"  # one length: no padding, one batched call
    critic = with_value_head(tiny_module(char_tok, seed=0), seed=0)
    assert choose_layout(critic, [3, 4]) == "padded"  # its decoder call takes no position ids
    out = run_packed(critic, batch_of([3, 5]), CPU)
    assert isinstance(out, torch.Tensor) and out.shape == (8,)  # values (tokens,)
    # the varlen case of bench/train_throughput.py at its CPU shape: 4 sequences in [16, 128]
    lens = [100, 23, 61, 128]
    assert packing.computed_positions(module, lens, "padded") == 4 * 128
    assert packing.computed_positions(module, lens, "packed") == sum(lens)  # one row of 312
    packing_positions = packing.computed_positions(module, [600, 300, 280, 20], "packed")
    assert packing_positions == 2 * 600  # rows 600 | 300 + 280 + 20: no padding
    module.config._attn_implementation = packing.attention_implementation("sdpa", module.config)
    assert packing.computed_positions(module, [600, 300, 280, 20, 7], "packed") == 1207  # one row
    engine = make_engine(char_tok, tiny_module(char_tok, seed=0))
    assert packing.varlen_attention(engine.module) == "sdpa"  # what the hf backend sets up


def test_varlen_sdpa_keeps_padded_generation_masks(char_tok):
    """The backends' attention implementation changes nothing for calls with a padding mask (left-padded
    prompts while generating) or a KV cache."""
    module = tiny_module(char_tok, seed=2)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want = module(input_ids=ids, attention_mask=mask).logits
    module.config._attn_implementation = packing.attention_implementation("sdpa", module.config)
    got = module(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got * mask[..., None], want * mask[..., None])


def test_fsdp_step_equals_hf_step(char_tok):
    """FSDP (a world of one, fp32) takes the LM head's gathered weight into the chunked log-probs: its
    SFT step equals the hf engine's, tied embeddings included."""
    from arealcli.runtime.backends.fsdp import FSDPBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import FSDPBackendArgs

    base = tiny_module(char_tok, seed=5, tie_word_embeddings=True)
    batch = batch_of([7, 19, 3, 12, 9], seed=6)
    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None)
    hf = make_engine(char_tok, copy.deepcopy(base), opt)
    hf_stats = hf.train_batch(batch, MicroBatchSpec(n_mbs=2), sft_loss, num_answer_tokens, version_steps=0)
    backend = FSDPBackend(FSDPBackendArgs(device="cpu", optimizer=opt, mixed_precision_param="float32"))
    model = backend.initialize(Model("m", copy.deepcopy(base), char_tok), FinetuneSpec(1, 8, 8, 10))
    try:
        stats = model.module.train_batch(batch, MicroBatchSpec(n_mbs=2), sft_loss, num_answer_tokens, 0)
        assert stats["loss"] == pytest.approx(hf_stats["loss"], rel=1e-5)
        assert stats["grad_norm"] == pytest.approx(hf_stats["grad_norm"], rel=1e-4)
        want = dict(hf.module.named_parameters())
        for name, p in model.module.module.named_parameters():
            torch.testing.assert_close(p.full_tensor(), want[name], rtol=1e-4, atol=1e-6)
    finally:
        backend.destroy(model)

"""Chunked log-probs and entropy (`algo.logprobs`, `LMOutput`): equal to the plain full-logits formula in
values and gradients, through the loss contract, and through SFT and PPO training steps."""

from __future__ import annotations

import copy
import functools
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from arealcli.runtime.algo.functional import entropy_from_logits
from arealcli.runtime.algo.logprobs import VocabShard, chunk_rows, token_logprobs_and_entropy
from arealcli.runtime.backends.hf import run_packed
from arealcli.runtime.engines.lm_output import LMOutput, outputs_for, takes_lm_output
from arealcli.runtime.interfaces import token_logprobs
from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
from tests.conftest import tiny_module
from tests.test_engine import make_engine, sft_batch


def plain(logits: torch.Tensor, targets: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula before chunking: log_softmax of the full fp32 logits, and their entropy."""
    z = logits.float() / t
    return torch.log_softmax(z, -1).gather(-1, targets[:, None]).squeeze(-1), entropy_from_logits(z)


def leaves(n=23, h=12, v=41, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


def grads(outputs, weights, params):
    for p in params:
        p.grad = None
    sum((o * w).sum() for o, w in zip(outputs, weights, strict=True)).backward()
    return [p.grad.clone() for p in params]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk_elements", [1, 41 * 5, 41 * 23, 1 << 20])  # 1 row, 5, all, more
def test_values_and_gradients_equal_the_full_logits_formula(temperature, chunk_elements):
    hidden, weight, bias, targets = leaves()
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(23, generator=g), torch.randn(23, generator=g)
    params = [hidden, weight, bias]

    ref_lp, ref_ent = plain(torch.nn.functional.linear(hidden, weight, bias), targets, temperature)
    ref_grads = grads([ref_lp, ref_ent], [w_lp, w_ent], params)
    lp, ent = token_logprobs_and_entropy(
        hidden, weight, targets, temperature, bias=bias, chunk_elements=chunk_elements
    )
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads([lp, ent], [w_lp, w_ent], params), ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_logprobs_alone_and_entropy_alone_have_their_own_gradients():
    hidden, weight, _, targets = leaves(bias=False)
    want_lp = grads([plain(hidden @ weight.T, targets, 0.8)[0]], [torch.ones(23)], [hidden, weight])
    want_ent = grads([plain(hidden @ weight.T, targets, 0.8)[1]], [torch.ones(23)], [hidden, weight])
    ref_lp = plain(hidden @ weight.T, targets, 0.8)[0].detach()

    def both():
        return token_logprobs_and_entropy(hidden, weight, targets, 0.8, chunk_elements=41 * 4)

    got_lp = grads([both()[0]], [torch.ones(23)], [hidden, weight])  # the entropy output unused
    got_ent = grads([both()[1]], [torch.ones(23)], [hidden, weight])  # the log-probs unused
    for got, want in zip(got_lp + got_ent, want_lp + want_ent, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    lp_only, none = token_logprobs_and_entropy(hidden, weight, targets, 0.8, with_entropy=False)
    assert none is None
    torch.testing.assert_close(lp_only, ref_lp, rtol=1e-5, atol=1e-5)


def test_from_logits_equals_the_formula_and_masked_vocabulary_gives_no_nan():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 17, generator=g)
    logits[:, 5] = float("-inf")  # a masked token: probability 0, no NaN in values or gradients
    logits.requires_grad_()
    targets = torch.randint(0, 5, (9,), generator=g)
    ref_lp, ref_ent = plain(logits, targets, 1.3)
    want = grads([ref_lp, ref_ent], [torch.ones(9), torch.ones(9)], [logits])
    lp, ent = LMOutput.from_logits(logits).logprobs_and_entropy(targets, 1.3)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (got,) = grads([lp, ent], [torch.ones(9), torch.ones(9)], [logits])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want[0])


def test_under_bf16_autocast_the_head_runs_in_bf16_like_the_plain_path():
    hidden, weight, _, targets = leaves(n=16, h=32, v=64, bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_lp, ref_ent = plain(torch.nn.functional.linear(hidden, weight), targets, 1.0)
        lp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_elements=64 * 3)
    # the same bf16 logits, then fp32: equal up to the summation order of the matmul
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-2)
    assert lp.dtype == torch.float32


def test_chunks_hold_a_bounded_number_of_logits():
    assert chunk_rows(151936) == 220  # 32 Mi fp32 logits per chunk with Qwen's vocabulary
    assert chunk_rows(10**9) == 1


def _vocab_parallel_worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hidden, weight, _, targets = leaves(n=11, h=6, v=40, bias=False)
    rows = 40 // world
    local = weight.detach()[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    shard = VocabShard(dist.group.WORLD, rank * rows, rows)
    lp, ent = token_logprobs_and_entropy(hidden, local, targets, 0.7, shard=shard, chunk_elements=rows * 4)
    assert ent is not None
    (lp + 0.5 * ent).sum().backward()
    out[rank] = (lp.detach(), ent.detach(), hidden.grad, local.grad)
    dist.destroy_process_group()


def test_vocab_parallel_shards_give_the_full_vocabulary_result():
    """Two gloo ranks, each with half the head's rows (megatron's tensor parallelism): the log-probs,
    entropy and hidden-state gradient of every rank, and the concatenated head gradient, equal one
    process with the whole head."""
    hidden, weight, _, targets = leaves(n=11, h=6, v=40, bias=False)
    ref_lp, ref_ent = plain(hidden @ weight.T, targets, 0.7)
    want_h, want_w = grads([ref_lp, ref_ent], [torch.ones(11), torch.full((11,), 0.5)], [hidden, weight])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_vocab_parallel_worker, args=(2, port, out), nprocs=2)
    for rank in range(2):
        lp, ent, gh, _ = out[rank]
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gh, want_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([out[0][3], out[1][3]]), want_w, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the loss contract


def test_loss_functions_receive_what_they_declare():
    hidden, weight, _, _ = leaves(bias=False)
    lm = LMOutput(hidden, weight)

    def old_style(logits, mb):
        return logits

    @takes_lm_output
    def new_style(outputs, mb, scale=1.0):
        return outputs

    assert isinstance(outputs_for(old_style, lm), torch.Tensor)  # third-party code: packed logits
    torch.testing.assert_close(outputs_for(old_style, lm), hidden @ weight.T)
    assert outputs_for(new_style, lm) is lm
    assert outputs_for(functools.partial(new_style, scale=2.0), lm) is lm  # through partials
    wrapped = outputs_for(new_style, hidden @ weight.T)  # a backend that returns logits
    assert isinstance(wrapped, LMOutput) and wrapped.weight is None
    mask = torch.arange(23) % 3 == 0
    ent = lm.entropy(0.6, mask)  # entropy at some tokens only
    torch.testing.assert_close(ent, entropy_from_logits((hidden @ weight.T)[mask] / 0.6))
    values = torch.randn(5)  # a value head's outputs pass through untouched
    assert outputs_for(new_style, values) is values and outputs_for(old_style, values) is values


def test_lm_output_of_a_model_equals_its_logits_tied_and_untied(char_tok):
    for tied in (True, False):
        module = tiny_module(char_tok, seed=4, tie_word_embeddings=tied)
        batch = sft_batch(6, seed=5)
        out = run_packed(module, batch, torch.device("cpu"))
        assert isinstance(out, LMOutput)
        ids, mask = batch.padded("packed_input_ids")
        torch.testing.assert_close(out.logits, module(input_ids=ids).logits[mask], rtol=1e-4, atol=1e-5)
        logp = token_logprobs.next_token_logprobs(out, batch, 0.9)
        targets, ends = token_logprobs.next_tokens(batch)
        want = plain(out.logits, targets, 0.9)[0].index_fill(0, ends, 0.0)
        torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- training steps


def full_logits_sft_loss(logits, mb):
    """The SFT loss before chunking: log_softmax of the full (tokens, V) logits in fp32."""
    targets, ends = token_logprobs.next_tokens(mb)
    logp = plain(logits, targets, 1.0)[0].index_fill(0, ends, 0.0)
    from arealcli.runtime.interfaces.sft import answer_token_mask

    mask = answer_token_mask(mb)
    return (-logp * mask).sum() / mask.sum().clamp(min=1), {"n_tokens": mask.sum().float()}


@pytest.mark.parametrize("tied", [True, False])
def test_sft_step_equals_the_full_logits_step(char_tok, tied):
    from arealcli.schema.components.engine import MicroBatchSpec, OptimizerConfig

    base = tiny_module(char_tok, seed=6, tie_word_embeddings=tied)
    batch = sft_batch(8, seed=7)
    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None)
    results = []
    for loss_fn in (full_logits_sft_loss, sft_loss):
        engine = make_engine(char_tok, copy.deepcopy(base), opt)
        stats = engine.train_batch(batch, MicroBatchSpec(n_mbs=2), loss_fn, num_answer_tokens, 0)
        results.append((stats["loss"], stats["grad_norm"], dict(engine.module.named_parameters())))
    (loss_a, norm_a, params_a), (loss_b, norm_b, params_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5)
    assert norm_b == pytest.approx(norm_a, rel=1e-4)
    for name, p in params_a.items():
        torch.testing.assert_close(params_b[name], p, rtol=1e-4, atol=1e-6)


def test_ppo_step_equals_the_full_logits_step(char_tok, monkeypatch):
    """One PPO update with an entropy bonus and temperature 0.7: the chunked path, against the same
    step whose log-probs and entropy come from `log_softmax` / `entropy_from_logits` of full logits."""
    from arealcli.schema.components.engine import MicroBatchSpec
    from tests.test_rl_interfaces import _rollout, engine_model

    base = tiny_module(char_tok, seed=8)
    torch.manual_seed(0)
    gen_model = engine_model(char_tok, copy.deepcopy(base), optimizer="sgd")
    _, data = _rollout(char_tok, gen_model, [1, 0, 0, 1, 0, 1, 1, 0])

    def full_logits_stats(outputs, mb, temperature=1.0):
        targets, ends = token_logprobs.next_tokens(mb)
        lp, ent = plain(outputs.logits, targets, temperature)
        return lp.index_fill(0, ends, 0.0), ent.index_fill(0, ends, 0.0)

    def step(reference: bool):
        from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
        from arealcli.schema.components.interfaces import PPOActorArgs

        model = engine_model(char_tok, copy.deepcopy(base), lr=0.1, optimizer="sgd")
        iface = PPOActorInterface(
            PPOActorArgs(generation={"n": 4, "max_new_tokens": 3}, temperature=0.7, entropy_coef=0.05)
        )
        if reference:
            engine = model.module
            engine.run_microbatch = lambda mb: run_packed(engine.module, mb, engine.device, "padded").logits
            monkeypatch.setattr(token_logprobs, "next_token_logprobs_and_entropy", full_logits_stats)
        stats = iface.train_step(model, data, MicroBatchSpec(n_mbs=2))
        monkeypatch.undo()
        return stats, dict(model.module.module.named_parameters())

    (ref_stats, ref_params), (stats, params) = step(True), step(False)
    for key in ("loss", "entropy", "grad_norm"):
        assert stats[key] == pytest.approx(ref_stats[key], rel=1e-4), key
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-6)

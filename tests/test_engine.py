"""The embedded HF engine on CPU: micro-batch invariance, loss normalization over ranks, generation
with a KV cache against a full recomputation, and HF export."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _dist_helpers import leave_world
from conftest import tiny_module

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.train import TrainEngine
from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig

TESTS_DIR = Path(__file__).resolve().parent


def sft_batch(
    bs: int, seed: int, vocab: int = 90, max_prompt: int = 6, max_answer: int = 9
) -> SequenceSample:
    """Random prompt + answer sequences; answer lengths vary so samples carry different weights."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(bs):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=g))
        a = int(torch.randint(1, max_answer + 1, (1,), generator=g))
        ids.append(torch.randint(3, vocab, (p + a,), generator=g))
        masks.append(torch.arange(p + a) < p)
    return SequenceSample.from_lists(list(range(bs)), {"packed_input_ids": ids, "prompt_mask": masks})


def prompts_batch(prompts: list[list[int]]) -> SequenceSample:
    return SequenceSample.from_lists(
        list(range(len(prompts))), {"packed_prompts": [torch.tensor(p) for p in prompts]}
    )


def make_engine(tokenizer, module, optimizer: OptimizerConfig | None = None, total_steps: int = 10):
    backend = HFBackend(HFBackendArgs(device="cpu", optimizer=optimizer))
    model = backend.initialize(Model("m", module, tokenizer), FinetuneSpec(1, 8, 8, total_steps))
    return model.module


# --------------------------------------------------------------------------- micro-batch invariance

OPTIMIZERS = {
    "sgd": OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None),
    "sgd-clipped": OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=0.1),
    "adamw": OptimizerConfig(type="adamw", lr=1e-3, eps=1e-4, weight_decay=0.01),
}
SPLITS = [
    MicroBatchSpec(n_mbs=4),
    MicroBatchSpec(max_tokens_per_mb=24),
    MicroBatchSpec(n_mbs=3, max_tokens_per_mb=16),
    MicroBatchSpec(n_mbs=100),  # one sample per micro-batch
]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_train_batch_is_independent_of_the_micro_batch_split(char_tok, opt):
    base = tiny_module(char_tok, seed=1)
    batch = sft_batch(10, seed=2)
    start = {k: v.clone() for k, v in base.state_dict().items()}

    def train(spec: MicroBatchSpec):
        engine = make_engine(char_tok, copy.deepcopy(base), OPTIMIZERS[opt])
        stats = engine.train_batch(batch, spec, sft_loss, num_answer_tokens, version_steps=0)
        return stats, dict(engine.module.named_parameters())

    ref_stats, ref_params = train(MicroBatchSpec(n_mbs=1))
    assert ref_stats["n_mbs"] == 1
    changed = [n for n, p in ref_params.items() if not torch.equal(p.detach(), start[n])]
    assert len(changed) == len(ref_params), "every parameter should move"
    for spec in SPLITS:
        stats, params = train(spec)
        assert stats["n_mbs"] > 1
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-5)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
        assert stats["loss_weight"] == ref_stats["loss_weight"] == num_answer_tokens(batch)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], atol=1e-5, rtol=0, msg=f"{spec} {name}")


def test_loss_is_the_token_mean_over_the_whole_batch(char_tok):
    module = tiny_module(char_tok, seed=4)
    batch = sft_batch(6, seed=5)
    engine = make_engine(char_tok, copy.deepcopy(module), OPTIMIZERS["sgd"])
    stats = engine.train_batch(batch, MicroBatchSpec(n_mbs=3), sft_loss, num_answer_tokens, version_steps=0)
    with torch.no_grad():
        expected, _ = sft_loss(engine_free_logits(module, batch), batch)  # one pass, whole batch
    assert stats["loss"] == pytest.approx(float(expected), abs=1e-5)


def engine_free_logits(module, batch: SequenceSample) -> torch.Tensor:
    """Packed logits computed one sequence at a time (no padding at all)."""
    return torch.cat([module(input_ids=seq[None]).logits[0] for seq in batch.unpack("packed_input_ids")])


def test_eval_batch_does_not_change_weights(char_tok):
    engine = make_engine(char_tok, tiny_module(char_tok, seed=6), OPTIMIZERS["sgd"])
    before = copy.deepcopy(engine.module.state_dict())
    stats = engine.eval_batch(sft_batch(5, seed=7), MicroBatchSpec(n_mbs=2), sft_loss)
    assert stats["loss"] > 0
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, before[k])


def test_train_without_optimizer_is_a_clear_error(char_tok):
    engine = make_engine(char_tok, tiny_module(char_tok), optimizer=None)
    with pytest.raises(RuntimeError, match="no optimizer"):
        engine.train_batch(sft_batch(2, 0), MicroBatchSpec(), sft_loss, num_answer_tokens, version_steps=0)


def test_forward_returns_per_sample_outputs_in_input_order(char_tok):
    module = tiny_module(char_tok, seed=8)
    engine = make_engine(char_tok, copy.deepcopy(module))
    batch = sft_batch(7, seed=9)
    out = engine.forward(batch, MicroBatchSpec(n_mbs=3, max_tokens_per_mb=20), aggregate_fn=list)
    with torch.no_grad():
        for got, seq in zip(out, batch.unpack("packed_input_ids"), strict=True):
            torch.testing.assert_close(got, module(input_ids=seq[None]).logits[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- normalization scope


def test_global_and_dp_scopes_agree_on_one_process(char_tok):
    base = tiny_module(char_tok, seed=3)
    batch = sft_batch(6, seed=4)
    params = {}
    for scope in ("global", "dp"):
        engine = make_engine(char_tok, copy.deepcopy(base), OPTIMIZERS["sgd"])
        engine.train_batch(
            batch, MicroBatchSpec(n_mbs=3), sft_loss, num_answer_tokens, 0, token_normalize_scope=scope
        )
        params[scope] = engine.module.state_dict()
    for k in params["global"]:
        assert torch.equal(params["global"][k], params["dp"][k])
    with pytest.raises(ValueError, match="token_normalize_scope"):
        make_engine(char_tok, copy.deepcopy(base), OPTIMIZERS["sgd"]).train_batch(
            batch, MicroBatchSpec(), sft_loss, num_answer_tokens, 0, token_normalize_scope="token"
        )


class BigramLM(torch.nn.Module):
    """A plain module standing in for an LM: packed input ids (tokens,) -> logits (tokens, V)."""

    def __init__(self, vocab: int = 20, dim: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, mb: SequenceSample) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(mb.data["packed_input_ids"])))


class PlainEngine(TrainEngine):
    """The shared training-engine code over a plain module (no optimizer: the test reads the grads)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def run_microbatch(self, mb: SequenceSample) -> torch.Tensor:
        return self.module(mb)


def rank_batches() -> list[SequenceSample]:
    """Rank 0 holds many answer tokens, rank 1 few: "global" and "dp" then differ."""
    return [sft_batch(4, seed=10, vocab=20, max_answer=12), sft_batch(2, seed=11, vocab=20, max_answer=2)]


def _dist_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: accumulate gradients on its own batch, then average them over ranks as DDP does."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batch = rank_batches()[rank]
    results = {}
    for scope in ("global", "dp"):
        for n_mbs in (1, 2):
            module = BigramLM()
            PlainEngine(module).accumulate_gradients(
                batch, MicroBatchSpec(n_mbs=n_mbs), sft_loss, num_answer_tokens, scope
            )
            for p in module.parameters():
                dist.all_reduce(p.grad)  # sum over ranks
                p.grad /= world  # the average every backend takes (DDP, FSDP, replicated hf)
            results[f"{scope}-{n_mbs}"] = {n: p.grad for n, p in module.named_parameters()}
    if rank == 0:
        torch.save(results, out)
    leave_world()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_global_vs_dp_normalization_on_two_gloo_ranks(tmp_path):
    out, port = tmp_path / "grads.pt", _free_port()
    code = "import sys, test_engine as t; t._dist_worker(int(sys.argv[1]), 2, int(sys.argv[2]), sys.argv[3])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    got = torch.load(out)

    # Expected gradients, computed explicitly on one process with the plain module.
    batches = rank_batches()

    def grads_of(loss_of) -> dict[str, torch.Tensor]:
        module = BigramLM()
        loss_of(module).backward()
        return {n: p.grad for n, p in module.named_parameters()}

    def nll_sum_and_count(module, batch):
        logits = module(batch)
        from arealcli.runtime.interfaces.sft import token_nll

        nll, mask = token_nll(logits, batch)
        return (nll * mask).sum(), mask.sum()

    def global_loss(module):  # token mean over ALL answer tokens of both ranks
        parts = [nll_sum_and_count(module, b) for b in batches]
        return sum(s for s, _ in parts) / sum(n for _, n in parts)

    def dp_loss(module):  # the average over ranks of each rank's own token mean
        parts = [nll_sum_and_count(module, b) for b in batches]
        return sum(s / n for s, n in parts) / len(parts)

    expected = {"global": grads_of(global_loss), "dp": grads_of(dp_loss)}
    counts = [num_answer_tokens(b) for b in batches]
    assert counts[0] > 3 * counts[1]
    diff = max((expected["global"][n] - expected["dp"][n]).abs().max() for n in expected["global"])
    assert diff > 1e-3, "the two scopes must differ on this data, or the test proves nothing"

    for key, grads in got.items():
        scope = key.split("-")[0]
        for name, g in grads.items():
            torch.testing.assert_close(g, expected[scope][name], atol=1e-6, rtol=1e-5, msg=f"{key} {name}")

    # "global" on two ranks == one process holding the whole batch.
    module = BigramLM()
    PlainEngine(module).accumulate_gradients(
        SequenceSample.gather(batches), MicroBatchSpec(), sft_loss, num_answer_tokens, "global"
    )
    for name, p in module.named_parameters():
        torch.testing.assert_close(p.grad, expected["global"][name], atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------- generation


@torch.no_grad()
def reference_generate(module, prompt: list[int], max_new: int, stop: set[int], min_new: int = 0):
    """Greedy decoding that recomputes the whole sequence every step (no KV cache, no padding)."""
    seq, out, lps = list(prompt), [], []
    for t in range(max_new):
        logits = module(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].float()
        if t < min_new:
            logits[sorted(stop)] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        tok = int(logits.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        seq.append(tok)
        if tok in stop:
            break
    return out, lps, not (out and out[-1] in stop)


PROMPTS = [[10, 11, 12], [40], [20, 21, 22, 23, 24, 25, 26], [5, 90, 7, 8]]


def gen_module(tokenizer, seed: int = 12):
    """Untied embeddings: a random tied model just repeats its last token, which tests little."""
    return tiny_module(tokenizer, seed=seed, tie_word_embeddings=False)


def fake_tok(eos: int, pad: int = 0):
    return SimpleNamespace(eos_token_id=eos, pad_token_id=pad)


@pytest.mark.parametrize("spec", [MicroBatchSpec(), MicroBatchSpec(n_mbs=3)], ids=["one-mb", "three-mbs"])
def test_greedy_with_kv_cache_equals_full_recompute(char_tok, spec):
    module = gen_module(char_tok, seed=12)
    engine = make_engine(char_tok, copy.deepcopy(module))
    g = GenerationHyperparameters(greedy=True, max_new_tokens=10)
    res = engine.generate(prompts_batch(PROMPTS), spec, fake_tok(eos=1), g)
    for i, prompt in enumerate(PROMPTS):
        ids, lps, no_eos = reference_generate(module, prompt, 10, {1})
        assert res.output_ids[i] == ids
        assert res.logprobs[i] == pytest.approx(lps, abs=1e-4)
        assert res.no_eos[i] == no_eos


def test_stop_tokens_eos_and_max_new_tokens(char_tok):
    module = gen_module(char_tok, seed=12)
    engine = make_engine(char_tok, copy.deepcopy(module))
    free = engine.generate(
        prompts_batch(PROMPTS),
        MicroBatchSpec(),
        fake_tok(eos=1),
        GenerationHyperparameters(greedy=True, max_new_tokens=10),
    )
    # Make a token the model emits mid-sequence the EOS token: generation must stop right after it.
    row = free.output_ids[2]
    k = next(j for j in range(1, len(row)) if row[j] not in row[:j])
    eos = row[k]
    res = engine.generate(
        prompts_batch(PROMPTS),
        MicroBatchSpec(),
        fake_tok(eos=eos),
        GenerationHyperparameters(greedy=True, max_new_tokens=10),
    )
    assert res.output_ids[2] == row[: k + 1] and res.no_eos[2] is False
    for i, prompt in enumerate(PROMPTS):
        ids, lps, no_eos = reference_generate(module, prompt, 10, {eos})
        assert (res.output_ids[i], res.no_eos[i]) == (ids, no_eos)
        assert res.logprobs[i] == pytest.approx(lps, abs=1e-4)
        assert len(res.output_ids[i]) <= 10
        assert no_eos == (len(ids) == 10 and ids[-1] != eos)
    # The same through stop_token_ids, with the real EOS elsewhere.
    g = GenerationHyperparameters(greedy=True, max_new_tokens=10, stop_token_ids=[eos])
    via_stop = engine.generate(prompts_batch(PROMPTS), MicroBatchSpec(), fake_tok(eos=1), g)
    assert via_stop.output_ids == res.output_ids
    # min_new_tokens suppresses the stop token before that many tokens.
    g = GenerationHyperparameters(greedy=True, max_new_tokens=10, min_new_tokens=k + 2)
    late = engine.generate(prompts_batch(PROMPTS), MicroBatchSpec(), fake_tok(eos=eos), g)
    ids, lps, _ = reference_generate(module, PROMPTS[2], 10, {eos}, min_new=k + 2)
    assert late.output_ids[2] == ids and len(ids) >= k + 2
    assert eos not in ids[: k + 2]
    assert late.logprobs[2] == pytest.approx(lps, abs=1e-4)
    # max_new_tokens is a hard cap.
    short = engine.generate(
        prompts_batch(PROMPTS),
        MicroBatchSpec(),
        fake_tok(eos=1),
        GenerationHyperparameters(greedy=True, max_new_tokens=3),
    )
    assert short.output_ids == [r[:3] for r in free.output_ids]
    assert short.no_eos == [len(r) == 3 and r[-1] != 1 for r in short.output_ids]


def test_n_samples_through_repeat(char_tok):
    module = gen_module(char_tok, seed=13)
    engine = make_engine(char_tok, copy.deepcopy(module))
    n = 4
    batch = prompts_batch(PROMPTS[:2]).repeat_interleave(n)
    assert batch.ids[:n] == [(0, j) for j in range(n)]
    greedy = engine.generate(
        batch,
        MicroBatchSpec(n_mbs=2),
        fake_tok(eos=1),
        GenerationHyperparameters(greedy=True, max_new_tokens=6),
    )
    assert len(greedy.output_ids) == 2 * n
    assert all(greedy.output_ids[j] == greedy.output_ids[0] for j in range(n))

    torch.manual_seed(0)
    g = GenerationHyperparameters(max_new_tokens=6, temperature=0.8, top_k=8)
    sampled = engine.generate(batch, MicroBatchSpec(n_mbs=2), fake_tok(eos=1), g)
    assert len(sampled.output_ids) == 2 * n
    assert len({tuple(x) for x in sampled.output_ids[:n]}) > 1, "sampling should differ between copies"
    # The returned log-probs are those of the sampling distribution, recomputed without a cache.
    with torch.no_grad():
        for i in range(2 * n):
            prompt, out = PROMPTS[i // n], sampled.output_ids[i]
            logits = module(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1] / 0.8
            kth = logits.topk(8, -1).values[:, -1:]
            logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
            want = logp.gather(-1, torch.tensor(out)[:, None]).squeeze(-1)
            assert torch.isfinite(want).all(), "a sampled token outside the top-k"
            assert sampled.logprobs[i] == pytest.approx(want.tolist(), abs=1e-4)


# --------------------------------------------------------------------------- HF export


def test_save_to_hf_loads_with_transformers_and_generates(char_tok, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arealcli.runtime.data.tokenizer import from_directory

    engine = make_engine(char_tok, tiny_module(char_tok, seed=14), OPTIMIZERS["sgd"])
    engine.train_batch(sft_batch(4, seed=1), MicroBatchSpec(), sft_loss, num_answer_tokens, 0)
    engine.save_to_hf(char_tok, str(tmp_path / "hf"))
    assert list((tmp_path / "hf").glob("*.safetensors"))

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "ab+12="
    # with spaces: AutoTokenizer swaps in qwen2's own class, from_directory loads what was saved
    spaced = "ab + 12 = "
    exact = from_directory(str(tmp_path / "hf"))
    assert exact(spaced, add_special_tokens=False) == char_tok(spaced, add_special_tokens=False)
    assert exact.decode(exact(spaced, add_special_tokens=False)["input_ids"]) == spaced
    assert (
        tok(text, add_special_tokens=False)["input_ids"]
        == char_tok(text, add_special_tokens=False)["input_ids"]
    )
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert (tok.eos_token_id, tok.pad_token_id) == (char_tok.eos_token_id, char_tok.pad_token_id)

    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, engine.module(input_ids=ids).logits)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    ours = engine.generate(
        prompts_batch([ids[0].tolist()]),
        MicroBatchSpec(),
        tok,
        GenerationHyperparameters(greedy=True, max_new_tokens=6),
    )
    assert out[0, ids.shape[1] :].tolist()[: len(ours.output_ids[0])] == ours.output_ids[0]

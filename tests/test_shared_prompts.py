"""Shared prompts (`packing.shared_prompt_row`, `hf.run_packed`): samples with the same prompt (a GRPO
group, a preference pair) computed with one copy of it give the outputs, losses and gradients of
separate sequences."""

from __future__ import annotations

import copy

import pytest
import torch

from arealcli.runtime.backends import packing
from arealcli.runtime.backends.hf import run_packed, shared_prompt_batch
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
from arealcli.schema.components.engine import MicroBatchSpec, OptimizerConfig
from tests.conftest import tiny_module
from tests.test_engine import make_engine
from tests.test_packing import assert_same_forward, assert_same_training

CPU = torch.device("cpu")


def groups_batch(prompts: list[int], responses: list[list[int]], seed: int = 0) -> SequenceSample:
    """Prompt i (random tokens, length prompts[i]) followed by each of its responses (lengths
    responses[i]), samples of one prompt adjacent, as a GRPO batch has them; the loss on responses."""
    g = torch.Generator().manual_seed(seed)
    ids, masks, keys = [], [], []
    for i, (p, lens) in enumerate(zip(prompts, responses, strict=True)):
        prompt = torch.randint(3, 90, (p,), generator=g)
        for j, n in enumerate(lens):
            ids.append(torch.cat([prompt, torch.randint(3, 90, (n,), generator=g)]))
            masks.append(torch.arange(p + n) < p)
            keys.append((i, j))
    return SequenceSample.from_lists(keys, {"packed_input_ids": ids, "prompt_mask": masks})


def varlen_module(char_tok, seed: int):
    module = tiny_module(char_tok, seed=seed)
    module.config._attn_implementation = packing.attention_implementation("sdpa", module.config)
    return module


def test_a_shared_prompt_is_computed_once_and_every_token_maps_back():
    lens, prompt_lens = [7, 9, 5, 6, 6], [4, 4, 5, 3, 3]
    ids = torch.cat([torch.tensor([1, 2, 3, 4, 10, 11, 12]), torch.tensor([1, 2, 3, 4, 20, 21, 22, 23, 24])])
    ids = torch.cat(
        [ids, torch.arange(30, 35), torch.tensor([5, 6, 7, 40, 41, 42]), torch.tensor([5, 6, 7, 50, 51, 52])]
    )
    groups = packing.prompt_groups(ids, lens, prompt_lens)
    assert groups == [[0, 1], [2], [3, 4]]
    row = packing.shared_prompt_row(ids, lens, prompt_lens, groups)
    assert row.ids.shape == (1, 4 + 3 + 5 + 5 + 3 + 3 + 3)  # each shared prompt once
    torch.testing.assert_close(row.ids.flatten()[row.index], ids)  # every sample whole again
    assert row.position_ids is not None
    starts = [0, 7, 16, 21, 27]
    for s, n in zip(starts, lens, strict=True):  # positions as in a sequence of its own
        torch.testing.assert_close(row.position_ids.flatten()[row.index[s : s + n]], torch.arange(n))
    assert row.blocks == (
        (0, 4, 0, 0),
        (4, 3, 0, 4),
        (7, 5, 0, 4),
        (12, 5, 0, 0),
        (17, 3, 0, 0),
        (20, 3, 17, 3),
        (23, 3, 17, 3),
    )


@pytest.mark.parametrize(
    "prompts, responses",
    [([5, 8], [[4, 4, 4], [2, 7, 1]]), ([6], [[3, 3]]), ([4, 4, 9], [[5], [5, 6], [1, 3, 3, 2]])],
)
def test_shared_prompts_give_the_outputs_loss_and_gradients_of_separate_sequences(
    char_tok, prompts, responses
):
    module = varlen_module(char_tok, seed=1)
    batch = groups_batch(prompts, responses)
    assert shared_prompt_batch(batch) is not None  # the groups share prompts: the shared path runs
    assert_same_forward(module, batch, {"share_prompts": False}, {"share_prompts": True})


def test_a_training_step_with_shared_prompts_equals_one_without(char_tok):
    base = varlen_module(char_tok, seed=2)
    batch = groups_batch([6, 9, 4], [[5, 2, 8, 8], [3, 3, 3, 3], [7, 1, 4, 6]], seed=3)
    opt = OptimizerConfig(type="sgd", lr=0.5, gradient_clipping=None)
    results = []
    for share in (False, True):
        engine = make_engine(char_tok, copy.deepcopy(base), opt)
        engine.run_microbatch = lambda mb, e=engine, s=share: run_packed(
            e.module, mb, e.device, share_prompts=s
        )
        stats = engine.train_batch(
            batch, MicroBatchSpec(n_mbs=2), sft_loss, num_answer_tokens, version_steps=0
        )
        results.append((stats, dict(engine.module.named_parameters())))
    assert_same_training(*results)


@pytest.mark.parametrize("greedy", [True, False])
def test_generation_prefills_a_shared_prompt_once_and_samples_the_same(char_tok, greedy):
    from arealcli.runtime.generation import decoder, sampling
    from arealcli.schema.components.engine import GenerationHyperparameters

    module = varlen_module(char_tok, seed=4)
    module.eval()
    encode = lambda text: char_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode("max(12,45,33)=")] * 3 + [encode("max(7,80,61)=")] * 2 + [encode("max(1,2,3)=")]
    g = GenerationHyperparameters(n=1, max_new_tokens=8, greedy=greedy, temperature=1.0)
    steps = []
    real_step = decoder.LeanDecoder.step

    def counting_step(self, ids, pos, valid):
        steps.append(ids.shape)
        return real_step(self, ids, pos, valid)

    results = []
    for share in (False, True):
        torch.manual_seed(0)
        steps.clear()
        decoder.LeanDecoder.step = counting_step
        try:
            results.append(
                sampling.generate(
                    module,
                    prompts,
                    g,
                    {char_tok.eos_token_id},
                    char_tok.pad_token_id,
                    CPU,
                    share_prompts=share,
                )
            )
        finally:
            decoder.LeanDecoder.step = real_step
        assert steps[0][0] == (3 if share else 6)  # the prefill: each distinct prompt once
    plain, shared = results
    assert shared.output_ids == plain.output_ids
    for a, b in zip(shared.logprobs, plain.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)

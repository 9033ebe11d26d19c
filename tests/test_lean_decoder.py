"""The lean decoder computes what the transformers module computes: same greedy tokens, same log-probs."""

from __future__ import annotations

import pytest
import torch

from arealcli.runtime.generation import decoder as lean_decoder
from arealcli.runtime.generation import sampling as generation
from arealcli.schema.components.engine import GenerationHyperparameters
from tests.conftest import tiny_module


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_lean_decoder_matches_transformers(char_tok, monkeypatch, family):
    module = tiny_module(char_tok, seed=5, family=family, tie_word_embeddings=False)
    assert lean_decoder.supports(module)
    # prompts of different lengths: left padding must be masked exactly as transformers masks it
    prompts = [char_tok(t)["input_ids"] for t in ["12+30=", "7=", "max(1,2,3)=", "a"]]
    g = GenerationHyperparameters(greedy=True, max_new_tokens=12)
    lean = generation.generate(module, prompts, g, {char_tok.eos_token_id}, char_tok.pad_token_id, "cpu")
    monkeypatch.setattr(lean_decoder, "supports", lambda m: False)
    ref = generation.generate(module, prompts, g, {char_tok.eos_token_id}, char_tok.pad_token_id, "cpu")
    assert lean.output_ids == ref.output_ids
    for a, b in zip(lean.logprobs, ref.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert lean.no_eos == ref.no_eos

"""The texts of generated samples: the prompt, and the response a reward scores (for an episode, the
model's final answer after its last tool result)."""

from __future__ import annotations

import torch

from arealcli.runtime.data.sample import SequenceSample


def final_answer_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """(L,) bool: the last run of the model's own tokens in an episode (its answer after the last tool
    result; the whole response when it called no tool)."""
    own = loss_mask.bool()
    after = torch.nonzero(~own).squeeze(-1)  # prompt and tool tokens
    start = int(after[-1]) + 1 if after.numel() else 0
    out = torch.zeros_like(own)
    out[start:] = True
    return out & own


def decode_responses(tokenizer, data: SequenceSample) -> tuple[list[str], list[str]]:
    """Prompt and response texts; for episodes (a `loss_mask` marks the model's tokens) the response
    is the final answer, the model's text after the last tool result."""
    prompts, responses = [], []
    masks = data.unpack("loss_mask") if "loss_mask" in data.data else [None] * data.bs
    for ids, pm, lm in zip(data.unpack("packed_input_ids"), data.unpack("prompt_mask"), masks, strict=True):
        pm = pm.bool()
        prompts.append(tokenizer.decode(ids[pm].tolist()))
        answer = ~pm if lm is None else final_answer_mask(lm)
        responses.append(tokenizer.decode(ids[answer].tolist(), skip_special_tokens=True))
    return prompts, responses

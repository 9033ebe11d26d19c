"""A critic: the base transformer of a causal LM with a scalar value head instead of the LM head."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn


class CausalLMWithValueHead(nn.Module):
    """values (B, T) = value_head(last hidden state); saved as an HF directory plus `value_head.weight`."""

    def __init__(self, lm: Any, seed: int):  # a transformers causal LM
        super().__init__()
        self.model = lm.model  # the decoder stack of Qwen2/Llama-style causal LMs
        self.config = lm.config
        self.value_head = nn.Linear(self.config.hidden_size, 1, bias=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            nn.init.normal_(self.value_head.weight, std=1.0 / (self.config.hidden_size + 1))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_
    ) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)

    def save_pretrained(self, save_dir: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        self.config.save_pretrained(save_dir)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})


def with_value_head(lm: nn.Module, seed: int) -> CausalLMWithValueHead:
    return CausalLMWithValueHead(lm, seed)

"""A scalar head on a causal LM's decoder: a PPO critic's values, a reward model's scores.

The module is laid out as Hugging Face's sequence classifiers with one label (`Qwen2ForSequenceClassification`,
`LlamaForSequenceClassification`: the decoder as `model`, a bias-free `score` linear layer), and saved as
one: `AutoModelForSequenceClassification.from_pretrained(dir)` loads an export or a checkpoint as it is.
What differs is the forward: this one returns the head's output at every position (B, T) (a critic's
value of each state), where the classifier keeps only the last token's (a reward model's score; see
`algo.bradley_terry.score_positions` for which token that is).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

HEAD = "score.weight"  # the head's weight in a saved state (HF's sequence classifiers' name)
LEGACY_HEAD = "value_head.weight"  # its name in checkpoints written before the classifier layout


class CausalLMWithValueHead(nn.Module):
    """values (B, T) = score(last hidden state); saved as `<Family>ForSequenceClassification` (one label)."""

    def __init__(self, lm: Any, seed: int, score: nn.Linear | None = None):  # a transformers causal LM
        super().__init__()
        self.model = lm.model  # the decoder stack of Qwen2/Llama-style causal LMs
        self.config = lm.config
        family = type(lm).__name__.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification")
        self.config.architectures = [f"{family}ForSequenceClassification"]
        self.config.num_labels = 1
        if score is None:
            score = nn.Linear(self.config.hidden_size, 1, bias=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                nn.init.normal_(score.weight, std=1.0 / (self.config.hidden_size + 1))
        self.score = score

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **_
    ) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (B, T, H)
        return self.score(hidden).squeeze(-1).float()  # (B, T)

    def save_pretrained(self, save_dir: str, safe_serialization: bool = True) -> None:
        from safetensors.torch import save_file

        os.makedirs(save_dir, exist_ok=True)
        self.config.save_pretrained(save_dir)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(save_dir, "model.safetensors"), metadata={"format": "pt"})


def with_value_head(lm: nn.Module, seed: int) -> CausalLMWithValueHead:
    """A fresh head (seeded: the same on every rank) on `lm`'s decoder."""
    return CausalLMWithValueHead(lm, seed)


def is_classifier_dir(path: str | Path) -> bool:
    """Does the model folder hold a sequence classifier (a reward model, a critic) rather than an LM?"""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def load_value_head_model(path: str, seed: int) -> CausalLMWithValueHead:
    """A model folder with a value head: a saved classifier's decoder and trained head, or a causal LM's
    decoder with a fresh head (e.g. a critic started from a pretrained model)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if not is_classifier_dir(path):
        return with_value_head(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    return CausalLMWithValueHead(classifier, seed, score=classifier.score)


def renamed_legacy_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state with the head under its old name (`value_head.weight`) under the classifier's (`score`)."""
    if LEGACY_HEAD not in state or HEAD in state:
        return state
    return {(HEAD if k == LEGACY_HEAD else k): v for k, v in state.items()}

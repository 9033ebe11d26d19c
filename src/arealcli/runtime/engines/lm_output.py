"""What a training engine hands a loss: a language model's output for a micro-batch, logits left lazy.

A language model's outputs for the packed tokens of a micro-batch are an `LMOutput`: the final hidden
states (tokens, H) and the LM head (weight (V, H), bias), from which it computes per-token log-probs
and entropy chunk by chunk of tokens (`algo.logprobs`), never the (tokens, V) logits at once, in the
forward or the backward pass. `.logits` materializes them for code that wants them.

The contract with loss functions and post-hooks (`train_batch`, `eval_batch`, `forward`):
- a function marked with `@takes_lm_output` receives an `LMOutput` (built from the logits when a
  backend returns logits);
- any other function receives what it always did: packed logits (tokens, V), or values (tokens,) from
  a value-head model.
Value-head models' outputs are plain tensors either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from arealcli.runtime.algo.logprobs import VocabShard, token_logprobs_and_entropy

F = TypeVar("F", bound=Callable[..., Any])


class LMOutput:
    """hidden (tokens, H) + head weight (V, H) [+ bias]; or logits (tokens, V) with `weight=None`.

    With a vocab-parallel head (`shard`), `weight` holds this rank's rows of it, and `logits_fn` maps
    hidden states to the full logits (tokens, V) for `.logits`.
    """

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor | None = None,
        bias: Tensor | None = None,
        shard: VocabShard | None = None,
        logits_fn: Callable[[Tensor], Tensor] | None = None,
    ):
        self.hidden, self.weight, self.bias, self.shard = hidden, weight, bias, shard
        self.logits_fn = logits_fn

    def rows(self, index: Tensor) -> LMOutput:
        """The output at some tokens only (an index or a bool mask over the tokens)."""
        hidden = self.hidden[index.to(self.device)]
        return LMOutput(hidden, self.weight, self.bias, self.shard, self.logits_fn)

    @classmethod
    def from_logits(cls, logits: Tensor) -> LMOutput:
        return cls(logits)

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def logprobs(self, targets: Tensor, temperature: float = 1.0) -> Tensor:
        """(tokens,) fp32: log softmax(logits / T)[target] at every token."""
        return self.logprobs_and_entropy(targets, temperature, with_entropy=False)[0]

    def logprobs_and_entropy(
        self, targets: Tensor, temperature: float = 1.0, with_entropy: bool = True
    ) -> tuple[Tensor, Tensor]:
        """(logp (tokens,), entropy (tokens,)) in fp32, in one pass over the vocabulary; the entropy
        is -sum_v p_v log p_v of softmax(logits / T) (an empty tensor without `with_entropy`)."""
        logp, ent = token_logprobs_and_entropy(
            self.hidden,
            self.weight,
            targets.to(self.device),
            temperature,
            bias=self.bias,
            with_entropy=with_entropy,
            shard=self.shard,
        )
        return logp, (ent if ent is not None else logp.new_empty(0))

    def entropy(self, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
        """Entropy of softmax(logits / T) at every token (tokens,), or at the tokens of `mask`."""
        sub = self if mask is None else self.rows(mask)
        targets = torch.zeros(len(sub), dtype=torch.long, device=self.device)
        return sub.logprobs_and_entropy(targets, temperature)[1]

    @property
    def logits(self) -> Tensor:
        """The full (tokens, V) logits, as the model's head computes them (differentiable)."""
        if self.logits_fn is not None:
            return self.logits_fn(self.hidden)
        if self.weight is None:
            return self.hidden
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)


def takes_lm_output(fn: F) -> F:
    """Mark a loss function or post-hook as taking an `LMOutput` instead of packed logits."""
    fn.takes_lm_output = True  # type: ignore[attr-defined]
    return fn


def outputs_for(fn: Callable[..., Any], outputs: Any) -> Any:
    """What `fn` receives: an `LMOutput` if it takes one (logits wrapped), else logits or values."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    wants = getattr(fn, "takes_lm_output", False)
    if isinstance(outputs, LMOutput):
        return outputs if wants else outputs.logits
    if wants and isinstance(outputs, Tensor) and outputs.dim() == 2:
        return LMOutput.from_logits(outputs)
    return outputs


def as_lm_output(outputs: Tensor | LMOutput) -> LMOutput:
    """An `LMOutput` of packed logits (tokens, V), or the argument itself."""
    return outputs if isinstance(outputs, LMOutput) else LMOutput.from_logits(outputs)

"""Autoregressive sampling with a KV cache over a transformers causal LM.

Prompts are left-padded into one (B, P) batch; each step feeds only the new token and reuses the cache.
Returns, per sample, the generated ids, the log-prob of each under the sampling distribution
(temperature, top-k, top-p applied), and whether it stopped without an end token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from arealcli.runtime import vision
from arealcli.runtime.generation import decoder as lean_decoder
from arealcli.schema.components.engine import GenerationHyperparameters

_T = TypeVar("_T")


@dataclass
class GenerationResult:
    output_ids: list[list[int]]
    logprobs: list[list[float]]
    no_eos: list[bool]
    # policy versions that generated each sample: the first and the last (they differ when a weight
    # update interrupted the sample and it was continued on the new weights); None = the model's own
    versions: list[int] | None = None
    last_versions: list[int] | None = None

    @staticmethod
    def concat(parts: list[GenerationResult]) -> GenerationResult:
        def cat(name: str) -> list | None:
            if any(getattr(p, name) is None for p in parts):
                return None
            return [x for p in parts for x in getattr(p, name)]

        return GenerationResult(
            cat("output_ids") or [],
            cat("logprobs") or [],
            cat("no_eos") or [],
            cat("versions"),
            cat("last_versions"),
        )

    def reordered(self, order: list[int]) -> GenerationResult:
        """Sample `order[i]` of this result becomes sample i."""

        def pick(xs: list[_T]) -> list[_T]:
            return [xs[i] for i in order]

        return GenerationResult(
            pick(self.output_ids),
            pick(self.logprobs),
            pick(self.no_eos),
            None if self.versions is None else pick(self.versions),
            None if self.last_versions is None else pick(self.last_versions),
        )


class StopTexts:
    """Stop strings: a sample ends at the token that completes one of `texts` in its decoded text (a stop
    text may span several tokens, or end inside one). Checked on the last few tokens only: a window of
    the longest text's length + 8 tokens, as every token but a special one decodes to a character at least.
    `decode(ids) -> str` is the tokenizer's (special tokens skipped)."""

    def __init__(self, texts, decode: Callable[[list[int]], str]):
        self.texts, self.decode = tuple(texts), decode
        self.window = max(len(t) for t in self.texts) + 8
        # A token can complete a text only if its own text holds that text's last character: checked on
        # a per-token cache before decoding the window. Not for texts ending in whitespace (a tokenizer
        # may drop a token's leading space when it is decoded alone).
        self._last = {t[-1] for t in self.texts}
        self._filter = not any(c.isspace() for c in self._last)
        self._pieces: dict[int, str] = {}

    def may_end(self, token: int) -> bool:
        """Whether `token` can be the one that completes a stop text (cheap: no window decode)."""
        if not self._filter:
            return True
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.decode([token])
        return "\ufffd" in piece or any(c in piece for c in self._last)  # U+FFFD: part of a character

    def matched(self, ids: list[int]) -> str | None:
        """The stop text the end of `ids` contains (the earliest in the window), if any."""
        tail = self.decode(ids[-self.window :])
        hits = [(tail.find(t), t) for t in self.texts if t in tail]
        return min(hits)[1] if hits else None

    def first_end(self, ids: list[int]) -> int | None:
        """How many tokens a sample keeps: up to the first that completes a stop text; None if none does."""
        full = self.decode(ids)
        if not any(t in full for t in self.texts):
            return None
        before = self.decode(ids[:-1])
        if not any(t in before for t in self.texts):
            return len(ids)  # the last token completes it: a generator that stopped there (the usual case)
        return next(
            n
            for n in range(1, len(ids) + 1)
            if self.may_end(ids[n - 1]) and self.matched(ids[:n]) is not None
        )

    def cut(self, result: GenerationResult) -> GenerationResult:
        """Every sample of `result` cut after the token that completes its first stop text (for
        generators that do not stop on texts themselves, or stop later)."""
        for i, ids in enumerate(result.output_ids):
            end = self.first_end(ids)
            if end is not None:
                result.output_ids[i], result.logprobs[i] = ids[:end], result.logprobs[i][:end]
                result.no_eos[i] = False
        return result


def stop_texts_of(g: GenerationHyperparameters, tokenizer) -> StopTexts | None:
    if not g.stop:
        return None
    return StopTexts(g.stop, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))


def process_logits(logits: torch.Tensor, g: GenerationHyperparameters) -> torch.Tensor:
    """(B, V) raw logits -> the logits actually sampled from."""
    if g.greedy:
        return logits
    logits = logits / g.temperature
    if g.top_k > 0 and g.top_k < logits.shape[-1]:
        kth = torch.topk(logits, g.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if g.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p (always keep the first)
        drop = probs.cumsum(-1) - probs >= g.top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, g: GenerationHyperparameters) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) -> next tokens (B,) and their log-probs (B,)."""
    logits = process_logits(logits.float(), g)
    logp = torch.log_softmax(logits, dim=-1)
    token = logits.argmax(-1) if g.greedy else torch.multinomial(logp.exp(), 1).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(
    module,
    prompts: list[list[int]],
    g: GenerationHyperparameters,
    eos_ids: set[int],
    pad_id: int,
    device,
    should_abort: Callable[[], bool] | None = None,
    stop_texts: StopTexts | None = None,
    images: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    share_prompts: bool = False,
) -> GenerationResult:
    """`should_abort()` is polled before every decode step; when it returns True the samples stop where
    they are (a server aborting requests for a weight update). A sample also ends at the token that
    completes one of `stop_texts`. `images`: a vision-language model's (pixel_values, image_grid_thw)
    per prompt, whose placeholder tokens the prompts hold (runtime/vision.py). `share_prompts`: equal
    prompts (the n samples of a group) are prefilled once and their cache copied to each sample's row
    (lean decoder only)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros(B, P, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p, device=device)
        attn[i, P - len(p) :] = 1
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, P)
    stop = torch.tensor(sorted(eos_ids | set(g.stop_token_ids)), dtype=torch.long, device=device)
    lean = None
    seeing: dict = {}
    placeholders: list[int] = []
    if vision.is_vision(module):  # M-RoPE: (3, B, P) positions; the text after continues past the largest
        seeing, pos = vision.prompt_inputs(module, ids, attn, images, device)
        placeholders = vision.placeholder_ids(module)
    if lean_decoder.supports(module):
        dtype = next(module.parameters()).dtype
        if torch.is_autocast_enabled(torch.device(device).type):
            dtype = torch.get_autocast_dtype(torch.device(device).type)
        firsts: dict[tuple[int, ...], int] = {}
        rows = [firsts.setdefault(tuple(p), i) for i, p in enumerate(prompts)] if share_prompts else []
        if images is None and share_prompts and len(firsts) < B:
            once = sorted(firsts.values())  # each distinct prompt's first row
            lean = lean_decoder.LeanDecoder(module, len(once), P + g.max_new_tokens, device, dtype)
            logits = lean.step(ids[once], pos[once], attn[once].bool())
            slot = {r: j for j, r in enumerate(once)}
            back = torch.tensor([slot[r] for r in rows], device=device)
            lean, logits = lean.expanded(back), logits[back]
        else:
            lean = lean_decoder.LeanDecoder(module, B, P + g.max_new_tokens, device, dtype)
            logits = lean.step(ids, pos, attn.bool())
    else:
        # transformers >= 5.2x names the cache argument `cache` (older: `past_key_values`)
        cache_arg = "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"
        out = module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **seeing)
        past, logits = _cache_of(out), out.logits[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logps = [], []
    history: list[list[int]] = [[] for _ in range(B)]
    text_ends: list[int | None] = [None] * B
    for t in range(g.max_new_tokens):
        logits = logits.float()
        if t < g.min_new_tokens:
            logits[:, stop] = float("-inf")
        if placeholders:  # a vision-language model's image placeholders stand for images, never sampled
            logits[:, placeholders] = float("-inf")
        token, logp = sample(logits, g)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        logps.append(logp)
        if stop_texts is not None and t >= g.min_new_tokens:
            done = finished.tolist()
            for i, tok in enumerate(token.tolist()):
                if not done[i]:
                    history[i].append(tok)
                    if stop_texts.may_end(tok) and stop_texts.matched(history[i]) is not None:
                        text_ends[i] = t + 1
            hit = torch.tensor([e is not None for e in text_ends], device=device)
            finished = finished | hit
        elif stop_texts is not None:
            for i, tok in enumerate(token.tolist()):
                history[i].append(tok)
        finished = finished | torch.isin(token, stop)
        if bool(finished.all()) or t == g.max_new_tokens - 1:
            break
        if should_abort is not None and should_abort():
            break
        pos = pos[..., -1:] + 1
        if lean is not None:
            logits = lean.step(token[:, None], pos, torch.ones(B, 1, dtype=torch.bool, device=device))
            continue
        attn = torch.cat([attn, torch.ones(B, 1, dtype=attn.dtype, device=device)], dim=1)
        out = module(
            input_ids=token[:, None],
            attention_mask=attn,
            position_ids=pos,
            **{cache_arg: past},
            use_cache=True,
        )
        past, logits = _cache_of(out), out.logits[:, -1]
    return trim_at_stop(torch.stack(tokens, 1), torch.stack(logps, 1), set(stop.tolist()), text_ends)


def trim_at_stop(
    tokens: torch.Tensor, logps: torch.Tensor, stop_ids: set[int], text_ends: list[int | None] | None = None
) -> GenerationResult:
    """(B, T) sampled tokens and log-probs -> per sample, everything up to and including its first stop
    token, or the token that completed a stop text (`text_ends[i]` tokens); all of it, flagged no_eos,
    when neither."""
    gen, lp = tokens.cpu(), logps.float().cpu()
    result = GenerationResult([], [], [])
    for i in range(gen.shape[0]):
        row = gen[i].tolist()
        end = next((j for j, tok in enumerate(row) if tok in stop_ids), None)
        text_end = text_ends[i] if text_ends is not None else None
        if text_end is not None and (end is None or text_end <= end):
            end = text_end - 1
        n = len(row) if end is None else end + 1
        result.output_ids.append(row[:n])
        result.logprobs.append(lp[i, :n].tolist())
        result.no_eos.append(end is None)
    return result

"""The samples of a continuous batch: rows that join between decoding steps and leave when they finish.

Each row is one sample with its own prompt, length, sampling params, stop tokens and stop texts. Every
step samples the next token of every row from the logits of the last forward pass (rows with the same
sampling params in one `sampling.sample` call, so a row draws what it would draw alone), records it, and
drops the rows that finished; one forward pass then feeds the new tokens of the rows that remain.
A row's token and log-prob lists are its sample's (`Sequence.output_ids`, `.logprobs`): readers see them
grow. A sample with `top_n` also gets, at every step, the top_n most likely tokens of the distribution its
token was drawn from (`Sequence.top`), from the same log-probs as its own token's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from arealcli.runtime.generation import sampling as generation
from arealcli.runtime.wire.sglang import Sampling, finish_length, finish_stop

if TYPE_CHECKING:
    from arealcli.runtime.generation.decoder import RowDecoder
    from arealcli.runtime.generation.model_runner import ModelRunner
    from arealcli.runtime.generation.scheduler import Sequence


@dataclass
class Row:
    """One sample being generated: its request, what ends it, and its tokens so far."""

    seq: Sequence
    key: Sampling  # the sampling params rows share a `sample` call by
    stop: frozenset[int]  # end tokens and stop_token_ids
    min_new: int  # stop tokens and stop texts are not allowed before this many tokens
    texts: generation.StopTexts | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Group:
    rows: torch.Tensor | None  # row indices (None: every row)
    members: list[int]
    stop: torch.Tensor  # (S,) stop token ids
    params: Any  # GenerationHyperparameters of `sampling.sample`


class RunningBatch:
    """The rows generated together, their KV cache (`RowDecoder`) and their next-token logits."""

    def __init__(self, runner: ModelRunner, decoder: RowDecoder):
        self.runner, self.decoder = runner, decoder
        self.rows: list[Row] = []
        self.logits: torch.Tensor | None = None  # (B, V): the next-token logits of every row
        self.tokens: torch.Tensor | None = None  # (B,): the tokens to feed in the next forward pass
        self._groups: list[_Group] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, seqs: list[Sequence]) -> None:
        """Prefill `seqs` (each with max_new_tokens >= 1) into new rows: one forward pass."""
        r = self.runner
        with r.autocast():
            logits = self.decoder.add(
                [s.prompt for s in seqs], [len(s.prompt) + s.max_new_tokens for s in seqs]
            )
        for s in seqs:
            texts = generation.StopTexts(s.sampling.stop, r.decode) if s.sampling.stop else None
            min_new = min(s.sampling.min_new_tokens, s.max_new_tokens)
            row = Row(s, s.sampling.batch_key(), frozenset(r.stop_ids(s.sampling)), min_new, texts)
            s.output_ids, s.logprobs, s.top = row.ids, row.logprobs, []  # seen as they grow
            self.rows.append(row)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self._groups = None

    def forward(self) -> None:
        """One decoding step: feed every row its last token; the logits of the next."""
        assert self.tokens is not None and len(self.tokens) == len(self.rows)
        with self.runner.autocast():
            self.logits = self.decoder.step(self.tokens)
        self.tokens = None

    def groups(self) -> list[_Group]:
        """Rows by sampling params (recomputed when rows join or leave)."""
        if self._groups is None:
            by_key: dict[Sampling, list[int]] = {}
            for i, row in enumerate(self.rows):
                by_key.setdefault(row.key, []).append(i)
            device = self.decoder.device
            self._groups = [
                _Group(
                    None if len(idx) == len(self.rows) else torch.tensor(idx, device=device),
                    idx,
                    torch.tensor(sorted(self.rows[idx[0]].stop), dtype=torch.long, device=device),
                    key.hyperparameters(key.min_new_tokens + 1),
                )
                for key, idx in by_key.items()
            ]
        return self._groups

    def sample(self) -> list[tuple[Row, dict[str, Any]]]:
        """Sample every row's next token; the rows that finished with it (removed), with their finish."""
        assert self.logits is not None and len(self.logits) == len(self.rows)
        B = len(self.rows)
        tokens = torch.empty(B, dtype=torch.long, device=self.logits.device)
        logps = torch.empty(B, dtype=torch.float32, device=self.logits.device)
        for g in self.groups():
            logits = (self.logits if g.rows is None else self.logits[g.rows]).float()
            early = [j for j, i in enumerate(g.members) if len(self.rows[i].ids) < self.rows[i].min_new]
            if early and len(g.stop):  # min_new_tokens: no stop token yet
                logits[torch.tensor(early, device=logits.device)[:, None], g.stop[None, :]] = float("-inf")
            tok, lp = generation.sample(logits, g.params)
            self._record_top(g, logits)
            if g.rows is None:
                tokens, logps = tok, lp
            else:
                tokens[g.rows], logps[g.rows] = tok, lp.float()
        self.logits = None
        finished: list[tuple[Row, dict[str, Any]]] = []
        keep: list[int] = []
        for i, (row, tok, lp) in enumerate(zip(self.rows, tokens.tolist(), logps.tolist(), strict=True)):
            row.ids.append(tok)
            row.logprobs.append(lp)
            finish = self._finish(row, tok)
            if finish is None:
                keep.append(i)
            else:
                finished.append((row, finish))
        if finished:
            self.decoder.keep(keep)
            self.rows = [self.rows[i] for i in keep]
            self._groups = None
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=tokens.device)]
        self.tokens = tokens
        return finished

    def _record_top(self, g: _Group, logits: torch.Tensor) -> None:
        """The top_n alternatives of the rows of group `g` that ask for them, from the distribution sampled
        (`logits`: the group's, as `sample` got them)."""
        want = [j for j, i in enumerate(g.members) if self.rows[i].seq.top_n > 0]
        if not want:
            return
        sel = torch.tensor(want, device=logits.device)
        logp = torch.log_softmax(generation.process_logits(logits[sel].float(), g.params), dim=-1)
        k = min(max(self.rows[g.members[j]].seq.top_n for j in want), logp.shape[-1])
        values, ids = logp.topk(k, dim=-1)
        for j, vs, ts in zip(want, values.tolist(), ids.tolist(), strict=True):
            seq = self.rows[g.members[j]].seq
            seq.top.append(list(zip(ts[: seq.top_n], vs[: seq.top_n], strict=True)))

    def drop(self, which: Callable[[Row], bool]) -> list[Row]:
        """Remove the rows `which` picks (between steps: after a forward pass); the rows removed."""
        picked = [which(row) for row in self.rows]
        if not any(picked):
            return []
        gone = [row for row, p in zip(self.rows, picked, strict=True) if p]
        keep = [i for i, p in enumerate(picked) if not p]
        self.decoder.keep(keep)
        if self.logits is not None:
            self.logits = self.logits[torch.tensor(keep, dtype=torch.long, device=self.logits.device)]
        if self.tokens is not None:
            self.tokens = self.tokens[torch.tensor(keep, dtype=torch.long, device=self.tokens.device)]
        self.rows = [self.rows[i] for i in keep]
        self._groups = None
        return gone

    @staticmethod
    def _finish(row: Row, token: int) -> dict[str, Any] | None:
        """How `row` ends with `token` just added, or None if it goes on."""
        if token in row.stop:
            return finish_stop(token)
        n = len(row.ids)
        if row.texts is not None and n > row.min_new and row.texts.may_end(token):
            text = row.texts.matched(row.ids)
            if text is not None:
                return finish_stop(text)
        if n >= row.seq.max_new_tokens:
            return finish_length(row.seq.sampling.max_new_tokens)
        return None

    def clear(self) -> list[Row]:
        """Drop every row (abort, error); the rows dropped."""
        rows, self.rows = self.rows, []
        self.decoder.keep([])
        self.logits = self.tokens = None
        self._groups = None
        return rows

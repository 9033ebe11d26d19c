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
    from arealcli.runtime.generation.sequence import Sequence


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
    """Rows that share their sampling params (and so their stop tokens): sampled in one call, failed
    together."""

    rows: torch.Tensor | None  # row indices, made once per grouping (None: every row)
    members: list[int]
    stop: torch.Tensor | None  # (S,) stop token ids
    params: Any  # GenerationHyperparameters of `sampling.sample`
    error: str | None = None  # why these rows cannot be sampled (their params), if they cannot


def _why(e: Exception) -> str:
    return f"sampling failed: {type(e).__name__}: {e}"


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

    def add(self, seqs: list[Sequence]) -> list[tuple[Sequence, str]]:
        """Prefill `seqs` (each with max_new_tokens >= 1) into new rows: one forward pass. Returns the
        samples that could not join, with why: those whose row cannot be made, or all of them when the
        prefill fails (the running rows go on, unless the cache no longer matches them). A prefill is not
        retried sample by sample: the server has checked every prompt (length, token ids), so what fails
        it is the device (memory), not one sample."""
        failed: list[tuple[Sequence, str]] = []
        rows: list[Row] = []
        for s in seqs:
            try:
                rows.append(self._row(s))
            except Exception as e:
                failed.append((s, _why(e)))
        if not rows:
            return failed
        try:
            self._prefill(rows)
        except Exception as e:
            self._check_consistent()
            failed += [(row.seq, _why(e)) for row in rows]
        return failed

    def _row(self, s: Sequence) -> Row:
        r = self.runner
        texts = generation.StopTexts(s.sampling.stop, r.decode) if s.sampling.stop else None
        min_new = min(s.sampling.min_new_tokens, s.max_new_tokens)
        return Row(s, s.sampling.batch_key(), frozenset(r.stop_ids(s.sampling)), min_new, texts)

    def _prefill(self, rows: list[Row]) -> None:
        with self.runner.autocast(), self.runner.adapters.use([row.seq.adapter for row in rows]):
            logits = self.decoder.add(
                [row.seq.prompt for row in rows],
                [len(row.seq.prompt) + row.seq.max_new_tokens for row in rows],
            )
        for row in rows:
            s = row.seq
            s.output_ids, s.logprobs, s.top = row.ids, row.logprobs, []  # seen as they grow
            self.rows.append(row)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self._groups = None

    def _check_consistent(self) -> None:
        """After a failed prefill: the cache must still hold exactly the batch's rows (else the whole
        batch fails: its rows' caches can no longer be trusted)."""
        if self.decoder.rows != len(self.rows):
            raise RuntimeError("a failed prefill left the KV cache inconsistent with the running batch")

    def forward(self) -> None:
        """One decoding step: feed every row its last token; the logits of the next."""
        assert self.tokens is not None and len(self.tokens) == len(self.rows)
        with self.runner.autocast(), self.runner.adapters.use([row.seq.adapter for row in self.rows]):
            self.logits = self.decoder.step(self.tokens)
        self.tokens = None

    def groups(self) -> list[_Group]:
        """Rows by sampling params (recomputed when rows join or leave). A group whose params cannot be
        sampled with (the server checks them first: a defence in depth) carries why, for its rows only."""
        if self._groups is None:
            by_key: dict[Sampling, list[int]] = {}
            for i, row in enumerate(self.rows):
                by_key.setdefault(row.key, []).append(i)
            device = self.decoder.device
            self._groups = []
            for key, idx in by_key.items():
                rows = None if len(idx) == len(self.rows) else torch.tensor(idx, device=device)
                try:
                    stop = torch.tensor(sorted(self.rows[idx[0]].stop), dtype=torch.long, device=device)
                    self._groups.append(_Group(rows, idx, stop, key.hyperparameters(1)))
                except Exception as e:  # e.g. a stop id beyond int64, params the sampler refuses
                    self._groups.append(_Group(rows, idx, None, None, _why(e)))
        return self._groups

    def sample(self) -> tuple[list[tuple[Row, dict[str, Any]]], list[tuple[Row, str]]]:
        """Sample every row's next token; the rows that finished with it, with their finish, and the rows
        that failed, with why (both removed). A failure while sampling fails its group only: the group's
        rows share the params and stop tokens that could make it fail."""
        assert self.logits is not None and len(self.logits) == len(self.rows)
        B = len(self.rows)
        tokens = torch.zeros(B, dtype=torch.long, device=self.logits.device)
        logps = torch.zeros(B, dtype=torch.float32, device=self.logits.device)
        failed: dict[int, str] = {}
        tops: dict[int, list[tuple[int, float]]] = {}
        for g in self.groups():
            if g.error is not None:
                failed.update(dict.fromkeys(g.members, g.error))
                continue
            try:
                self._sample_group(g, tokens, logps, tops)
            except Exception as e:
                failed.update(dict.fromkeys(g.members, _why(e)))
        self.logits = None
        return self._advance(tokens, logps, tops, failed)

    def _advance(
        self,
        tokens: torch.Tensor,
        logps: torch.Tensor,
        tops: dict[int, list[tuple[int, float]]],
        failed: dict[int, str],
    ) -> tuple[list[tuple[Row, dict[str, Any]]], list[tuple[Row, str]]]:
        """Record every sampled row's token (and alternatives); drop the rows that finished or failed."""
        finished: list[tuple[Row, dict[str, Any]]] = []
        failures: list[tuple[Row, str]] = []
        keep: list[int] = []
        for i, (row, tok, lp) in enumerate(zip(self.rows, tokens.tolist(), logps.tolist(), strict=True)):
            if i in failed:
                failures.append((row, failed[i]))
                continue
            row.ids.append(tok)
            row.logprobs.append(lp)
            if i in tops:
                row.seq.top.append(tops[i])
            try:
                finish = self._finish(row, tok)
            except Exception as e:  # e.g. its stop texts cannot be matched
                failures.append((row, _why(e)))
                continue
            if finish is None:
                keep.append(i)
            else:
                finished.append((row, finish))
        if len(keep) < len(self.rows):
            self.decoder.keep(keep)
            self.rows = [self.rows[i] for i in keep]
            self._groups = None
            tokens = tokens[torch.tensor(keep, dtype=torch.long, device=tokens.device)]
        self.tokens = tokens
        return finished, failures

    def _sample_group(
        self,
        g: _Group,
        tokens: torch.Tensor,
        logps: torch.Tensor,
        tops: dict[int, list[tuple[int, float]]],
    ) -> None:
        """Sample the next token of group `g`'s rows into `tokens` and `logps`, their top alternatives into
        `tops`; nothing is written when it fails."""
        assert self.logits is not None and g.stop is not None
        members = g.members
        logits = (self.logits if g.rows is None else self.logits[g.rows]).float()
        early = [j for j, i in enumerate(members) if len(self.rows[i].ids) < self.rows[i].min_new]
        if early and len(g.stop):  # min_new_tokens: no stop token yet
            logits[torch.tensor(early, device=logits.device)[:, None], g.stop[None, :]] = float("-inf")
        tok, lp = generation.sample(logits, g.params)
        found = self._top(members, logits, g.params)
        if g.rows is None:
            tokens.copy_(tok)
            logps.copy_(lp.float())
        else:
            tokens[g.rows], logps[g.rows] = tok, lp.float()
        tops.update(found)

    def _top(
        self, members: list[int], logits: torch.Tensor, params: Any
    ) -> dict[int, list[tuple[int, float]]]:
        """The top_n alternatives of the rows `members` that ask for them, from the distribution sampled
        (`logits`: those rows', as sampled)."""
        want = [j for j, i in enumerate(members) if self.rows[i].seq.top_n > 0]
        if not want:
            return {}
        sel = torch.tensor(want, device=logits.device)
        logp = torch.log_softmax(generation.process_logits(logits[sel].float(), params), dim=-1)
        k = min(max(self.rows[members[j]].seq.top_n for j in want), logp.shape[-1])
        values, ids = logp.topk(k, dim=-1)
        out = {}
        for j, vs, ts in zip(want, values.tolist(), ids.tolist(), strict=True):
            n = self.rows[members[j]].seq.top_n
            out[members[j]] = list(zip(ts[:n], vs[:n], strict=True))
        return out

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

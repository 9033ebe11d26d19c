"""Preference pairs: a prompt with a chosen and a rejected response, as two sequences of one batch.

Rows `{prompt, chosen, rejected}` (the keys are args), from JSONL, parquet, a folder or a Hub dataset
like every dataset. Each value is a text, or chat messages: the prompt [{role, content}, ...] (system,
user, assistant and tool turns), each response [{role: assistant, content}, ...]. When any row has
messages (or with `apply_chat_template`) every row is rendered with the tokenizer's chat template (a
text prompt as a user message, a text response as an assistant one), and the loss counts the
response's assistant tokens only, never the prompt's history.

How a pair travels in a batch (the contract of the interfaces that learn from pairs: `dpo`, a
Bradley-Terry reward model):

    dataset row k -> two samples, next to each other, the chosen one first
                          chosen sample            rejected sample
        id                (k, CHOSEN) = (k, 0)     (k, REJECTED) = (k, 1)
        packed_input_ids  prompt + chosen          prompt + rejected      (the same prompt tokens)
        prompt_mask       True on the prompt's tokens
        loss_mask         True on the response's tokens (text: the response and its EOS; chat: the
                          assistant message(s) with the template's end of turn)
        meta `pair`       k                        k
        meta `prompt`     the prompt as text (rendered by the chat template when there is one)
        meta `margin`     the pair's margin (`margin_key`; 0 without it), the same on both samples

A step's batch of `dataset.batch_size` pairs holds 2 x batch_size samples: c0 r0 c1 r1 ... The meta
key `pair` (`sample.PAIR`) makes the two samples one unit: micro-batch splits (`SequenceSample.split`)
and the data-parallel slices (`distributed.dp_slice`) never separate them and keep the chosen one
first, so a train call must list `pair` among its inputs (`areal check` says so). `pair_indices(mb)`
gives, in a micro-batch, the position of each pair's chosen and rejected sample, and refuses a batch
that breaks the layout.

Rows are checked as the other datasets check them (every bad row named with file:line); a pair whose
prompt alone is `max_length` tokens or more is dropped, longer sequences are cut, and a pair whose two
responses are the same tokens (no preference to learn) is dropped; each is counted in `notes`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from arealcli.errors import DataError
from arealcli.runtime.data.chat import (
    messages_problem,
    render_conversation,
    require_template,
    with_system,
)
from arealcli.runtime.data.datasets import kind_of, read_valid_rows, row_lines, text_value
from arealcli.runtime.data.sample import SequenceSample
from arealcli.schema.components.datasets import MARGIN, PAIR, PreferenceArgs

CHOSEN, REJECTED = 0, 1  # the second part of a preference sample's id: (row, CHOSEN), (row, REJECTED)


def pair_indices(mb: SequenceSample) -> tuple[list[int], list[int]]:
    """(chosen positions (P,), rejected positions (P,)) of the P pairs of a batch in the layout above:
    samples 2p and 2p + 1 share a `pair` value and have ids (k, CHOSEN), (k, REJECTED)."""
    pairs = mb.meta[PAIR]
    chosen, rejected = list(range(0, mb.bs, 2)), list(range(1, mb.bs, 2))
    laid_out = mb.bs % 2 == 0 and all(
        pairs[c] == pairs[r] and mb.ids[c][1] == CHOSEN and mb.ids[r][1] == REJECTED
        for c, r in zip(chosen, rejected, strict=True)
    )
    if not laid_out:
        raise ValueError(
            "a batch of preference pairs must hold each pair's chosen then rejected sample, next to each "
            f"other (ids (k, 0), (k, 1), the same `pair`); got ids {mb.ids[:6]}..."
        )
    return chosen, rejected


def _response_problem(value: Any, key: str) -> str | None:
    """Why a chosen or rejected response is neither a non-empty text nor assistant messages, or None."""
    if isinstance(value, list):
        problem = messages_problem(value, key)
        if problem is not None:
            return problem
        if any(m["role"] not in ("assistant", "tool") for m in value):
            return f"{key!r} messages must be the response's (roles assistant or tool); put the rest in the prompt"
        if not any(m["role"] == "assistant" for m in value):
            return f"{key!r} has no assistant message: no response to prefer"
        return None
    text = text_value(value)
    if text is None or not text:
        got = "an empty text" if value == "" else kind_of(value)
        return f"{key!r} must be a non-empty text or a list of assistant messages, got {got}"
    return None


def _margin_problem(row: dict, key: str | None) -> str | None:
    """Why the row's margin (when the data has one) is not a finite number, or None."""
    if key is None:
        return None
    if key not in row:
        return f"row has no {key!r} field (margin_key; has {sorted(row)})"
    value = row[key]
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        got = repr(value) if isinstance(value, float) else kind_of(value)
        return f"{key!r} (margin_key) must be a finite number, got {got}"
    return None


def _as_messages(value: Any, role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": text_value(value)}]


class PreferenceDataset:
    """Preference pairs {prompt, chosen, rejected}: each row two sequences, chosen and rejected, one unit."""

    Args = PreferenceArgs
    provides = ("packed_input_ids", "prompt_mask", "loss_mask", PAIR, "prompt", MARGIN)

    def __init__(self, args: PreferenceArgs, tokenizer, base_dir: str | Path = "."):
        self.args, self.tokenizer = args, tokenizer
        self.path, rows = read_valid_rows(args, base_dir, self._row_problem)
        # one form for every row: the chat template when asked, or when any row is given as messages
        keys = (args.prompt_key, args.chosen_key, args.rejected_key)
        self.chat = args.apply_chat_template or any(isinstance(row[k], list) for _, row in rows for k in keys)
        if self.chat:
            require_template(tokenizer)
        self.notes: list[str] = []
        self.items: list[dict[str, Any]] = []
        dropped: dict[str, list[str]] = {"long": [], "same": []}
        cut: list[str] = []
        for where, row in rows:
            item = self._encode(len(self.items), row)
            if item["prompt_len"] >= args.max_length:
                dropped["long"].append(where)
            elif item["chosen"] == item["rejected"]:
                dropped["same"].append(where)
            else:
                cut += [where] if item.pop("truncated") else []
                self.items.append(item)
        self._note(len(rows), dropped, cut)
        if not self.items:
            raise DataError(
                f"{self.path}: no usable pair (each prompt is {args.max_length} tokens or more, or each "
                "pair's responses are the same); raise dataset.args.max_length or check the data"
            )

    def _note(self, n: int, dropped: dict[str, list[str]], cut: list[str]) -> None:
        a = self.args
        if dropped["long"]:
            self.notes.append(
                f"{self.path}: dropped {len(dropped['long'])} of {n} pairs whose prompt alone is {a.max_length} "
                f"tokens or more (max_length) — {row_lines(dropped['long'])}"
            )
        if dropped["same"]:
            self.notes.append(
                f"{self.path}: dropped {len(dropped['same'])} of {n} pairs whose chosen and rejected responses "
                f"are the same tokens — {row_lines(dropped['same'])}"
            )
        if cut:
            self.notes.append(
                f"{self.path}: cut {len(cut)} of {n} pairs to max_length ({a.max_length} tokens) — {row_lines(cut)}"
            )

    def _row_problem(self, row: Any) -> str | None:
        a = self.args
        keys = (a.prompt_key, a.chosen_key, a.rejected_key)
        if not isinstance(row, dict):
            return f"a row must be a JSON object with {', '.join(map(repr, keys))}, got {kind_of(row)}"
        for key in keys:
            if key not in row:
                return f"row has no {key!r} field (has {sorted(row)})"
        prompt = row[a.prompt_key]
        if isinstance(prompt, list):
            problem = messages_problem(prompt, a.prompt_key)
            if problem:
                return problem
        elif text_value(prompt) is None or prompt == "":
            got = "an empty text" if prompt == "" else kind_of(prompt)
            return f"{a.prompt_key!r} must be a non-empty text or a list of messages, got {got}"
        return (
            _response_problem(row[a.chosen_key], a.chosen_key)
            or _response_problem(row[a.rejected_key], a.rejected_key)
            or _margin_problem(row, a.margin_key)
        )

    def _encode(self, index: int, row: dict[str, Any]) -> dict[str, Any]:
        """The pair's two token sequences and loss masks, cut to max_length."""
        a = self.args
        encode = self._chat if self.chat else self._plain
        (chosen, chosen_mask), (rejected, rejected_mask), prompt_len = encode(
            row[a.prompt_key], row[a.chosen_key], row[a.rejected_key]
        )
        n = a.max_length
        return {
            "id": index,
            "prompt_len": prompt_len,
            "chosen": chosen[:n],
            "chosen_mask": chosen_mask[:n],
            "rejected": rejected[:n],
            "rejected_mask": rejected_mask[:n],
            "truncated": max(len(chosen), len(rejected)) > n,
            "prompt": self.tokenizer.decode(chosen[:prompt_len]),
            "margin": float(row[a.margin_key]) if a.margin_key is not None else 0.0,
        }

    def _plain(self, prompt: Any, chosen: Any, rejected: Any):
        """Text: prompt tokens, then the response's tokens (and EOS), each tokenized on its own."""
        tok = self.tokenizer
        prompt_ids = tok(text_value(prompt), add_special_tokens=False)["input_ids"]
        eos = [tok.eos_token_id] if self.args.append_eos else []

        def sequence(response: Any) -> tuple[list[int], list[bool]]:
            ids = tok(text_value(response), add_special_tokens=False)["input_ids"] + eos
            return prompt_ids + ids, [False] * len(prompt_ids) + [True] * len(ids)

        return sequence(chosen), sequence(rejected), len(prompt_ids)

    def _chat(self, prompt: Any, chosen: Any, rejected: Any):
        """Messages: the conversation prompt + response in the chat template, the loss on the response's
        assistant tokens; the prompt ends where the first counted token starts."""
        head = with_system(_as_messages(prompt, "user"), self.args.system_prompt)

        def sequence(response: Any) -> tuple[list[int], list[bool]]:
            messages = head + _as_messages(response, "assistant")
            return render_conversation(self.tokenizer, messages, counted_from=len(head))

        (c_ids, c_mask), (r_ids, r_mask) = sequence(chosen), sequence(rejected)
        prompt_len = min(m.index(True) if True in m else len(m) for m in (c_mask, r_mask))
        return (c_ids, c_mask), (r_ids, r_mask), prompt_len

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> SequenceSample:
        """2 x len(indices) samples, each pair's chosen then rejected (the layout of the module docstring)."""
        ids, seqs, masks, prompt_masks, pairs, prompts, margins = [], [], [], [], [], [], []
        for it in (self.items[i] for i in indices):
            for role, key in ((CHOSEN, "chosen"), (REJECTED, "rejected")):
                seq = it[key]
                ids.append((it["id"], role))
                seqs.append(torch.tensor(seq, dtype=torch.long))
                masks.append(torch.tensor(it[f"{key}_mask"], dtype=torch.bool))
                prompt_masks.append(torch.arange(len(seq)) < it["prompt_len"])
                pairs.append(it["id"])
                prompts.append(it["prompt"])
                margins.append(it["margin"])
        return SequenceSample.from_lists(
            ids,
            {"packed_input_ids": seqs, "prompt_mask": prompt_masks, "loss_mask": masks},
            {PAIR: pairs, "prompt": prompts, MARGIN: margins},
        )

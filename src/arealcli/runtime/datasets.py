"""Datasets and seeded, position-addressable batching (so resume restores the exact data order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from arealcli.errors import DataError
from arealcli.runtime.data import SequenceSample
from arealcli.schema.components.datasets import PromptAnswerArgs

MAX_REPORTED = 5  # bad rows named in one error


def read_jsonl(path: Path) -> tuple[list[tuple[int, Any]], list[str]]:
    """(line number, parsed value) of every non-blank line, and `file:line:col: problem` of every bad one.

    UTF-8 only (a BOM is allowed); each line one JSON value.
    """
    if path.is_dir():
        raise DataError(f"{path} is a directory; give the JSONL file inside it")
    try:
        raw_lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    rows, bad = [], []
    for lineno, raw in enumerate(raw_lines, 1):
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad.append(
                f"{path}:{lineno}:{e.start + 1}: not valid UTF-8 (byte 0x{raw[e.start]:02x}); save the file as UTF-8"
            )
            continue
        if not line.strip():
            continue
        try:
            rows.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            bad.append(f"{path}:{lineno}:{e.colno}: not valid JSON: {e.msg}")
        except RecursionError:
            bad.append(f"{path}:{lineno}: JSON nested too deeply")
    return rows, bad


def _raise_bad(bad: list[str]) -> None:
    if bad:
        more = f"\n... and {len(bad) - MAX_REPORTED} more bad row(s)" if len(bad) > MAX_REPORTED else ""
        raise DataError("\n".join(bad[:MAX_REPORTED]) + more)


def _text(value: Any) -> str | None:
    """A prompt or answer as text: strings, and numbers written as JSON numbers (`"answer": 42`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


class PromptAnswerDataset:
    """JSONL rows with a prompt and an answer (a string, a number, or a list of accepted answers).

    Every row is checked: a row that is not an object, a missing, null or non-text prompt, or an answer
    that is not text, a number or a non-empty list of those is an error naming the file and line. A row
    whose prompt alone is `max_length` tokens or more is dropped (it leaves no room for an answer); one
    whose prompt + answer is longer has its answer cut. Both are counted and reported (`notes`).
    """

    Args = PromptAnswerArgs
    provides = ("packed_input_ids", "prompt_mask", "packed_prompts", "prompt", "answers")

    def __init__(self, args: PromptAnswerArgs, tokenizer, base_dir: str | Path = "."):
        path = Path(args.path).expanduser()
        if not path.is_absolute():
            path = Path(base_dir) / path
        if not path.exists():
            raise DataError(f"dataset file {path} does not exist")
        self.path, self.args, self.tokenizer = path, args, tokenizer
        self.notes: list[str] = []  # what was dropped or cut, for the console
        rows = []
        parsed, bad = read_jsonl(path)
        for lineno, row in parsed:
            if args.limit is not None and len(rows) >= args.limit:
                break
            problem = self._row_problem(row)
            if problem:
                bad.append(f"{path}:{lineno}: {problem}")
            else:
                rows.append((lineno, row))
        _raise_bad(sorted(bad, key=lambda line: int(line[len(str(path)) + 1 :].split(":")[0])))
        if not rows:
            raise DataError(f"{path} has no rows (an empty or blank file); each line must be a JSON object")
        self.items, dropped, cut = [], [], []
        for lineno, row in rows:
            item = self._encode(len(self.items), row)
            if len(item["prompt_ids"]) >= args.max_length:
                dropped.append(lineno)
                continue
            if item["truncated"]:
                cut.append(lineno)
            self.items.append(item)
        if dropped:
            self.notes.append(
                f"{path}: dropped {len(dropped)} of {len(rows)} rows whose prompt alone is {args.max_length} "
                f"tokens or more (max_length) — lines {_lines(dropped)}"
            )
        if cut:
            self.notes.append(
                f"{path}: cut the answer of {len(cut)} of {len(rows)} rows to fit max_length "
                f"({args.max_length} tokens) — lines {_lines(cut)}"
            )
        if not self.items:
            raise DataError(
                f"{path}: every row's prompt is longer than max_length ({args.max_length} tokens); "
                "raise dataset.args.max_length"
            )

    def _row_problem(self, row: Any) -> str | None:
        a = self.args
        if not isinstance(row, dict):
            return f"a row must be a JSON object with {a.prompt_key!r} and {a.answer_key!r}, got {_kind(row)}"
        for key in (a.prompt_key, a.answer_key):
            if key not in row:
                return f"row has no {key!r} field (has {sorted(row)})"
        prompt = row[a.prompt_key]
        if _text(prompt) is None or (isinstance(prompt, str) and not prompt):
            return f"{a.prompt_key!r} must be a non-empty text, got {_kind(prompt) if prompt != '' else 'an empty text'}"
        answer = row[a.answer_key]
        answers = answer if isinstance(answer, list) else [answer]
        if not answers:
            return f"{a.answer_key!r} is an empty list; give at least one accepted answer"
        for x in answers:
            if _text(x) is None:
                return f"{a.answer_key!r} must be a text, a number or a list of those, got {_kind(x)}"
        return None

    def _encode(self, index: int, row: dict[str, Any]) -> dict[str, Any]:
        a, tok = self.args, self.tokenizer
        prompt = _text(row[a.prompt_key])
        answers = row[a.answer_key] if isinstance(row[a.answer_key], list) else [row[a.answer_key]]
        answers = [_text(x) for x in answers]
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tok(answers[0], add_special_tokens=False)["input_ids"]
        if a.append_eos:
            answer_ids = answer_ids + [tok.eos_token_id]
        full = prompt_ids + answer_ids
        return {
            "id": index,
            "prompt_ids": prompt_ids,
            "input_ids": full[: a.max_length],
            "truncated": len(full) > a.max_length,
            "prompt": prompt,
            "answers": answers,
        }

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> SequenceSample:
        """Keys: packed_input_ids (prompt + answer), prompt_mask, packed_prompts; meta: prompt, answers."""
        items = [self.items[i] for i in indices]
        return SequenceSample.from_lists(
            [it["id"] for it in items],
            {
                "packed_input_ids": [torch.tensor(it["input_ids"]) for it in items],
                "prompt_mask": [
                    torch.tensor(
                        [1] * min(len(it["prompt_ids"]), len(it["input_ids"]))
                        + [0] * max(0, len(it["input_ids"]) - len(it["prompt_ids"])),
                        dtype=torch.bool,
                    )
                    for it in items
                ],
                "packed_prompts": [torch.tensor(it["prompt_ids"]) for it in items],
            },
            {"prompt": [it["prompt"] for it in items], "answers": [it["answers"] for it in items]},
        )


def _lines(linenos: list[int]) -> str:
    shown = ", ".join(map(str, linenos[:MAX_REPORTED]))
    return shown + (f", ... ({len(linenos) - MAX_REPORTED} more)" if len(linenos) > MAX_REPORTED else "")


def _source(dataset) -> str:
    path = getattr(dataset, "path", None)
    return str(path) if path is not None else f"the dataset ({type(dataset).__name__})"


class Batches:
    """Batch `step` of epoch `epoch` is a pure function of (seed, epoch, step): resume needs no state."""

    def __init__(self, dataset, batch_size: int, shuffle: bool, seed: int):
        if batch_size > len(dataset):
            raise DataError(
                f"dataset.batch_size ({batch_size}) is larger than {_source(dataset)} ({len(dataset)} usable "
                "rows); lower the batch size or add rows"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.steps_per_epoch = len(dataset) // batch_size  # the last partial batch is dropped

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    def batch(self, epoch: int, step: int) -> SequenceSample:
        idx = self.order(epoch)[step * self.batch_size : (step + 1) * self.batch_size]
        return self.dataset.collate(idx)

    def all_batches(self, min_size: int = 1):
        """Every row once, in order (evaluation); the last batch may be smaller.

        A last batch of fewer than `min_size` rows joins the one before it (so that a batch split over
        `min_size` ranks gives every rank at least one row).
        """
        n = len(self.dataset)
        if n < min_size:
            raise DataError(
                f"the evaluation dataset {_source(self.dataset)} has {n} rows, fewer than the {min_size} "
                "data-parallel processes"
            )
        starts = list(range(0, n, self.batch_size))
        if len(starts) > 1 and n - starts[-1] < min_size:
            starts.pop()
        for start, end in zip(starts, [*starts[1:], n], strict=True):
            yield self.dataset.collate(list(range(start, end)))

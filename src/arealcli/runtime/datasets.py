"""Datasets and seeded, position-addressable batching (so resume restores the exact data order)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from arealcli.runtime.data import SequenceSample
from arealcli.schema.components.datasets import PromptAnswerArgs


class PromptAnswerDataset:
    """JSONL rows with a prompt and an answer (extra fields are kept as metadata)."""

    Args = PromptAnswerArgs
    provides = ("packed_input_ids", "prompt_mask", "packed_prompts", "prompt", "answers")

    def __init__(self, args: PromptAnswerArgs, tokenizer, base_dir: str | Path = "."):
        path = Path(args.path)
        if not path.is_absolute():
            path = Path(base_dir) / path
        if not path.exists():
            raise FileNotFoundError(f"dataset file {path} does not exist")
        self.rows: list[dict[str, Any]] = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                for key in (args.prompt_key, args.answer_key):
                    if key not in row:
                        raise ValueError(f"{path}:{lineno}: row has no {key!r} field (has {sorted(row)})")
                self.rows.append(row)
                if args.limit is not None and len(self.rows) >= args.limit:
                    break
        self.args, self.tokenizer = args, tokenizer
        self.items = [self._encode(i, row) for i, row in enumerate(self.rows)]

    def _encode(self, index: int, row: dict[str, Any]) -> dict[str, Any]:
        a, tok = self.args, self.tokenizer
        prompt = str(row[a.prompt_key])
        answers = row[a.answer_key] if isinstance(row[a.answer_key], list) else [row[a.answer_key]]
        answers = [str(x) for x in answers]
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"][: a.max_length]
        answer_ids = tok(answers[0], add_special_tokens=False)["input_ids"]
        if a.append_eos:
            answer_ids = answer_ids + [tok.eos_token_id]
        full = (prompt_ids + answer_ids)[: a.max_length]
        return {
            "id": index,
            "prompt_ids": prompt_ids,
            "input_ids": full,
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


class Batches:
    """Batch `step` of epoch `epoch` is a pure function of (seed, epoch, step): resume needs no state."""

    def __init__(self, dataset, batch_size: int, shuffle: bool, seed: int):
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} is larger than the dataset ({len(dataset)} rows)")
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
            raise ValueError(f"the evaluation dataset has {n} rows, fewer than the {min_size} processes")
        starts = list(range(0, n, self.batch_size))
        if len(starts) > 1 and n - starts[-1] < min_size:
            starts.pop()
        for start, end in zip(starts, [*starts[1:], n], strict=True):
            yield self.dataset.collate(list(range(start, end)))

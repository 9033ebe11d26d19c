"""The tasks of a verifiers taskset as a dataset (verifiers >= 0.4, `verifiers.v1`).

A taskset is a module exporting a `vf.Taskset` subclass whose `load()` yields typed tasks
(`vf.TaskData`: `prompt`, a text or chat messages, an optional `system_prompt`, and the taskset's own
fields). Each task is one row: its prompt rendered with the chat template and its generation prompt
(what the environment's first model call renders), the task's data as JSON in the meta key `task` (the
`verifiers` workflow rebuilds the task from it, as verifiers' env server does), and, for an SFT warm-up,
the task's reference answer (`answer_key`) after the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from arealcli.errors import DataError, UserError
from arealcli.runtime.data.chat import render_prompt, require_template, with_system
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.data.verifiers_configs import import_verifiers, taskset_config
from arealcli.schema.components.datasets import VerifiersTasksArgs

TASK = "task"  # meta key: the task's data, as verifiers' TaskData.model_dump(mode="json")


def load_tasks(taskset: dict[str, Any], folder: str | Path | None) -> list[Any]:
    """Every task of the taskset `taskset` ({id, ...its config}), in its order."""
    vf = import_verifiers()
    try:
        config = taskset_config(taskset, folder)
    except UserError as e:
        raise DataError(str(e)) from None
    return list(vf.load_taskset(config))


def task_messages(data: Any) -> list[dict[str, Any]]:
    """The task's prompt as chat messages: its system prompt, then its prompt (a text: one user message)."""
    prompt = data.prompt
    if prompt is None:
        messages: list[dict[str, Any]] = []
    elif isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [
            m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else dict(m)
            for m in prompt
        ]
    return with_system(messages, data.system_prompt)


class VerifiersTasksDataset:
    """The tasks of a verifiers taskset (see the module doc)."""

    Args = VerifiersTasksArgs
    provides = ("packed_input_ids", "prompt_mask", "loss_mask", "packed_prompts", "prompt", "answers", TASK)

    def __init__(self, args: VerifiersTasksArgs, tokenizer, base_dir: str | Path = "."):
        require_template(tokenizer)
        self.args, self.tokenizer = args, tokenizer
        name = str(args.taskset.get("id"))
        self.path = f"verifiers taskset {name}"
        tasks = load_tasks(args.taskset, args.taskset_dir or base_dir)[args.skip :]
        if args.limit is not None:
            tasks = tasks[: args.limit]
        if not tasks:
            raise DataError(f"{self.path}: no tasks (after skip: {args.skip})")
        self.notes: list[str] = []
        self.items: list[dict[str, Any]] = []
        dropped = 0
        for task in tasks:
            item = self._encode(len(self.items), task.data)
            if len(item["prompt_ids"]) >= args.max_length:
                dropped += 1
                continue
            self.items.append(item)
        if dropped:
            self.notes.append(
                f"{self.path}: dropped {dropped} of {len(tasks)} tasks whose prompt alone is {args.max_length} "
                "tokens or more (max_length)"
            )
        if not self.items:
            raise DataError(f"{self.path}: every task's prompt is longer than max_length ({args.max_length})")

    def _encode(self, index: int, data: Any) -> dict[str, Any]:
        a, tok = self.args, self.tokenizer
        messages = task_messages(data)
        # a task without a prompt (the env writes the first message, e.g. an observation): the episode's
        # prompt is its first request's
        prompt, prompt_ids = render_prompt(tok, messages) if messages else ("", [])
        answer = getattr(data, a.answer_key, None) if a.answer_key else None
        answer_ids = tok(str(answer), add_special_tokens=False)["input_ids"] if answer is not None else []
        if answer is not None and a.append_eos:
            answer_ids.append(tok.eos_token_id)
        full = (prompt_ids + answer_ids)[: a.max_length]
        return {
            "id": index,
            "prompt_ids": prompt_ids,
            "input_ids": full,
            "loss_mask": ([False] * len(prompt_ids) + [True] * len(answer_ids))[: a.max_length],
            "prompt": prompt,
            "answers": [str(answer) if answer is not None else ""],
            TASK: data.model_dump(mode="json"),
        }

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> SequenceSample:
        items = [self.items[i] for i in indices]
        return SequenceSample.from_lists(
            [it["id"] for it in items],
            {
                "packed_input_ids": [torch.tensor(it["input_ids"]) for it in items],
                "prompt_mask": [torch.arange(len(it["input_ids"])) < len(it["prompt_ids"]) for it in items],
                "loss_mask": [torch.tensor(it["loss_mask"], dtype=torch.bool) for it in items],
                "packed_prompts": [torch.tensor(it["prompt_ids"]) for it in items],
            },
            {
                "prompt": [it["prompt"] for it in items],
                "answers": [it["answers"] for it in items],
                TASK: [it[TASK] for it in items],
            },
        )

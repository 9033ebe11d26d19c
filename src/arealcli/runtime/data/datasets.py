"""Datasets and seeded, position-addressable batching (so resume restores the exact data order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from arealcli.errors import DataError
from arealcli.runtime import vision
from arealcli.runtime.data.chat import (
    messages_problem,
    render_conversation,
    render_prompt,
    require_template,
    with_system,
)
from arealcli.runtime.data.images import image_problem, message_parts
from arealcli.runtime.data.jsonl import read_jsonl
from arealcli.runtime.data.sample import SequenceSample
from arealcli.schema.components.datasets import ChatArgs, PromptAnswerArgs

MAX_REPORTED = 5  # bad rows named in one error


def _raise_bad(bad: list[str]) -> None:
    if bad:
        more = f"\n... and {len(bad) - MAX_REPORTED} more bad row(s)" if len(bad) > MAX_REPORTED else ""
        raise DataError("\n".join(bad[:MAX_REPORTED]) + more)


def text_value(value: Any) -> str | None:
    """A prompt or answer as text: strings, and numbers written as JSON numbers (`"answer": 42`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    return None


def kind_of(value: Any) -> str:
    return {dict: "an object", list: "a list", bool: "a boolean", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def load_rows(args, base_dir: str | Path) -> tuple[str, list[tuple[str, Any]], list[str]]:
    """(source name, [(where, row)], [problems]) of a data source: a JSONL file read line by line (every
    bad line named), or anything else through the `datasets` library."""
    from arealcli.schema.paths import REPO_ID

    path = Path(args.path).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    if path.suffix == ".jsonl" or (path.is_file() and path.suffix not in DATASETS_FORMATS):
        if not path.exists():
            raise DataError(f"dataset file {path} does not exist")
        parsed, bad = read_jsonl(path)
        return str(path), [(f"{path}:{n}", row) for n, row in parsed], bad
    if path.exists():
        source = str(path)
    elif REPO_ID.match(args.path) or "/" not in args.path:
        source = args.path  # a Hub dataset name: from the cache (or downloaded, when online)
    else:
        raise DataError(f"dataset {path} does not exist")
    table = _load_dataset(source, path if path.exists() else None, args)
    return source, [(f"{source} [{args.split}] row {i}", row) for i, row in enumerate(table)], []


DATASETS_FORMATS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _load_dataset(source: str, path: Path | None, args) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {source} needs the `datasets` package: pip install datasets") from None
    if int(datasets.__version__.split(".")[0]) < 4:  # before 4, load_dataset could run a dataset's script
        raise DataError(
            f"reading {source} needs datasets >= 4 (found {datasets.__version__}, whose load_dataset runs "
            "code shipped with a dataset): pip install -U 'datasets>=4'"
        )
    datasets.disable_progress_bars()
    try:
        if path is not None and path.is_file():
            fmt = DATASETS_FORMATS[path.suffix]
            table = datasets.load_dataset(fmt, data_files={args.split: str(path)}, split=args.split)
        elif path is not None and any((path / f).exists() for f in ("state.json", "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(path))  # a folder written by save_to_disk
            table = loaded[args.split] if isinstance(loaded, datasets.DatasetDict) else loaded
        else:  # a folder of data files, or a Hub name (from the cache)
            table = datasets.load_dataset(
                str(path) if path is not None else source, args.subset, split=args.split
            )
    except Exception as e:  # not found, offline, unknown split, bad file: one message
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"cannot read the dataset {source} (split {args.split!r}): {first}") from None
    if args.limit is not None:
        table = table.select(range(min(args.limit, len(table))))
    return table


def data_folder(args, base_dir: str | Path) -> Path:
    """The folder a data source's relative paths (images) are relative to: the data file's, or the
    dataset folder itself."""
    path = Path(args.path).expanduser()
    path = path if path.is_absolute() else Path(base_dir) / path
    return path if path.is_dir() else path.parent


def read_valid_rows(args, base_dir, problem_of) -> tuple[str, list[tuple[str, Any]]]:
    """(source, [(where, row)]) of the rows up to `limit`, each checked by `problem_of(row) -> why |
    None`: every bad row is named at once (up to MAX_REPORTED), and no rows at all is an error."""
    source, parsed, bad = load_rows(args, base_dir)
    rows: list[tuple[str, Any]] = []
    for where, row in parsed:
        if args.limit is not None and len(rows) >= args.limit:
            break
        problem = problem_of(row)
        if problem:
            bad.append(f"{where}: {problem}")
        else:
            rows.append((where, row))
    _raise_bad(bad)
    if not rows:
        raise DataError(f"{source} has no rows (an empty or blank file); each row must be an object")
    return source, rows


class PromptAnswerDataset:
    """Rows with a prompt (text, or chat messages with messages_key) and an answer (text, a number, or a list
    of accepted answers), from a JSONL file or anything the `datasets` library reads.

    Every row is checked: a row that is not an object, a missing, null or non-text prompt, bad messages,
    or an answer that is not text, a number or a non-empty list of those is an error naming the file and
    line (or row). With `apply_chat_template` the prompt is rendered with the tokenizer's chat template
    and its generation prompt. A row whose prompt alone is `max_length` tokens or more is dropped (it
    leaves no room for an answer); one whose prompt + answer is longer has its answer cut. Both are
    counted and reported (`notes`).
    """

    Args = PromptAnswerArgs
    provides = ("packed_input_ids", "prompt_mask", "loss_mask", "packed_prompts", "prompt", "answers")

    def __init__(self, args: PromptAnswerArgs, tokenizer, base_dir: str | Path = "."):
        self.args, self.tokenizer = args, tokenizer
        if args.messages_key is not None or args.apply_chat_template or args.episode_tools is not None:
            require_template(tokenizer)
        self.images = vision.encoder_of(tokenizer)  # the run reads images (a vision-language model)
        self.image_dir = data_folder(args, base_dir)
        self.path, rows = read_valid_rows(args, base_dir, self._row_problem)
        self.notes: list[str] = []
        self.items: list[dict[str, Any]] = []
        dropped: list[str] = []
        cut: list[str] = []
        for where, row in rows:
            item = self._encode(len(self.items), row)
            if len(item["prompt_ids"]) >= args.max_length:
                dropped.append(where)
                continue
            if item["truncated"]:
                cut.append(where)
            self.items.append(item)
        if dropped:
            self.notes.append(
                f"{self.path}: dropped {len(dropped)} of {len(rows)} rows whose prompt alone is {args.max_length} "
                f"tokens or more (max_length) — {row_lines(dropped)}"
            )
        if cut:
            self.notes.append(
                f"{self.path}: cut the answer of {len(cut)} of {len(rows)} rows to fit max_length "
                f"({args.max_length} tokens) — {row_lines(cut)}"
            )
        if not self.items:
            raise DataError(
                f"{self.path}: every row's prompt is longer than max_length ({args.max_length} tokens); "
                "raise dataset.args.max_length"
            )

    def _row_problem(self, row: Any) -> str | None:
        a = self.args
        prompt_key = a.messages_key or a.prompt_key
        if not isinstance(row, dict):
            return f"a row must be a JSON object with {prompt_key!r} and {a.answer_key!r}, got {kind_of(row)}"
        for key in (prompt_key, a.answer_key):
            if key not in row:
                return f"row has no {key!r} field (has {sorted(row)})"
        if a.messages_key is not None:
            problem = messages_problem(row[a.messages_key], a.messages_key, parts=True)
            if problem:
                return problem
        else:
            prompt = row[a.prompt_key]
            if text_value(prompt) is None or (isinstance(prompt, str) and not prompt):
                return f"{a.prompt_key!r} must be a non-empty text, got {kind_of(prompt) if prompt != '' else 'an empty text'}"
        problem = image_problem(row, a.image_key, prompt_key, self.image_dir, self.images is not None)
        if problem:
            return problem
        if a.episode_key is not None and row.get(a.episode_key) is not None:
            problem = (
                _chat_episode_problem(row[a.episode_key], a.episode_key)
                if a.episode_tools is not None
                else _episode_problem(row[a.episode_key], a.episode_key)
            )
            if problem:
                return problem
        answer = row[a.answer_key]
        answers = answer if isinstance(answer, list) else [answer]
        if not answers:
            return f"{a.answer_key!r} is an empty list; give at least one accepted answer"
        for x in answers:
            if text_value(x) is None:
                return f"{a.answer_key!r} must be a text, a number or a list of those, got {kind_of(x)}"
        return None

    def _encode(self, index: int, row: dict[str, Any]) -> dict[str, Any]:
        a, tok = self.args, self.tokenizer
        if a.messages_key is not None or a.apply_chat_template:
            messages = (
                row[a.messages_key]
                if a.messages_key
                else [{"role": "user", "content": text_value(row[a.prompt_key])}]
            )
            messages, in_parts = message_parts(messages)  # image_url parts: marks in the text
            prompt, prompt_ids = render_prompt(tok, with_system(messages, a.system_prompt))
        else:
            text = text_value(row[a.prompt_key])
            assert text is not None  # _row_problem refused the rows without a text prompt
            prompt, in_parts = text, []
            prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        pixels = grids = None
        if self.images is not None:  # placeholder tokens where the images go (none: text only)
            sources = in_parts + vision.images_in(row.get(a.image_key))
            opened = [vision.open_image(x, self.image_dir) for x in sources]
            pixels, grids = self.images.encode(opened)
            if opened:
                prompt_ids = self.images.tokenize(tok, prompt, grids)
        answers = row[a.answer_key] if isinstance(row[a.answer_key], list) else [row[a.answer_key]]
        answers = [text_value(x) for x in answers]
        episode = row.get(a.episode_key) if a.episode_key is not None else None
        if a.episode_tools is not None and episode is not None:
            return self._chat_episode(index, prompt, prompt_ids, episode, answers, a.episode_tools)
        turns = episode if episode is not None else [{"role": "assistant", "content": answers[0]}]
        answer_ids, answer_mask = [], []
        for turn in turns:  # each turn tokenized on its own, as the workflow appends them
            ids = tok(turn["content"], add_special_tokens=False)["input_ids"]
            answer_ids += ids
            answer_mask += [turn["role"] == "assistant"] * len(ids)
        if a.append_eos:
            answer_ids, answer_mask = answer_ids + [tok.eos_token_id], answer_mask + [True]
        full = prompt_ids + answer_ids
        return {
            "id": index,
            "prompt_ids": prompt_ids,
            "prompt_len": len(prompt_ids),
            "input_ids": full[: a.max_length],
            "loss_mask": ([False] * len(prompt_ids) + answer_mask)[: a.max_length],
            "truncated": len(full) > a.max_length,
            "prompt": prompt,
            "answers": answers,
            "pixel_values": pixels,
            "image_grid_thw": grids,
        }

    def _chat_episode(
        self, index: int, prompt: str, prompt_ids: list[int], episode: list, answers, tool_names: list[str]
    ) -> dict:
        """A worked episode as the function_calling workflow renders it: the SFT sequence is the
        conversation [system?, user: prompt, *episode] in the chat template with the tools offered, the
        loss on assistant turns; the prompt (for generation) stays the plain question."""
        from arealcli.runtime.tools import tool_schema
        from arealcli.runtime.wire.openai import chat_message

        a, tok = self.args, self.tokenizer
        tools = [tool_schema(name) for name in tool_names]  # a.episode_tools
        head = with_system([{"role": "user", "content": prompt}], a.system_prompt)
        messages = head + [chat_message(m, i) for i, m in enumerate(episode)]
        ids, mask = render_conversation(tok, messages, tools)
        rendered_prompt = render_prompt(tok, head, tools)[1]
        return {
            "id": index,
            "prompt_ids": prompt_ids,
            "prompt_len": len(rendered_prompt),
            "input_ids": ids[: a.max_length],
            "loss_mask": mask[: a.max_length],
            "truncated": len(ids) > a.max_length,
            "prompt": prompt,
            "answers": answers,
        }

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> SequenceSample:
        """Keys: packed_input_ids (prompt + answer or worked episode), prompt_mask, loss_mask (the tokens
        SFT learns: the answer, or the episode's assistant turns), packed_prompts; meta: prompt, answers."""
        items = [self.items[i] for i in indices]
        return SequenceSample.from_lists(
            [it["id"] for it in items],
            {
                "packed_input_ids": [torch.tensor(it["input_ids"]) for it in items],
                "prompt_mask": [
                    torch.tensor(
                        [1] * min(it["prompt_len"], len(it["input_ids"]))
                        + [0] * max(0, len(it["input_ids"]) - it["prompt_len"]),
                        dtype=torch.bool,
                    )
                    for it in items
                ],
                "loss_mask": [torch.tensor(it["loss_mask"], dtype=torch.bool) for it in items],
                "packed_prompts": [torch.tensor(it["prompt_ids"]) for it in items],
                **(self._images(items) if self.images is not None else {}),
            },
            {"prompt": [it["prompt"] for it in items], "answers": [it["answers"] for it in items]},
        )

    def _images(self, items: list[dict[str, Any]]) -> dict[str, list[torch.Tensor]]:
        """The batch's image keys (`vision.IMAGE_KEYS`): each row's, none for a row without images."""
        assert self.images is not None
        none = self.images.encode([])
        pairs = [
            (it["pixel_values"], it["image_grid_thw"]) if it.get("image_grid_thw") is not None else none
            for it in items
        ]
        return {"pixel_values": [p for p, _ in pairs], "image_grid_thw": [g for _, g in pairs]}


def _episode_problem(episode: Any, key: str) -> str | None:
    """What is wrong with a worked episode [{role: assistant|tool, content}], or None."""
    if not isinstance(episode, list) or not episode:
        return f"{key!r} must be a non-empty list of turns [{{role, content}}], got {kind_of(episode)}"
    for i, turn in enumerate(episode):
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            return f"{key!r} turn {i} must be an object with exactly 'role' and 'content'"
        if turn["role"] not in ("assistant", "tool"):
            return f"{key!r} turn {i}: role must be 'assistant' or 'tool', got {turn['role']!r}"
        if not isinstance(turn["content"], str) or not turn["content"]:
            return f"{key!r} turn {i}: content must be a non-empty text"
    if not any(t["role"] == "assistant" for t in episode):
        return f"{key!r} has no assistant turn: nothing to learn"
    return None


def _chat_episode_problem(episode: Any, key: str) -> str | None:
    """What is wrong with a worked episode in OpenAI messages (assistant turns with `tool_calls`, `tool`
    turns), or None."""
    from arealcli.runtime.wire.openai import ProtocolError, chat_message

    if not isinstance(episode, list) or not episode:
        return f"{key!r} must be a non-empty list of messages, got {kind_of(episode)}"
    for i, m in enumerate(episode):
        try:
            message = chat_message(m, i)
        except ProtocolError as e:
            return f"{key!r}: {e}"
        if message["role"] not in ("assistant", "tool"):
            return f"{key!r} message {i}: role must be 'assistant' or 'tool', got {message['role']!r}"
    if not any(m["role"] == "assistant" for m in episode):
        return f"{key!r} has no assistant turn: nothing to learn"
    return None


class ChatDataset:
    """Conversations for multi-turn SFT: the loss is on the assistant's tokens only.

    Each row's `messages` ([{role, content}], roles system/user/assistant/tool) is rendered with the
    tokenizer's chat template; `loss_mask` is True on the tokens of assistant messages (content and end
    of turn), so prompts, system text and tool output never get gradient. `prompt_mask` marks what comes
    before the first assistant token. Conversations longer than max_length are cut (counted).
    """

    Args = ChatArgs
    provides = ("packed_input_ids", "prompt_mask", "loss_mask", "prompt")

    def __init__(self, args: ChatArgs, tokenizer, base_dir: str | Path = "."):
        self.args, self.tokenizer = args, tokenizer
        require_template(tokenizer)
        self.path, rows = read_valid_rows(args, base_dir, self._row_problem)
        self.notes: list[str] = []
        self.items: list[dict[str, Any]] = []
        cut: list[str] = []
        for where, row in rows:
            ids, mask = render_conversation(
                tokenizer, with_system(row[args.messages_key], args.system_prompt)
            )
            if len(ids) > args.max_length:
                cut.append(where)
                ids, mask = ids[: args.max_length], mask[: args.max_length]
            first = mask.index(True) if True in mask else len(mask)
            self.items.append({"id": len(self.items), "ids": ids, "mask": mask, "prompt_len": first})
        if cut:
            self.notes.append(
                f"{self.path}: cut {len(cut)} of {len(rows)} conversations to max_length ({args.max_length} tokens) — {row_lines(cut)}"
            )

    def _row_problem(self, row: Any) -> str | None:
        key = self.args.messages_key
        if not isinstance(row, dict) or key not in row:
            return f"row has no {key!r} field (has {sorted(row) if isinstance(row, dict) else kind_of(row)})"
        problem = messages_problem(row[key], key)
        if problem is None and not any(m["role"] == "assistant" for m in row[key]):
            problem = f"{key!r} has no assistant message: nothing to learn"
        return problem

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> SequenceSample:
        items = [self.items[i] for i in indices]
        return SequenceSample.from_lists(
            [it["id"] for it in items],
            {
                "packed_input_ids": [torch.tensor(it["ids"]) for it in items],
                "loss_mask": [torch.tensor(it["mask"], dtype=torch.bool) for it in items],
                "prompt_mask": [torch.arange(len(it["ids"])) < it["prompt_len"] for it in items],
            },
            {"prompt": [self.tokenizer.decode(it["ids"][: it["prompt_len"]]) for it in items]},
        )


def row_lines(wheres: list[str]) -> str:
    """`file:3, file:9` -> `lines 3, 9`; rows of other sources as they are."""
    short = [w.rsplit(":", 1)[1] if ":" in w and w.rsplit(":", 1)[1].isdigit() else w for w in wheres]
    label = "lines " if all(s.isdigit() for s in short) else ""
    shown = ", ".join(short[:MAX_REPORTED])
    return label + shown + (f", ... ({len(short) - MAX_REPORTED} more)" if len(short) > MAX_REPORTED else "")


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

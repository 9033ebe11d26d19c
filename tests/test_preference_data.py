"""The `preference` dataset: rows {prompt, chosen, rejected} as text or chat messages, from JSONL, parquet
and saved HF datasets; how a pair travels in a batch (chosen then rejected, one unit that micro-batch
splits and data-parallel slices never separate); bad rows named with file:line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arealcli.errors import DataError
from arealcli.runtime import distributed
from arealcli.runtime.data.preferences import CHOSEN, REJECTED, PreferenceDataset, pair_indices
from arealcli.runtime.data.tokenizer import char_tokenizer
from arealcli.schema.components.datasets import PAIR, PreferenceArgs
from arealcli.schema.components.engine import MicroBatchSpec

# who says what, one line per turn; the assistant's turn ends with EOS (as recipes/sft-chat.yaml)
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
)
ROWS = [
    {"prompt": "2+3=", "chosen": "5", "rejected": "6"},
    {"prompt": "12+9=", "chosen": "21", "rejected": "11"},
    {"prompt": "7+7=", "chosen": 14, "rejected": "41"},  # a number is a text, as answers are
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dataset(char_tok, path: Path, **args) -> PreferenceDataset:
    return PreferenceDataset(PreferenceArgs(path=str(path), **args), char_tok)


def texts(char_tok, batch, key: str | None = None) -> list[str]:
    """Each sample's tokens as text (those under `key`'s mask, when given)."""
    seqs = batch.unpack("packed_input_ids")
    masks = batch.unpack(key) if key else [s >= 0 for s in seqs]
    return [char_tok.decode(s[m.bool()].tolist()) for s, m in zip(seqs, masks, strict=True)]


def test_text_pairs_travel_as_chosen_then_rejected(char_tok, tmp_path):
    ds = dataset(char_tok, write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert len(ds) == 3 and ds.notes == []
    batch = ds.collate([2, 0])
    assert batch.ids == [(2, CHOSEN), (2, REJECTED), (0, CHOSEN), (0, REJECTED)]
    assert batch.meta[PAIR] == [2, 2, 0, 0] and batch.meta["prompt"] == ["7+7=", "7+7=", "2+3=", "2+3="]
    assert texts(char_tok, batch) == ["7+7=14<eos>", "7+7=41<eos>", "2+3=5<eos>", "2+3=6<eos>"]
    assert texts(char_tok, batch, "loss_mask") == ["14<eos>", "41<eos>", "5<eos>", "6<eos>"]
    assert texts(char_tok, batch, "prompt_mask") == ["7+7=", "7+7=", "2+3=", "2+3="]
    assert pair_indices(batch) == ([0, 2], [1, 3])
    no_eos = dataset(char_tok, tmp_path / "p.jsonl", append_eos=False).collate([0])
    assert texts(char_tok, no_eos, "loss_mask") == ["5", "6"]


def test_chat_pairs_count_the_response_only(tmp_path):
    char_tok = char_tokenizer()  # its own: the shared one has no template
    char_tok.chat_template = TEMPLATE
    history = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},  # the prompt's history: context, never a target
        {"role": "user", "content": "2+3="},
    ]
    rows = [
        {
            "prompt": history,
            "chosen": [{"role": "assistant", "content": "5"}],
            "rejected": [{"role": "assistant", "content": "6"}],
        },
        {"prompt": "4+4=", "chosen": "8", "rejected": "9"},  # a text row beside them: rendered as chat too
    ]
    ds = dataset(char_tok, write_jsonl(tmp_path / "chat.jsonl", rows), system_prompt="be brief")
    batch = ds.collate([0, 1])
    assert texts(char_tok, batch)[0] == "s: be brief\nu: 1+1=\na: 2<eos>\nu: 2+3=\na: 5<eos>\n"
    assert texts(char_tok, batch, "loss_mask") == ["5<eos>\n", "6<eos>\n", "8<eos>\n", "9<eos>\n"]
    assert texts(char_tok, batch, "prompt_mask")[3] == "s: be brief\nu: 4+4=\na: "
    plain = dataset(char_tok, write_jsonl(tmp_path / "plain.jsonl", ROWS), apply_chat_template=True)
    assert texts(char_tok, plain.collate([0]), "loss_mask") == ["5<eos>\n", "6<eos>\n"]


def test_chat_rows_need_a_template(char_tok, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+3="}], "chosen": "5", "rejected": "6"}]
    with pytest.raises(DataError, match="no chat template"):
        dataset(char_tok, write_jsonl(tmp_path / "chat.jsonl", rows))


def test_parquet_and_saved_datasets_with_other_column_names(char_tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    renamed = [{"question": r["prompt"], "good": str(r["chosen"]), "bad": r["rejected"]} for r in ROWS]
    table = datasets.Dataset.from_list(renamed)
    table.to_parquet(str(tmp_path / "pairs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    keys = {"prompt_key": "question", "chosen_key": "good", "rejected_key": "bad"}
    for path in (tmp_path / "pairs.parquet", tmp_path / "saved"):
        batch = dataset(char_tok, path, **keys).collate([1])
        assert texts(char_tok, batch) == ["12+9=21<eos>", "12+9=11<eos>"], path


BAD = {
    "missing rejected": ({"prompt": "1+1=", "chosen": "2"}, "no 'rejected' field (has ['chosen', 'prompt'])"),
    "chosen an object": ({"prompt": "1+1=", "chosen": {"text": "2"}, "rejected": "3"}, "'chosen' must be a"),
    "empty rejected": ({"prompt": "1+1=", "chosen": "2", "rejected": ""}, "got an empty text"),
    "prompt null": ({"prompt": None, "chosen": "2", "rejected": "3"}, "'prompt' must be a non-empty text"),
    "user turn in a response": (
        {"prompt": "1+1=", "chosen": [{"role": "user", "content": "2"}], "rejected": "3"},
        "roles assistant or tool",
    ),
    "not an object": (["1+1=", "2", "3"], "a row must be a JSON object with 'prompt', 'chosen', 'rejected'"),
}


@pytest.mark.parametrize("row, message", BAD.values(), ids=list(BAD))
def test_bad_rows_are_named_with_file_and_line(char_tok, tmp_path, row, message):
    path = write_jsonl(tmp_path / "p.jsonl", [*ROWS, row])
    with pytest.raises(DataError) as e:
        dataset(char_tok, path)
    assert f"{path}:4: " in str(e.value) and message in str(e.value), str(e.value)


def test_bad_rows_stop_training_with_exit_2(ws, cli):
    recipe = ws.dpo(dataset={"batch_size": 2})
    write_jsonl(ws.root / "pairs.jsonl", [*ROWS * 4, {"prompt": "1+1=", "chosen": "2"}])
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2, result.output
    assert "pairs.jsonl:13: row has no 'rejected' field" in result.stderr
    assert "Traceback" not in result.output


def test_long_and_tied_pairs_are_dropped_or_cut_and_counted(char_tok, tmp_path):
    rows = [
        *ROWS,
        {"prompt": "1+1=", "chosen": "2", "rejected": "2"},  # the same response twice: nothing to prefer
        {"prompt": "9" * 20 + "=", "chosen": "1", "rejected": "2"},  # the prompt alone is too long
        {"prompt": "3+4=", "chosen": "7" * 30, "rejected": "8"},  # cut to max_length
    ]
    ds = dataset(char_tok, write_jsonl(tmp_path / "p.jsonl", rows), max_length=12)
    assert len(ds) == 4
    notes = " ".join(ds.notes)
    assert "dropped 1 of 6 pairs whose prompt alone" in notes and "lines 5" in notes
    assert (
        "dropped 1 of 6 pairs whose chosen and rejected responses are the same" in notes
        and "lines 4" in notes
    )
    assert "cut 1 of 6 pairs to max_length (12 tokens) — lines 6" in notes
    assert max(ds.collate([3]).seqlens["packed_input_ids"]) == 12


def test_micro_batches_and_data_parallel_slices_never_separate_a_pair(char_tok, tmp_path, monkeypatch):
    rows = [
        {"prompt": f"{i}+{i}=", "chosen": "x" * (1 + i % 4), "rejected": "y" * (4 - i % 4)} for i in range(7)
    ]
    batch = dataset(char_tok, write_jsonl(tmp_path / "p.jsonl", rows)).collate(list(range(7)))
    for spec in (MicroBatchSpec(n_mbs=3), MicroBatchSpec(n_mbs=14), MicroBatchSpec(max_tokens_per_mb=20)):
        mbs, forward, _ = batch.split(spec)
        assert len(mbs) > 1
        for mb in mbs:
            chosen, rejected = pair_indices(mb)  # raises unless whole pairs, chosen first
            assert len(chosen) == len(rejected) == mb.bs // 2
        assert sorted(forward) == list(range(14))
    for world in (2, 3):
        monkeypatch.setattr(distributed, "dp_world", lambda w=world: w)
        parts = []
        for rank in range(world):
            monkeypatch.setattr(distributed, "dp_rank", lambda r=rank: r)
            parts.append(distributed.dp_slice(batch))
        assert [p.ids for p in parts] and sum((p.ids for p in parts), []) == batch.ids
        assert all(pair_indices(p) for p in parts)
        assert max(p.bs for p in parts) - min(p.bs for p in parts) <= 2  # balanced in pairs
    unpaired = batch.select(["packed_input_ids"])  # without `pair`: samples are packed one by one
    assert len(unpaired.split(MicroBatchSpec(n_mbs=14))[0]) == 14

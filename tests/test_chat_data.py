"""Real data formats: chat templates, multi-turn SFT with the loss on assistant tokens, files the `datasets`
library reads (parquet, folders, save_to_disk) with field mapping — on a BPE tokenizer built here, with a
Jinja chat template, saved beside a config-built Qwen2 model (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from arealcli.errors import DataError
from arealcli.runtime.data.datasets import ChatDataset, PromptAnswerDataset
from arealcli.runtime.interfaces.sft import num_answer_tokens
from arealcli.schema.components.datasets import ChatArgs, PromptAnswerArgs
from tests.conftest import TINY_ARCH

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and three times three?"},
    {"role": "assistant", "content": "nine"},
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here, with a ChatML template, and a tiny Qwen2 beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    corpus = ["what is two plus two? four. and three times three? nine. hello there, answer briefly."] * 50
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("chat-model")
    fast.save_pretrained(d)
    arch = {k: v for k, v in TINY_ARCH.items() if k != "family"}
    config = Qwen2Config(
        vocab_size=len(fast), pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id, **arch
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tok(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_multi_turn_loss_mask_covers_assistant_tokens_only(tok, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    ds = ChatDataset(ChatArgs(path=str(data), system_prompt="be brief"), tok)
    batch = ds.collate([0])
    ids, mask = batch.data["packed_input_ids"], batch.data["loss_mask"]
    assert tok.decode(ids[mask].tolist()) == "four<|im_end|>\nnine<|im_end|>\n"
    assert tok.decode(ids[~mask].tolist()).startswith(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
    )
    first = int(mask.float().argmax())
    assert batch.data["prompt_mask"].tolist() == [i < first for i in range(len(ids))]
    # the SFT loss counts exactly the assistant tokens (predicted from the position before each)
    assert num_answer_tokens(batch) == int(mask.sum())


def test_prompts_rendered_with_the_chat_template(tok, tmp_path):
    data = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "two plus two?", "answer": "four"}])
    ds = PromptAnswerDataset(
        PromptAnswerArgs(path=str(data), apply_chat_template=True, system_prompt="answer briefly"), tok
    )
    item = ds.items[0]
    want = "<|im_start|>system\nanswer briefly<|im_end|>\n<|im_start|>user\ntwo plus two?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(item["prompt_ids"]) == want and item["prompt"] == want
    assert tok.decode(item["input_ids"]) == want + "four<|im_end|>"  # the answer ends with EOS (end of turn)
    messages = write_jsonl(tmp_path / "m.jsonl", [{"conv": CONVERSATION[:1], "answer": "four"}])
    ds = PromptAnswerDataset(PromptAnswerArgs(path=str(messages), messages_key="conv"), tok)
    assert tok.decode(ds.items[0]["prompt_ids"]).endswith("two plus two?<|im_end|>\n<|im_start|>assistant\n")


def test_parquet_folders_and_save_to_disk_with_field_mapping(tok, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"q{i}?", "answer": f"step by step #### {i}", "extra": i} for i in range(12)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "gsm.parquet"))
    args = {"prompt_key": "question", "limit": 10}
    ds = PromptAnswerDataset(PromptAnswerArgs(path=str(tmp_path / "gsm.parquet"), **args), tok)
    assert (
        len(ds) == 10 and ds.items[3]["prompt"] == "q3?" and ds.items[3]["answers"] == ["step by step #### 3"]
    )
    (tmp_path / "folder").mkdir()
    table.to_json(str(tmp_path / "folder" / "train.json"))
    assert len(PromptAnswerDataset(PromptAnswerArgs(path=str(tmp_path / "folder"), **args), tok)) == 10
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "saved"))
    ds = PromptAnswerDataset(
        PromptAnswerArgs(path=str(tmp_path / "saved"), split="test", prompt_key="question"), tok
    )
    assert len(ds) == 12
    with pytest.raises(DataError, match=r"split 'validation'"):
        PromptAnswerDataset(PromptAnswerArgs(path=str(tmp_path / "saved"), split="validation"), tok)


def test_bad_chat_input_names_row_and_what_exists(tok, char_tok, tmp_path):
    data = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": CONVERSATION}, {"messages": [{"role": "robot", "content": "x"}]}],
    )
    with pytest.raises(
        DataError, match=r"chat.jsonl:2: 'messages' message 0 has role 'robot'; roles are system, user"
    ):
        ChatDataset(ChatArgs(path=str(data)), tok)
    with pytest.raises(DataError, match="has no chat template"):
        ChatDataset(ChatArgs(path=str(data)), char_tok)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"q": "a", "a": "b"}]).to_parquet(str(tmp_path / "x.parquet"))
    with pytest.raises(
        DataError, match=r"x.parquet \[train\] row 0: row has no 'prompt' field \(has \['a', 'q'\]\)"
    ):
        PromptAnswerDataset(PromptAnswerArgs(path=str(tmp_path / "x.parquet")), tok)


def test_multi_turn_sft_trains_on_assistant_tokens(ws, cli, chat_dir):
    convs = [
        [{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": str(a + b)}]
        for a in range(4)
        for b in range(4)
    ]
    write_jsonl(ws.root / "chat.jsonl", [{"messages": c} for c in convs])
    recipe = {
        "experiment": "chat-sft",
        "models": {
            "default": {
                "path": str(chat_dir),
                "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 5e-3}}},
            }
        },
        "dataset": {"type_": "chat", "args": {"path": "chat.jsonl", "max_length": 64}, "batch_size": 8},
        "dataflow": {"preset": "sft"},
        "trainer": {"max_steps": 12, "tensorboard": False},
    }
    path = ws.text("chat.yaml", yaml.safe_dump(recipe))
    printed = cli("check", path, "--print")
    assert printed.exit_code == 0, printed.output
    (call,) = yaml.safe_load(printed.stdout)["dataflow"]["calls"]
    assert call["inputs"] == ["packed_input_ids", "prompt_mask", "loss_mask"]
    result = cli("train", path, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output
    losses = [json.loads(x)["sft/loss"] for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.7 * losses[0], losses

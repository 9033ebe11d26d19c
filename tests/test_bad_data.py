"""Bad dataset files: `areal train` stops before training with exit 2 and a message naming file and line."""

from __future__ import annotations

import json

import pytest

GOOD = '{"prompt": "a:", "answer": "bcde"}\n'


def _rows(*lines: str | bytes) -> bytes:
    good = GOOD.encode() * 10  # enough rows for a batch
    return good + b"".join(x if isinstance(x, bytes) else x.encode() for x in lines)


# (file content, fragments the error must contain); the bad line is line 11 unless said otherwise
CASES = {
    "malformed JSON": (_rows('{"prompt": "a:", "answer": \n'), ["data.jsonl:11:", "not valid JSON"]),
    "Latin-1 bytes": (
        _rows(b'{"prompt": "caf\xe9", "answer": "x"}\n'),
        ["data.jsonl:11:", "not valid UTF-8"],
    ),
    "truncated UTF-8": (_rows(b'{"prompt": "\xe2\x82", "answer": "x"}\n'), ["data.jsonl:11:", "UTF-8"]),
    "answer null": (_rows('{"prompt": "a:", "answer": null}\n'), ["data.jsonl:11:", "'answer'", "null"]),
    "answer object": (
        _rows('{"prompt": "a:", "answer": {"value": "3"}}\n'),
        ["data.jsonl:11:", "'answer'", "an object"],
    ),
    "answer empty list": (_rows('{"prompt": "a:", "answer": []}\n'), ["data.jsonl:11:", "empty list"]),
    "prompt null": (_rows('{"prompt": null, "answer": "3"}\n'), ["data.jsonl:11:", "'prompt'", "null"]),
    "prompt missing": (_rows('{"question": "a:", "answer": "3"}\n'), ["data.jsonl:11:", "no 'prompt' field"]),
    "row is a string": (_rows('"just text"\n'), ["data.jsonl:11:", "JSON object", "str"]),
    "empty file": (b"", ["data.jsonl", "no rows"]),
    "blank lines only": (b"\n  \n\n", ["data.jsonl", "no rows"]),
    "fewer rows than a batch": (GOOD.encode() * 3, ["data.jsonl", "batch_size (8)", "3 usable rows"]),
}


@pytest.mark.parametrize("content, fragments", CASES.values(), ids=list(CASES))
def test_bad_training_file(ws, cli, content, fragments):
    (ws.root / "data.jsonl").write_bytes(content)
    recipe = ws.recipe(dataset={"args": {"path": "data.jsonl"}}, trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert not (ws.root / "run" / "recipe.yaml").exists()  # a failed start leaves no record


def test_several_bad_rows_are_named_at_once(ws, cli):
    (ws.root / "data.jsonl").write_bytes(_rows('{"prompt": null, "answer": "3"}\n', "[1]\n", "{oops\n"))
    recipe = ws.recipe(dataset={"args": {"path": "data.jsonl"}}, trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2
    assert all(f"data.jsonl:{n}:" in result.stderr for n in (11, 12, 13)), result.stderr


def test_bom_numbers_and_lists_are_fine(ws, cli):
    rows = [{"prompt": "a:", "answer": 42}, {"prompt": "b:", "answer": ["x", 3.5]}] * 5
    text = "\ufeff" + "".join(json.dumps(r) + "\n" for r in rows)
    (ws.root / "data.jsonl").write_text(text, encoding="utf-8")
    recipe = ws.recipe(dataset={"args": {"path": "data.jsonl"}}, trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output


def test_over_long_rows_are_dropped_or_cut_and_reported(ws, cli):
    rows = [{"prompt": "a:", "answer": "bcde"}] * 9
    rows.append({"prompt": "x" * 100_000, "answer": "3"})  # prompt alone is over max_length: dropped
    rows.append({"prompt": "a:", "answer": "y" * 200})  # the answer does not fit: cut
    (ws.root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = ws.recipe(dataset={"args": {"path": "data.jsonl", "max_length": 64}}, trainer={"max_steps": 1})
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output
    assert "dropped 1 of 11 rows" in result.stderr and "lines 10" in result.stderr
    assert "cut the answer of 1 of 11 rows" in result.stderr and "lines 11" in result.stderr


def test_empty_eval_set_names_the_file(ws, cli):
    (ws.root / "empty.jsonl").write_text("")
    recipe = ws.recipe(
        eval_dataset={"type_": "prompt_answer", "args": {"path": "empty.jsonl"}, "batch_size": 4},
        trainer={"max_steps": 1, "eval_every_n_steps": 1},
    )
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 2
    assert "empty.jsonl has no rows" in result.stderr


@pytest.mark.parametrize("what", ["dataset", "model", "tokenizer"])
def test_wrong_kind_of_path_is_an_error_for_check_and_train(ws, cli, what):
    (ws.root / "folder").mkdir()
    (ws.root / "file.txt").write_text("x")
    update = {
        "dataset": {"dataset": {"args": {"path": "folder"}}},
        "model": {"models": {"default": {"config": None, "path": "folder"}}},
        "tokenizer": {"tokenizer": {"kind": "hf", "path": "folder"}},
    }[what]
    recipe = ws.recipe(**update)
    for command in ("check", "train"):
        result = cli(command, recipe, "-o", ws.root / "run") if command == "train" else cli(command, recipe)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        expected = {
            "dataset": "holds no data files",
            "model": "no config.json",
            "tokenizer": "no tokenizer files",
        }
        assert expected[what] in result.stderr, result.stderr

"""What a new user met on a fresh clone, and now meets instead: `areal eval` of a chat SFT run says what
to give (exit 2, no traceback); `areal export RUN DIR` takes the folder as its second argument;
`areal eval`'s table says why avg@k and pass@k differ; `areal check` says to drop the quotes of a quoted
number; the docs name every shipped recipe."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, Workspace

CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"{a + b}"}]}
    for a in range(1, 5)
    for b in range(1, 5)
]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
    "{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}a: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """A 2-step chat SFT run (as recipes/sft-chat.yaml: conversations, no answers) with a checkpoint."""
    from typer.testing import CliRunner

    from arealcli.main import app
    from tests.conftest import write_jsonl

    ws = Workspace(tmp_path_factory.mktemp("chat-run"))
    write_jsonl(ws.root / "chat.jsonl", CHAT_ROWS)
    chat = {"type_": "chat", "args": {"path": "chat.jsonl", "max_length": 32}, "batch_size": 8}
    recipe = ws.recipe(
        experiment="tiny-chat",
        tokenizer={"kind": "char", "chat_template": TEMPLATE},
        dataset=chat,
        eval_dataset=chat,
        dataflow={"calls": None, "preset": "sft"},
        trainer={"max_steps": 2, "save_every_n_steps": 2, "eval_every_n_steps": None},
    )
    text = recipe.read_text().replace("  calls: null\n", "")
    recipe.write_text(text)
    result = CliRunner().invoke(app, ["train", str(recipe), "-o", str(ws.root / "run")])
    assert result.exit_code == 0, result.output
    return ws.root / "run"


def test_eval_of_a_chat_sft_run_says_to_give_data(chat_run, cli):
    result = cli("eval", chat_run)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert "eval_dataset (chat) has no answers to score" in result.stderr
    assert "give --data" in result.stderr


def test_eval_with_data_of_a_chat_run_explains_avg_and_pass_under_the_table(chat_run, cli, tmp_path):
    from tests.conftest import write_jsonl

    data = write_jsonl(
        tmp_path / "sums.jsonl", [{"prompt": f"{a}+1", "answer": str(a + 1)} for a in range(6)]
    )
    result = cli("eval", chat_run, "--data", data, "--n", "2", "--k", "1,2", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "avg@1" in out and "pass@1" in out
    assert "avg@k: mean reward of each prompt's first k samples" in out
    assert "pass@k: chance that k of all n samples hold a correct one" in out
    assert "avg@1 and pass@1 differ by sampling noise" in out


def test_export_takes_the_folder_as_its_second_argument(chat_run, cli, tmp_path):
    out = tmp_path / "model"
    result = cli("export", chat_run, out)
    assert result.exit_code == 0, result.output
    assert (out / "README.md").exists() and (out / "config.json").exists()
    same = cli("export", chat_run, tmp_path / "again", "-o", tmp_path / "again")
    assert same.exit_code == 0, same.output
    both = cli("export", chat_run, tmp_path / "a", "-o", tmp_path / "b")
    assert both.exit_code == 2 and "give one" in both.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    neither = cli("export", chat_run)
    assert neither.exit_code == 2 and "areal export RUN DIR (or -o DIR)" in neither.stderr


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ('trainer.max_steps="100"', "write 100 without the quotes"),
        ("dataflow.actor.eps_clip='0.3'", "write 0.3 without the quotes"),
        ('trainer.eval_at_start="true"', "write true without the quotes"),
    ],
)
def test_check_says_to_drop_the_quotes_of_a_quoted_number(override, hint, cli):
    result = cli("check", REPO / "recipes/quickstart.yaml", override)
    assert result.exit_code == 2
    assert hint in result.stderr, result.stderr


def test_check_gives_no_quote_hint_for_real_text(cli):
    result = cli("check", REPO / "recipes/quickstart.yaml", 'trainer.max_steps="many"')
    assert result.exit_code == 2 and "without the quotes" not in result.stderr


def test_the_docs_name_every_shipped_recipe():
    recipes = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    for doc in ("README.md", "docs/recipes.md"):
        text = (REPO / doc).read_text()
        missing = [r for r in recipes if r not in text]
        assert not missing, f"{doc} does not name {missing}"


def test_the_readme_is_a_front_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    text = "\n".join(lines)
    assert "docs/img/quickstart-report.png" in text and (REPO / "docs/img/quickstart-report.png").exists()
    assert "Python 3.10" in text
    for page in ("docs/security.md", "docs/reference/recipe.md", "docs/reference/cli.md"):
        assert page in text and (REPO / page).exists(), page


def test_commands_log_records_the_order_the_docs_say(chat_run, cli, tmp_path):
    """docs/commands.md: recipe, overrides, -o, --resume, launch flags; --overwrite not recorded."""
    recipe = chat_run.parent / "recipe.yaml"
    run = tmp_path / "run"
    result = cli("train", "--overwrite", recipe, "-o", run, "trainer.max_steps=1")
    assert result.exit_code == 0, result.output
    (line,) = (run / "commands.log").read_text().splitlines()
    assert line.endswith(f"areal train {recipe} trainer.max_steps=1 -o {run}"), line
    assert "--overwrite" not in line

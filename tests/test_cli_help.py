"""`--help`, `--version` and `areal list` as a new user meets them: every command shows 2-4 examples and
each one works (`areal check`, `--dry-run`, or at least parses); the README's command block too; `areal
list` piped is one greppable key per line, recipe sections included."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from conftest import REPO

from arealcli import __version__
from arealcli.main import app

COMMANDS = ("train", "check", "list", "serve", "report", "schema", "init")


def click_app():
    return typer.main.get_command(app)


def help_examples(name: str) -> list[str]:
    """The `Examples:` lines of a command's help."""
    text = click_app().commands[name].help or ""  # type: ignore[attr-defined]
    block = text.split("Examples:", 1)[1] if "Examples:" in text else ""
    return [line.strip() for line in block.splitlines() if line.strip().startswith("areal ")]


def readme_commands() -> list[str]:
    """The commands of the README's first code block (what `areal` does, one example a line)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"```\n(areal .*?)```", text, re.S)
    assert block, "the README starts with a block of areal commands"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.startswith("areal ")]


def run_example(cli, line: str, tmp_path: Path, monkeypatch) -> None:
    """Run an example as far as it can run here: check and list for real, train as --dry-run (or check
    when it resumes a run that does not exist here), init in an empty folder; serve, report and plugin
    imports parse."""
    args = shlex.split(line.split(" > ")[0])[1:]  # `areal schema > file`: the command before the redirect
    name = args[0]
    click_app().commands[name].make_context(name, args[1:])  # options and arguments parse
    monkeypatch.chdir(REPO)
    if "--import" in args:  # registers a plugin for good: parsing is enough here
        return
    if name in ("check", "list", "schema"):
        result = cli(*args)
    elif name == "train" and "--resume" not in args:
        out = ["-o", str(tmp_path / "run")]
        if "-o" in args:
            i = args.index("-o")
            args = args[:i] + args[i + 2 :]
        result = cli(*args, *out, "--dry-run")
        assert "nothing was written" in result.stdout, result.output
    elif name == "train":
        result = cli("check", *[a for a in args[1:] if not a.startswith("-")])
    elif name == "init":
        monkeypatch.chdir(tmp_path)
        result = cli(*args)
    else:
        return
    assert result.exit_code == 0, f"{line}\n{result.output}"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_two_to_four_examples_that_work(name, cli, tmp_path, monkeypatch):
    examples = help_examples(name)
    assert 2 <= len(examples) <= 4, examples
    for line in examples:
        assert line.startswith(f"areal {name}")
        run_example(cli, line, tmp_path, monkeypatch)


def test_readme_command_block_works(cli, tmp_path, monkeypatch):
    lines = readme_commands()
    assert {shlex.split(line)[1] for line in lines} >= set(COMMANDS)
    for line in lines:
        run_example(cli, line, tmp_path, monkeypatch)


def test_help_shows_plain_metavars_and_flags_without_values(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    for name in COMMANDS:
        text = cli(name, "--help").stdout
        assert "Examples:" in text, name
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "{" not in usage and "}" not in usage, usage
        for flag in ("--help", "--resume", "--overwrite", "--dry-run", "--print", "--json", "--plain"):
            for line in (x for x in text.splitlines() if f" {flag} " in x):
                assert "<bool>" not in line, line
    assert "areal train [OPTIONS] RECIPE [KEY=VALUE]..." in cli("train", "--help").stdout
    assert "default: see above" not in cli("report", "--help").stdout


def test_version(cli):
    result = cli("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"areal {__version__}"


def test_list_piped_is_one_greppable_key_per_line():
    """`areal list ppo_actor | grep generation.temperature` finds the key, whole, with its type, default
    and description."""
    out = subprocess.run(
        [sys.executable, "-m", "arealcli.main", "list", "ppo_actor"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "40", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    found = [line for line in out.stdout.splitlines() if re.match(r"generation\.temperature\s", line)]
    assert len(found) == 1
    assert re.fullmatch(r"generation\.temperature\s+float\s+1\.0\s+\S.*", found[0]), found[0]
    assert not any(c in out.stdout for c in "│─╭╰┃━")  # no boxes


def test_list_sections_and_plain_defaults(cli):
    trainer = cli("list", "trainer").stdout.splitlines()
    assert trainer[0].startswith("# trainer")
    assert re.search(r"^trainer\.max_steps\s+int \| None\s+null\s+Train", "\n".join(trainer), re.M)
    assert re.search(r"^trainer\.wandb\.mode\s+.*\s+online\s+", "\n".join(trainer), re.M)
    dataflow = cli("list", "dataflow").stdout
    assert re.search(r"^dataflow\.sft_warmup_steps\s+int\s+0\s", dataflow, re.M)
    assert re.search(r"^dataflow\.calls\.N\.mb_spec\.n_mbs\s", dataflow, re.M)
    models = cli("list", "models").stdout
    assert re.search(r"^models\.NAME\.config\.hidden_size\s+int\s+\d+\s", models, re.M)
    for section in ("recipe", "dataset", "rollout", "tokenizer", "eval_dataset", "cluster"):
        result = cli("list", section)
        assert result.exit_code == 0 and len(result.stdout.splitlines()) > 2, section
    everything = cli("list", "--plain").stdout
    assert re.search(r"^# ppo_actor \(interface, builtin\)", everything, re.M)
    assert re.search(r"^reward_fn\s+str\s+math\s", everything, re.M)  # a string default, unquoted
    result = cli("list", "trainr")
    assert result.exit_code == 2 and "did you mean 'trainer'" in result.stderr


def test_init_names_the_new_file_in_the_run_comment(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli("init", "mine").exit_code == 0
    text = (tmp_path / "mine.yaml").read_text()
    assert "Run: areal train mine.yaml" in text and "recipes/quickstart.yaml" not in text


def test_an_override_of_a_preset_call_says_what_to_write_instead(cli):
    recipe = REPO / "recipes" / "quickstart.yaml"
    result = cli("check", recipe, "dataflow.calls.0.mb_spec.n_mbs=2")
    assert result.exit_code == 2
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert "override 'dataflow.calls.0.mb_spec.n_mbs=2'" in line and "preset 'grpo'" in line
    assert "write dataflow.mb_spec.n_mbs=2" in line
    assert cli("check", recipe, "dataflow.mb_spec.n_mbs=2").exit_code == 0  # ... which works
    result = cli("check", recipe, "dataflow.calls.4.interface.args.eps_clip=0.1")
    assert result.exit_code == 2 and "dataflow.actor.*" in result.stderr
    assert cli("check", recipe, "dataflow.actor.eps_clip=0.1").exit_code == 0

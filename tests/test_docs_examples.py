"""Every example in the docs that is marked as a command runs, and says what the docs say it says.

The marker (docs/examples.md explains it to writers): a fenced block whose language is `console`. In it,
a line starting with `$ ` is a command (a line ending in `\\` continues it); the lines after it, up to the
next command, are output that must appear in what the command prints (stdout and stderr), each line
somewhere in it, `...` standing for any text. An HTML comment on the line before the block adjusts it:

    <!-- example: skip REASON -->            not run here (GPUs, a cluster): reported as skipped, REASON
    <!-- example: scale KEY=VALUE ... -->    appended to each `areal train` of the block: the CPU scale
    <!-- example: unchecked REASON -->       run (exit 0), its output not compared, REASON (a claim that
                                             needs the full run, checked by the test REASON names)

The blocks run in the order of the site's navigation, in one scratch folder holding the repository's
recipes/, data/, examples/ and scripts/, so a later block uses the run an earlier one trained (`areal chat runs/quickstart`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import REPO

pytestmark = pytest.mark.slow

BLOCK = re.compile(r"(?:<!-- example: (\w+) ?([^\n]*?) -->\n)?```console\n(.*?)```", re.S)


@dataclass
class Command:
    line: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Example:
    page: str
    index: int
    commands: list[Command]
    directive: str = ""
    argument: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}"


def nav_pages() -> list[str]:
    """The docs' pages in the order of mkdocs.yml's navigation."""

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for x in node for p in walk(x)]
        return [p for v in node.values() for p in walk(v)]

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text().replace("!!python", "#"))
    return [p for p in walk(config["nav"]) if not p.startswith("reference/")]


def parse(page: str, text: str) -> list[Example]:
    out = []
    for i, m in enumerate(BLOCK.finditer(text)):
        commands: list[Command] = []
        pending = ""
        for raw in m.group(3).splitlines():
            if pending:
                pending += " " + raw.strip()
            elif raw.startswith("$ "):
                pending = raw[2:]
            elif raw.strip() and commands:
                commands[-1].expected.append(raw.strip())
                continue
            else:
                continue
            if pending.endswith("\\"):
                pending = pending[:-1].rstrip()
            else:
                commands.append(Command(pending))
                pending = ""
        out.append(Example(page, i, commands, m.group(1) or "", m.group(2) or ""))
    return out


def examples() -> list[Example]:
    return [e for p in nav_pages() for e in parse(p, (REPO / "docs" / p).read_text())]


def matches(expected: str, output: str) -> bool:
    """An expected line appears in the output (whitespace runs equal, `...` any text)."""
    parts = [re.escape(" ".join(p.split())) for p in expected.split("...")]
    return re.search(r".*?".join(parts), " ".join(output.split())) is not None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch folder that looks like the repository to a user: recipes/, data/, examples/, scripts/."""
    import shutil

    root = tmp_path_factory.mktemp("docs-examples")
    # recipes/ is a copy: a recipe's relative paths (../runs/... of a run an earlier command made) resolve
    # from the recipe's real folder, which must be this one, as in a user's clone
    shutil.copytree(REPO / "recipes", root / "recipes")
    for name in ("data", "examples", "scripts"):
        (root / name).symlink_to(REPO / name)
    return root


def run(command: Command, example: Example, workdir: Path) -> str:
    line = command.line
    if example.directive == "scale" and re.match(r"areal train\b", line):
        line = f"{line} {example.argument}"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("AREAL_API_KEY", None)
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", line],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{example.id}: `{line}` exited {proc.returncode}\n{output[-3000:]}"
    return output


def test_the_docs_have_runnable_examples():
    found = examples()
    assert len([e for e in found if e.directive != "skip"]) >= 5, [e.id for e in found]
    assert all(e.commands for e in found), [e.id for e in found if not e.commands]


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.id)
def test_docs_example(example, workdir):
    if example.directive == "skip":
        pytest.skip(f"{example.id}: {example.argument}")
    for command in example.commands:
        output = run(command, example, workdir)
        if example.directive == "unchecked":
            continue
        missing = [e for e in command.expected if not matches(e, output)]
        assert not missing, f"{example.id}: `{command.line}` did not print {missing}:\n{output[-3000:]}"

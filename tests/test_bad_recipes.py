"""Hostile and odd recipes: every one gives exit 0 with a valid recipe or exit 2 with a located error —
never a traceback, a hang, code run from a YAML tag, or a broken recipe accepted."""

from __future__ import annotations

import random
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import REPO

from arealcli.schema.paths import path_problems
from arealcli.schema.plan import plan_lines
from arealcli.schema.source import RecipeSourceError, apply_overrides, load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def check(cli, recipe: Path, *overrides: str):
    result = cli("check", recipe, *overrides)
    assert result.exit_code in (0, 2), result.output
    assert "Traceback" not in result.output
    return result


# --------------------------------------------------------------------------- the YAML loader


@pytest.mark.parametrize(
    "content, message",
    [
        (b"experiment: caf\xe9\n", ":1:16: the recipe is not valid UTF-8 (byte 0xe9)"),
        (b"experiment: x\nseed: \xe2\x82\n", ":2:7: the recipe is not valid UTF-8"),
        ("experiment: x\n".encode("utf-16"), ":1:1: the recipe is UTF-16 encoded"),
        (b"experiment: !!float abc\n", ":1:13: 'abc' is not a valid float"),
        (b"seed: !!int x\n", ":1:7: 'x' is not a valid int"),
        (b"experiment: !mine x\n", "the YAML tag '!mine' is not allowed"),
        (b"experiment: !!python/name:os.system\n", "is not allowed in a recipe"),
        (b"experiment: !!binary aGVsbG8=\n", "tag:yaml.org,2002:binary' is not allowed"),
        (b"experiment: !!set {a, b}\n", "tag:yaml.org,2002:set' is not allowed"),
        (b"experiment: x\nseed: 1\nseed: 2\n", ":3:1: duplicate key 'seed' (first given on line 2)"),
        (b"experiment: x\nseed: 1\nseed: 1\n", ":3:1: duplicate key 'seed'"),
        (b"models: {a: 1, b: 2, a: 3}\n", ":1:22: duplicate key 'a' (first given on line 1)"),
        (b"seed: .inf\n", "'.inf' is not a finite number"),
        (b"seed: .nan\n", "'.nan' is not a finite number"),
        (b"seed: 123456789012345678901234567890\n", "is out of range"),
        (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 64 levels deep"),
        (b"a: &a [*a]\n", "expands to more than"),
        (b"- just\n- a list\n", "a recipe must be a mapping"),
        (b"experiment: x\0\n", "NUL byte"),
        (b"experiment: q\x07x\n", ":1:14: control character U+0007 is not allowed in a recipe"),
        (b"seed: 1\n\x1b[31m: 2\n", ":2:1: control character U+001B is not allowed in a recipe"),
        (b"seed: 1\x0c\n", ":1:8: control character U+000C"),
        (b"experiment: x\x7f\n", ":1:14: control character U+007F"),
        ("experiment: x\x9b\n".encode(), ":1:14: control character U+009B"),
    ],
)
def test_loader_refuses_with_a_location(ws, cli, content, message):
    recipe = ws.root / "r.yaml"
    recipe.write_bytes(content)
    result = check(cli, recipe)
    assert result.exit_code == 2
    assert message in result.stderr, result.stderr
    assert str(recipe) in result.stderr


def test_control_characters_in_overrides_are_located(cli):
    result = check(cli, REPO / "recipes" / "quickstart.yaml", "experiment=a\x1bb", "seed=1\x07")
    assert result.exit_code == 2
    assert "override 'experiment=a\\x1bb':13: control character U+001B is not allowed" in result.stderr
    assert "override 'seed=1\\x07':7: control character U+0007" in result.stderr
    assert "\x1b" not in result.stderr  # never echoed raw to the terminal


def test_alias_bomb_is_refused_quickly(ws, cli):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]  # 10**12 values
    recipe = ws.text("bomb.yaml", "\n".join(lines) + "\n")
    t0 = time.perf_counter()
    result = check(cli, recipe)
    assert result.exit_code == 2 and "expands to more than" in result.stderr
    assert time.perf_counter() - t0 < 20  # "no answer in 20 s" was the bug; it takes milliseconds


def test_yaml_tags_never_run_code(ws, cli, tmp_path):
    marker = tmp_path / "ran"
    for tag in ("!!python/object/apply:os.system", "!!python/object/new:os.system"):
        recipe = ws.text("evil.yaml", f'experiment: {tag} ["touch {marker}"]\n')
        result = check(cli, recipe)
        assert result.exit_code == 2 and "is not allowed in a recipe" in result.stderr
        result = cli("check", ws.recipe(), f'experiment={tag} ["touch {marker}"]')
        assert result.exit_code == 2
    assert not marker.exists()


def test_yaml_12_floats_and_merge_keys(ws, cli):
    text = ws.recipe().read_text()
    text = text.replace("lr: 0.01", "lr: 1e-2").replace(
        "trainer:", "defaults: &d {max_steps: 3}\ntrainer:", 1
    )
    recipe = ws.text("r.yaml", text.replace("defaults: &d {max_steps: 3}\n", ""))
    result = check(cli, recipe, "--print")
    assert result.exit_code == 0, result.output
    assert "lr: 0.01" in result.stdout


# --------------------------------------------------------------------------- values and names


@pytest.mark.parametrize(
    "override, message",
    [
        ("dataset.batch_size=true", "dataset.batch_size: Input should be a valid integer (got True)"),
        (
            "dataset.batch_size='8'",
            "Input should be a valid integer; in quotes it is text: write 8 without the quotes (got '8')",
        ),
        ("dataset.batch_size=8.0", "Input should be a valid integer"),
        ("models.default.backend.args.optimizer.lr=.inf", "not a finite number"),
        (
            "models.default.backend.args.optimizer.lr=inf",
            "optimizer.lr: Input should be a valid number (got 'inf')",
        ),
        ("models.default.backend.args.optimizer.lr=nan", "Input should be a valid number (got 'nan')"),
        ("dataset.batch_size=100000000000", "dataset.batch_size: Input should be less than or equal to"),
        ("dataset.args.path=''", "dataset.args.path: String should have at least 1 character"),
        ("dataset.args=0", "dataset.args: `args` must be a mapping"),
        ("dataset.args=[]", "dataset.args: `args` must be a mapping"),
        ("dataset.args=false", "dataset.args: `args` must be a mapping"),
        ("dataset.args=''", "dataset.args: `args` must be a mapping"),
        ("models.default.backend.type_='hf '", "unknown backend 'hf '; did you mean 'hf'?"),
        ("models.default.backend.type_=HF", "unknown backend 'HF'"),
        ("models.default.backend.type_=h\u200bf", "unknown backend"),
        ("seed=", "no value after '='"),
        ("experiment=../../x", "experiment: not a name (it contains '/')"),
        ("experiment=/tmp/x", "experiment: not a name"),
        ("experiment=..", "experiment: not a name"),
        ("experiment='x '", "experiment: not a name (it contains ' ')"),
        ("dataflow.calls.0.name='s f t'", "dataflow.calls.0.name: not a name"),
        ("imports=[1]", "imports.0: Input should be a valid string"),
        ("imports=['..x']", "imports.0: not a module name"),
        ("imports=['a b']", "imports.0: not a module name"),
        ("imports=x", "imports: Input should be a valid list"),
        ("dataset.args.path=~nosuchuser_xyz/x", "is not a usable path"),
    ],
)
def test_mistaken_values_are_located_errors(ws, cli, override, message):
    result = check(cli, ws.recipe(), override)
    assert result.exit_code == 2, result.output
    assert message in result.stderr, result.stderr
    assert "override" in result.stderr


def test_user_text_is_printed_literally(ws, cli):
    result = check(cli, ws.recipe(), "experiment=[bold]x:100:[/]", "dataset.args.path=[red]oops")
    assert result.exit_code == 2
    assert "[bold]x:100:[/]" in result.stderr  # no markup applied, no emoji
    recipe = ws.text("[odd] name:100:.yaml", "experiment: [x\n")  # the file name itself has markup
    result = check(cli, recipe)
    assert result.exit_code == 2 and "[odd] name:100:.yaml:" in result.stderr


def test_init_from_cycle_is_refused(ws, cli):
    recipe = ws.recipe(models={"a": {"init_from": "b"}, "b": {"init_from": "a"}, "c": {"init_from": "c"}})
    result = check(cli, recipe)
    assert result.exit_code == 2
    assert "models.a.init_from: init_from forms a cycle: a -> b -> a" in result.stderr
    assert "models.c.init_from: a model cannot start from itself" in result.stderr


def test_misnamed_model_is_not_silently_unused(ws, cli):
    recipe = ws.recipe(models={"Default": {"config": {"hidden_size": 32}}})
    result = check(cli, recipe)
    assert result.exit_code == 2
    assert "model 'Default' is used by no call" in result.stderr and "did you mean 'default'" in result.stderr


def test_preset_typos_say_it_once_where_written(cli):
    result = check(cli, REPO / "recipes" / "quickstart.yaml", "dataflow.preset=gpro")
    assert result.exit_code == 2
    assert "1 problem(s)" in result.stderr and "did you mean 'grpo'" in result.stderr
    result = check(cli, REPO / "recipes" / "quickstart.yaml", "dataflow.actor.eps_clipp=0.1")
    assert result.exit_code == 2
    assert "1 problem(s)" in result.stderr and "dataflow.actor.eps_clipp: unknown key" in result.stderr
    result = check(cli, REPO / "recipes" / "quickstart.yaml", "dataflow.actor=[1]")
    assert result.exit_code == 2 and "dataflow.actor: Input should be a valid dictionary" in result.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["dataflow.actor.eval_reward_fn=mth"], "unknown reward 'mth'; did you mean 'math'?"),
        (["dataflow.reward.reward_fn=mth"], "unknown reward 'mth'"),
        (["models.actor.backend.args.optimizer.lr=.inf"], "not a finite number"),
        (["dataflow.shaping.reward_scaling=.nan"], "not a finite number"),
        (["tokenizer=null"], "no tokenizer: set `tokenizer:`"),
    ],
)
def test_caught_by_check_not_by_train(cli, overrides, message):
    result = check(cli, REPO / "recipes" / "quickstart.yaml", *overrides)
    assert result.exit_code == 2
    assert message in result.stderr, result.stderr


def test_ppo_with_one_sample_per_prompt_is_fine(cli):
    result = check(cli, REPO / "recipes" / "ppo-quickstart.yaml", "dataflow.actor.generation.n=1")
    assert result.exit_code == 0, result.output


# --------------------------------------------------------------------------- fuzzing

POOL = [
    "true", "false", "null", "''", '""', "0", "-1", "1", "1.5", ".inf", "-.inf", ".nan", "inf", "nan",
    "1e400", "99999999999999999999", "[]", "{}", "[1, 2]", "{a: 1}", "!!binary aGk=", "!custom x",
    "!!python/name:os.system", "!!float abc", "!!int x", "&a x", "*a", "*nope", "x\u200b", "'x '",
    "~nosuchuser_q/x", "../../x", "[bold]x", ":100:", "'a: b'", "|\n  text", "[", "{", "- a", "?",
    "!!str 3", "0x10", "0o7", "1_000", "2024-01-01", "yes", "~", "\t", "'\\x00'",
]  # fmt: skip
CONTROL = [*(chr(c) for c in range(32) if c not in (9, 10, 13)), "\x7f", "\x80", "\x9b", "\ufffe", "\uffff"]
KEYS = ["n", "lr", "args", "type_", "path", "preset", "model", "models", "init_from", "batch_size", "x"]


def mutate(text: str, rng: random.Random) -> bytes:
    lines = text.splitlines(keepends=True)
    op = rng.randrange(10)
    i = rng.randrange(len(lines))
    if op == 0:  # a value replaced
        m = re.match(r"^(\s*[-\w.]+:\s*)(\S.*)$", lines[i])
        if m:
            lines[i] = m.group(1) + rng.choice(POOL) + "\n"
    elif op == 1:  # a line dropped
        del lines[i]
    elif op == 2:  # a line duplicated
        lines.insert(i, lines[i])
    elif op == 3:  # two lines swapped
        j = rng.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    elif op == 4:  # re-indented
        lines[i] = " " * rng.choice([0, 1, 2, 4, 6]) + lines[i].lstrip()
    elif op == 5:  # a key renamed
        lines[i] = re.sub(r"[\w]+:", rng.choice(KEYS) + ":", lines[i], count=1)
    elif op == 6:  # cut short
        return "".join(lines).encode()[: rng.randrange(len(text))]
    elif op == 7:  # odd bytes
        raw = bytearray("".join(lines).encode())
        raw[rng.randrange(len(raw))] = rng.choice([0xE9, 0xFF, 0x80, 0x00, 0xC3, 0x5B, 0x7B])
        return bytes(raw)
    elif op == 8:  # a control character or other unprintable code point anywhere (a terminal escape, ...)
        text = "".join(lines)
        at = rng.randrange(len(text) + 1)
        return (text[:at] + rng.choice(CONTROL) + text[at:]).encode()
    else:  # a new key somewhere
        lines.insert(i, " " * rng.choice([0, 2, 4]) + f"{rng.choice(KEYS)}: {rng.choice(POOL)}\n")
    return "".join(lines).encode()


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def check_in_process(path: Path) -> str:
    """What `areal check` does, in-process: 'ok', or 'error' with every message located."""
    try:
        src = load_recipe_source(path)
        recipe = validate(apply_overrides(src, []))
        path_problems(recipe, path.parent)
        plan_lines(recipe)
        recipe.model_dump(mode="json")
        return "ok"
    except RecipeSourceError as e:
        messages = e.messages
    except RecipeInvalid as e:
        messages = e.lines()
    for m in messages:
        assert m.startswith(str(path)) or m.startswith("<override"), m
    return "error"


def run_fuzz(tmp_path: Path, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    texts = [p.read_text() for p in RECIPES]
    counts = {"ok": 0, "error": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for k in range(n):
            content = mutate(rng.choice(texts), rng)
            path = tmp_path / "fuzz.yaml"
            path.write_bytes(content)
            signal.alarm(10)
            try:
                counts[check_in_process(path)] += 1
            except _Hang:
                raise AssertionError(f"mutation {k} hung:\n{content[:2000]!r}") from None
            except Exception as e:
                raise AssertionError(f"mutation {k}: {type(e).__name__}: {e}\n{content[:3000]!r}") from e
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return counts


def test_fuzz_recipe_loader(tmp_path):
    counts = run_fuzz(tmp_path, 400, seed=0)
    assert counts["error"] > 100 and counts["ok"] > 10, counts  # the mutations do bite, and not always


@pytest.mark.slow
def test_fuzz_recipe_loader_long(tmp_path):
    counts = run_fuzz(tmp_path, 5000, seed=1)
    assert counts["error"] > 1000, counts

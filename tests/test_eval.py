"""`areal eval`: the metrics (pass@k against enumeration, majority votes, intervals), and the command on
a real short quickstart run: greedy accuracy equal to the run's final held-out accuracy, in process and
through `areal serve`; results.json consistent with its per-prompt counts; errors exit 2."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from arealcli.main import app
from arealcli.runtime.eval.metrics import PromptResult, majority_correct, pass_at_k, summarize
from tests.conftest import REPO


def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one():
    for n, c in [(1, 0), (1, 1), (5, 0), (5, 2), (6, 3), (8, 1), (8, 8)]:
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(range(n), k))
            exact = sum(any(outcomes[i] for i in d) for d in draws) / len(draws)
            assert math.isclose(pass_at_k(n, c, k), exact, abs_tol=1e-12), (n, c, k)
    assert pass_at_k(8, 1, 1) == pytest.approx(1 / 8)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_vote_ignores_missing_answers_and_breaks_ties_by_order():
    assert (
        majority_correct(["3", "4", "4", None, None, None], [True, False, False, False, False, False]) == 0.0
    )
    assert majority_correct(["3", "4", "3", "4"], [True, False, True, False]) == 1.0  # tie: "3" came first
    assert majority_correct([None, None], [False, False]) == 0.0
    assert majority_correct(["7", None, "7"], [True, False, True]) == 1.0


def test_summary_means_and_intervals():
    rows = [
        PromptResult("p", ["1"], "x", 1.0, ["a", "b"], [1.0, 0.0], ["1", "2"], [2, 3], [False, True]),
        PromptResult("q", ["2"], "y", 0.0, ["c", "d"], [0.0, 0.0], ["5", "5"], [4, 4], [False, False]),
    ]
    out = summarize(rows, [1, 2], binary=True, n_boot=200)
    assert out["greedy_accuracy"] == 0.5 and out["avg@2"] == 0.25 and out["pass@2"] == 0.5
    assert out["pass@1"] == 0.25 and out["maj@2"] == 0.5  # p: "1" vs "2" tie -> "1" (correct); q: "5" (wrong)
    assert out["response_tokens"] == 3.25 and out["truncated"] == 0.25
    for name in ("greedy_accuracy", "pass@2", "avg@2"):
        lo, hi = out[f"{name}_ci95"]
        assert lo <= out[name] <= hi


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A short quickstart: SFT warm-up then a few GRPO steps, held-out accuracy logged at the end."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    result = invoke(
        "train",
        REPO / "recipes" / "quickstart.yaml",
        "-o",
        run_dir,
        "trainer.max_steps=28",
        "dataflow.sft_warmup_steps=24",
        "trainer.eval_every_n_steps=28",
        "trainer.eval_at_start=false",
        "trainer.tensorboard=false",
        "eval_dataset.args.limit=64",
    )
    assert result.exit_code == 0, result.output
    return run_dir


def final_accuracy(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]


def test_greedy_accuracy_equals_the_runs_held_out_accuracy_and_pass_at_k_its_counts(run, tmp_path):
    out = tmp_path / "results.json"
    result = invoke("eval", run, "--n", 4, "--k", "1,2,4", "-o", out)
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    m = body["metrics"]
    assert 0 < final_accuracy(run) < 1 and m["greedy_accuracy"] == final_accuracy(run)
    assert len(body["per_prompt"]) == 64 and body["config"]["n"] == 4
    for k in (1, 2, 4):
        again = sum(pass_at_k(p["n"], p["correct"], k) for p in body["per_prompt"]) / 64
        assert m[f"pass@{k}"] == pytest.approx(again, abs=1e-12)
    assert m["pass@1"] <= m["pass@2"] <= m["pass@4"] and m["avg@4"] == pytest.approx(m["pass@1"])
    assert sum(p["greedy_correct"] for p in body["per_prompt"]) / 64 == m["greedy_accuracy"]
    lines = (tmp_path / "results.samples.jsonl").read_text().splitlines()
    assert len(lines) == 64 and len(json.loads(lines[0])["completions"]) == 4
    assert "greedy_accuracy" in result.output and "pass@4" in result.output


def test_the_same_checkpoint_served_gives_the_same_greedy_answers(run, tmp_path):
    from arealcli.runtime.clients import launcher
    from arealcli.runtime.run.targets import find_model
    from tests.test_server import start_servers

    local = tmp_path / "local.json"
    assert invoke("eval", run, "--n", 0, "-o", local).exit_code == 0
    servers = start_servers(find_model(run).model_dir, tmp_path)
    try:
        served = tmp_path / "served.json"
        url = f"http://{servers[0].address}"
        result = invoke("eval", url, "--recipe", run / "recipe.yaml", "--n", 2, "-o", served)
        assert result.exit_code == 0, result.output
    finally:
        launcher.stop(servers)
    a, b = json.loads(local.read_text()), json.loads(served.read_text())
    assert [p["greedy_correct"] for p in a["per_prompt"]] == [p["greedy_correct"] for p in b["per_prompt"]]
    assert b["metrics"]["greedy_accuracy"] == final_accuracy(run)
    assert b["per_prompt"][0]["n"] == 2


def test_several_checkpoints_in_one_table(run, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "arealcli.main",
            "eval",
            *map(str, sorted((run / "checkpoints").glob("step_*"))),
            "--n",
            "0",
        ],
        capture_output=True,
        text=True,
        env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"},
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "greedy_accuracy" in result.stdout and "step 28" in result.stdout


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--n", "2", "--k", "4"], "every k must be between 1 and --n 2"),
        (["--reward", "nosuch"], "--reward nosuch: no such reward function"),
        (["--data", "nowhere.jsonl"], "nowhere.jsonl"),
    ],
)
def test_bad_requests_exit_2_with_one_line(run, args, said):
    result = invoke("eval", run, *args)
    assert result.exit_code == 2 and said in result.output, result.output


def test_an_unreachable_endpoint_and_a_missing_field_exit_2(run, tmp_path):
    result = invoke("eval", "http://127.0.0.1:9", "--recipe", run / "recipe.yaml")
    assert result.exit_code == 2 and "cannot reach" in result.output, result.output
    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "max(1,2,3)=", "answer": "3"}\n')
    result = invoke("eval", run, "--data", data)
    assert result.exit_code == 2 and "prompt" in result.output, result.output


def test_in_training_evaluation_with_samples_leaves_training_untouched(tmp_path):
    """trainer.eval: {n: 4}: eval/pass@k, avg@k, maj@k logged beside eval/accuracy; every other metric
    equal to a run without it (the evaluation samples from a random stream of its own)."""
    common = [
        "trainer.max_steps=12",
        "dataflow.sft_warmup_steps=8",
        "trainer.eval_every_n_steps=6",
        "trainer.eval_at_start=false",
        "trainer.tensorboard=false",
        "eval_dataset.args.limit=32",
        "trainer.save_every_n_steps=null",
    ]
    recipe = REPO / "recipes" / "quickstart.yaml"
    assert invoke("train", recipe, "-o", tmp_path / "plain", *common).exit_code == 0
    result = invoke("train", recipe, "-o", tmp_path / "sampled", *common, "trainer.eval={n: 4, k: [1, 4]}")
    assert result.exit_code == 0, result.output
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    plain, sampled = read("plain"), read("sampled")
    extra = {
        "eval/avg@1",
        "eval/avg@4",
        "eval/pass@1",
        "eval/pass@4",
        "eval/maj@1",
        "eval/maj@4",
        "eval/response_tokens",
        "eval/truncated",
    }
    for a, b in zip(plain, sampled, strict=True):
        timing = {k for k in a if k.startswith(("timing/", "sys/")) or k.endswith("_per_s")}
        assert {k: v for k, v in b.items() if k not in extra | timing} == {
            k: v for k, v in a.items() if k not in timing
        }
    last = sampled[-1]
    assert extra <= set(last) and last["eval/pass@1"] <= last["eval/pass@4"]
    assert last["eval/avg@4"] == pytest.approx(last["eval/pass@1"])
    from arealcli.runtime.console.report import _panels

    assert (
        "held-out with samples",
        ["eval/avg@1", "eval/avg@4", "eval/maj@1", "eval/maj@4", "eval/pass@1", "eval/pass@4"],
    ) in _panels([(tmp_path / "sampled", sampled)])


def test_a_bad_later_target_is_refused_before_the_first_is_evaluated(run, tmp_path, monkeypatch):
    """Every target is checked before any model loads: a URL without a tokenizer, given after a run,
    exits 2 at once (no evaluation of the run first, no results written)."""
    from arealcli.runtime.eval import run as eval_run

    evaluated = []
    real = eval_run.evaluate
    monkeypatch.setattr(eval_run, "evaluate", lambda *a, **k: evaluated.append(1) or real(*a, **k))
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "max(1,2,3)=", "answer": "3"}\n')
    out = tmp_path / "results.json"
    result = invoke("eval", run, "http://127.0.0.1:9", "--data", data, "-o", out)
    assert result.exit_code == 2, result.output
    assert "http://127.0.0.1:9: prompts go as token ids: give --tokenizer" in " ".join(result.output.split())
    assert not evaluated and not out.exists()

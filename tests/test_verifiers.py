"""verifiers environments as a rollout workflow (`verifiers`) and their tasksets as a dataset: the max3
environment written in verifiers' style (recipes/max3_vf) and verifiers' own envs (`single_agent`, the
env every plain taskset runs in, and `best_of_n`) run unchanged on a model; the endpoint their calls
reach; `areal check` on tasksets and envs; the verifiers quickstart's reward rises (slow)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
import yaml

from tests.conftest import REPO, tiny_module, train_asynchronously

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (pip install 'arealcli[verifiers]')")

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
MAX3 = {"id": "max3_vf", "split": "test"}


@pytest.fixture
def tok(char_tok, monkeypatch):
    """The character tokenizer with the quickstart's chat template; recipes/ (max3_vf) on sys.path."""
    import copy

    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    t = copy.deepcopy(char_tok)
    t.chat_template = TEMPLATE
    return t


def engine(tok, seed: int = 0, module=None):
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import HFBackendArgs

    model = Model("actor", module if module is not None else tiny_module(tok, seed=seed), tok)
    return HFBackend(HFBackendArgs(device="cpu")).initialize(model, FinetuneSpec(1, 1, 1, 1)).module


def rows(tok, taskset=MAX3, **args):
    from arealcli.runtime.data.tasksets import VerifiersTasksDataset
    from arealcli.schema.components.datasets import VerifiersTasksArgs

    return VerifiersTasksDataset(VerifiersTasksArgs(taskset=taskset, **args), tok)


def run_episodes(tok, env: dict, n: int, seed: int = 0, **gen):
    from arealcli.runtime.agents.verifiers_env import VerifiersWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import VerifiersArgs

    data = rows(tok, limit=n)
    workflow = VerifiersWorkflow(VerifiersArgs(env=env, max_total_tokens=32))
    try:
        torch.manual_seed(seed)
        g = GenerationHyperparameters(**{"max_new_tokens": 3, "temperature": 1.0, **gen})
        episodes = workflow.run(
            engine(tok, seed),
            tok,
            [it["prompt_ids"] for it in data.items],
            g,
            [it["task"] for it in data.items],
        )
    finally:
        workflow.close()
    assert workflow.loop is None  # closed: its event loop and endpoint are gone
    return data, episodes


def test_the_tasks_of_a_taskset_become_rows(tok):
    data = rows(tok, skip=2, limit=5)
    lines = [json.loads(line) for line in (REPO / "data" / "max3" / "test.jsonl").read_text().splitlines()]
    assert len(data) == 5
    for item, row in zip(data.items, lines[2:7], strict=True):
        assert item["prompt"] == row["prompt"] and tok.decode(item["prompt_ids"]) == row["prompt"]
        assert item["answers"] == [row["answer"]]
        # SFT: the prompt, then the answer and EOS (trained)
        assert tok.decode(item["input_ids"]) == row["prompt"] + row["answer"] + "<eos>"
        assert item["loss_mask"].count(True) == len(row["answer"]) + 1
        assert item["task"]["prompt"] == row["prompt"] and item["task"]["answer"] == row["answer"]
    batch = data.collate([0, 1])
    assert batch.meta["task"][1]["answer"] == lines[3]["answer"]


def test_episodes_of_a_multi_turn_environment_in_verifiers_style(tok):
    """recipes/max3_vf's Env, two attempts: the env's " no. " + the task again comes between the replies
    as untrained tokens; each reward is the task's `@vf.reward` (1 / the try that was right, else 0),
    logged with the `@vf.metric` attempts."""
    data, episodes = run_episodes(tok, {"taskset": MAX3, "attempts": 2}, n=6, min_new_tokens=3)
    for item, ep in zip(data.items, episodes, strict=True):
        answer, prompt = item["answers"][0], item["prompt"]
        assert ep.prompt in (None, item["prompt_ids"])  # None: the dataset's prompt
        replies = [tok.decode(ep.tokens[s:e]) for s, e in spans(ep.mask)]
        shown = tok.decode([t for t, m in zip(ep.tokens, ep.mask, strict=True) if not m])
        assert ep.metrics["attempts"] == len(replies) and ep.metrics["errors"] == 0
        first = replies[0].replace("<eos>", "").strip()
        if first == answer:
            assert len(replies) == 1 and ep.reward == 1.0
        else:
            # the template ends the first reply with EOS where the model did not (3 tokens, then cut)
            assert len(replies) == 2 and shown.removeprefix("<eos>") == " no. " + prompt
            second = replies[1].replace("<eos>", "").strip()
            assert ep.reward == (0.5 if second == answer else 0.0)
        assert ep.metrics["correct"] == ep.reward  # the one reward, weight 1
        assert len(ep.logprobs) == len(ep.tokens) and all(lp <= 0 for lp in ep.logprobs)


def spans(mask: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained tokens."""
    out, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_a_trained_model_scores_in_verifiers_own_environments(tok):
    """verifiers' own envs run unchanged over the max3 taskset: `single_agent` (what a taskset without an
    env of its own runs in) and `best_of_n` (here one attempt: its `best` and `pass_at_n` metrics). A model
    fitted to the answers scores most episodes; its log-probs are the generator's."""
    from arealcli.runtime.agents.verifiers_env import VerifiersWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import VerifiersArgs

    data = rows(tok, limit=12)
    model = tiny_module(tok, seed=0).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    ids = [torch.tensor(it["input_ids"]) for it in data.items]
    torch.manual_seed(0)
    for _ in range(150):  # fit prompt -> answer on these 12 tasks
        for x, item in zip(ids, data.items, strict=True):
            logits = model(x[None]).logits[0, :-1]
            mask = torch.tensor(item["loss_mask"][1:])
            loss = torch.nn.functional.cross_entropy(logits[mask], x[1:][mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
        if all(greedy(model, tok, it) for it in data.items):
            break
    model.eval()
    fitted = engine(tok, module=model)
    g = GenerationHyperparameters(max_new_tokens=4, greedy=True)
    prompts, tasks = [it["prompt_ids"] for it in data.items], [it["task"] for it in data.items]
    for env, metric in (({"id": "single_agent"}, None), ({"id": "best_of_n", "n": 1}, "pass_at_n")):
        workflow = VerifiersWorkflow(VerifiersArgs(env={"taskset": MAX3, **env}, max_total_tokens=32))
        try:
            episodes = workflow.run(fitted, tok, prompts, g, tasks)
        finally:
            workflow.close()
        rewards = [ep.reward for ep in episodes]
        assert sum(rewards) >= 10, rewards
        for ep in episodes:
            assert ep.metrics["errors"] == 0 and ep.metrics["attempts"] == 1
            if metric:
                assert ep.metrics[metric] == ep.reward and ep.metrics["best"] == 1.0


def greedy(model, tok, item) -> bool:
    x = torch.tensor([item["prompt_ids"]])
    with torch.no_grad():
        for _ in range(len(item["answers"][0])):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return tok.decode(x[0, len(item["prompt_ids"]) :]) == item["answers"][0]


def test_episodes_leave_no_connection_open(tok):
    """Every episode makes HTTP clients (verifiers' relay, the harness's OpenAI client): over many calls
    the process's open files stay flat (a run of thousands of episodes must not run out of them)."""
    import os

    from arealcli.runtime.agents.verifiers_env import VerifiersWorkflow
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.components.workflows import VerifiersArgs

    data = rows(tok, limit=16)
    workflow = VerifiersWorkflow(VerifiersArgs(env={"taskset": MAX3, "attempts": 2}, max_total_tokens=32))
    model, g = engine(tok), GenerationHyperparameters(max_new_tokens=3, temperature=1.0)
    opened = []
    try:
        for _ in range(4):
            workflow.run(
                model, tok, [it["prompt_ids"] for it in data.items], g, [it["task"] for it in data.items]
            )
            opened.append(len(os.listdir("/proc/self/fd")))
    finally:
        workflow.close()
    assert opened[-1] <= opened[0] + 8, opened  # 16 episodes a call: a leak would add 16+ a call


def test_the_endpoint_answers_only_the_runs_episodes(tok):
    """The chat endpoint the env's calls reach: no key, a wrong key, an ended run: refused."""
    from arealcli.runtime.agents.verifiers_env import Endpoint
    from arealcli.runtime.engines.inference import EventLoopThread

    loop = EventLoopThread()
    endpoint = Endpoint(loop)
    try:

        def post(url: str, key: str | None) -> tuple[int, str]:
            request = urllib.request.Request(
                url + "/chat/completions",
                data=json.dumps(
                    {
                        "model": endpoint.model("policy", "abc", 0),
                        "messages": [{"role": "user", "content": "hi"}],
                    }
                ).encode(),
                headers={
                    "Content-Type": "application/json",
                    **({"Authorization": f"Bearer {key}"} if key else {}),
                },
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        url = endpoint.url
        assert url.startswith("http://127.0.0.1:")
        assert post(url, None)[0] == 401
        assert post(url, "wrong")[0] == 401
        status, body = post(url, endpoint.key)
        assert status == 404 and "no such episode" in body
    finally:
        loop.run(endpoint.close())
        loop.close()


def test_check_names_what_is_wrong_with_a_taskset_or_env(cli):
    recipe = REPO / "recipes" / "verifiers-quickstart.yaml"
    assert cli("check", recipe).exit_code == 0  # the shipped recipe finds its taskset beside it
    result = cli(
        "check",
        recipe,
        "dataset.args.taskset.id=no_such_tasks",
        "dataflow.actor.workflow.args.env.attempts=x",
        "eval_dataset.args.taskset.split=[1]",
    )
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "dataset.args.taskset: verifiers taskset 'no_such_tasks': taskset 'no_such_tasks' not found" in err
    assert (
        "eval_dataset.args.taskset: verifiers taskset 'max3_vf': split: Input should be a valid string" in err
    )
    assert (
        "workflow.args.env: verifiers env of taskset 'max3_vf': attempts: Input should be a valid integer"
        in err
    )
    # verifiers' own env (best_of_n) over the taskset: its bounds hold
    result = cli(
        "check",
        recipe,
        "dataflow.actor.workflow.args.env.id=best_of_n",
        "dataflow.actor.workflow.args.env.n=0",
    )
    assert result.exit_code == 2 and "n: Input should be greater than or equal to 1" in " ".join(
        result.stderr.split()
    )


@pytest.mark.slow
def test_the_verifiers_quickstart_learns(tmp_path, cli, monkeypatch):
    """The quickstart through 40 of its 80 RL steps: the env's reward of held-out greedy episodes rises
    past where SFT left it, fewer attempts are needed, and `areal eval RUN` from another folder finds the
    taskset from the run's recipe.yaml and scores the same episodes with the environment's reward."""
    from tests.test_quickstart import train

    run = tmp_path / "run"
    train("verifiers-quickstart.yaml", run, "trainer.max_steps=160")
    rows_ = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["actor_gen/env/reward"] for r in rows_ if "actor_gen/env/reward" in r]
    correct = [r["actor_gen/env/correct"] for r in rows_ if "actor_gen/env/correct" in r]
    attempts = [r["actor_gen/env/attempts"] for r in rows_ if "actor_gen/env/attempts" in r]
    errors = [r["actor_gen/env/errors"] for r in rows_ if "actor_gen/env/errors" in r]
    held_out = {r["step"]: r["eval/reward/environment"] for r in rows_ if "eval/reward/environment" in r}
    print(f"verifiers-quickstart: env reward {rewards}, attempts {attempts}, held-out {held_out}")
    assert len(rewards) == 4 and correct == rewards  # the env's one reward, logged by its name
    assert errors == [0.0] * 4
    assert held_out[0] < 0.05 and held_out[120] >= 0.5  # SFT on the tasks' answers
    assert held_out[160] >= held_out[120] + 0.04  # then RL in the environment
    assert sum(attempts[-2:]) / 2 < attempts[0]  # more answers right at the first attempt

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "eval.json"
    result = cli("eval", run, "--n", 1, "-o", out)
    assert result.exit_code == 0, result.output
    assert abs(json.loads(out.read_text())["metrics"]["greedy_reward"] - held_out[160]) <= 0.02


@pytest.mark.slow
def test_the_verifiers_workflow_runs_asynchronously(tmp_path):
    """The quickstart with generation on a `local` generator up to 2 steps ahead (decoupled PPO): the
    episodes run on the rollout thread, no sample is more than 2 versions behind, and over 60 RL steps the
    env's reward of held-out episodes rises past where SFT left it."""
    recipe = yaml.safe_load((REPO / "recipes" / "verifiers-quickstart.yaml").read_text())
    for key in ("dataset", "eval_dataset"):
        recipe[key]["args"]["taskset_dir"] = str(REPO / "recipes")
    recipe["dataflow"]["actor"]["workflow"]["args"]["env_dir"] = str(REPO / "recipes")
    recipe["trainer"].update(max_steps=180, eval_every_n_steps=60, eval_at_start=False)
    rows_ = train_asynchronously(recipe, tmp_path)
    rewards = [r["actor_gen/env/reward"] for r in rows_ if "actor_gen/env/reward" in r]
    held_out = {r["step"]: r["eval/reward/environment"] for r in rows_ if "eval/reward/environment" in r}
    print(f"verifiers async: env reward {rewards}, held-out {held_out}")
    # sampled rewards of a few steps vary with the rollout thread's timing; held-out greedy episodes do not
    assert len(rewards) == 6 and held_out[180] >= held_out[120] + 0.03, held_out
    lag = [r["actor_train/version_lag_max"] for r in rows_ if "actor_train/version_lag_max" in r]
    assert lag and max(lag) <= 2  # no sample more than max_staleness policy versions behind
    assert all(r["actor_gen/env/errors"] == 0 for r in rows_ if "actor_gen/env/errors" in r)

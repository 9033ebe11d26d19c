"""Rewards from a service (`reward: {url: ...}`, interface remote_reward): the protocol's client and
reference server over real HTTP, keys, retries, refusals, and a training run scored by the service that
logs exactly what the same reward gives in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from arealcli.runtime.rewards.builtin import math_reward
from arealcli.runtime.rewards.remote import MAX_BODY, RemoteReward, RemoteRewardError, make_server
from tests.conftest import TINY_ARCH


@pytest.fixture
def serve():
    """Start reward services on free loopback ports; shut them down after the test."""
    servers = []

    def start(fn, api_key=None) -> str:
        server = make_server(fn, "127.0.0.1", 0, api_key)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


PROMPTS = ["max(3,9,4)=", "max(1,2,3)=", "max(7,5,6)="]
RESPONSES = ["9", "2", "7"]
ANSWERS = [["9"], ["3"], ["7"]]


def test_scores_come_back_in_order_in_batches_and_with_info(serve):
    seen: list[int] = []

    def graded(prompts, responses, answers):
        seen.append(len(prompts))
        scores = math_reward(prompts, responses, answers)
        return scores, [{"length": len(r), "note": "text is not logged"} for r in responses]

    url = serve(graded)
    client = RemoteReward(url, batch_size=2, concurrency=2)
    scores, info = client(PROMPTS * 3, RESPONSES * 3, ANSWERS * 3)
    assert scores == [1.0, 0.0, 1.0] * 3
    assert sorted(seen) == [1, 2, 2, 2, 2] and info[0] == {"length": 1.0}  # 9 samples in batches of 2


def test_the_key_is_needed_and_checked(serve):
    url = serve(math_reward, api_key="s3cret")
    with pytest.raises(RemoteRewardError, match="refused the batch: HTTP 401"):
        RemoteReward(url, retries=0)(PROMPTS, RESPONSES, ANSWERS)
    with pytest.raises(RemoteRewardError, match="HTTP 401"):
        RemoteReward(url, api_key="wrong", retries=0)(PROMPTS, RESPONSES, ANSWERS)
    assert RemoteReward(url, api_key="s3cret")(PROMPTS, RESPONSES, ANSWERS)[0] == [1.0, 0.0, 1.0]
    with urllib.request.urlopen(url + "/health") as r:  # health needs no key
        assert json.loads(r.read()) == {"status": "ok", "protocol": 1}


def test_a_failing_service_is_retried_then_named(serve):
    calls = {"n": 0}

    def flaky(prompts, responses, answers):
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("sandbox busy")
        return math_reward(prompts, responses, answers)

    url = serve(flaky)
    assert RemoteReward(url, retries=3, backoff_s=0.01)(PROMPTS, RESPONSES, ANSWERS)[0] == [1.0, 0.0, 1.0]
    assert calls["n"] == 3  # two 500s, then the scores

    calls["n"] = -100  # fails for good
    with pytest.raises(RemoteRewardError) as e:
        RemoteReward(url, retries=2, backoff_s=0.01)(PROMPTS, RESPONSES, ANSWERS)
    assert f"the reward service {url}/score did not answer after 3 tries" in str(e.value)
    assert "the reward function failed: RuntimeError: sandbox busy" in str(e.value)

    # nothing listening: a lost connection, retried, then named
    dead = "http://127.0.0.1:9"
    with pytest.raises(RemoteRewardError, match="did not answer after 2 tries"):
        RemoteReward(dead, retries=1, backoff_s=0.01, timeout_s=2)(PROMPTS, RESPONSES, ANSWERS)


def test_an_answer_outside_the_protocol_is_an_error_not_zeros(serve):
    short = serve(lambda p, r, a: [1.0])  # one score for three samples
    with pytest.raises(RemoteRewardError, match="answered outside protocol 1: the answer has 1 scores for 3"):
        RemoteReward(short)(PROMPTS, RESPONSES, ANSWERS)
    nan = serve(lambda p, r, a: [float("nan")] * len(p))
    with pytest.raises(RemoteRewardError, match="scores must be finite numbers"):
        RemoteReward(nan)(PROMPTS, RESPONSES, ANSWERS)


def post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_reference_server_refuses_bad_requests_with_their_reason(serve):
    url = serve(math_reward) + "/score"
    status, body = post(url, b"{not json")
    assert status == 400 and body["error"].startswith("the body is not JSON")
    status, body = post(url, json.dumps({"protocol": 1, "samples": [{"prompt": "x"}]}).encode())
    assert status == 400 and body["error"] == 'samples[0] needs "prompt" and "response" strings'
    status, body = post(url, b"x", {"Content-Length": str(MAX_BODY + 1)})
    assert status == 413
    assert post(url.replace("/score", "/other"), b"{}")[0] == 404


def remote_recipe(ws, reward: dict, name: str) -> Path:
    recipe = {
        "experiment": "tiny-remote",
        "seed": 1,
        "tokenizer": {"kind": "char"},
        "models": {
            "actor": {
                "config": TINY_ARCH,
                "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 1e-3}}},
            }
        },
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
        "dataflow": {
            "preset": "grpo",
            "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
            "reward": reward,
        },
        "trainer": {"max_steps": 3, "log_every_n_steps": 1, "tensorboard": False},
    }
    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "perf/", "sys/"))} for r in rows]


def test_a_run_scored_by_the_service_logs_what_the_reward_gives_in_process(ws, cli, tmp_path, serve):
    """`areal serve-reward exact_match` in its own process (keyed), and the grpo preset with
    `reward: {url: ...}`: the same metrics as `reward: {reward_fn: exact_match}`, step by step."""
    env = {**os.environ, "AREAL_API_KEY": "k3y"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "arealcli.main", "serve-reward", "exact_match", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert "served at http://127.0.0.1:" in line and "keyed" in line, line
        url = line.split("served at ", 1)[1].split(" ", 1)[0]
        local = tmp_path / "local"
        remote = tmp_path / "remote"
        result = cli("train", remote_recipe(ws, {"reward_fn": "exact_match"}, "local.yaml"), "-o", local)
        assert result.exit_code == 0, result.output
        os.environ["REWARD_KEY"] = "k3y"
        try:
            recipe = remote_recipe(ws, {"url": url, "api_key_env": "REWARD_KEY"}, "remote.yaml")
            result = cli("train", recipe, "-o", remote)
        finally:
            del os.environ["REWARD_KEY"]
        assert result.exit_code == 0, result.output
    finally:
        proc.terminate()
        proc.wait(10)
    ours, theirs = metrics(local), metrics(remote)
    assert [r.get("actor_train/reward") for r in theirs] == [r.get("actor_train/reward") for r in ours]
    assert theirs == ours


def test_check_and_train_say_what_is_wrong_with_a_remote_reward(ws, cli, tmp_path):
    bad = remote_recipe(ws, {"url": "localhost:8100"}, "bad.yaml")
    result = cli("check", bad)
    assert result.exit_code == 2
    assert "a reward service URL is http://HOST[:PORT] or https://..., not 'localhost:8100'" in result.stderr
    unset = remote_recipe(ws, {"url": "http://127.0.0.1:9", "api_key_env": "NO_SUCH_KEY_VAR"}, "unset.yaml")
    result = cli("train", unset, "-o", tmp_path / "unset")
    assert result.exit_code == 2 and "NO_SUCH_KEY_VAR (api_key_env) is not set" in result.stderr
    down = remote_recipe(ws, {"url": "http://127.0.0.1:9", "retries": 0, "timeout_s": 2}, "down.yaml")
    result = cli("train", down, "-o", tmp_path / "down")
    assert result.exit_code != 0
    assert (
        "scoring failed at step 1: the reward service http://127.0.0.1:9/score did not answer"
        in result.stderr
    )
    assert "this looks like a bug" not in result.stderr and "Traceback" not in result.stderr

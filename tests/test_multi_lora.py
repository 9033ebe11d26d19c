"""Several LoRA adapters on one generation server: rows of different adapters decode in one batch and
each answers as its merged model does; `areal serve --lora NAME=DIR`, the load/unload endpoints, requests
that pick an adapter by name (OpenAI `model`, SGLang `lora_path`), and the refusals."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import httpx
import pytest
import torch

from arealcli.runtime.clients import launcher
from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.generation.scheduler import Scheduler
from arealcli.runtime.generation.sequence import Sequence
from arealcli.runtime.models.lora import with_lora
from arealcli.runtime.wire.sglang import parse_sampling
from arealcli.schema.components.backends import SGLangBackendArgs
from arealcli.schema.components.engine import LoraConfig
from tests.conftest import deep_merge, tiny_module
from tests.test_lora_sync import RECIPE, ROWS

PROMPTS = [[20, 21, 22], [30, 31], [25, 26, 27, 28]]
NEW = 6
EOS = 1  # the char tokenizer's <eos>


def make_adapter(char_tok, folder: Path, seed: int, rank: int = 4):
    """A peft adapter on the tiny base (seed 0) with trained-looking B, saved in peft's format; returns
    the merged model (what the adapter should answer as)."""
    module = with_lora(
        tiny_module(char_tok, seed=0), LoraConfig(rank=rank, alpha=8, target_modules="all-linear"), seed
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    module.save_pretrained(folder)
    return copy.deepcopy(module).merge_and_unload().eval()


def greedy(module, prompt: list[int], n: int = NEW) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, one full forward per token (no cache)."""
    ids: list[int] = []
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            logits = module(torch.tensor([prompt + ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            tok = int(lp.argmax())
            ids.append(tok)
            lps.append(float(lp[tok]))
    return ids, lps


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, char_tok, model_dir):
    root = tmp_path_factory.mktemp("adapters")
    merged = {name: make_adapter(char_tok, root / name, seed) for name, seed in (("a", 1), ("b", 2))}
    merged[None] = tiny_module(char_tok, seed=0)
    return root, merged


def test_rows_of_different_adapters_decode_in_one_batch_as_their_merged_models(model_dir, adapters):
    """Base, a and b rows submitted together run in one continuous batch (max_running = all of them);
    each row's greedy tokens are its merged model's, with the same log-probs."""
    root, merged = adapters
    runner = ModelRunner(str(model_dir), device="cpu")
    for name in ("a", "b"):
        runner.load_adapter(name, str(root / name), version=f"{name}-1")
    scheduler = Scheduler(runner, batch_window_s=0.05, continuous=True)
    scheduler.start()
    try:
        greedy_params = parse_sampling({"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True})
        seqs = [
            Sequence(f"{name}-{i}", p, greedy_params, NEW, adapter=name)
            for name in (None, "a", "b")
            for i, p in enumerate(PROMPTS)
        ]
        scheduler.submit(seqs)
        for s in seqs:
            assert s.done.wait(60), s.rid
    finally:
        scheduler.stop()
        scheduler.join(10)
    assert scheduler.stats["max_running"] == len(seqs)  # one batch: base and both adapters together
    answers = {}
    for s in seqs:
        assert s.error is None, s.error
        ids, lps = greedy(merged[s.adapter], s.prompt)
        assert s.output_ids == ids, s.rid
        assert max(abs(x - y) for x, y in zip(s.logprobs, lps, strict=True)) < 1e-4, s.rid
        assert s.weight_version == (f"{s.adapter}-1" if s.adapter else "default")
        answers.setdefault(s.adapter, []).append(tuple(ids))
    assert answers["a"] != answers["b"] != answers[None]  # the adapters change what is written


# --------------------------------------------------------------------------- areal serve --lora


@pytest.fixture(scope="module")
def server(model_dir, adapters, tmp_path_factory):
    root, _ = adapters
    args = SGLangBackendArgs(
        launch="embedded",
        num_servers=1,
        device="cpu",
        extra_args=["--num-threads", "1", "--lora", f"a={root / 'a'}", "--lora", f"b={root / 'b'}"],
    )
    servers = launcher.launch(args, str(model_dir), tmp_path_factory.mktemp("logs"), "lora")
    try:
        launcher.wait_ready(servers, 90)
        yield servers[0]
    finally:
        launcher.stop(servers)


def url(server, path: str) -> str:
    return f"http://{server.address}{path}"


def test_serve_answers_each_adapter_by_model_name_at_once(server, adapters):
    """OpenAI requests for the base, a and b sent together (they batch) answer as their merged models;
    SGLang's /generate picks the adapter by `lora_path`; /v1/models lists the adapters under the base."""
    _, merged = adapters

    async def ask(client, model: str | None, prompt: list[int]):
        body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "logprobs": 0}
        if model is not None:
            body["model"] = model
        r = await client.post(url(server, "/v1/completions"), json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return r.json()["model"], choice["token_ids"], choice["logprobs"]["token_logprobs"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            jobs = [ask(client, m, p) for m in ("a", "b", None) for p in PROMPTS]
            return await asyncio.gather(*jobs)

    results = asyncio.run(all_at_once())
    served = httpx.get(url(server, "/v1/models"), trust_env=False).json()["data"]
    base_name = served[0]["id"]
    assert [(m["id"], m.get("parent")) for m in served] == [
        (base_name, None),
        ("a", base_name),
        ("b", base_name),
    ]
    for (name, prompt), (model, ids, lps) in zip(
        [(m, p) for m in ("a", "b", None) for p in PROMPTS], results, strict=True
    ):
        want_ids, want_lps = greedy(merged[name], prompt)
        assert model == (name or base_name)
        assert ids == want_ids[: len(ids)] and (len(ids) == NEW or ids[-1] == EOS), (name, prompt)
        assert max(abs(x - y) for x, y in zip(lps, want_lps[: len(ids)], strict=True)) < 1e-4
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
    }
    native = httpx.post(
        url(server, "/generate"), json={**body, "lora_path": "b"}, trust_env=False, timeout=60
    )
    assert native.status_code == 200, native.text
    assert native.json()["output_ids"] == greedy(merged["b"], PROMPTS[0])[0]


def test_adapters_load_and_unload_while_serving(server, adapters, model_dir):
    """A new name loads from a folder, a served name takes a new folder (a trainer's update) with its
    weight version, unloading ends it; unknown names and folders that are not adapters are refused, naming
    what is served or what is missing."""
    root, merged = adapters

    def complete(model: str) -> httpx.Response:
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": NEW, "temperature": 0}
        return httpx.post(url(server, "/v1/completions"), json=body, trust_env=False, timeout=60)

    r = httpx.post(
        url(server, "/load_lora_adapter"),
        json={"lora_name": "c", "lora_path": str(root / "a")},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["success"], r.text
    ids = complete("c").json()["choices"][0]["token_ids"]
    assert ids == greedy(merged["a"], PROMPTS[1])[0][: len(ids)]
    body = {"lora_name": "c", "lora_path": str(root / "b"), "weight_version": 7}
    r = httpx.post(url(server, "/v1/load_lora_adapter"), json=body, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    sampled = httpx.post(
        url(server, "/generate"),
        json={
            "input_ids": PROMPTS[1],
            "lora_path": "c",
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
        },
        trust_env=False,
        timeout=60,
    ).json()
    assert sampled["output_ids"] == greedy(merged["b"], PROMPTS[1])[0]
    assert sampled["meta_info"]["weight_version"] == "7"
    r = httpx.post(url(server, "/unload_lora_adapter"), json={"lora_name": "c"}, trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    gone = complete("c")
    assert gone.status_code == 404
    assert "`c` does not exist" in gone.text and "a, b" in gone.text
    unknown = httpx.post(
        url(server, "/generate"),
        json={"input_ids": PROMPTS[1], "lora_path": "nope", "sampling_params": {"max_new_tokens": 2}},
        trust_env=False,
        timeout=60,
    )
    assert unknown.status_code == 400 and "'nope' is not served" in unknown.text
    r = httpx.post(
        url(server, "/load_lora_adapter"),
        json={"lora_name": "d", "lora_path": str(model_dir)},
        trust_env=False,
        timeout=60,
    )
    assert r.status_code == 400 and "adapter_config.json" in r.json()["message"]
    r = httpx.post(url(server, "/unload_lora_adapter"), json={"lora_name": "d"}, trust_env=False, timeout=60)
    assert r.status_code == 404


def test_an_adapter_for_another_model_is_refused_with_the_layer_named(tmp_path, model_dir, char_tok):
    """An adapter trained on a wider model does not fit: refused before it is served, naming the layer."""
    wide = tiny_module(char_tok, seed=0, hidden_size=64, intermediate_size=128)
    module = with_lora(wide, LoraConfig(rank=2, alpha=4, target_modules="all-linear"), 1)
    module.save_pretrained(tmp_path / "wide")
    runner = ModelRunner(str(model_dir), device="cpu")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj does not fit the served model"):
        runner.load_adapter("wide", str(tmp_path / "wide"))
    assert runner.adapters.names() == []


@pytest.mark.parametrize(
    "option, message",
    [
        ("nameonly", "give NAME=DIR"),
        ("a=/no/such/folder", "not a LoRA adapter folder"),
        ("bad name=/tmp", "the name may use"),
    ],
)
def test_serve_refuses_a_bad_lora_option_before_loading(cli, model_dir, option, message):
    result = cli("serve", "--model", model_dir, "--lora", option)
    assert result.exit_code == 2
    assert message in result.output


# --------------------------------------------------------------------------- two runs, one server


def two_runs_recipe(model_dir: Path, address: str, name: str, seed: int) -> dict:
    """test_lora_sync's LoRA GRPO run on the base folder, its generation on a shared server by name."""
    actor_gen = {"type_": "sglang", "args": {"addresses": [address], "lora_name": name}}
    recipe = deep_merge(RECIPE, {"experiment": f"shared-{name}", "seed": seed})
    recipe["models"] = {
        "actor": {"path": str(model_dir), "backend": RECIPE["models"]["actor"]["backend"]},
        "actor_gen": {**RECIPE["models"]["actor_gen"], "backend": actor_gen},
    }
    return recipe


@pytest.mark.slow
def test_two_runs_train_their_own_adapters_on_one_server(ws, model_dir, tmp_path):
    """Two LoRA runs at once against one `areal serve` of their base, each syncing its adapter under its
    own name: both finish, the server serves both (and the base), each name answers as its run's last
    update merged into the base, the two differ, and each update was the adapter alone (no base written)."""
    import json
    import subprocess
    import sys

    import yaml
    from safetensors.torch import load_file

    from arealcli.runtime.models.lora import apply_adapter_update, lora_scale

    ws.text("train.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))
    args = SGLangBackendArgs(
        launch="embedded", num_servers=1, device="cpu", extra_args=["--num-threads", "1"]
    )
    servers = launcher.launch(args, str(model_dir), tmp_path / "logs", "shared")
    try:
        launcher.wait_ready(servers, 90)
        server = servers[0]
        procs = {}
        for name, seed in (("run-a", 1), ("run-b", 2)):
            recipe = ws.text(
                f"{name}.yaml", yaml.safe_dump(two_runs_recipe(model_dir, server.address, name, seed))
            )
            cmd = [sys.executable, "-m", "arealcli.main", "train", str(recipe), "-o", str(tmp_path / name)]
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for proc in procs.values():
            _, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-3000:]
        served = httpx.get(url(server, "/v1/models"), trust_env=False).json()["data"]
        assert sorted(m["id"] for m in served if m.get("parent")) == ["run-a", "run-b"]
        base = load_file(str(model_dir / "model.safetensors"))
        answers = {}
        for name in ("run-a", "run-b"):
            weights = tmp_path / name / "weights" / "actor" / "base"
            updates = sorted(weights.glob("a*"), key=lambda p: int(p.name[1:]))
            assert updates and not (weights / "model.safetensors").exists()  # adapters only
            scale = lora_scale(json.loads((updates[-1] / "adapter_config.json").read_text()))
            update = load_file(str(updates[-1] / "adapter_model.safetensors"))
            merged_state = apply_adapter_update(base, update, scale)
            module = tiny_module_like(model_dir, {**base, **merged_state})
            body = {"model": name, "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "logprobs": 0}
            got = httpx.post(url(server, "/v1/completions"), json=body, trust_env=False, timeout=60).json()
            ids = got["choices"][0]["token_ids"]
            want_ids, want_lps = greedy(module, PROMPTS[0])
            assert ids == want_ids[: len(ids)], name
            lps = got["choices"][0]["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(lps, want_lps[: len(ids)], strict=True)) < 1e-4
            answers[name] = lps
            metrics = [
                json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            ]
            sync_bytes = [m["weight_sync/actor_bytes"] for m in metrics if "weight_sync/actor_bytes" in m]
            full = (model_dir / "model.safetensors").stat().st_size
            assert sync_bytes and max(sync_bytes) < full / 2, (sync_bytes, full)
        assert answers["run-a"] != answers["run-b"]
        body = {"prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0, "logprobs": 0}
        got = httpx.post(url(server, "/v1/completions"), json=body, trust_env=False, timeout=60).json()
        base_lps = got["choices"][0]["logprobs"]["token_logprobs"]
        for name in ("run-a", "run-b"):  # trained adapters: not the base's answer
            n = min(len(base_lps), len(answers[name]))
            assert max(abs(x - y) for x, y in zip(base_lps[:n], answers[name][:n], strict=True)) > 1e-3, name
    finally:
        launcher.stop(servers)


def tiny_module_like(model_dir: Path, state: dict):
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir)
    module.load_state_dict(state, strict=False)
    return module.eval()

"""Placement (`cpus`, `devices` on every backend): what `areal check` refuses and prints, and the
placement applied for real — read back from the kernel (thread and process CPU affinity, a launched
server's environment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from arealcli.schema.components.backends import SGLangBackendArgs, VLLMBackendArgs, share
from tests.conftest import REPO, TINY_ARCH, sft_recipe

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two usable cores and Linux affinity")
ASYNC = REPO / "recipes" / "quickstart-async.yaml"
SERVER = REPO / "recipes" / "quickstart-server.yaml"


def task_cpus(pid: int | str = "self") -> dict[int, set[int]]:
    """Every thread of a process -> the cores it may run on, as /proc says (Cpus_allowed_list)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = parse_list(line.split(":", 1)[1].strip())
    return out


def parse_list(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores |= set(range(int(lo), int(hi or lo) + 1))
    return cores


# --------------------------------------------------------------------------- areal check


@needs_two_cores
@pytest.mark.parametrize("recipe", [ASYNC, SERVER])
def test_shipped_recipes_take_the_overrides_and_print_the_placement(cli, recipe):
    a, b = CORES[0], CORES[1]
    result = cli(
        "check", recipe, f"models.actor.backend.args.cpus=[{a}]", f"models.actor_gen.backend.args.cpus=[{b}]"
    )
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert f"actor (hf): the training process, cpus {a}, devices default; 1 torch thread(s)" in out
    if recipe == ASYNC:
        assert f"actor_gen (local): a generation thread of the training process, cpus {b}" in out
        assert "concurrent: actor_gen (rollout side) beside actor (training side)" in out
    else:
        assert (
            f"actor_gen (sglang): 1 launched server process(es): server 0: cpus {b}, devices default" in out
        )
        assert "synchronous: models compute one after another" in out


def test_plan_without_placement_says_any_core(cli):
    result = cli("check", ASYNC)
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert (
        "actor (hf): the training process, cpus any, devices default; torch threads: the cores it may use, "
        "fixed for the run, waiting passively (OMP_WAIT_POLICY)" in out
    )


@needs_two_cores
def test_concurrent_models_may_not_share_a_core(cli):
    result = cli(
        "check", ASYNC, f"models.actor.backend.args.cpus=[{CORES[0]},{CORES[1]}]",
        f"models.actor_gen.backend.args.cpus=[{CORES[1]}]",
    )  # fmt: skip
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert "<override models.actor_gen.backend.args.cpus=" in err
    assert f"core(s) {CORES[1]} are also placed for model 'actor'" in err
    assert "computes at the same time" in err


@needs_two_cores
def test_models_that_take_turns_may_share_a_core(cli):
    """Without `rollout`, generation and training never run at the same time."""
    result = cli(
        "check", SERVER, f"models.actor.backend.args.cpus=[{CORES[0]}]",
        f"models.actor_gen.backend.args.cpus=[{CORES[0]}]",
    )  # fmt: skip
    assert result.exit_code == 0, result.output


def test_unavailable_and_malformed_ids_are_refused_with_their_line(cli, ws):
    absent = max(CORES, default=0) + 1000
    result = cli(
        "check", ASYNC, f"models.actor.backend.args.cpus=[{absent}]", "models.actor_gen.backend.args.cpus=[]",
    )  # fmt: skip
    assert result.exit_code == 2
    err = " ".join(result.stderr.split())
    assert f"models.actor.backend.args.cpus.0: core {absent} is not available here" in err
    assert "models.actor_gen.backend.args.cpus: an empty list places nothing" in err

    recipe = yaml.safe_load(ASYNC.read_text())
    recipe["models"]["actor"]["backend"]["args"]["cpus"] = [0, 0]
    recipe["dataset"]["args"]["path"] = str(REPO / "data/max3/train.jsonl")
    recipe["eval_dataset"]["args"]["path"] = str(REPO / "data/max3/test.jsonl")
    path = ws.text("twice.yaml", yaml.safe_dump(recipe, sort_keys=False))
    result = cli("check", path)
    assert result.exit_code == 2
    line = next(x for x in result.stderr.splitlines() if "given twice" in x)
    assert (
        line.startswith(f"{path}:") and "models.actor.backend.args.cpus: 0 given twice (got [0, 0])" in line
    )


def test_devices_are_checked_against_the_visible_gpus(cli, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # one GPU visible: index 0 only
    result = cli("check", SERVER, "models.actor_gen.backend.args.devices=[1]")
    assert result.exit_code == 2
    assert "GPU 1 is not visible here: 1 GPU(s) visible (CUDA_VISIBLE_DEVICES=3)" in " ".join(
        result.stderr.split()
    )
    assert cli("check", SERVER, "models.actor_gen.backend.args.devices=[0]").exit_code == 0


def test_a_fleet_splits_its_devices_and_connected_servers_are_not_placed():
    with pytest.raises(ValueError, match=r"2 server\(s\) x 2 GPU\(s\) each need 4 device ids, 2 given"):
        SGLangBackendArgs(launch="sglang", num_servers=2, tp_size=2, devices=[0, 1])
    with pytest.raises(ValueError, match="servers given by `addresses` run where they were started"):
        VLLMBackendArgs(addresses=["127.0.0.1:8000"], cpus=[0])
    fleet = SGLangBackendArgs(launch="sglang", num_servers=2, tp_size=2, devices=[4, 5, 6, 7], cpus=[0, 1, 2])
    assert [fleet.server_devices(i) for i in range(2)] == [[4, 5], [6, 7]]
    assert [fleet.server_cpus(i) for i in range(2)] == [[0], [1, 2]]
    assert share([3], 1, 2) == [3]  # fewer ids than parts: shared


# --------------------------------------------------------------------------- applied: servers


@needs_two_cores
def test_launched_servers_run_on_their_share(tmp_path, monkeypatch):
    """Two servers of one fleet: each process's affinity and CUDA_VISIBLE_DEVICES, read back."""
    from arealcli.runtime.clients import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    args = SGLangBackendArgs(launch="embedded", num_servers=2, cpus=CORES[:2], devices=[1, 0])
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    servers = launcher.launch(args, "unused", tmp_path, "gen", command=lambda port, i: sleep)
    try:
        for i, s in enumerate(servers):
            assert os.sched_getaffinity(s.proc.pid) == {CORES[i]}
            assert all(c == {CORES[i]} for c in task_cpus(s.proc.pid).values())
            env = dict(
                x.split("=", 1)
                for x in Path(f"/proc/{s.proc.pid}/environ").read_text().split("\0")
                if "=" in x
            )
            assert env["CUDA_VISIBLE_DEVICES"] == ["7", "5"][i]  # index 1 of the visible GPUs, then 0
    finally:
        launcher.stop(servers)
    cmd = launcher.server_command(args, "M", 1234, 1)
    assert cmd[cmd.index("--num-threads") + 1] == "1"  # one torch thread per core of its share


def test_vllm_cpu_workers_bind_to_the_share():
    from arealcli.runtime.backends.vllm import server_env

    args = VLLMBackendArgs(launch=True, num_servers=2, tensor_parallel_size=2, cpus=[0, 1, 2, 3, 4, 5, 6, 7])
    assert server_env(args, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "4-5|6-7"  # one part per tensor-parallel rank


@needs_two_cores
def test_an_embedded_server_process_is_pinned(tmp_path, char_tok):
    """A real `areal serve` launched by the sglang backend: every thread of it on the given core."""
    from arealcli.runtime.backends.sglang import SGLangBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from tests.conftest import tiny_module

    core = CORES[-1]
    backend = SGLangBackend(SGLangBackendArgs(launch="embedded", cpus=[core], startup_timeout_s=120))
    model = backend.initialize(
        Model("gen", tiny_module(char_tok), char_tok), FinetuneSpec(1, 8, 8, 1, str(tmp_path))
    )
    try:
        (server,) = backend.servers
        threads = task_cpus(server.proc.pid)
        assert len(threads) > 1 and all(c == {core} for c in threads.values()), threads
    finally:
        backend.destroy(model)


# --------------------------------------------------------------------------- applied: in-process


@needs_two_cores
def test_local_generation_thread_and_its_torch_threads_are_pinned(char_tok):
    import threading

    from arealcli.runtime.backends.local import LocalBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import LocalBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters
    from tests.conftest import tiny_module

    core = CORES[-1]
    before = task_cpus()
    args = LocalBackendArgs(device="cpu", cpus=[core], num_threads=2)  # 2: its OpenMP team has a worker
    model = LocalBackend(args).initialize(
        Model("gen", tiny_module(char_tok), char_tok), FinetuneSpec(1, 8, 8, 1)
    )
    try:
        g = GenerationHyperparameters(max_new_tokens=4)
        model.module.submit_group([20, 21], g, {char_tok.eos_token_id}, 8).result(timeout=60)
        (loop,) = [t for t in threading.enumerate() if t.name == "batching-loop"]
        now = task_cpus()
        assert now[loop.native_id] == {core}
        started = {tid: cpus for tid, cpus in now.items() if tid not in before}
        assert sum(1 for c in started.values() if c == {core}) >= 2  # the loop and a torch worker it started
        assert now[threading.get_native_id()] == before[threading.get_native_id()]  # this thread: untouched
    finally:
        model.backend.destroy(model)


PROBE = """
import faulthandler, json, os, sys, threading
from pathlib import Path
faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
import torch
from arealcli.runtime.run import driver
from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import validate

seen = {}
real_train = Trainer.train
def train(self):  # the run's threads and servers, read back while they are all still there
    out = real_train(self)
    loops = [t for t in threading.enumerate() if t.name == "batching-loop"]
    seen["main"] = sorted(os.sched_getaffinity(0))
    seen["loop"] = sorted(os.sched_getaffinity(loops[0].native_id)) if loops else None
    seen["all"] = sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task"))
    seen["servers"] = [sorted(os.sched_getaffinity(s.proc.pid)) for s in getattr(self.models["actor_gen"].backend, "servers", [])]
    seen["torch_threads"] = torch.get_num_threads()
    return out
Trainer.train = train
path, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
driver.run(validate(load_recipe_source(path)), path, run_dir)
print("SEEN" + json.dumps(seen))
"""


def placed_run(ws, gen_backend: dict, rollout: bool) -> dict:
    """A short GRPO run in a fresh process (pinning would otherwise reach the test's own), trainer on the
    first core: what the kernel says of its threads and its generator's, read back in the middle of it."""
    recipe = sft_recipe()
    actor_args = {"device": "cpu", "optimizer": {"lr": 1e-2}, "cpus": [CORES[0]]}
    recipe["models"] = {
        "actor": {"config": TINY_ARCH, "backend": {"type_": "hf", "args": actor_args}},
        "actor_gen": {"init_from": "actor", "weights_from": "actor", "backend": gen_backend},
    }
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": 1,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
        "reward": {"reward_fn": "exact_match"},
    }
    if rollout:
        recipe["rollout"] = {"max_staleness": 1}
    recipe["trainer"] = {"max_steps": 3, "tensorboard": False}
    path = ws.text("placed.yaml", yaml.safe_dump(recipe, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-c", PROBE, str(path), str(ws.root / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.split("SEEN", 1)[1])
    assert seen["main"] == [CORES[0]] and seen["torch_threads"] == 1  # the trainer: its core, 1 thread
    return seen


@needs_two_cores
def test_a_placed_async_run_pins_trainer_and_local_generator(ws):
    seen = placed_run(ws, {"type_": "local", "args": {"device": "cpu", "cpus": [CORES[1]]}}, rollout=True)
    assert seen["loop"] == [CORES[1]]
    assert all(cpus in ([CORES[0]], [CORES[1]]) for cpus in seen["all"]), seen["all"]


@needs_two_cores
@pytest.mark.parametrize("placed", [True, False], ids=["placed", "unplaced"])
def test_a_placed_trainer_launches_its_server_on_the_server_cores(ws, placed):
    """A placed server runs on its own core; one without `cpus` on every core the trainer had before it
    was pinned (not on the trainer's core alone)."""
    args: dict = {"launch": "embedded", "num_servers": 1}
    if placed:
        args["cpus"] = [CORES[1]]
    seen = placed_run(ws, {"type_": "sglang", "args": args}, rollout=False)
    assert seen["servers"] == ([[CORES[1]]] if placed else [CORES])


def test_thread_policy_stays_within_the_placed_cores():
    from arealcli.runtime.run import threads

    if not threads.enabled():
        pytest.skip("needs Linux's /proc and no OMP_NUM_THREADS")
    before = torch.get_num_threads()
    try:
        policy = threads.ThreadPolicy(interval_s=0.0, cores=CORES[:1])
        assert policy.cpus == 1 and policy.update() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_resumed_run_may_move_to_other_cores():
    """Placement says where a run computes, not what it trains: `--resume` allows changing it."""
    from arealcli.schema.resume import differences

    saved = {"models": {"actor": {"backend": {"args": {"cpus": None, "devices": [0], "lr": 1.0}}}}}
    now = {"models": {"actor": {"backend": {"args": {"cpus": [0, 1], "devices": [1], "lr": 1.0}}}}}
    refused, allowed = differences(saved, now)
    assert refused == [] and len(allowed) == 4  # cpus: null -> absent, and its two items
    now["models"]["actor"]["backend"]["args"]["lr"] = 2.0
    refused, _ = differences(saved, now)
    assert refused == ["models.actor.backend.args.lr: 1.0 -> 2.0"]

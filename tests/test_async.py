"""Asynchronous RL: the rollout producer, the staleness bound, interruptible rollouts, resume, checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from arealcli.runtime.data.datasets import Batches, PromptAnswerDataset
from arealcli.runtime.data.tokenizer import char_tokenizer
from arealcli.runtime.registry import register_reward
from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.components.datasets import PromptAnswerArgs
from arealcli.schema.registry import REWARDS
from arealcli.schema.source import apply_overrides, load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate
from tests.conftest import TINY_ARCH, sft_recipe


def letter_fraction(prompts, responses, answers):
    """A reward an untrained tiny model gets sometimes (so advantages are not all zero)."""
    return [sum(c.islower() for c in r) / max(len(r), 1) for r in responses]


if "letter_fraction" not in REWARDS:
    register_reward("letter_fraction", letter_fraction)

LOCAL_GEN = {
    "init_from": "actor",
    "weights_from": "actor",
    "backend": {"type_": "local", "args": {"device": "cpu"}},
}


def grpo(
    ws,
    name: str = "grpo.yaml",
    gen: dict | None = None,
    staleness: int | None = None,
    reward_fn: str = "letter_fraction",
    **update,
) -> Path:
    """GRPO on the toy data: one SFT warm-up step, then RL; `actor_gen` generates when given."""
    recipe = sft_recipe()
    recipe["experiment"] = "tiny-async"
    recipe["models"] = {
        "actor": {
            "config": TINY_ARCH,
            "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 1e-2}}},
        }
    }
    if gen is not None:
        recipe["models"]["actor_gen"] = gen
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": 1,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}, "n_minibatches": 2},
        "reward": {"reward_fn": reward_fn},
    }
    recipe["eval_dataset"] = {"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 8}
    recipe["trainer"] = {
        "max_steps": 6,
        "tensorboard": False,
        "samples_every_n_steps": 1,
        "eval_every_n_steps": 3,
        "save_every_n_steps": 3,
    }
    if staleness is not None:
        recipe["rollout"] = {"max_staleness": staleness}
    for key, value in update.items():
        recipe[key] = value
    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def run(path: Path, run_dir: Path, *overrides: str, before_train=None) -> Trainer:
    trainer = Trainer(
        validate(apply_overrides(load_recipe_source(path), list(overrides))), path.parent, run_dir
    )
    try:
        trainer.setup()
        if before_train is not None:
            before_train(trainer)
        trainer.train()
    finally:
        trainer.close()
    return trainer


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def samples(run_dir: Path) -> dict[int, list[dict]]:
    return {
        int(p.stem.split("_")[1]): [json.loads(x) for x in p.read_text().splitlines()]
        for p in sorted((run_dir / "samples").glob("step_*.jsonl"))
    }


def final_weights(run_dir: Path, model: str = "actor") -> dict[str, torch.Tensor]:
    step = (run_dir / "checkpoints" / "LATEST").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / step / model / "model.safetensors"))


def comparable(rows: list[dict]) -> list[dict]:
    """Metrics without wall-clock times and the async bookkeeping."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "rollout/"))} for r in rows]


# --------------------------------------------------------------------------- K = 0 is synchronous RL


def test_k0_is_the_synchronous_algorithm_bit_for_bit(ws):
    runs = {
        "sync, actor generates": grpo(ws, "a.yaml"),
        "sync, local generator": grpo(ws, "b.yaml", gen=LOCAL_GEN),
        "async K=0, local generator": grpo(ws, "c.yaml", gen=LOCAL_GEN, staleness=0),
    }
    results = {}

    def one_interface_per_model(trainer) -> None:  # generate and train of one model: one PPO actor
        calls = {c.spec.name: c for c in trainer.calls}
        gen, train = calls["actor_gen"], calls["actor_train"]
        assert (gen.interface is train.interface) == (gen.model is train.model)

    for name, path in runs.items():
        torch.manual_seed(0)  # whatever ran before in this process
        run(path, ws.root / path.stem, before_train=one_interface_per_model)
        results[name] = (final_weights(ws.root / path.stem), comparable(metrics(ws.root / path.stem)))
    (w0, m0), *others = results.values()
    assert any("eval/reward/letter_fraction" in r for r in m0)  # held out: the training reward
    assert all(r["actor_train/adv_abs"] > 0 for r in m0 if "actor_train/reward" in r)  # RL really learns
    for name, (w, m) in list(results.items())[1:]:
        assert w.keys() == w0.keys()
        for k in w0:
            assert torch.equal(w[k], w0[k]), (name, k)
        assert m == m0, name


# --------------------------------------------------------------------------- the staleness bound


def lags(run_dir: Path) -> list[tuple[int, int, int]]:
    """(trainer version, first, last generating version) of every trained sample. Every step trains the
    actor (warm-up included), so the trainer's version at step N (1-based file name) is N - 1."""
    return [
        (n - 1, r["version"], r["version_last"])
        for n, rows in samples(run_dir).items()
        for r in rows
        if "version" in r
    ]


@pytest.mark.parametrize("staleness", [1, 2])
def test_fast_generator_runs_ahead_but_never_past_the_bound(ws, staleness):
    path = grpo(ws, gen=LOCAL_GEN, staleness=staleness, trainer={"max_steps": 8, "samples_every_n_steps": 1})
    run(path, ws.root / "run")
    seen = lags(ws.root / "run")
    assert seen and all(t - first <= staleness for t, first, _ in seen), seen
    assert max(t - first for t, first, _ in seen) == staleness  # it did run ahead, as far as allowed
    rl = [m for m in metrics(ws.root / "run") if "actor_train/version_lag_max" in m]
    assert all(m["actor_train/version_lag_max"] <= staleness for m in rl)
    assert all(m["rollout/started_behind"] <= staleness for m in rl)


def test_slow_generator_is_waited_for_and_interrupted_by_updates(ws):
    path = grpo(ws, gen=LOCAL_GEN, staleness=2, trainer={"max_steps": 7, "samples_every_n_steps": 1})

    def slow_down(trainer: Trainer) -> None:
        trainer.models["actor_gen"].module.scheduler.forward_sleep_s = 0.15  # before every decode step

    run(path, ws.root / "run", before_train=slow_down)
    seen = lags(ws.root / "run")
    assert seen and all(t - first <= 2 for t, first, _ in seen), seen
    rl = [m for m in metrics(ws.root / "run") if "actor_train/version_lag_max" in m]
    assert sum(m["rollout/wait_s"] for m in rl) > 0.5  # the trainer waited for the slow generator
    # weight updates arrived mid-generation: those samples were continued on the new weights
    assert any(last > first for _, first, last in seen), seen


def test_async_on_an_embedded_server(ws):
    """The generation model on an `areal serve` process (SGLang's protocol): updates abort the requests in
    flight, which the client continues on the new weights."""
    server = LOCAL_GEN | {"backend": {"type_": "sglang", "args": {"launch": "embedded", "num_servers": 1}}}
    path = grpo(ws, gen=server, staleness=1, trainer={"max_steps": 5, "samples_every_n_steps": 1})
    run(path, ws.root / "run")
    seen = lags(ws.root / "run")
    assert len(seen) == 4 * 8 * 2 and all(0 <= t - first <= 1 for t, first, _ in seen), seen
    rl = [m for m in metrics(ws.root / "run") if "actor_train/version_lag_max" in m]
    assert len(rl) == 4 and all(m["actor_train/version_lag_max"] <= 1 for m in rl)


def test_rollout_errors_reach_the_trainer(ws):
    path = grpo(ws, gen=LOCAL_GEN, staleness=1)

    def broken(trainer: Trainer) -> None:
        def fail(*args, **kwargs):
            raise RuntimeError("the generator broke")

        trainer.models["actor_gen"].module.generate = fail

    with pytest.raises(RuntimeError, match="the generator broke"):
        run(path, ws.root / "run", before_train=broken)


# --------------------------------------------------------------------------- resume after kill -9


def expected_prompts(ws, step: int, batch_size: int = 8, seed: int = 3) -> list[str]:
    ds = PromptAnswerDataset(PromptAnswerArgs(path=str(ws.root / "train.jsonl")), char_tokenizer())
    batches = Batches(ds, batch_size, True, seed)
    epoch, i = divmod(step, batches.steps_per_epoch)
    return list(batches.batch(epoch, i).meta["prompt"])


@pytest.mark.slow
def test_kill_9_during_async_run_then_resume(ws):
    total = 14
    path = grpo(
        ws,
        gen=LOCAL_GEN,
        staleness=2,
        reward_fn="exact_match",  # a built-in: the runs are subprocesses
        trainer={
            "max_steps": total,
            "samples_every_n_steps": 1,
            "save_every_n_steps": 3,
            "tensorboard": False,
        },
    )
    run_dir = ws.root / "run"
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill it somewhere after its second checkpoint
        latest = run_dir / "checkpoints" / "LATEST"
        if latest.exists() and latest.read_text().strip() >= "step_00000006":
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -9
    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    state = torch.load(run_dir / "checkpoints" / f"step_{total:08d}" / "trainer_state.pt", weights_only=False)
    assert state["global_step"] == total
    # every RL step trained exactly its own batch: no prompt trained twice or skipped
    by_step = samples(run_dir)
    assert sorted(by_step) == list(range(2, total + 1))  # step 1 was the SFT warm-up
    for n, rows in by_step.items():
        assert sorted(r["prompt"] for r in rows) == sorted(expected_prompts(ws, n - 1) * 2), n
    assert all(t - first <= 2 for t, first, _ in lags(run_dir))


@pytest.mark.parametrize(
    "sig, code, said", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")]
)
def test_ctrl_c_and_sigterm_stop_an_async_run_within_seconds(ws, sig, code, said):
    path = grpo(ws, gen=LOCAL_GEN, staleness=2, reward_fn="exact_match", trainer={"max_steps": 5000})
    run_dir = ws.root / "run"
    cmd = [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # well into RL: generation ahead, updates in flight
        m = run_dir / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(sig)
    t0 = time.time()
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code, out[-2000:]
    assert time.time() - t0 < 10
    assert f"{said}: no checkpoint was written yet" in out and "Traceback" not in out  # none saved


# --------------------------------------------------------------------------- checks


def check_problems(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(RecipeInvalid) as e:
        validate(apply_overrides(load_recipe_source(path), list(overrides)))
    return e.value.lines()


def test_checker_refuses_what_a_backend_cannot_do(ws):
    recipe = sft_recipe()
    recipe["models"]["default"]["backend"] = {"type_": "sglang", "args": {"addresses": ["127.0.0.1:1"]}}
    path = ws.text("r.yaml", yaml.safe_dump(recipe))
    (line,) = check_problems(path)
    assert f"{path}:" in line and "dataflow.calls.0.type" in line
    assert "backend 'sglang' cannot train (it can: generate, update_weights)" in line

    follower_on_fsdp = LOCAL_GEN | {"backend": {"type_": "fsdp"}}
    (line,) = check_problems(grpo(ws, gen=follower_on_fsdp))
    assert "models.actor_gen.backend.type_" in line and "cannot load new weights in place" in line


def test_checker_refuses_a_rollout_without_a_generation_model(ws):
    (line,) = check_problems(grpo(ws, staleness=2))  # the actor generates itself
    assert "rollout:" in line and "call 'actor_gen' runs on 'actor', which is trained itself" in line
    gen_on_hf = LOCAL_GEN | {"backend": {"type_": "hf", "args": {"device": "cpu"}}}
    (line,) = check_problems(grpo(ws, gen=gen_on_hf, staleness=2))
    assert "runs on the training backend 'hf'" in line
    sft = ws.recipe(rollout={"max_staleness": 1})
    (line,) = check_problems(sft)
    assert "a rollout section needs a generate call" in line
    (line,) = check_problems(grpo(ws, gen=LOCAL_GEN, staleness=2), "rollout.max_staleness=-1")
    assert "rollout.max_staleness" in line and "greater than or equal to 0" in line


def test_plan_shows_the_two_sides(ws, cli):
    result = cli("check", grpo(ws, gen=LOCAL_GEN, staleness=2))
    assert result.exit_code == 0, result.output
    out = " ".join(result.stdout.split())
    assert "rollout: asynchronous, max_staleness 2" in out
    assert (
        "rollout side, ahead on a background thread: actor_gen, reward; "
        "training side: sft_warmup, returns, actor_train" in out
    )


# --------------------------------------------------------------------------- the inference engine


def test_local_engine_groups_pause_resume_and_updates(char_tok, tmp_path):
    from arealcli.runtime.backends.local import LocalBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import LocalBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters
    from tests.conftest import tiny_module

    module = tiny_module(char_tok, seed=1)
    model = LocalBackend(LocalBackendArgs(device="cpu")).initialize(
        Model("gen", module, char_tok), FinetuneSpec(1, 8, 8, 10)
    )
    engine = model.module
    g = GenerationHyperparameters(greedy=True, max_new_tokens=6)
    eos = {char_tok.eos_token_id}
    try:
        assert not any(hasattr(engine, m) for m in ("train_batch", "forward", "eval_batch"))
        first = engine.submit_group([20, 21], g, eos, 3).result(timeout=30)
        assert len(first) == 3 and len({tuple(s.output_ids) for s in first}) == 1  # greedy: one answer
        assert all(s.versions() == (0, 0) for s in first)

        engine.pause()
        held = engine.submit_group([20, 21], g, eos, 1)
        time.sleep(0.3)
        assert not held.done()  # paused: new groups wait
        engine.resume()
        assert held.result(timeout=30)[0].output_ids == first[0].output_ids

        other = tiny_module(char_tok, seed=2)  # new weights, version 7
        other.save_pretrained(tmp_path / "w")
        model.backend.update_weights(model, str(tmp_path / "w"), 7)
        after = engine.submit_group([20, 21], g, eos, 1).result(timeout=30)[0]
        assert after.versions() == (7, 7) and engine.version == 7
        expected = tiny_module(char_tok, seed=2)
        from arealcli.runtime.generation import sampling as generation

        want = generation.generate(expected, [[20, 21]], g, eos, char_tok.pad_token_id, "cpu")
        assert after.output_ids == want.output_ids[0]
    finally:
        model.backend.destroy(model)

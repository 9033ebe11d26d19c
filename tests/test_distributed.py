"""Data parallelism: `areal train --nproc-per-node N` (real subprocesses), the fsdp backend, and the
hf backend over several processes — same losses and weights as one process at the same global batch,
exact resume, a failing worker stopping everything, and GRPO on FSDP."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from _dist_helpers import leave_world
from conftest import TINY_ARCH, Workspace, sft_recipe
from safetensors.torch import load_file
from test_cli_subprocess import areal_command

from arealcli.runtime.run import checkpoint as ckpt

TESTS_DIR = Path(__file__).resolve().parent
EVAL = {"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 5}
STEPS = 6


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["sft/loss"] for r in metrics(run) if "sft/loss" in r}


def weights(run: Path, step: int, model: str = "default") -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / ckpt.step_dir_name(step) / model / "model.safetensors"))


def areal(*args, cwd: Path, timeout: float = 180, extra_path: Path | None = None):
    """`areal ...` in its own session (so a test can check that no worker survives it)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [*areal_command(), *map(str, args)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        with_survivors = _group_alive(proc.pid)
        if with_survivors:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), with_survivors


def _group_alive(pgid: int) -> bool:
    for _ in range(50):  # the resource tracker may take a moment to notice its parent is gone
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True


def ok(result) -> subprocess.CompletedProcess:
    out, survivors = result
    assert out.returncode == 0, out.stdout + out.stderr
    assert not survivors
    return out


def backend(type_: str) -> dict:
    return {"models": {"default": {"backend": {"type_": type_}}}}


def sft(ws: Workspace, name: str, type_: str, **update) -> Path:
    trainer = {"max_steps": STEPS, "save_every_n_steps": 3, "eval_every_n_steps": 3, "tensorboard": False}
    return ws.recipe(name, eval_dataset=EVAL, trainer=trainer, **backend(type_), **update)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same 6-step SFT (global batch 8, shuffled, warmup + cosine, 2 micro-batches per rank):
    hf and fsdp in one process, fsdp and hf over 2 processes."""
    from typer.testing import CliRunner

    from arealcli.main import app

    ws = Workspace(tmp_path_factory.mktemp("dp"))
    out = {}
    for name, type_, nproc in [
        ("hf1", "hf", 1),
        ("fsdp1", "fsdp", 1),
        ("fsdp2", "fsdp", 2),
        ("hf2", "hf", 2),
    ]:
        recipe, run = sft(ws, f"{type_}.yaml", type_), ws.root / name
        if nproc == 1:  # in this process (fsdp makes its own world of one)
            result = CliRunner().invoke(app, ["train", str(recipe), "-o", str(run)])
            assert result.exit_code == 0, result.output
        else:
            ok(areal("train", recipe, "-o", run, "--nproc-per-node", nproc, cwd=ws.root))
        out[name] = run
    out["ws"] = ws.root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp1", "fsdp2", "hf2"])
def test_same_losses_and_weights_as_one_process(runs, name):
    ref, got = losses(runs["hf1"]), losses(runs[name])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in ref:
        assert got[step] == pytest.approx(ref[step], abs=1e-4), (step, ref, got)
    evals = [r["eval/nll"] for r in metrics(runs[name]) if "eval/nll" in r]
    ref_evals = [r["eval/nll"] for r in metrics(runs["hf1"]) if "eval/nll" in r]
    assert evals == pytest.approx(ref_evals, abs=1e-4) and len(evals) == 2
    a, b = weights(runs["hf1"], STEPS), weights(runs[name], STEPS)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-4, rtol=0, msg=k)
    assert any(not torch.equal(a[k], weights(runs["hf1"], 3)[k]) for k in a)  # it did train


@pytest.mark.slow
def test_rank_zero_writes_the_run_directory(runs):
    run = runs["fsdp2"]
    assert [r["step"] for r in metrics(run)] == list(range(1, STEPS + 1))  # one row per step, not two
    assert (run / "recipe.yaml").exists()
    step = run / "checkpoints" / ckpt.step_dir_name(STEPS)
    assert (run / "checkpoints" / "LATEST").read_text().strip() == step.name
    state = torch.load(step / "trainer_state.pt", weights_only=False)
    assert len(state["rng_per_rank"]) == 2
    assert not torch.equal(state["rng_per_rank"][0]["torch"], state["rng_per_rank"][1]["torch"])
    shards = sorted(p.name for p in (step / "default" / "optimizer").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one optimizer shard per rank

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(step / "default")  # a plain HF directory
    assert type(model).__name__ == "Qwen2ForCausalLM"


@pytest.mark.slow
def test_fsdp_resume_over_two_processes_is_exact(runs, tmp_path):
    """3 steps, then resume to 6 == 6 steps: from the 2-process run's own step-3 checkpoint."""
    run = tmp_path / "resumed"
    shutil.copytree(runs["fsdp2"], run)
    shutil.rmtree(run / "checkpoints" / ckpt.step_dir_name(STEPS))
    (run / "checkpoints" / "LATEST").unlink()
    recipe = runs["ws"] / "fsdp.yaml"
    out = ok(areal("train", recipe, "-o", run, "--resume", "--nproc-per-node", 2, cwd=runs["ws"]))
    assert "(step 3)" in out.stdout
    a, b = weights(runs["fsdp2"], STEPS), weights(run, STEPS)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(run) == losses(runs["fsdp2"])


FAULTY = '''
"""An SFT interface that fails on rank 1 at step 2 (a test plugin)."""
import torch.distributed as dist

from arealcli.runtime.interfaces.sft import SFTInterface
from arealcli.runtime.registry import register_interface


class FaultySFT(SFTInterface):
    """SFT that raises on rank 1 at step 2."""

    def train_step(self, model, data, mb_spec):
        if dist.is_initialized() and dist.get_rank() == 1 and model.version.global_step == 2:
            raise RuntimeError("injected fault on rank 1 at step 2")
        return super().train_step(model, data, mb_spec)


register_interface("faulty_sft", FaultySFT)
'''


@pytest.mark.slow
def test_a_failing_worker_stops_every_process_and_shows_its_error_once(ws):
    (ws.root / "faulty_plugin.py").write_text(textwrap.dedent(FAULTY))
    call = sft_recipe()["dataflow"]["calls"][0] | {"interface": {"type_": "faulty_sft"}}
    recipe = ws.recipe(
        imports=["faulty_plugin"],
        dataflow={"calls": [call]},
        trainer={"max_steps": 50},
        **backend("fsdp"),
    )
    t0 = time.perf_counter()
    out, survivors = areal(
        "train", recipe, "-o", ws.root / "run", "--nproc-per-node", 2, cwd=ws.root, extra_path=ws.root
    )
    elapsed = time.perf_counter() - t0
    assert out.returncode == 1  # a failure, not bad input; before a checkpoint: not retried
    assert not survivors, "a worker outlived the failed run"
    assert elapsed < 60
    text = out.stdout + out.stderr
    assert text.count("RuntimeError: injected fault on rank 1 at step 2") == 1, text
    assert "training failed in worker rank 1: RuntimeError" in out.stderr
    assert "Traceback" not in text  # the traceback goes to crash.log, which the message names
    crash = (ws.root / "run" / "logs" / "crash.log").read_text()
    assert "worker rank 1 failed" in crash and "faulty_plugin.py" in crash and "crash.log" in out.stderr
    assert "done" not in out.stdout
    assert [r["step"] for r in metrics(ws.root / "run")] == [1, 2]  # steps 1, 2 ran; the third failed


@pytest.mark.slow
def test_bad_data_in_workers_is_one_message_and_exit_2(ws):
    (ws.root / "bad.jsonl").write_text('{"prompt": "a:", "answer": null}\n' * 8)
    recipe = ws.recipe(dataset={"args": {"path": "bad.jsonl"}}, trainer={"max_steps": 1}, **backend("fsdp"))
    out, survivors = areal("train", recipe, "-o", ws.root / "run", "--nproc-per-node", 2, cwd=ws.root)
    assert out.returncode == 2, out.stderr
    assert not survivors
    assert "bad.jsonl:1: 'answer' must be a text" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_data_parallel_size_reads_typed_backend_args(ws):
    from arealcli.runtime.run.session import data_parallel_size
    from arealcli.schema.source import apply_overrides, load_recipe_source
    from arealcli.schema.validate import validate

    megatron = [
        "models.default.backend={type_: megatron, args: {tensor_parallel_size: 2, optimizer: {lr: 0.1}}}"
    ]
    recipe = validate(apply_overrides(load_recipe_source(ws.recipe()), megatron))
    assert data_parallel_size(recipe, 2) == 1  # tensor parallel over both ranks: one data-parallel rank
    assert data_parallel_size(recipe, 4) == 2


def test_batch_size_must_divide_over_the_processes(ws, cli):
    result = cli("train", ws.recipe(), "-o", ws.root / "run", "--nproc-per-node", "3")
    assert result.exit_code == 2
    assert "batch_size (8) must be divisible by the number of data-parallel ranks (3)" in result.stderr
    assert not (ws.root / "run").exists()  # refused before anything was written or launched


REWARD = '''
"""A reward a random tiny policy gets sometimes: the fraction of vowels in the response."""
from arealcli.runtime.registry import register_reward


def vowels(prompts, responses, answers):
    return [sum(c in "aeiouAEIOU" for c in r) / max(len(r), 1) for r in responses]


register_reward("vowels", vowels)
'''


# bf16 compute with fp32 master weights and reduction, activation recomputation.
ACTOR_ARGS = {
    "device": "cpu",
    "optimizer": {"lr": 1e-2},
    "mixed_precision_param": "bfloat16",
    "gradient_checkpointing": True,
}


@pytest.mark.slow
def test_grpo_on_fsdp_over_two_processes(ws):
    (ws.root / "vowel_reward.py").write_text(textwrap.dedent(REWARD))
    fsdp = {"type_": "fsdp", "args": {"device": "cpu"}}
    recipe = {
        "experiment": "tiny-grpo",
        "seed": 5,
        "imports": ["vowel_reward"],
        "tokenizer": {"kind": "char"},
        "models": {
            "actor": {"config": TINY_ARCH, "backend": fsdp | {"args": ACTOR_ARGS}},
            "ref": {"init_from": "actor", "backend": fsdp},
        },
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
        "eval_dataset": EVAL,
        "dataflow": {
            "preset": "grpo",
            "sft_warmup_steps": 1,
            "actor": {"generation": {"n": 4, "max_new_tokens": 6}, "adv_norm": "group", "n_minibatches": 2},
            "reward": {"reward_fn": "vowels"},
            "mb_spec": {"max_tokens_per_mb": 40},  # uneven micro-batch counts over the ranks
        },
        "trainer": {
            "max_steps": 4,
            "eval_every_n_steps": 4,
            "samples_every_n_steps": 4,
            "tensorboard": False,
        },
    }
    path = ws.text("grpo.yaml", yaml.safe_dump(recipe))
    run = ws.root / "run"
    out = ok(areal("train", path, "-o", run, "--nproc-per-node", 2, cwd=ws.root, extra_path=ws.root))
    assert "done" in out.stdout and "4 steps on 2 processes" in out.stdout
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    rl = rows[1:]
    assert all(r["actor_train/n_updates"] == 2 for r in rl)
    assert any(r["actor_train/reward"] > 0 for r in rl)
    assert any(r["actor_train/grad_norm"] > 0 for r in rl)  # advantages were not all zero
    assert all(abs(r["actor_train/kl_ref"]) < 10 for r in rl)
    assert "eval/reward/vowels" in rows[-1]  # held out: the training reward, by name
    samples = (run / "samples" / "step_00000004.jsonl").read_text().splitlines()
    assert len(samples) == 16  # 4 prompts x 4 samples, gathered from both ranks
    assert weights(run, 4, "actor").keys()


# --------------------------------------------------------------------------- FSDP engine, uneven ranks


def _uneven_worker(rank: int, port: int, out: str) -> None:
    """Rank 0 has 4 samples in 4 micro-batches, rank 1 none: train, forward and generate must not
    deadlock (equal collective counts), and give what one process gives on the 4 samples."""
    import torch.distributed as dist
    from conftest import tiny_module
    from test_engine import prompts_batch, sft_batch

    from arealcli.runtime.backends.fsdp import FSDPBackend
    from arealcli.runtime.data.tokenizer import char_tokenizer
    from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import FSDPBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok = char_tokenizer()
    opt = OptimizerConfig(lr=1e-2, gradient_clipping=None)
    model = FSDPBackend(FSDPBackendArgs(device="cpu", optimizer=opt)).initialize(
        Model("m", tiny_module(tok, seed=0), tok), FinetuneSpec(1, 8, 8, 10)
    )
    engine = model.module
    g = GenerationHyperparameters(greedy=True, max_new_tokens=8 if rank == 0 else 2)  # unequal steps
    gen = engine.generate(prompts_batch([[5, 6, 7], [8, 9]]), MicroBatchSpec(), tok, g)
    batch = sft_batch(4, seed=1, vocab=len(tok))
    local = batch if rank == 0 else batch.subset([])
    stats = engine.train_batch(local, MicroBatchSpec(n_mbs=4), sft_loss, num_answer_tokens, version_steps=0)
    lp = engine.forward(batch.subset([0, 1, 2][: 3 - 2 * rank]), MicroBatchSpec(n_mbs=3 - 2 * rank))
    engine.save_to_hf(tok, out)
    if rank == 0:
        torch.save({"stats": stats, "logits": lp, "gen": gen.output_ids}, Path(out) / "rank0.pt")
    leave_world()


@pytest.mark.slow
def test_fsdp_engine_with_uneven_ranks_matches_one_process(tmp_path, char_tok):
    from conftest import tiny_module
    from test_engine import make_engine, prompts_batch, sft_batch

    from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig

    port = _free_port()
    code = (
        "import sys, test_distributed as t; t._uneven_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(rank), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    engine = make_engine(
        char_tok, tiny_module(char_tok, seed=0), OptimizerConfig(lr=1e-2, gradient_clipping=None)
    )
    batch = sft_batch(4, seed=1, vocab=len(char_tok))
    g = GenerationHyperparameters(greedy=True, max_new_tokens=8)
    gen = engine.generate(prompts_batch([[5, 6, 7], [8, 9]]), MicroBatchSpec(), char_tok, g)
    assert got["gen"] == gen.output_ids  # generated with the gathered (initial) weights
    from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss

    stats = engine.train_batch(batch, MicroBatchSpec(n_mbs=4), sft_loss, num_answer_tokens, version_steps=0)
    assert got["stats"]["loss"] == pytest.approx(stats["loss"], abs=1e-5)
    assert got["stats"]["loss_weight"] == stats["loss_weight"]  # global, also seen by the empty rank
    assert got["stats"]["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    logits = engine.forward(batch.subset([0, 1, 2]), MicroBatchSpec(n_mbs=3))
    torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-5)
    saved = load_file(str(tmp_path / "model.safetensors"))
    for k, v in engine.module.state_dict().items():
        if k in saved:
            torch.testing.assert_close(saved[k], v, atol=1e-6, rtol=0, msg=k)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_dpo_over_two_fsdp_processes_matches_one_process(ws):
    """The same 4 DPO steps (8 pairs a step, shuffled, 2 micro-batches per rank) on hf in this process and
    on fsdp over 2 processes (4 pairs each, the reference sharded too): the same losses, held-out
    preference metrics and weights."""
    eval_pairs = {"type_": "preference", "args": {"path": "pairs_test.jsonl"}, "batch_size": 11}
    trainer = {"max_steps": 4, "eval_every_n_steps": 4, "tensorboard": False}
    one = ws.dpo("hf.yaml", eval_dataset=eval_pairs, trainer=trainer)
    fsdp = {
        "actor": {"backend": {"type_": "fsdp"}},
        "ref": {"backend": {"type_": "fsdp", "args": {"device": "cpu"}}},
    }
    two = ws.dpo("fsdp.yaml", models=fsdp, eval_dataset=eval_pairs, trainer=trainer)
    from typer.testing import CliRunner

    from arealcli.main import app

    result = CliRunner().invoke(app, ["train", str(one), "-o", str(ws.root / "one")])
    assert result.exit_code == 0, result.output
    ok(areal("train", two, "-o", ws.root / "two", "--nproc-per-node", 2, cwd=ws.root))
    a, b = metrics(ws.root / "one"), metrics(ws.root / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        for key in ("dpo/loss", "dpo/rewards/margins", "dpo/logps/chosen", "dpo/rewards/accuracies"):
            assert rb[key] == pytest.approx(ra[key], abs=1e-4), (ra["step"], key)
    for key in ("eval/loss", "eval/rewards/accuracies", "eval/rewards/margins"):
        assert b[-1][key] == pytest.approx(a[-1][key], abs=1e-4), key
    wa, wb = weights(ws.root / "one", 4, "actor"), weights(ws.root / "two", 4, "actor")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=1e-4, rtol=0, msg=k)
    assert a[0]["dpo/loss"] != a[-1]["dpo/loss"]  # it trained

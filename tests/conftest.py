"""Shared fixtures: a char tokenizer, tiny models built from a config, toy JSONL data, small recipes.

Everything here is CPU-only and small (hidden 32, 2 layers) so the suite runs in seconds.
"""

from __future__ import annotations

import copy
import json
import string
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# A Qwen2-shaped model small enough to train for dozens of steps in a second or two.
TINY_ARCH: dict[str, Any] = {
    "family": "qwen2",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


def toy_rows() -> list[dict[str, str]]:
    """`c:` -> the next four letters after c (a pattern a tiny model learns in a few dozen steps)."""
    rows = []
    for alphabet in (string.ascii_lowercase, string.ascii_uppercase):
        for i in range(len(alphabet) - 4):
            rows.append({"prompt": f"{alphabet[i]}:", "answer": alphabet[i + 1 : i + 5]})
    return rows  # 44 rows


def toy_pairs() -> list[dict[str, str]]:
    """Preference pairs of `toy_rows`: the next four letters chosen, the same letters backwards rejected."""
    return [{"prompt": r["prompt"], "chosen": r["answer"], "rejected": r["answer"][::-1]} for r in toy_rows()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def deep_merge(base: dict, update: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def sft_recipe(**update: Any) -> dict[str, Any]:
    """A small SFT recipe (as data) over `train.jsonl` / `test.jsonl` next to the recipe file."""
    base = {
        "experiment": "tiny-sft",
        "seed": 3,
        "tokenizer": {"kind": "char"},
        "models": {
            "default": {
                "config": TINY_ARCH,
                "backend": {
                    "type_": "hf",
                    "args": {
                        "device": "cpu",
                        "optimizer": {
                            "lr": 1e-2,
                            "lr_scheduler": "cosine",
                            "warmup_steps_proportion": 0.2,
                            "min_lr_ratio": 0.1,
                        },
                    },
                },
            }
        },
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 8},
        "dataflow": {
            "calls": [
                {
                    "name": "sft",
                    "model": "default",
                    "interface": {"type_": "sft"},
                    "type": "train_step",
                    "inputs": ["packed_input_ids", "prompt_mask"],
                    "mb_spec": {"n_mbs": 2},
                }
            ]
        },
        "trainer": {"total_train_epochs": 1, "tensorboard": False},
    }
    return deep_merge(base, update)


REF_CALL = {
    "name": "ref_logprobs",
    "model": "ref",
    "interface": {"type_": "dpo"},
    "type": "inference",
    "inputs": ["packed_input_ids"],
    "outputs": ["packed_ref_logprobs"],
    "output_key_remap": {"packed_logprobs": "packed_ref_logprobs"},
}
DPO_INPUTS = ["packed_input_ids", "prompt_mask", "loss_mask", "pair", "packed_ref_logprobs"]


def dpo_recipe(
    dpo_args: dict[str, Any] | None = None, reference: bool = True, **update: Any
) -> dict[str, Any]:
    """A small DPO recipe (as data) over `pairs.jsonl` / `pairs_test.jsonl`: an actor, a frozen copy of it
    as the reference, the reference's log-probs call, then the dpo call (2 micro-batches). Without
    `reference` (a reference-free loss): the actor and the dpo call only."""
    train = {
        "name": "dpo",
        "model": "actor",
        "interface": {"type_": "dpo", "args": dpo_args or {"beta": 0.5}},
        "type": "train_step",
        "inputs": DPO_INPUTS if reference else [k for k in DPO_INPUTS if k != "packed_ref_logprobs"],
        "mb_spec": {"n_mbs": 2},
    }
    base = sft_recipe(
        experiment="tiny-dpo",
        dataset={"type_": "preference", "args": {"path": "pairs.jsonl"}, "batch_size": 8},
        dataflow={"calls": [REF_CALL, train] if reference else [train]},
    )
    base["models"] = {
        "actor": base["models"]["default"],
        **({"ref": {"init_from": "actor"}} if reference else {}),
    }
    return deep_merge(base, update)


class Workspace:
    """A temporary directory holding toy data and the recipes a test writes."""

    def __init__(self, root: Path):
        self.root = root
        write_jsonl(root / "train.jsonl", toy_rows())
        write_jsonl(root / "test.jsonl", toy_rows()[::4])

    def recipe(self, name: str = "recipe.yaml", **update: Any) -> Path:
        path = self.root / name
        path.write_text(yaml.safe_dump(sft_recipe(**update), sort_keys=False))
        return path

    def dpo(
        self,
        name: str = "dpo.yaml",
        dpo_args: dict[str, Any] | None = None,
        reference: bool = True,
        **update: Any,
    ) -> Path:
        """A DPO recipe over toy pairs (`dpo_recipe`), the pairs written beside it."""
        write_jsonl(self.root / "pairs.jsonl", toy_pairs())
        write_jsonl(self.root / "pairs_test.jsonl", toy_pairs()[::4])
        path = self.root / name
        path.write_text(yaml.safe_dump(dpo_recipe(dpo_args, reference, **update), sort_keys=False))
        return path

    def text(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text)
        return path


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path)


@pytest.fixture(scope="session")
def char_tok():
    from arealcli.runtime.data.tokenizer import char_tokenizer

    return char_tokenizer()


def tiny_module(tokenizer, seed: int = 0, **arch: Any):
    """A fp32 Qwen2 causal LM with random weights (from the same config path the recipes use)."""
    import torch
    from transformers import AutoModelForCausalLM

    from arealcli.runtime.models.model import hf_config_from_arch
    from arealcli.schema.recipe import ModelArchConfig

    torch.manual_seed(seed)
    config = hf_config_from_arch(ModelArchConfig(**{**TINY_ARCH, **arch}), tokenizer)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def cli():
    """Invoke the `areal` app in-process; returns click's Result (stdout and stderr kept apart)."""
    from typer.testing import CliRunner

    from arealcli.main import app

    runner = CliRunner()

    def invoke(*args: str | Path):
        return runner.invoke(app, [str(a) for a in args])

    return invoke


def train_until(step, done, min_steps: int, max_steps: int) -> dict:
    """Call `step()` (one optimizer step, returning its stats) `min_steps` times, then on until
    `done(stats)`, at most `max_steps` in all. How far a fixed number of steps gets depends on the CPU's
    kernels (torch picks them by CPU); a criterion with a bound does not."""
    stats: dict = {}
    for k in range(max_steps):
        stats = step()
        if k + 1 >= min_steps and done(stats):
            return stats
    raise AssertionError(f"not reached in {max_steps} steps: {stats}")


def load_example(name: str):
    """A module of examples/ (plugins to start from), imported as a user's recipe would."""
    import importlib
    import sys

    sys.path.insert(0, str(REPO / "examples"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "examples"))


class Crash(Exception):
    """A crash injected into a run (a kill between steps, without the process dying)."""


def train_until_crash(recipe: Path, run_dir: Path, step: int) -> None:
    """Train `recipe` into `run_dir` and crash during step `step` (its checkpoints so far are kept)."""
    from arealcli.runtime.run.trainer import Trainer
    from arealcli.schema.source import load_recipe_source
    from arealcli.schema.validate import validate

    def crash(at: int, total, stats, log_now) -> None:
        if at == step:
            raise Crash

    trainer = Trainer(validate(load_recipe_source(recipe)), recipe.parent, run_dir)
    trainer.progress = crash
    trainer.setup()
    try:
        with pytest.raises(Crash):
            trainer.train()
    finally:
        trainer.close()


def with_returns(data, **args: Any):
    """`data` with the `returns` call's keys (advantages, returns, seq_scores, kl_coef), as the grpo and ppo
    presets give them to the actor's and critic's train_step; `args` are ReturnsArgs."""
    from arealcli.runtime.interfaces.returns import ReturnsInterface
    from arealcli.schema.components.engine import MicroBatchSpec
    from arealcli.schema.components.interfaces import ReturnsArgs

    data.update_(ReturnsInterface(ReturnsArgs(**args)).inference(None, data, MicroBatchSpec()))
    return data


# the served-model fixtures of the server and fault tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, char_tok) -> Path:
    d = tmp_path_factory.mktemp("served-model")
    tiny_module(char_tok, seed=0).save_pretrained(d)
    char_tok.save_pretrained(d)
    return d


@pytest.fixture
def loop():
    """A client event loop; clients made with `loop.client(...)` are closed at the end."""
    from arealcli.runtime.clients.client import EventLoopThread, GenerationClient

    loop = EventLoopThread()
    clients: list = []

    def client(addresses, **kwargs) -> GenerationClient:
        clients.append(GenerationClient(addresses, **kwargs))
        return clients[-1]

    loop.client = client
    yield loop
    for c in clients:
        loop.run(c.aclose(), timeout=5)
    loop.close()


def run_in_thread(fn):
    """Start fn() in a thread; returns (thread, box) where box gets 'out' or 'err'."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, box


def train_asynchronously(recipe: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    """Train `recipe` with generation on a `local` generator up to 2 policy versions ahead (decoupled PPO,
    log-linear proximal log-probs) in a process of its own; its metrics.jsonl rows."""
    import subprocess
    import sys

    recipe["models"]["actor_gen"] = {
        "init_from": "actor",
        "weights_from": "actor",
        "backend": {"type_": "local", "args": {"device": "cpu"}},
    }
    recipe["rollout"] = {"max_staleness": 2}
    recipe["dataflow"]["actor"].update(
        use_decoupled_loss=True, prox_logp_method="loglinear", behav_imp_weight_cap=5.0
    )
    path = tmp_path / "async.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "arealcli.main", "train", str(path), "-o", str(run)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

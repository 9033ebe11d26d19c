"""`weights_from` in memory: the `local` generator copies the trained model's tensors (no files), and a
LoRA model sends its adapters alone after the first update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from arealcli.runtime.backends.local import LocalBackend
from arealcli.runtime.models.weights import WeightsInMemory
from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.source import load_recipe_source
from arealcli.schema.validate import validate
from tests.conftest import TINY_ARCH, sft_recipe


def grpo_with_local_gen(ws, lora: dict | None = None) -> Path:
    recipe = sft_recipe()
    actor_args: dict = {"device": "cpu", "optimizer": {"lr": 1e-2}}
    if lora is not None:
        actor_args["lora"] = lora
    recipe["models"] = {
        "actor": {"config": TINY_ARCH, "backend": {"type_": "hf", "args": actor_args}},
        "actor_gen": {
            "init_from": "actor",
            "weights_from": "actor",
            "backend": {"type_": "local", "args": {"device": "cpu"}},
        },
    }
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": 1,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
        "reward": {"reward_fn": "exact_match"},
    }
    recipe["trainer"] = {"max_steps": 3, "tensorboard": False}
    return ws.text("grpo.yaml", yaml.safe_dump(recipe, sort_keys=False))


@pytest.fixture
def updates(monkeypatch) -> list[WeightsInMemory]:
    """Every in-memory update a local generator receives."""
    seen: list[WeightsInMemory] = []
    real = LocalBackend.update_weights_in_memory

    def spy(self, model, weights, version):
        seen.append(weights)
        return real(self, model, weights, version)

    monkeypatch.setattr(LocalBackend, "update_weights_in_memory", spy)
    return seen


def train(path: Path, run_dir: Path, check) -> None:
    trainer = Trainer(validate(load_recipe_source(path)), path.parent, run_dir)
    try:
        trainer.setup()
        trainer.train()
        check(trainer)
    finally:
        trainer.close()


def test_local_generator_gets_the_weights_in_memory(ws, updates):
    run_dir = ws.root / "run"

    def check(trainer):
        actor, gen = trainer.models["actor"], trainer.models["actor_gen"]
        served = dict(gen.module.scheduler.runner.module.named_parameters())
        for name, p in actor.module.module.named_parameters():
            torch.testing.assert_close(served[name], p, rtol=0, atol=0, msg=name)
            assert served[name].data_ptr() != p.data_ptr()  # a copy, not the trained tensor itself
        assert gen.version.global_step == gen.module.version == 3

    train(grpo_with_local_gen(ws), run_dir, check)
    assert len(updates) == 4  # at setup, then after each of the 3 steps
    assert all(u.full is not None and u.adapters is None for u in updates)
    assert not (run_dir / "weights").exists()  # nothing went through disk


def test_lora_sends_the_adapters_alone_after_the_first_update(ws, updates):
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}

    def check(trainer):
        actor, gen = trainer.models["actor"], trainer.models["actor_gen"]
        ids = torch.tensor([[5, 9, 12, 7, 3]])
        with torch.no_grad():
            want = actor.module.module(input_ids=ids).logits
            got = gen.module.scheduler.runner.module(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # base + scaled B A, as trained

    train(grpo_with_local_gen(ws, lora), ws.root / "run", check)
    first, *rest = updates
    assert first.full is not None and first.adapters and first.lora_config is not None
    assert len(rest) == 3 and all(u.full is None and u.adapters for u in rest)
    assert {k.rsplit(".", 3)[-3] for k in rest[0].adapters or {}} == {"lora_A", "lora_B"}
    assert rest[0].nbytes() < first.nbytes() / 10  # adapters: a small share of the weights
    assert not (ws.root / "run" / "weights").exists()


def test_weights_that_do_not_fit_leave_the_generator_untouched(char_tok):
    from arealcli.runtime.backends.local import LocalRunner, copy_in
    from tests.conftest import tiny_module

    runner = LocalRunner.in_memory(tiny_module(char_tok, seed=1), char_tok, "gen", "cpu", "float32")
    before = {k: v.clone() for k, v in runner.module.state_dict().items()}
    other = dict(tiny_module(char_tok, seed=2).state_dict())
    bad = {**other, "model.norm.weight": torch.ones(7)}
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(7,\)"):
        copy_in(runner, WeightsInMemory(full=bad))
    partial = {k: v for k, v in other.items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing"):
        copy_in(runner, WeightsInMemory(full=partial))
    for k, v in runner.module.state_dict().items():
        assert torch.equal(v, before[k]), k
    copy_in(runner, WeightsInMemory(full=other))
    for k, v in runner.module.state_dict().items():
        assert torch.equal(v, other[k]), k

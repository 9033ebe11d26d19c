"""LoRA on the hf backend: only adapters train (and carry optimizer state), checkpoints hold the adapters
and a merged export equal to base + scaled B A, resume is exact, the reference model can be the actor's
base with adapters off, and GRPO on adapters moves the policy the right way."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from arealcli.runtime.run.trainer import Trainer
from arealcli.schema.source import apply_overrides, load_recipe_source
from arealcli.schema.validate import RecipeInvalid, validate
from tests.conftest import TINY_ARCH, sft_recipe, train_until_crash

LORA = {"rank": 4, "alpha": 8.0}


def lora_recipe(ws, name: str = "lora.yaml", **update):
    recipe = sft_recipe(trainer={"max_steps": 6, "save_every_n_steps": 3, "tensorboard": False})
    recipe["models"]["default"]["backend"]["args"]["lora"] = LORA
    recipe["models"]["default"]["backend"]["args"]["optimizer"] = {"lr": 2e-2}
    recipe.update(update)
    import yaml

    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def run(path, run_dir, resume=False, overrides=()):
    trainer = Trainer(
        validate(apply_overrides(load_recipe_source(path), list(overrides))),
        path.parent,
        run_dir,
        resume=resume,
    )
    trainer.setup()
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def test_only_adapters_train_and_the_export_is_the_merge(ws):
    path = lora_recipe(ws)
    trainer = Trainer(validate(load_recipe_source(path)), path.parent, ws.root / "run")
    trainer.setup()
    engine = trainer.models["default"].module
    params = dict(engine.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    try:
        trainer.train()
    finally:
        trainer.close()
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == trainable  # every adapter moved, nothing else did
    state = engine.optimizer.state_dict()["state"]
    assert len(state) == len(trainable)  # optimizer state for the adapters only

    ckpt = ws.root / "run" / "checkpoints" / "step_00000006" / "default"
    merged = load_file(str(ckpt / "model.safetensors"))
    adapters = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert adapters and all("lora_" in k for k in adapters)
    scale = LORA["alpha"] / LORA["rank"]
    base = engine.module.get_base_model()
    for name, module in base.named_modules():
        if hasattr(module, "lora_A"):
            want = (
                module.base_layer.weight
                + scale * module.lora_B["default"].weight @ module.lora_A["default"].weight
            )
            torch.testing.assert_close(merged[f"{name}.weight"], want.detach(), rtol=1e-6, atol=1e-7)
    # and it loads as a plain model giving the adapted model's outputs
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.tensor([[3, 17, 22, 9, 40]])
    with torch.no_grad():
        torch.testing.assert_close(
            plain(input_ids=ids).logits, engine.module(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    losses = [json.loads(x)["sft/loss"] for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("backend", ["hf", "fsdp"])
def test_lora_resume_is_exact(ws, backend):
    """Crash at step 4, resume, run to 6 == 6 uninterrupted steps: merged export, adapters, losses."""
    path = lora_recipe(ws) if backend == "hf" else fsdp_lora_recipe(ws)
    run(path, ws.root / "full")

    train_until_crash(path, ws.root / "crashed", step=4)
    run(path, ws.root / "crashed", resume=True)
    for a, b in zip(exported(ws.root / "full"), exported(ws.root / "crashed"), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sft_losses(ws.root / "crashed") == sft_losses(ws.root / "full")


def grpo_lora(ws, **actor_args):
    recipe = sft_recipe(trainer={"max_steps": 4, "tensorboard": False})
    recipe["experiment"] = "lora-grpo"
    recipe["models"] = {
        "actor": {
            "config": TINY_ARCH,
            "backend": {"type_": "hf", "args": {"device": "cpu", "optimizer": {"lr": 2e-2}, "lora": LORA}},
        },
        "ref": {"base_of": "actor"},
    }
    recipe["dataflow"] = {
        "preset": "grpo",
        "sft_warmup_steps": 1,
        "actor": {"generation": {"n": 4, "max_new_tokens": 4}, **actor_args},
        "shaping": {"kl_ctl": 0.1},
        "reward": {"reward_fn": "exact_match"},
    }
    import yaml

    return ws.text("grpo-lora.yaml", yaml.safe_dump(recipe, sort_keys=False))


def test_reference_is_the_actors_base_with_adapters_off(ws):
    path = grpo_lora(ws)
    trainer = run(path, ws.root / "run")
    actor, ref = trainer.models["actor"], trainer.models["ref"]
    assert ref.module.engine is actor.module  # one copy of the weights
    from arealcli.runtime.data.sample import SequenceSample
    from arealcli.schema.components.engine import MicroBatchSpec

    batch = SequenceSample.from_lists([0], {"packed_input_ids": [torch.tensor([3, 17, 22, 9, 40])]})
    with_adapters = actor.module.forward(batch, MicroBatchSpec())
    base_only = ref.module.forward(batch, MicroBatchSpec())
    assert not torch.allclose(with_adapters, base_only)  # the adapters trained
    # the base: a plain model with the base_layer weights gives the reference's outputs
    from transformers import AutoModelForCausalLM

    base = actor.module.module.get_base_model()
    plain = AutoModelForCausalLM.from_config(base.config)
    state = {k.replace(".base_layer", ""): v for k, v in base.state_dict().items() if "lora_" not in k}
    plain.load_state_dict(state, strict=False)
    plain.tie_weights()
    with torch.no_grad():
        want = plain.eval()(input_ids=batch.data["packed_input_ids"][None]).logits[0]
    torch.testing.assert_close(base_only, want, rtol=1e-5, atol=1e-5)
    rows = [json.loads(x) for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["returns/kl_ref"] for r in rows if "returns/kl_ref" in r]
    assert len(kls) == 3 and any(abs(k) > 1e-4 for k in kls)  # the actor moved away from its base


def test_checks_for_lora(ws, cli):
    recipe = sft_recipe()
    recipe["models"]["default"]["backend"] = {
        "type_": "megatron",
        "args": {"lora": LORA, "optimizer": {"lr": 0.1}},
    }
    import yaml

    result = cli("check", ws.text("m.yaml", yaml.safe_dump(recipe)))
    assert result.exit_code == 2 and "lora: unknown key" in result.stderr  # megatron has no LoRA
    recipe["models"]["default"]["backend"] = {"type_": "fsdp", "args": {"lora": LORA}}
    result = cli("check", ws.text("f.yaml", yaml.safe_dump(recipe)))
    assert result.exit_code == 2 and "add `optimizer: {lr: ...}`" in result.stderr
    path = grpo_lora(ws)
    with pytest.raises(RecipeInvalid, match="has no LoRA adapters"):
        validate(apply_overrides(load_recipe_source(path), ["models.actor.backend.args.lora=null"]))
    bad_target = cli(
        "train",
        lora_recipe(ws),
        "-o",
        ws.root / "t",
        "models.default.backend.args.lora.target_modules=[nope]",
    )
    assert bad_target.exit_code == 2
    assert "match no layer of the model" in bad_target.stderr and "q_proj" in bad_target.stderr


def test_grpo_on_adapters_raises_the_logprob_of_rewarded_samples(char_tok):
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
    from arealcli.runtime.interfaces.rl_common import response_view
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import HFBackendArgs
    from arealcli.schema.components.engine import MicroBatchSpec
    from arealcli.schema.components.interfaces import PPOActorArgs
    from tests.conftest import tiny_module, with_returns
    from tests.test_rl_interfaces import prompts

    args = HFBackendArgs(
        device="cpu", optimizer={"lr": 5e-2, "type": "sgd", "gradient_clipping": None}, lora=LORA
    )
    model = HFBackend(args).initialize(
        Model("actor", tiny_module(char_tok, seed=3), char_tok), FinetuneSpec(1, 8, 8, 100)
    )
    iface = PPOActorInterface(PPOActorArgs(generation={"n": 4, "max_new_tokens": 3}))
    data = iface.generate(model, prompts(char_tok, ["5+2=", "3+3="]), MicroBatchSpec())
    data.data["rewards"] = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.float32)
    data.seqlens["rewards"] = [1] * data.bs
    with_returns(data)
    before, mask = response_view(iface.inference(model, data, MicroBatchSpec()).data["packed_logprobs"], data)
    iface.train_step(model, data, MicroBatchSpec())
    after, _ = response_view(iface.inference(model, data, MicroBatchSpec()).data["packed_logprobs"], data)
    delta = ((after - before) * mask).sum(-1)
    assert delta[0] > 0 and delta[7] > 0 and delta[1:7].mean() < 0


# --------------------------------------------------------------------------- LoRA on fsdp


def fsdp_lora_recipe(ws, name: str = "fsdp-lora.yaml"):
    import yaml

    recipe = yaml.safe_load(lora_recipe(ws, name).read_text())
    recipe["models"]["default"]["backend"]["type_"] = "fsdp"
    return ws.text(name, yaml.safe_dump(recipe, sort_keys=False))


def exported(run_dir, step: int = 6) -> tuple[dict, dict]:
    ckpt = run_dir / "checkpoints" / f"step_{step:08d}" / "default"
    return load_file(str(ckpt / "model.safetensors")), load_file(
        str(ckpt / "adapter" / "adapter_model.safetensors")
    )


def sft_losses(run_dir) -> list[float]:
    return [json.loads(x)["sft/loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lora_on_fsdp_equals_lora_on_hf(ws):
    """The same LoRA SFT on fsdp (a world of one) and hf: losses, merged export and adapters agree; only
    adapters train and carry optimizer state; the export loads as a plain model."""
    run(lora_recipe(ws, "hf-lora.yaml"), ws.root / "hf")
    trainer = run(fsdp_lora_recipe(ws), ws.root / "fsdp")
    engine = trainer.models["default"].module
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(engine.optimizer.state_dict()["state"]) == len(trainable)
    assert sft_losses(ws.root / "fsdp") == pytest.approx(sft_losses(ws.root / "hf"), abs=1e-5)
    (hf_merged, hf_adapters), (merged, adapters) = exported(ws.root / "hf"), exported(ws.root / "fsdp")
    assert merged.keys() == hf_merged.keys() and adapters.keys() == hf_adapters.keys()
    for k in merged:
        torch.testing.assert_close(merged[k], hf_merged[k], rtol=0, atol=1e-5, msg=k)
    for k in adapters:
        torch.testing.assert_close(adapters[k], hf_adapters[k], rtol=0, atol=1e-5, msg=k)
    ckpt = ws.root / "fsdp" / "checkpoints" / "step_00000006" / "default"
    assert json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["r"] == LORA["rank"]
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(plain).__name__ == "Qwen2ForCausalLM"


@pytest.mark.slow
def test_lora_on_fsdp_over_two_processes(ws):
    """Sharded over 2 ranks (gloo): the same losses and export as one process, and GRPO whose reference
    is the actor's base with adapters off."""
    from tests.test_distributed import areal, ok

    path = fsdp_lora_recipe(ws)
    run(path, ws.root / "one")
    ok(areal("train", path, "-o", ws.root / "two", "--nproc-per-node", 2, cwd=ws.root))
    assert sft_losses(ws.root / "two") == pytest.approx(sft_losses(ws.root / "one"), abs=1e-4)
    for a, b in zip(exported(ws.root / "one"), exported(ws.root / "two"), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4, msg=k)

    import yaml

    recipe = yaml.safe_load(grpo_lora(ws).read_text())
    recipe["models"]["actor"]["backend"]["type_"] = "fsdp"
    grpo = ws.text("grpo-fsdp-lora.yaml", yaml.safe_dump(recipe, sort_keys=False))
    ok(areal("train", grpo, "-o", ws.root / "grpo", "--nproc-per-node", 2, cwd=ws.root))
    rows = [json.loads(x) for x in (ws.root / "grpo" / "metrics.jsonl").read_text().splitlines()]
    kls = [r["returns/kl_ref"] for r in rows if "returns/kl_ref" in r]
    assert len(kls) == 3 and any(abs(k) > 1e-4 for k in kls)  # the adapters moved the actor off its base


def test_dpo_on_adapters_against_the_base_with_adapters_off(ws):
    """DPO with LoRA: the reference is the actor's own base (`base_of`, no second copy); at the start the
    policy is its reference (held-out loss log 2), only the adapters move, and the preferences are learnt."""
    path = ws.dpo(
        models={
            "actor": {"backend": {"args": {"lora": LORA, "optimizer": {"lr": 2e-2}}}},
            "ref": {"init_from": None, "base_of": "actor"},
        },
        eval_dataset={"type_": "preference", "args": {"path": "pairs_test.jsonl"}, "batch_size": 11},
        trainer={"total_train_epochs": 2, "eval_every_n_steps": 10, "eval_at_start": True},
    )
    trainer = Trainer(validate(load_recipe_source(path)), path.parent, ws.root / "run")
    trainer.setup()
    assert trainer.models["ref"].module.engine is trainer.models["actor"].module  # one copy of the weights
    params = dict(trainer.models["actor"].module.module.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    try:
        trainer.train()
    finally:
        trainer.close()
    changed = {n for n, p in params.items() if not torch.equal(p.detach(), before[n])}
    assert changed == {n for n, p in params.items() if p.requires_grad} and all("lora_" in n for n in changed)
    rows = [json.loads(x) for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert evals[0] == pytest.approx(math.log(2), abs=1e-6) and evals[-1] < 0.9 * math.log(2), evals
    assert rows[-1]["eval/rewards/accuracies"] > 0.5

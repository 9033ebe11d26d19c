"""Adapter-only weight sync: a LoRA actor's embedded generation servers get the base once and then the
adapters alone, merge them into their copy of the base as peft merges, and generate exactly what they
generate from the merged weights; the bytes per update shrink to the adapters'."""

from __future__ import annotations

import json

import torch
import yaml
from safetensors.torch import load_file

from arealcli.runtime.generation.model_runner import ModelRunner
from arealcli.runtime.models.lora import (
    apply_adapter_update,
    lora_scale,
    save_adapter_update,
    save_base,
    split_lora_state,
    with_lora,
)
from arealcli.schema.components.engine import LoraConfig
from tests.conftest import TINY_ARCH, tiny_module


def lora_model(char_tok, rank: int = 4):
    module = with_lora(
        tiny_module(char_tok, seed=0), LoraConfig(rank=rank, alpha=8, target_modules="all-linear"), 1
    )
    with torch.no_grad():  # trained-looking adapters: B away from its zero start
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return module


def test_an_adapter_update_merges_as_peft_does(char_tok, tmp_path):
    """base + update, merged by the server's code, equals peft's merge_and_unload bit for bit."""
    import copy

    module = lora_model(char_tok)
    base_dir = tmp_path / "base"
    save_base(module, str(base_dir))
    save_adapter_update(module, str(base_dir / "a1"))
    base = load_file(str(base_dir / "model.safetensors"))
    update = load_file(str(base_dir / "a1" / "adapter_model.safetensors"))
    merged = apply_adapter_update(
        base, update, lora_scale(json.loads((base_dir / "a1" / "adapter_config.json").read_text()))
    )
    reference = copy.deepcopy(module).merge_and_unload().state_dict()
    assert merged and all(torch.equal(v, reference[k]) for k, v in merged.items())
    untouched, _ = split_lora_state(module.state_dict())
    assert set(base) <= set(untouched)


def test_a_fresh_server_applies_an_update_onto_the_base_above_it(char_tok, tmp_path):
    """A server that never saw the base (restarted, or launched from a checkpoint) reads it from the
    update's parent folder; a second update reuses it; both generate as the merged weights do."""
    import copy

    module = lora_model(char_tok)
    base_dir = tmp_path / "weights" / "actor" / "base"
    save_base(module, str(base_dir))
    save_adapter_update(module, str(base_dir / "a1"))
    served = tmp_path / "served"
    tiny_module(char_tok, seed=5).save_pretrained(served)  # other weights: all of them must change
    char_tok.save_pretrained(served)
    runner = ModelRunner(str(served), device="cpu")
    runner.load_weights(str(base_dir / "a1"), root=str(tmp_path / "weights"))
    merged = copy.deepcopy(module).merge_and_unload().state_dict()
    own = runner.module.state_dict()
    assert all(torch.equal(own[k], v) for k, v in merged.items() if k in own)

    with torch.no_grad():  # a later update: new adapters onto the kept base
        for name, p in module.named_parameters():
            if "lora_A" in name:
                p.mul_(-1.5)
    save_adapter_update(module, str(base_dir / "a2"))
    (base_dir / "model.safetensors").unlink()  # kept in memory: not read again
    runner.load_weights(str(base_dir / "a2"), root=str(tmp_path / "weights"))
    merged = copy.deepcopy(module).merge_and_unload().state_dict()
    own = runner.module.state_dict()
    assert all(torch.equal(own[k], v) for k, v in merged.items() if k in own)


ROWS = [
    {"prompt": f"max({a},{b},{c})=", "answer": str(max(a, b, c))}
    for a, b, c in [(12, 45, 33), (71, 18, 64), (25, 90, 47), (56, 34, 81)]
]
RECIPE = {
    "experiment": "lora-sync",
    "seed": 1,
    "tokenizer": {"kind": "char"},
    "models": {
        "actor": {
            "config": {**TINY_ARCH},
            "backend": {
                "type_": "hf",
                "args": {
                    "device": "cpu",
                    "optimizer": {"lr": 1e-2},
                    "lora": {"rank": 4, "alpha": 8, "target_modules": "all-linear"},
                },
            },
        },
        "actor_gen": {
            "init_from": "actor",
            "weights_from": "actor",
            "backend": {"type_": "sglang", "args": {"launch": "embedded", "num_servers": 1}},
        },
    },
    "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
    "dataflow": {
        "preset": "grpo",
        "sft_warmup_steps": 2,
        "actor": {"generation": {"n": 2, "max_new_tokens": 4}},
    },
    "trainer": {"max_steps": 5, "log_every_n_steps": 1, "tensorboard": False},
}


def test_adapter_only_sync_generates_what_merged_sync_generates(ws, cli, tmp_path):
    """Two runs, the embedded server following a LoRA actor by adapters alone and by merged weights:
    the same samples (the same losses and rewards at every step, temperature 1, same seeds), the
    adapter updates a fraction of the merged ones' bytes, and no full export written."""
    ws.text("train.jsonl", "".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = ws.text("lora.yaml", yaml.safe_dump(RECIPE, sort_keys=False))
    runs = {}
    for mode in ("adapters", "merged"):
        run = tmp_path / mode
        result = cli("train", recipe, "-o", run, f"models.actor_gen.backend.args.lora_updates={mode}")
        assert result.exit_code == 0, result.output
        runs[mode] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("actor_train/loss", "actor_train/reward", "actor_train/logp_policy", "sft_warmup/loss")
    assert [[r.get(k) for k in keys] for r in runs["adapters"]] == [
        [r.get(k) for k in keys] for r in runs["merged"]
    ]
    adapter_bytes = runs["adapters"][-1]["weight_sync/actor_bytes"]
    merged_bytes = runs["merged"][-1]["weight_sync/actor_bytes"]
    print(f"bytes per update: adapters {adapter_bytes:.0f}, merged {merged_bytes:.0f}")
    assert merged_bytes > 4 * adapter_bytes
    weights = tmp_path / "adapters" / "weights" / "actor"
    assert sorted(p.name for p in weights.iterdir()) == ["base"]
    assert sorted(p.name for p in (weights / "base").iterdir()) == ["a4", "a5", "model.safetensors"]


def test_a_checkpoints_adapter_loads_with_peft_onto_the_base(ws, cli, tmp_path, model_dir):
    """A LoRA run on a base model folder: its checkpoint's `adapter/` is peft's format, so
    PeftModel.from_pretrained(base, adapter) gives the logits of the checkpoint's merged weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    ws.text("train.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "experiment": "lora-peft",
        "seed": 1,
        "tokenizer": {"kind": "char"},
        "models": {
            "default": {
                "path": str(model_dir),
                "backend": {
                    "type_": "hf",
                    "args": {"device": "cpu", "optimizer": {"lr": 1e-2}, "lora": {"rank": 4, "alpha": 8}},
                },
            }
        },
        "dataset": {"type_": "prompt_answer", "args": {"path": "train.jsonl"}, "batch_size": 4},
        "dataflow": {"preset": "sft"},
        "trainer": {"max_steps": 3, "tensorboard": False},
    }
    result = cli("train", ws.text("peft.yaml", yaml.safe_dump(recipe)), "-o", tmp_path / "run")
    assert result.exit_code == 0, result.output
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003" / "default"
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), checkpoint / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(peft(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(
            AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits, merged(ids).logits
        )

"""Plugins written the way AReaL's documentation shows (a dataclass interface, `module.train()`, a loss
that returns a bare scalar), found beside the recipe without PYTHONPATH, checked, listed and trained."""

from __future__ import annotations

import json
import textwrap

import torch
import yaml

from tests.conftest import sft_recipe

# AReaL's "Customization: Interfaces" example, unchanged except for its imports; above it, the loss it
# names (the documentation leaves it to the reader) and a call that puts `mask` in the data it reads.
PLUGIN = '''
from dataclasses import dataclass

import torch

from arealcli import api as model_api
from arealcli.runtime.data.sample import SequenceSample


def custom_loss_function(logits, data):
    """NLL of the tokens under `mask` (the answer), a bare scalar."""
    ids = data.data["packed_input_ids"].to(logits.device)
    logp = torch.log_softmax(logits.float(), -1)[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    mask = data.data["mask"][1:].to(logits.device).float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


class MaskInterface(model_api.ModelInterface):
    """Marks the answer tokens (`mask`)."""

    needs_model = False

    def inference(self, model, data, mb_spec):
        mask = ~data.data["prompt_mask"].bool()
        return SequenceSample(data.ids, {"mask": list(data.seqlens["packed_input_ids"])}, {"mask": mask})


model_api.register_interface("answer_mask", MaskInterface)


@dataclass
class CustomInterface(model_api.ModelInterface):
    # Custom parameters
    custom_param: float = 1.0

    def train_step(self, model, data, mb_spec):
        module = model.module
        module.train()

        # Custom training logic
        stats = module.train_batch(
            input_=data,
            loss_fn=custom_loss_function,
            loss_weight_fn=lambda x: x.data["mask"].count_nonzero(),
            token_normalize_scope="global",
            mb_spec=mb_spec,
            version_steps=model.version.global_step,
        )

        model.inc_version()
        return stats

    def save(self, model, save_dir):
        module = model.module
        module.save_to_hf(tokenizer=model.tokenizer, save_dir=save_dir)

# Register the interface
model_api.register_interface("custom", CustomInterface)
'''


def plugin_recipe(ws, **custom_args) -> str:
    (ws.root / "areal_doc_plugin.py").write_text(textwrap.dedent(PLUGIN))
    recipe = sft_recipe(imports=["areal_doc_plugin"], trainer={"max_steps": 8, "tensorboard": False})
    recipe["dataflow"]["calls"] = [
        {
            "name": "mask",
            "model": None,
            "interface": {"type_": "answer_mask"},
            "type": "inference",
            "inputs": ["packed_input_ids", "prompt_mask"],
            "outputs": ["mask"],
        },
        {
            "name": "custom",
            "model": "default",
            "interface": {"type_": "custom", "args": custom_args},
            "type": "train_step",
            "inputs": ["packed_input_ids", "mask"],
        },
    ]
    return ws.text("doc.yaml", yaml.safe_dump(recipe, sort_keys=False))


def test_areal_documentation_example_checks_lists_and_trains(ws, cli, tmp_path, monkeypatch):
    recipe = plugin_recipe(ws, custom_param=0.5)
    monkeypatch.chdir(tmp_path)  # not the recipe's folder: found beside the recipe, no PYTHONPATH
    assert cli("check", recipe).exit_code == 0
    listed = cli("list", "custom", "--json", "--import", "areal_doc_plugin")
    assert listed.exit_code == 0, listed.output
    (entry,) = json.loads(listed.stdout)["interfaces"]
    assert entry["args"] == [{"name": "custom_param", "type": "float", "default": "1.0", "description": ""}]
    result = cli("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in (ws.root / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["custom/loss"] for r in rows]
    assert losses[-1] < losses[0], losses


def test_dataclass_fields_are_validated_like_any_args(ws, cli):
    result = cli("check", plugin_recipe(ws, custom_parm=0.5))
    assert result.exit_code == 2 and "custom_parm: unknown key; did you mean 'custom_param'?" in result.stderr
    result = cli("check", plugin_recipe(ws, custom_param="big"))
    assert result.exit_code == 2 and "custom_param: Input should be a valid number" in result.stderr


def test_a_missing_data_key_lists_the_keys(ws, cli):
    recipe = yaml.safe_load(plugin_recipe(ws).read_text())
    recipe["dataflow"]["calls"][1]["inputs"] = ["packed_input_ids", "prompt_mask"]  # no `mask`
    recipe["dataflow"]["calls"] = recipe["dataflow"]["calls"][1:]
    path = ws.text("nomask.yaml", yaml.safe_dump(recipe))
    result = cli("train", path, "-o", ws.root / "run2")
    assert result.exit_code == 1  # a failure in training: one message, the traceback in crash.log
    assert "'mask' is not in this batch; it has ['packed_input_ids', 'prompt_mask']" in result.output
    assert "Traceback" not in result.output and (ws.root / "run2" / "logs" / "crash.log").is_file()


# A backend in the shape of AReaL's "Customization: Backends" example: a ModelBackend whose `_initialize`
# wraps `model.module` in an engine of its own and assigns it back; registered by name.
BACKEND_PLUGIN = '''
import dataclasses

import torch

from arealcli import api as model_api


class PlainEngine(model_api.TrainEngine):
    """Plain SGD on a transformers module in this process."""

    def __init__(self, module, lr):
        self.module, self.device = module, torch.device("cpu")
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)

    def run_microbatch(self, mb):
        ids, mask = mb.padded("packed_input_ids", pad_value=0)
        return self.module(input_ids=ids).logits[mask]

    def begin_train_step(self, version_steps, lr_scale):
        self.optimizer.zero_grad()
        return self.optimizer.param_groups[0]["lr"]

    def finish_train_step(self, stepped):
        self.optimizer.step()
        return 0.0

    def save_to_hf(self, tokenizer, save_dir):
        self.module.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)


@dataclasses.dataclass
class PlainArgs:
    lr: float = 0.5


class PlainBackend(model_api.ModelBackend):
    Args = PlainArgs

    def _initialize(self, model, spec):
        module = model.module
        model.module = PlainEngine(module, self.args.lr)
        return model


model_api.register_backend("plain", PlainBackend)
'''


def test_a_backend_plugin_in_the_original_form_trains_saves_and_resumes(ws, cli):
    (ws.root / "plain_backend.py").write_text(textwrap.dedent(BACKEND_PLUGIN))
    recipe = sft_recipe(
        imports=["plain_backend"],
        trainer={"max_steps": 6, "save_every_n_steps": 3, "tensorboard": False},
    )
    recipe["models"]["default"]["backend"] = {"type_": "plain", "args": {"lr": 0.5}}
    path = ws.text("plain.yaml", yaml.safe_dump(recipe, sort_keys=False))
    assert cli("check", path).exit_code == 0
    full = cli("train", path, "-o", ws.root / "full")
    assert full.exit_code == 0, full.output
    # its engine keeps no optimizer state for resume (plain SGD has none): said before training
    assert "its engine (PlainEngine) does not implement save_state" in " ".join(full.output.split())
    rows = [json.loads(x) for x in (ws.root / "full" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["sft/loss"] < rows[0]["sft/loss"], rows
    assert (ws.root / "full" / "checkpoints" / "step_00000006" / "default" / "config.json").is_file()
    # 3 steps, then resume to 6: the same weights as 6 uninterrupted steps
    short = ws.text(
        "short.yaml", yaml.safe_dump({**recipe, "trainer": {**recipe["trainer"], "max_steps": 3}})
    )
    assert cli("train", short, "-o", ws.root / "part").exit_code == 0
    resumed = cli("train", path, "-o", ws.root / "part", "--resume")
    assert resumed.exit_code == 0, resumed.output
    from safetensors.torch import load_file

    def final(run: str) -> dict:
        return load_file(
            str(ws.root / run / "checkpoints" / "step_00000006" / "default" / "model.safetensors")
        )

    a, b = final("full"), final("part")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

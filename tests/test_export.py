"""`areal export`: a run's checkpoint as a self-contained HF folder (the checkpoint's weights, the
tokenizer, generation_config.json, the recipe, report.png, a model card with the held-out results over
training) that `from_pretrained` loads and `areal serve` serves; LoRA merged or as an adapter over its
base; an output folder never overwritten unless it is an earlier export and --force says so; a damaged
checkpoint refused; --push-to-hub refused cleanly offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from arealcli.main import app
from arealcli.runtime.run.export import generation_settings
from arealcli.runtime.run.model_card import public_recipe
from tests.conftest import Workspace, tiny_module
from tests.test_chat import Greedy

EVAL = {"type_": "prompt_answer", "args": {"path": "test.jsonl"}, "batch_size": 11}
TRAINER = {"max_steps": 12, "save_every_n_steps": 6, "eval_every_n_steps": 4, "eval_at_start": True}


def invoke(*args: str | Path, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A 12-step SFT run with held-out evaluations every 4 steps and checkpoints at 6 and 12."""
    ws = Workspace(tmp_path_factory.mktemp("export-run"))
    recipe = ws.recipe(eval_dataset=EVAL, trainer={**TRAINER, "tensorboard": False})
    result = invoke("train", recipe, "-o", ws.root / "run")
    assert result.exit_code == 0, result.output
    return ws.root / "run"


def card_parts(out: Path) -> tuple[dict, str]:
    """The model card's metadata block and its text."""
    text = (out / "README.md").read_text()
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


def held_out_table(body: str) -> list[list[str]]:
    section = body.split("## Held-out results over training", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]  # after the header


def logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return module(torch.tensor([ids])).logits[0]


def test_export_is_a_model_folder_with_a_card(run, tmp_path):
    out = tmp_path / "exported"
    result = invoke("export", run, "-o", out)
    assert result.exit_code == 0, result.output
    ckpt = run / "checkpoints" / "step_00000012" / "default"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert {"README.md", "recipe.yaml", "report.png"} <= files
    assert not any(name.endswith(".pt") for name in files)  # no optimizer state
    for k, v in load_file(str(ckpt / "model.safetensors")).items():
        assert torch.equal(load_file(str(out / "model.safetensors"))[k], v)

    # it loads with transformers: the checkpoint's model, the tokenizer as saved, the generation config
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)  # the class the card names for this tokenizer
    assert tok.decode(tok.encode("c: d")) == "c: d"
    ids = tok.encode("c:")
    assert torch.equal(logits(out, ids), logits(ckpt, ids))
    assert GenerationConfig.from_pretrained(out).eos_token_id == tok.eos_token_id

    meta, body = card_parts(out)
    assert meta["library_name"] == "transformers" and {"arealcli", "sft"} <= set(meta["tags"])
    assert "# tiny-sft: model `default` at step 12" in body and "(the run's last)" in body
    assert "PreTrainedTokenizerFast.from_pretrained" in body
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/nll"]) for r in rows if "eval/nll" in r]
    assert [s for s, _ in evals] == [0, 4, 8, 12]
    assert held_out_table(body) == [[str(s), f"{v:.4g}"] for s, v in evals]
    assert "![metrics of the run over training](report.png)" in body
    embedded = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    saved = yaml.safe_load((run / "recipe.yaml").read_text())
    assert (
        yaml.safe_load(embedded)
        == public_recipe(saved, run)
        == yaml.safe_load((out / "recipe.yaml").read_text())
    )
    assert yaml.safe_load(embedded)["dataset"]["args"]["path"] == "<local>/train.jsonl"  # (not published)
    assert "areal train recipe.yaml -o runs/tiny-sft" in body
    # and the command that trained it, as typed (the run's commands.log), without the folder typed in and
    # its absolute paths (typed outside the folder it was typed in: `<local>/NAME`; the run: `<run>`)
    (logged,) = (run / "commands.log").read_text().splitlines()
    assert logged.endswith(f" && areal train {run.parent / 'recipe.yaml'} -o {run}")
    typed = "areal train <local>/recipe.yaml -o <run>"
    assert "It was trained with" in body and f"\n{typed}\n" in body


def test_the_export_serves_with_areal_serve(run, tmp_path):
    from arealcli.runtime.clients import launcher
    from arealcli.schema.components.backends import SGLangBackendArgs

    out = tmp_path / "served"
    assert invoke("export", run, "-o", out).exit_code == 0
    args = SGLangBackendArgs(launch="embedded", device="cpu", extra_args=["--num-threads", "1"])
    servers = launcher.launch(args, str(out), tmp_path / "logs", "export")
    try:
        launcher.wait_ready(servers, 90)
        body = {"prompt": "c:", "max_tokens": 6, "temperature": 0}
        r = httpx.post(f"http://{servers[0].address}/v1/completions", json=body, timeout=60, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == Greedy(out)("c:")
    finally:
        launcher.stop(servers)


def test_an_earlier_step_and_its_results_so_far(run, tmp_path):
    out = tmp_path / "step6"
    assert invoke("export", run, "--step", "6", "--model", "default", "-o", out).exit_code == 0
    ckpt = run / "checkpoints" / "step_00000006" / "default"
    assert torch.equal(logits(out, [5, 6, 7]), logits(ckpt, [5, 6, 7]))
    _, body = card_parts(out)
    assert "at step 6" in body and "(the run went on to step 12)" in body
    assert [row[0] for row in held_out_table(body)] == ["0", "4"]  # only what was measured by step 6
    result = invoke("export", run, "--step", "7", "-o", tmp_path / "none")
    assert result.exit_code == 2 and "no checkpoint of step 7 (kept: 6, 12)" in result.stderr


def test_nothing_of_yours_is_overwritten(run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    for extra in ([], ["--force"]):
        result = invoke("export", run, "-o", mine, *extra)
        assert result.exit_code == 2 and "nothing in it is touched" in result.stderr
        assert [p.name for p in mine.iterdir()] == ["notes.txt"]
        assert (mine / "notes.txt").read_text() == "my notes"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    result = invoke("export", run, "-o", a_file)
    assert result.exit_code == 2 and "is a file" in result.stderr and a_file.read_text() == "x"

    # an earlier export is replaced with --force only
    out = tmp_path / "exported"
    assert invoke("export", run, "--step", "6", "-o", out).exit_code == 0
    result = invoke("export", run, "-o", out)
    assert result.exit_code == 2 and "--force" in result.stderr
    assert invoke("export", run, "-o", out, "--force").exit_code == 0
    assert "at step 12" in card_parts(out)[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "file", "mine"]  # no leftovers


def test_a_damaged_checkpoint_is_refused(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    weights = copy / "checkpoints" / "step_00000012" / "default" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100:] = bytes(100)
    weights.write_bytes(bytes(data))
    result = invoke("export", copy, "-o", tmp_path / "out")
    assert result.exit_code == 2
    assert "default/model.safetensors does not match its checksum" in result.stderr
    assert not (tmp_path / "out").exists()


def test_push_to_hub_refuses_cleanly_offline(run, tmp_path):
    out = tmp_path / "out"
    result = invoke("export", run, "-o", out, "--push-to-hub", "me/tiny", env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2 and "HF_HUB_OFFLINE is set" in result.stderr
    assert "Traceback" not in result.output and not out.exists()
    result = invoke("export", run, "-o", out, "--push-to-hub", "not a repo!")
    assert result.exit_code == 2 and "not a repository name" in result.stderr and not out.exists()


def test_lora_merged_or_as_an_adapter_over_its_base(tmp_path, char_tok, run):
    ws = Workspace(tmp_path)
    base = tmp_path / "base"
    tiny_module(char_tok, seed=4).save_pretrained(base)
    char_tok.save_pretrained(base)
    recipe = ws.recipe(trainer={"max_steps": 4, "tensorboard": False})
    data = yaml.safe_load(recipe.read_text())
    model = data["models"]["default"]
    model.pop("config")
    model["path"] = str(base)
    model["backend"]["args"]["lora"] = {"rank": 4, "alpha": 8.0}
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    assert invoke("train", recipe, "-o", tmp_path / "lora").exit_code == 0
    ckpt = tmp_path / "lora" / "checkpoints" / "step_00000004" / "default"
    ids = [20, 21, 22, 23]

    merged = tmp_path / "merged"
    assert invoke("export", tmp_path / "lora", "-o", merged).exit_code == 0
    assert not (merged / "adapter").exists()
    assert torch.equal(logits(merged, ids), logits(ckpt, ids))
    assert "LoRA adapters (rank 4, alpha 8.0) merged in" in card_parts(merged)[1]

    adapter = tmp_path / "adapter"
    assert invoke("export", tmp_path / "lora", "--adapter", "-o", adapter).exit_code == 0
    files = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "README.md"} <= files
    assert not files & {"config.json", "model.safetensors"}
    # the base was a local folder: named as the card and recipe.yaml show it, not by its absolute path
    config_text = (adapter / "adapter_config.json").read_text()
    assert json.loads(config_text)["base_model_name_or_path"] == "<local>/base"
    leaks = [p.name for p in adapter.iterdir() if str(tmp_path).encode() in p.read_bytes()]
    assert leaks == [], f"absolute paths in {leaks}"
    meta, body = card_parts(adapter)
    assert meta["library_name"] == "peft" and "base_model" not in meta
    assert "`<local>/base`" in body and "point it at your own copy of that base" in body
    assert 'PeftModel.from_pretrained(base, "THIS_FOLDER")' in body
    from peft import PeftModel  # as the card says: your copy of the base, then the adapters
    from transformers import AutoModelForCausalLM

    module = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        adapted = module(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(adapted, logits(merged, ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted, logits(base, ids), atol=1e-4)  # the adapters did something

    result = invoke("export", run, "--adapter", "-o", tmp_path / "none")
    assert result.exit_code == 2 and "trained all its weights" in result.stderr


def test_adapters_over_a_base_saved_nowhere_are_refused(tmp_path):
    run = tmp_path / "run"
    model = run / "checkpoints" / "step_00000001" / "default"
    (model / "adapter").mkdir(parents=True)
    for name in ("config.json", "adapter/adapter_config.json", "adapter/adapter_model.safetensors"):
        (model / name).write_text("{}")
    (model.parent / "trainer_state.pt").write_text("")
    (run / "recipe.yaml").write_text(yaml.safe_dump({"models": {"default": {"config": {"family": "qwen2"}}}}))
    result = invoke("export", run, "--adapter", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "built from a config" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial folder


def test_generation_settings_come_from_the_call_that_generates_with_the_model():
    gen = {"max_new_tokens": 4, "greedy": False, "temperature": 0.9, "top_p": 0.95, "top_k": 0}
    recipe = {
        "models": {"actor": {}, "actor_gen": {"weights_from": "actor"}, "critic": {}},
        "dataflow": {
            "calls": [
                {
                    "name": "gen",
                    "model": "actor_gen",
                    "type": "generate",
                    "interface": {"args": {"generation": gen}},
                },
                {"name": "train", "model": "actor", "type": "train_step"},
            ]
        },
    }
    assert generation_settings(recipe, "actor") == gen
    assert generation_settings(recipe, "critic") is None

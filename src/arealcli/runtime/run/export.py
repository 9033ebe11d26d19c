"""`areal export`: one model of a run's checkpoint as a self-contained Hugging Face folder.

    OUT/  config.json, *.safetensors    the weights (LoRA merged into them), or with `adapter`:
          adapter_config.json,          the LoRA adapters alone (peft's layout) over the base model (a
          adapter_model.safetensors     Hub name as it is; a local folder as the recipe shows it)
          tokenizer files, generation_config.json (the recipe's sampling settings for this model)
          recipe.yaml, report.png       the run's resolved recipe (`published`: no local absolute
                                        path or address) and its plot (when it has one)
          README.md                     the model card (`model_card`)

Published as made: the folder and its files get the user's own umask (usually readable by all), not
the run's private modes (`trainer.permissions`): an export exists to be shared, and holds the weights,
tokenizer, the recipe and the card, never the run's samples, logs or data.

Written to a temporary folder beside OUT, then renamed: OUT is complete or absent. OUT must be empty or
absent; with `force`, a folder an earlier export wrote (its README says so) is replaced. Nothing else is
ever removed. Errors are `UserError`s.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import yaml

from arealcli.errors import UserError
from arealcli.runtime.run.checkpoint import verify_checkpoint
from arealcli.runtime.run.model_card import CARD_MARK, Published, model_card, published
from arealcli.runtime.run.targets import ModelCheckpoint, generate_calls, run_recipe, saved_source

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def check_output(out: Path, force: bool) -> None:
    """Refuse an OUT that is a file, not empty (without `force`), or not an earlier export."""
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out} is a file; give a folder to export into")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise UserError(
            f"-o {out} is not empty, so nothing in it is touched: give a new or empty folder "
            "(or --force to replace an earlier export there)"
        )
    if not is_export(out):
        shown = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise UserError(
            f"--force replaces only a folder `areal export` wrote (its README.md says so); {out} holds "
            f"other files ({shown}), so nothing in it is touched: give another -o folder"
        )
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise UserError(f"--force will not replace {out}: it is the current folder or one above it")


def is_export(folder: Path) -> bool:
    card = folder / "README.md"
    try:
        return card.is_file() and CARD_MARK in card.read_text(errors="replace")
    except OSError:
        return False


def export(found: ModelCheckpoint, out: Path, adapter: bool = False, force: bool = False) -> Path:
    """Write the export of `found` (a run's checkpoint of one model) to `out`; returns `out`."""
    assert found.run_dir is not None and found.model is not None and found.step is not None
    check_output(out, force)
    why = verify_checkpoint(found.model_dir.parent)
    if why is not None:
        raise UserError(f"{found.model_dir.parent} is damaged: {why}; export another step (--step N)")
    recipe = run_recipe(found.run_dir)
    shown = published(recipe, found.run_dir)  # what the card, recipe.yaml and the adapters' config show
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise UserError(f"cannot write into {out.parent}: {e.strerror or e}") from None
    try:
        if adapter:
            _copy_adapter(found, recipe, shown, tmp)
        else:
            _copy_model(found.model_dir, tmp)
        if not any((tmp / f).is_file() for f in TOKENIZER_FILES):
            _write_tokenizer(recipe, found.model, tmp)
        _write_generation_config(found, recipe, tmp)
        if (found.run_dir / "recipe.yaml").is_file():  # as the card shows it: no local path or address
            (tmp / "recipe.yaml").write_text(yaml.safe_dump(shown.recipe, sort_keys=False))
        if (found.run_dir / "report.png").is_file():
            shutil.copyfile(found.run_dir / "report.png", tmp / "report.png")
        (tmp / "README.md").write_text(model_card(found, recipe, shown, adapter, tmp))
        _publish(tmp, out)
    except OSError as e:  # disk full, permissions: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the export to {out}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _copy_model(model_dir: Path, dst: Path) -> None:
    """Every file of the HF folder but the engine's own state (optimizer: `*.pt`) and the adapters."""
    if not any(model_dir.glob("*.safetensors")):
        raise UserError(f"{model_dir} holds no *.safetensors weights")
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and f.suffix != ".pt":
            shutil.copyfile(f, dst / f.name)


def _copy_adapter(found: ModelCheckpoint, recipe: dict[str, Any], shown: Published, dst: Path) -> None:
    """The adapters in peft's layout, naming the base model they go over (as published: a Hub name as it
    is, a local folder as `shown` has it, which the card asks the reader to point at their own copy);
    and the tokenizer files."""
    src = found.model_dir / "adapter"
    if not all((src / f).is_file() for f in ADAPTER_FILES):
        raise UserError(
            f"--adapter: model {found.model} trained all its weights (no LoRA adapters in {found.model_dir}); "
            "export without --adapter"
        )
    base = ((recipe.get("models") or {}).get(found.model) or {}).get("path")
    if not base:
        raise UserError(
            f"--adapter: the base model of {found.model} was built from a config (random weights saved "
            "nowhere else), so its adapters alone cannot be used; export without --adapter (merged)"
        )
    for name in ADAPTER_FILES:
        shutil.copyfile(src / name, dst / name)
    config = json.loads((dst / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = ((shown.recipe.get("models") or {}).get(found.model) or {}).get(
        "path", base
    )
    (dst / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = {"config.json", "generation_config.json", "model.safetensors.index.json"}
    for f in sorted(found.model_dir.iterdir()):
        if f.is_file() and f.suffix not in (".pt", ".safetensors", ".bin") and f.name not in weights:
            shutil.copyfile(f, dst / f.name)


def _write_tokenizer(recipe: dict[str, Any], model: str, dst: Path) -> None:
    """A checkpoint saved without its tokenizer: the recipe's, rebuilt."""
    from arealcli.runtime.data.tokenizer import load_tokenizer
    from arealcli.schema.recipe import TokenizerSpec

    spec = recipe.get("tokenizer")
    path = ((recipe.get("models") or {}).get(model) or {}).get("path")
    try:
        tok = load_tokenizer(TokenizerSpec.model_validate(spec) if spec else None, path)
    except Exception as e:  # no tokenizer to be had: the folder would not be self-contained
        raise UserError(
            f"the checkpoint has no tokenizer files and the recipe's cannot be loaded: {e}"
        ) from None
    tok.save_pretrained(str(dst))


def generation_settings(recipe: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The `generation` args of the first call that generates with `model` (or a model following it)."""
    models = recipe.get("models") or {}
    for call in generate_calls(recipe):
        if saved_source(models, call.get("model"), [model]) == model:
            args = (call.get("interface") or {}).get("args") or {}
            gen = args.get("generation")
            if isinstance(gen, dict):
                return gen
    return None


def _write_generation_config(found: ModelCheckpoint, recipe: dict[str, Any], dst: Path) -> None:
    """The checkpoint's generation_config.json (end and pad tokens) with the recipe's sampling settings."""
    from transformers import AutoConfig, GenerationConfig

    if (found.model_dir / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(str(found.model_dir))
    else:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(found.model_dir)))
    gen = generation_settings(recipe, found.model or "")
    if gen is not None:
        config.max_new_tokens = gen.get("max_new_tokens", config.max_new_tokens)
        config.do_sample = not gen.get("greedy", False)
        if config.do_sample:
            config.temperature = gen.get("temperature", 1.0)
            config.top_p = gen.get("top_p", 1.0)
            config.top_k = gen.get("top_k") or None
    config.save_pretrained(str(dst))


def _publish(tmp: Path, out: Path) -> None:
    """`tmp` becomes `out`: an empty `out` is replaced, an earlier export moved aside then removed."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f".old-export-{out.name}-{os.getpid()}"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

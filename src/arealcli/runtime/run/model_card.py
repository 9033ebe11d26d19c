"""The model card (`README.md`) of an exported model: what was trained, from which base, on which data,
with which recipe and command, for how many steps, and its held-out scores over training (from the run's
`metrics.jsonl`, up to the exported step), with the Hub's metadata block on top.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import yaml

from arealcli.runtime.console.report import LOWER_IS_BETTER, read_metrics
from arealcli.runtime.run.targets import ModelCheckpoint

CARD_MARK = "<!-- written by areal export"
MAX_ROWS = 25  # held-out rows shown; more are thinned evenly (first and last kept)


def model_card(found: ModelCheckpoint, recipe: dict[str, Any], adapter: bool, folder: Path) -> str:
    """The card of the export being written in `folder` (its other files are there already)."""
    assert found.run_dir is not None and found.model is not None and found.step is not None
    models = recipe.get("models") or {}
    spec = models.get(found.model) or {}
    rows = [r for r in read_metrics(found.run_dir) if isinstance(r.get("step"), int)]
    experiment = recipe.get("experiment") or found.run_dir.name
    parts = [
        _front_matter(recipe, spec, adapter),
        f"{CARD_MARK}: `areal export --force` may replace this folder -->\n",
        f"# {experiment}: model `{found.model}` at step {found.step}\n",
        _summary(recipe, found, adapter),
        _facts(recipe, spec, found, rows, adapter),
        _results(rows, found.step),
    ]
    if (folder / "report.png").is_file():
        parts.append("## Training curves\n\n![metrics of the run over training](report.png)\n")
    parts += [_usage(adapter, tokenizer_class(folder)), _reproduce(recipe, _commands(found.run_dir))]
    return "\n".join(parts)


def _is_hub_name(path: Any) -> bool:
    return isinstance(path, str) and not Path(path).is_absolute() and path.count("/") == 1


def _front_matter(recipe: dict[str, Any], spec: dict[str, Any], adapter: bool) -> str:
    interfaces = {(c.get("interface") or {}).get("type_") for c in _calls(recipe)}
    tags = ["arealcli"]
    tags += ["sft"] if "sft" in interfaces else []
    tags += ["reinforcement-learning"] if "ppo_actor" in interfaces else []
    tags += ["lora"] if _lora(spec) else []
    meta: dict[str, Any] = {
        "library_name": "peft" if adapter else "transformers",
        "pipeline_tag": "text-generation",
        "tags": tags,
    }
    if _is_hub_name(spec.get("path")):
        meta["base_model"] = spec["path"]
    datasets = [
        d["args"]["path"]
        for d in (recipe.get("dataset"), recipe.get("eval_dataset"))
        if isinstance(d, dict) and _is_hub_name((d.get("args") or {}).get("path"))
    ]
    if datasets:
        meta["datasets"] = sorted(set(datasets))
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---\n"


def _calls(recipe: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in (recipe.get("dataflow") or {}).get("calls") or [] if isinstance(c, dict)]


def _lora(spec: dict[str, Any]) -> dict[str, Any] | None:
    lora = ((spec.get("backend") or {}).get("args") or {}).get("lora")
    return lora if isinstance(lora, dict) else None


def _summary(recipe: dict[str, Any], found: ModelCheckpoint, adapter: bool) -> str:
    what = "LoRA adapters" if adapter else "A language model"
    lines = [f"{what} trained with arealcli (`areal train`), exported with `areal export`. The dataflow:\n"]
    for c in _calls(recipe):
        interface = (c.get("interface") or {}).get("type_")
        start, end = c.get("start_step") or 0, c.get("end_step")
        when = f", steps {start} to {end}" if end is not None else (f", from step {start}" if start else "")
        on = f" on `{c['model']}`" if c.get("model") else ""
        mine = " (this model)" if c.get("model") == found.model else ""
        lines.append(f"- `{c.get('name')}`: {interface} {c.get('type')}{on}{mine}{when}")
    return "\n".join(lines) + "\n"


def _dataset(d: Any) -> str:
    if not isinstance(d, dict):
        return "none"
    args = d.get("args") or {}
    where = f"`{args.get('path')}`" + (f" ({args['subset']})" if args.get("subset") else "")
    return f"{where}, `{d.get('type_')}`, batches of {d.get('batch_size')}"


def _facts(
    recipe: dict[str, Any], spec: dict[str, Any], found: ModelCheckpoint, rows: list[dict], adapter: bool
) -> str:
    if spec.get("path"):
        base = f"`{spec['path']}`"
    else:
        arch = spec.get("config") or {}
        shape = ", ".join(f"{k} {v}" for k, v in arch.items() if k in _ARCH_KEYS)
        base = f"built from a config ({shape}), random initial weights (seed {recipe.get('seed')})"
    tok = recipe.get("tokenizer") or {}
    tokenizer = (
        "built-in character tokenizer"
        if tok.get("kind") == "char"
        else f"`{tok.get('path') or spec.get('path')}`"
    )
    lora = _lora(spec)
    if adapter and lora:
        weights = f"LoRA adapters (rank {lora.get('rank')}, alpha {lora.get('alpha')}) over the base model"
    elif lora:
        weights = (
            f"full weights, LoRA adapters (rank {lora.get('rank')}, alpha {lora.get('alpha')}) merged in"
        )
    else:
        weights = "full weights, all trained"
    step = found.step or 0
    last = max((int(r["step"]) for r in rows), default=step)
    steps = f"{step}" + (f" (the run went on to step {last})" if last > step else " (the run's last)")
    table = [
        ("experiment", f"`{recipe.get('experiment')}`, seed {recipe.get('seed')}"),
        ("base model", base),
        ("tokenizer", tokenizer),
        ("weights", weights),
        ("trained steps", steps),
        ("training data", _dataset(recipe.get("dataset"))),
        ("held-out data", _dataset(recipe.get("eval_dataset"))),
    ]
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in table)


_ARCH_KEYS = ("family", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def _number(v: Any) -> float | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def _results(rows: list[dict], step: int) -> str:
    """Held-out metrics (`eval/...`) up to the exported step: a table, then final and best."""
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and not k.endswith("/ppl")})
    shown = [r for r in rows if r["step"] <= step and any(_number(r.get(k)) is not None for k in keys)]
    if not shown:
        return (
            "## Held-out results\n\nThe run logged no held-out evaluation (`eval_dataset`) up to this step.\n"
        )
    out = ["## Held-out results over training\n"]
    for key in keys:
        pts = [(r["step"], v) for r in shown if (v := _number(r.get(key))) is not None]
        if not pts:
            continue
        pick = min if key.rsplit("/", 1)[-1] in LOWER_IS_BETTER else max
        best = pick(pts, key=lambda p: p[1])
        out.append(
            f"- {key[5:]}: {pts[-1][1]:.4g} at step {pts[-1][0]} (best {best[1]:.4g} at step {best[0]}; "
            f"{pts[0][1]:.4g} at step {pts[0][0]})"
        )
    if len(shown) > MAX_ROWS:
        idx = sorted({round(i * (len(shown) - 1) / (MAX_ROWS - 1)) for i in range(MAX_ROWS)})
        shown = [shown[i] for i in idx]
    out.append("\n| step | " + " | ".join(k[5:] for k in keys) + " |")
    out.append("|---" * (len(keys) + 1) + "|")
    for r in shown:
        cells = [f"{v:.4g}" if (v := _number(r.get(k))) is not None else "" for k in keys]
        out.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def tokenizer_class(folder: Path) -> str:
    """The class that loads the folder's tokenizer as saved: `AutoTokenizer` swaps a generic one (the
    character tokenizer) for the model type's own class, which tokenizes differently."""
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    return "PreTrainedTokenizerFast" if declared in GENERIC_TOKENIZERS else "AutoTokenizer"


GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _usage(adapter: bool, tok_class: str) -> str:
    if adapter:
        code = (
            "from peft import AutoPeftModelForCausalLM\n"
            f"from transformers import {tok_class}\n\n"
            'model = AutoPeftModelForCausalLM.from_pretrained("THIS_FOLDER")  # the base model, then these adapters\n'
            f'tokenizer = {tok_class}.from_pretrained("THIS_FOLDER")\n'
        )
        return f"## Use\n\n```python\n{code}```\n"
    code = (
        f"from transformers import AutoModelForCausalLM, {tok_class}\n\n"
        'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER")\n'
        f'tokenizer = {tok_class}.from_pretrained("THIS_FOLDER")\n'
    )
    shell = (
        "areal chat THIS_FOLDER            # talk to it in a terminal\n"
        "areal serve --model THIS_FOLDER   # SGLang's HTTP protocol and OpenAI's /v1\n"
    )
    return f"## Use\n\n```python\n{code}```\n\n```\n{shell}```\n"


def _commands(run_dir: Path) -> list[str]:
    """The `areal train` commands of the run, as typed (its commands.log, oldest first)."""
    from arealcli.runtime.run.session import COMMANDS_LOG

    try:
        lines = (run_dir / COMMANDS_LOG).read_text().splitlines()
    except OSError:
        return []
    # `TIME  cd DIR && areal train ...`: the card shows the command, not the folder it was typed in
    return [line.split("  ", 1)[1].split(" && ", 1)[-1] for line in lines if "  " in line]


def _reproduce(recipe: dict[str, Any], commands: list[str]) -> str:
    experiment = recipe.get("experiment") or "run"
    text = yaml.safe_dump(recipe, sort_keys=False) if recipe else "(the run has no recipe.yaml)\n"
    typed = ""
    if commands:
        shown = "\n".join(commands[-10:])
        typed = f"It was trained with (from the run's `commands.log`):\n\n```\n{shown}\n```\n\n"
    return (
        "## How it was trained\n\n"
        + typed
        + "The run's resolved recipe (overrides applied, presets expanded, local paths absolute) is "
        "`recipe.yaml` in this folder, shown below; this command trains the same model again "
        "(with the same data, torch build and CPU kind or GPU):\n\n"
        f"```\nareal train recipe.yaml -o runs/{experiment}\n```\n\n"
        f"<details><summary>recipe.yaml</summary>\n\n```yaml\n{text}```\n\n</details>\n"
    )

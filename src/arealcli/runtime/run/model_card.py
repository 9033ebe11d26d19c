"""The model card (`README.md`) of an exported model: what was trained, from which base, on which data,
with which recipe and command, for how many steps, and its held-out scores over training (from the run's
`metrics.jsonl`, up to the exported step), with the Hub's metadata block on top.

A card is written to be published, so it shows no local absolute path, host name or address: paths
under the folder the run was started from are shown relative to it, the run's own files as `<run>/...`,
other local paths by their last name (`<local>/NAME`), and server addresses and host names (`addresses`,
`host`, URLs, IP addresses, `--master-addr`) as `<address>` (`public_recipe`, `public_command`).
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from arealcli.runtime.console.report import LOWER_IS_BETTER, read_metrics
from arealcli.runtime.run.targets import ModelCheckpoint

CARD_MARK = "<!-- written by areal export"
MAX_ROWS = 25  # held-out rows shown; more are thinned evenly (first and last kept)


def model_card(found: ModelCheckpoint, recipe: dict[str, Any], adapter: bool, folder: Path) -> str:
    """The card of the export being written in `folder` (its other files are there already). `recipe`
    is the run's own; the card shows its `public_recipe`."""
    assert found.run_dir is not None and found.model is not None and found.step is not None
    spec = (recipe.get("models") or {}).get(found.model) or {}  # (the Hub names in it are not local)
    shown = public_recipe(recipe, found.run_dir)
    shown_spec = (shown.get("models") or {}).get(found.model) or {}
    rows = [r for r in read_metrics(found.run_dir) if isinstance(r.get("step"), int)]
    experiment = shown.get("experiment") or found.run_dir.name
    parts = [
        _front_matter(recipe, spec, adapter),
        f"{CARD_MARK}: `areal export --force` may replace this folder -->\n",
        f"# {experiment}: model `{found.model}` at step {found.step}\n",
        _summary(shown, found, adapter),
        _facts(shown, shown_spec, found, rows, adapter),
        _results(rows, found.step),
    ]
    if (folder / "report.png").is_file():
        parts.append("## Training curves\n\n![metrics of the run over training](report.png)\n")
    parts += [_usage(adapter, tokenizer_class(folder)), _reproduce(shown, _commands(found.run_dir))]
    return "\n".join(parts)


# ------------------------------------------------------------------ what a published card may show

ADDRESS = "<address>"
RUN = "<run>"
LOCAL = "<local>"
_LOCAL_HOSTS = ("localhost", "0.0.0.0", "::")  # (and the loopback addresses): they point nowhere else
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)(\[[^\]]*\]|[^/\s'\"?#]+)")
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?![\w.])")
_ADDRESS_FLAGS = ("--master-addr", "--address", "--nodelist", "--exclude", "-w", "-x")


def _is_address_key(key: str) -> bool:
    """A recipe key, an override's or a flag's name that holds host names or addresses."""
    key = key.lower().rsplit(".", 1)[-1].lstrip("-")
    return any(word in key for word in ("addr", "host", "url", "nodelist", "exclude"))


def _local_host(text: str) -> bool:
    """A host (or host:port) that names this machine only: loopback, or every interface."""
    host = text.strip()
    if host.startswith("[") and "]" in host:
        host = host[1 : host.index("]")]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if host.lower() in _LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Scrub:
    """Rewrites local paths and addresses for publication (see the module docstring)."""

    def __init__(self, run_dir: Path | None, start: Path | None):
        self.bases: list[tuple[Path, str | None]] = []  # (folder, shown as); None: relative to it
        for folder, shown in ((start, None), (run_dir, RUN)):
            if folder is not None:
                for variant in {Path(os.path.abspath(folder)), folder.resolve()}:
                    self.bases.append((variant, shown))

    def path(self, text: str) -> str:
        """An absolute (or ~) path: relative to the start folder, under `<run>`, or `<local>/NAME`."""
        full = Path(os.path.normpath(os.path.expanduser(text)))
        for base, shown in self.bases:
            if full == base or base in full.parents:
                rel = full.relative_to(base).as_posix()
                if shown is None:
                    return rel
                return shown if rel == "." else f"{shown}/{rel}"
        return f"{LOCAL}/{full.name}" if full.name else LOCAL

    def token(self, token: str, key: str = "") -> str:
        """One word of a value or a command: a path, `NAME=VALUE`, or text with URLs and IPs."""
        if key and _is_address_key(key):
            return self.address(token)
        if token.startswith(("/", "~/")):
            return self.path(token)
        name, eq, value = token.partition("=")
        if eq and name and not name.startswith(("/", "~")):
            if _is_address_key(name):
                return f"{name}={ADDRESS}"
            if value.startswith(("/", "~/")):
                return f"{name}={self.path(value)}"
        return self.addresses(token)

    def address(self, text: str) -> str:
        """The value of an address key: a URL with its host hidden, else `<address>` (this machine's
        kept: it points nowhere else)."""
        if "://" in text:
            return self.addresses(text)
        return text if _local_host(text) else ADDRESS

    @staticmethod
    def addresses(text: str) -> str:
        """URLs' hosts and IPv4 addresses (but this machine's) as `<address>`."""
        text = _URL.sub(lambda m: m.group(0) if _local_host(m.group(2)) else m.group(1) + ADDRESS, text)
        return _IPV4.sub(lambda m: m.group(0) if _local_host(m.group(0)) else ADDRESS, text)

    def value(self, data: Any, key: str = "") -> Any:
        """A recipe value, every string in it rewritten (the key of a list is its items')."""
        if isinstance(data, dict):
            return {k: self.value(v, str(k)) for k, v in data.items()}
        if isinstance(data, list):
            return [self.value(v, key) for v in data]
        if not isinstance(data, str):
            return data
        if key and _is_address_key(key):
            return self.address(data)
        return re.sub(r"\S+", lambda m: self.token(m.group(0)), data)


def _start_dirs(run_dir: Path) -> list[tuple[Path | None, list[str]]]:
    """(the folder it was typed in, the command's words) of each `areal train` of the run (commands.log:
    `TIME  cd DIR && areal train ...`), oldest first."""
    from arealcli.runtime.run.session import COMMANDS_LOG

    try:
        lines = (run_dir / COMMANDS_LOG).read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[Path | None, list[str]]] = []
    for line in lines:
        if "  " not in line:
            continue
        try:
            words = shlex.split(line.split("  ", 1)[1])
        except ValueError:
            continue
        if len(words) >= 3 and words[0] == "cd" and words[2] == "&&":
            out.append((Path(words[1]), words[3:]))
        else:
            out.append((None, words))
    return out


def public_recipe(recipe: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run's recipe as a published card and export show it: local paths relative to the folder the
    run was first started from (`<run>/...`, `<local>/NAME` for the others), addresses `<address>`."""
    starts = _start_dirs(run_dir)
    return _Scrub(run_dir, starts[0][0] if starts else None).value(recipe)


def public_command(words: list[str], start: Path | None, run_dir: Path) -> str:
    """A command line as published: its paths and addresses rewritten as `public_recipe`'s, relative to
    the folder it was typed in."""
    scrub = _Scrub(run_dir, start)
    out: list[str] = []
    for i, word in enumerate(words):
        after_flag = i > 0 and words[i - 1] in _ADDRESS_FLAGS
        out.append(ADDRESS if after_flag else scrub.token(word))
    return " ".join(_quote(w) for w in out)


def _quote(word: str) -> str:
    """shlex's quoting, except for the placeholders (`<run>/x` reads better bare)."""
    plain = word
    for mark in (ADDRESS, RUN, LOCAL):
        plain = plain.replace(mark, "X")
    return word if shlex.quote(plain) == plain else shlex.quote(word)


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
    """The `areal train` commands of the run, as commands.log records them (oldest first), without the
    folder they were typed in, and published (`public_command`)."""
    return [public_command(words, start, run_dir) for start, words in _start_dirs(run_dir)]


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
        + "The run's resolved recipe (overrides applied, presets expanded) is `recipe.yaml` in this "
        "folder, shown below. Its local paths are relative to the folder the run was started from "
        "(`<local>/NAME`: a file or folder elsewhere on the machine that trained it, `<run>/...`: in the "
        "run's own folder) and server addresses read `<address>`: with the recipe in that folder and "
        "those filled in, this command trains the same model again (with the same data, torch build "
        "and CPU kind or GPU):\n\n"
        f"```\nareal train recipe.yaml -o runs/{experiment}\n```\n\n"
        f"<details><summary>recipe.yaml</summary>\n\n```yaml\n{text}```\n\n</details>\n"
    )

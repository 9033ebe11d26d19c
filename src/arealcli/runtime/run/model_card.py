"""The model card (`README.md`) of an exported model: what was trained, from which base, on which data,
with which recipe and command, for how many steps, and its held-out scores over training (from the run's
`metrics.jsonl`, up to the exported step), with the Hub's metadata block on top.

A card is written to be published, so it shows no local absolute path, host name or address
(`published`: the recipe and commands.log's commands, worked out once for the card and the export):
- local paths (the values of path keys such as `path` and `output_dir`, command words, and strings that
  are a path as a whole) under the folder the run was started from are shown relative to it (the run's
  own files too when the run lies in it, as `runs/NAME/...`), the run's files otherwise as `<run>/...`,
  other local paths by their last name (`<local>/NAME`), file:// URLs' paths likewise;
- server addresses and host names (keys `addresses`, `host`, `*_url`, `--master-addr`, IP addresses) as
  `<address>`, but this machine's own (loopback, 0.0.0.0, ::), which point nowhere else;
- free text (prompts, chat templates, stop strings) stays as written, but for the hosts of URLs that name
  a machine rather than a public site (an IP address, a name of one label, a private domain) and IPv4
  addresses.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from arealcli.runtime.console.report import LOWER_IS_BETTER, read_metrics
from arealcli.runtime.run.session import COMMANDS_LOG
from arealcli.runtime.run.targets import ModelCheckpoint
from arealcli.runtime.wire.hosts import is_loopback_host

CARD_MARK = "<!-- written by areal export"
MAX_ROWS = 25  # held-out rows shown; more are thinned evenly (first and last kept)


def model_card(
    found: ModelCheckpoint, recipe: dict[str, Any], shown: Published, adapter: bool, folder: Path
) -> str:
    """The card of the export being written in `folder` (its other files are there already). `recipe`
    is the run's own; `shown` what of it and of its commands is published (`published`)."""
    assert found.run_dir is not None and found.model is not None and found.step is not None
    spec = (recipe.get("models") or {}).get(found.model) or {}  # (the Hub names in it are not local)
    shown_spec = (shown.recipe.get("models") or {}).get(found.model) or {}
    rows = [r for r in read_metrics(found.run_dir) if isinstance(r.get("step"), int)]
    experiment = shown.recipe.get("experiment") or found.run_dir.name
    parts = [
        _front_matter(recipe, spec, adapter),
        f"{CARD_MARK}: `areal export --force` may replace this folder -->\n",
        f"# {experiment}: model `{found.model}` at step {found.step}\n",
        _summary(shown.recipe, found, adapter),
        _facts(shown.recipe, shown_spec, found, rows, adapter),
        _results(rows, found.step),
    ]
    if (folder / "report.png").is_file():
        parts.append("## Training curves\n\n![metrics of the run over training](report.png)\n")
    local_base = shown_spec.get("path") if adapter and not _is_hub_name(spec.get("path")) else None
    parts += [_usage(adapter, tokenizer_class(folder), local_base), _reproduce(shown.recipe, shown.commands)]
    return "\n".join(parts)


# ------------------------------------------------------------------ what a published card may show

ADDRESS = "<address>"
RUN = "<run>"
LOCAL = "<local>"
_ANY_INTERFACE = ("0.0.0.0", "::")  # every interface: like loopback, it points at no other machine
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)(\[[^\]]*\]|[^/\s'\"?#]+)")
_FILE_URL = re.compile(r"(?i)(file://)([^/\s'\"]*)(/[^\s'\"]*)")  # (host, often empty) and the path
_IPV4 = re.compile(r"(?<![\w.])\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?(?![\w.])")
_ADDRESS_FLAGS = ("--master-addr", "--address")  # `areal train`'s flags whose value is a host
_PATH_KEYS = ("path", "output_dir", "python", "python_executable")
_COMMAND_KEYS = ("extra_args", "sbatch_args", "setup")  # command-line words and shell lines
_PRIVATE_SUFFIXES = (
    ".local",
    ".localdomain",
    ".lan",
    ".home",
    ".home.arpa",
    ".internal",
    ".intranet",
    ".corp",
)


def _key_name(key: str) -> str:
    """The last name of a recipe key, an override's dotted key or a flag (`a.b.path`, `--master-addr`)."""
    return key.lower().rsplit(".", 1)[-1].lstrip("-")


def _is_address_key(key: str) -> bool:
    """A recipe key, an override's or a flag's name that holds host names or addresses."""
    return any(word in _key_name(key) for word in ("addr", "host", "url", "nodelist", "exclude"))


def _is_path_key(key: str) -> bool:
    """A recipe key that holds a path (a model's, the data's, the run's folder, a Python)."""
    name = _key_name(key)
    return name in _PATH_KEYS or name.endswith(("_path", "_dir", "_file", "_folder"))


def _absolute(text: str) -> bool:
    return text.startswith(("/", "~/")) or text == "~"


def _is_path(text: str) -> bool:
    """A string that is a local path as a whole: absolute, and there on this machine or of two names or
    more without spaces (`/no_think`, `/` or a sentence that starts with a slash is text)."""
    if not _absolute(text) or "\n" in text:
        return False
    full = os.path.normpath(os.path.expanduser(text))
    names = [n for n in full.split(os.sep) if n]
    if not names:
        return False
    return os.path.lexists(full) or (len(names) >= 2 and not any(c.isspace() for c in text))


def _host(netloc: str) -> str:
    """The host of `host`, `host:port`, `[v6]:port` (a bare IPv6 address is its own host)."""
    netloc = netloc.strip()
    if netloc.startswith("[") and "]" in netloc:
        return netloc[1 : netloc.index("]")]
    return netloc.split(":", 1)[0] if netloc.count(":") == 1 else netloc


def _local_host(netloc: str) -> bool:
    """A host (or host:port) that names this machine only: loopback, or every interface."""
    host = _host(netloc)
    return host in _ANY_INTERFACE or is_loopback_host(host)


def _public_host(netloc: str) -> bool:
    """A name of the public internet (`huggingface.co`), kept in text: dotted, not an IP address, not a
    private domain (`.local`, `.internal`, ...), no credentials. A name of one label (`gpu-node-17`) or an
    address names a machine of the site that trained the model."""
    if "@" in netloc:
        return False
    name = _host(netloc).lower().rstrip(".")
    if "." not in name or name.endswith(_PRIVATE_SUFFIXES):
        return False
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return True
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

    def value(self, data: Any, key: str = "") -> Any:
        """A recipe value, every string in it rewritten (the key of a list is its items')."""
        if isinstance(data, dict):
            return {k: self.value(v, str(k)) for k, v in data.items()}
        if isinstance(data, list):
            return [self.value(v, key) for v in data]
        return self.text(data, key) if isinstance(data, str) else data

    def text(self, text: str, key: str = "") -> str:
        """One string of the recipe under `key`: an address, command words, a path, or free text."""
        if _is_address_key(key):
            return self.address(text)
        if _key_name(key) in _COMMAND_KEYS:
            return re.sub(r"\S+", lambda m: self.word(m.group(0)), text)
        if _is_path(text) or (_is_path_key(key) and _absolute(text)):
            return self.path(text)
        return self.free(text)

    def word(self, word: str) -> str:
        """One word of a command line: a path, `--flag=VALUE`, an override `KEY=VALUE`, or other text."""
        if _absolute(word):
            return self.path(word)
        name, eq, value = word.partition("=")
        if not (eq and name) or name.startswith("~"):
            return self.free(word)
        if not name.startswith("-"):
            return f"{name}={self.text(value, name)}"  # an override: as the recipe's value of that key
        if name in _ADDRESS_FLAGS or _is_address_key(name):
            return f"{name}={ADDRESS}"
        return f"{name}={self.path(value) if _absolute(value) else self.free(value)}"

    def address(self, text: str) -> str:
        """The value of an address key: a URL with its host hidden, else `<address>` (this machine's
        kept: it points nowhere else)."""
        if "://" in text:
            return self.urls(text, _local_host)
        return text if _local_host(text) else ADDRESS

    def free(self, text: str) -> str:
        """Free text (a prompt, a chat template, a stop string) stays as written but for the hosts of URLs
        that name a machine (`_public_host`), the paths of file:// URLs, and IPv4 addresses (but this
        machine's)."""
        text = self.urls(text, lambda netloc: _local_host(netloc) or _public_host(netloc))
        return _IPV4.sub(lambda m: m.group(0) if _local_host(m.group(0)) else ADDRESS, text)

    def urls(self, text: str, keep: Callable[[str], bool]) -> str:
        """URLs' hosts but those `keep` keeps as `<address>`; file:// URLs' paths as `path`'s."""

        def host(m: re.Match[str]) -> str:
            if m.group(1).lower() == "file://" or keep(m.group(2)):
                return m.group(0)
            return m.group(1) + ADDRESS

        def file(m: re.Match[str]) -> str:
            where = m.group(2) if not m.group(2) or _local_host(m.group(2)) else ADDRESS
            shown = self.path(m.group(3))
            return f"file://{where}{shown}" if shown.startswith("<") else f"file:{shown}"

        return _FILE_URL.sub(file, _URL.sub(host, text))


def _start_dirs(run_dir: Path) -> list[tuple[Path | None, list[str]]]:
    """(the folder it was typed in, the command's words) of each `areal train` of the run (commands.log:
    `TIME  cd DIR && areal train ...`), oldest first."""
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


@dataclass(frozen=True)
class Published:
    """What an export publishes of a run's recipe and commands (commands.log read once)."""

    recipe: dict[str, Any]  # `public_recipe`
    commands: list[str]  # the `areal train` commands of commands.log, oldest first, as `public_command`


def published(recipe: dict[str, Any], run_dir: Path) -> Published:
    """The run's recipe and commands as an export shows them (`public_recipe`, `public_command`)."""
    starts = _start_dirs(run_dir)
    shown = _Scrub(run_dir, starts[0][0] if starts else None).value(recipe)
    return Published(shown, [public_command(words, start, run_dir) for start, words in starts])


def public_recipe(recipe: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The run's recipe as a published card and export show it: local paths (the values of path keys,
    and strings that are a path as a whole) relative to the folder the run was first started from
    (`<run>/...` and `<local>/NAME` for the others, see the module docstring), addresses `<address>`;
    free text (prompts, templates, stop strings) as written but for URLs' hosts that name a machine."""
    return published(recipe, run_dir).recipe


def public_command(words: list[str], start: Path | None, run_dir: Path) -> str:
    """A command line as published: its paths and addresses rewritten as `public_recipe`'s, relative to
    the folder it was typed in."""
    scrub = _Scrub(run_dir, start)
    out: list[str] = []
    for i, word in enumerate(words):
        after_flag = i > 0 and words[i - 1] in _ADDRESS_FLAGS
        out.append(ADDRESS if after_flag else scrub.word(word))
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


def _usage(adapter: bool, tok_class: str, local_base: str | None = None) -> str:
    """How to load the export. Adapters over a local base (`local_base`, as published) need the reader's
    own copy of that base."""
    if adapter and local_base is not None:
        code = (
            "from peft import PeftModel\n"
            f"from transformers import AutoModelForCausalLM, {tok_class}\n\n"
            'base = AutoModelForCausalLM.from_pretrained("YOUR_COPY_OF_THE_BASE")\n'
            'model = PeftModel.from_pretrained(base, "THIS_FOLDER")  # these adapters over it\n'
            f'tokenizer = {tok_class}.from_pretrained("THIS_FOLDER")\n'
        )
        note = (
            f"The base model was a local folder (`{local_base}`; `base_model_name_or_path` in "
            "`adapter_config.json` says so): point it at your own copy of that base, or load the base "
            "first as below.\n\n"
        )
        return f"## Use\n\n{note}```python\n{code}```\n"
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
        "run's own folder, when that lay elsewhere) and server addresses read `<address>`: with the "
        "recipe in that folder and those filled in, this command trains the same model again (with the "
        "same data, torch build and CPU kind or GPU):\n\n"
        f"```\nareal train recipe.yaml -o runs/{experiment}\n```\n\n"
        f"<details><summary>recipe.yaml</summary>\n\n```yaml\n{text}```\n\n</details>\n"
    )

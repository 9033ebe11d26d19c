"""Local files a recipe needs (model directories, tokenizers, data files), checked before anything starts.

A path that does not exist is a warning for `areal check` (a recipe may be checked on a laptop for a
cluster) and an error for `areal train`, which refuses to start without it. A path that exists but is
the wrong thing (a directory given as a data file, a folder without `config.json` as a model, an
empty folder as a tokenizer) or cannot be used at all (`~nosuchuser/x`) is an error for both.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from arealcli.schema.recipe import Recipe
from arealcli.schema.registry import INTERFACES
from arealcli.schema.source import Path_

# Files one of which an HF tokenizer directory holds.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")


@dataclass
class PathProblem:
    where: Path_
    message: str
    missing: bool  # the path does not exist (a warning for `areal check`)


REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def hub_cache_dir() -> Path:
    """Where Hugging Face keeps downloaded repositories (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str, kind: str = "model") -> Path | None:
    """The local snapshot folder of a Hub repository in the cache (revision `main`), or None."""
    folder = hub_cache_dir() / f"{kind}s--{repo_id.replace('/', '--')}"
    ref = folder / "refs" / "main"
    if ref.is_file():
        snapshot = folder / "snapshots" / ref.read_text().strip()
        if snapshot.is_dir():
            return snapshot
    snapshots = sorted((folder / "snapshots").glob("*")) if (folder / "snapshots").is_dir() else []
    return snapshots[-1] if snapshots else None


def locate(path: str, recipe_dir: Path, kind: str = "model") -> Path | None:
    """A local path (absolute, or relative to `recipe_dir`), else a Hub name found in the cache, else None."""
    full = resolve(path, recipe_dir)
    if full.exists():
        return full
    if REPO_ID.match(path):
        return cached_snapshot(path, kind)
    return None


def resolve(path: str, recipe_dir: Path) -> Path:
    """`~` expanded; relative paths are relative to `recipe_dir`. Raises ValueError when unusable."""
    try:
        p = Path(path).expanduser()
    except RuntimeError as e:  # ~nosuchuser
        raise ValueError(f"cannot expand {path!r}: {e}") from None
    if "\x00" in path:
        raise ValueError(f"{path!r} contains a NUL character")
    return p if p.is_absolute() else recipe_dir / p


DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")


def _holds_data_files(folder: Path, max_entries: int = 10_000) -> bool | None:
    """Whether `folder` or one of its subfolders (`data/train.parquet`) holds a data file; None when there
    are too many entries to tell. Hidden files and folders are skipped, as the `datasets` library does."""
    pending, seen = [folder], 0
    for depth in range(2):
        subfolders = []
        for current in pending:
            entries = [e for e in _entries(current) if not e.name.startswith(".")]
            seen += len(entries)
            if seen > max_entries:
                return None
            if any(e.is_file() and Path(e.name).suffix in DATA_SUFFIXES for e in entries):
                return True
            subfolders += [Path(e.path) for e in entries if depth == 0 and e.is_dir()]
        pending = subfolders
    return False


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return list(it)
    except OSError:
        return []


def _kind_problem(full: Path, what: str) -> str | None:
    """Why an existing `full` is not usable as `what`, or None."""
    if what == "data path":
        if full.is_dir():
            saved = any((full / f).exists() for f in ("state.json", "dataset_dict.json"))
            if not saved and _holds_data_files(full) is False:
                return (
                    f"data folder {full} holds no data files ({', '.join(DATA_SUFFIXES)}) in it or its "
                    "subfolders one level down; give the file, or the folder that holds the files"
                )
            return None
        if full.suffix not in DATA_SUFFIXES:
            return f"data file {full} is not one of {', '.join(DATA_SUFFIXES)}"
        return None
    if what == "data file":
        if full.is_dir():
            return f"{what} {full} is a directory; give the JSONL file inside it (or a folder of data files)"
        if not os.access(full, os.R_OK):
            return f"{what} {full} is not readable (permissions)"
        return None
    if not full.is_dir():
        return f"{what} {full} is a file; give the directory (a Hugging Face model folder)"
    if what in ("model directory", REWARD_MODEL) and not (full / "config.json").is_file():
        return f"{what} {full} has no config.json; is it a Hugging Face model folder?"
    if what == REWARD_MODEL:
        return _not_a_reward_model(full)
    if what == "tokenizer directory" and not any((full / f).is_file() for f in TOKENIZER_FILES):
        return f"{what} {full} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...)"
    return None


REWARD_MODEL = "reward model directory"  # a model folder holding a trained reward model (rm_reward's)


def _not_a_reward_model(full: Path) -> str | None:
    """Why a model folder is not a saved reward model (a sequence classifier with a trained head)."""
    try:
        architectures = json.loads((full / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return f"{REWARD_MODEL} {full}: its config.json is not readable JSON"
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return None
    return (
        f"{full} is not a reward model (its config.json names {architectures or 'no architecture'}, not a "
        "...ForSequenceClassification): give a checkpoint or export of a model trained with the "
        "reward_model interface (e.g. recipes/rm-quickstart.yaml)"
    )


def _trained_heads(recipe: Recipe) -> set[str]:
    """The models some call scores responses with (their head must come trained)."""
    out = set()
    for call in recipe.dataflow.calls:
        entry = INTERFACES.find(call.interface.type_)
        if entry is not None and entry.trained_head and call.model is not None:
            out.add(call.model)
    return out


def _run_hint(full: Path, recipe_dir: Path) -> str:
    """For a missing path inside a run's checkpoints (`RUN/checkpoints/...`): that the run must be trained
    first, and with which recipe when one beside this recipe names that experiment."""
    parts = full.parts
    if "checkpoints" not in parts[1:]:
        return ""
    run = Path(*parts[: parts.index("checkpoints")])
    hint = f": a checkpoint of the run {_shown(run)}, which is not trained yet (or not that far)"
    for candidate in sorted(recipe_dir.glob("*.yaml")):
        try:
            text = candidate.read_text(errors="replace")
        except OSError:
            continue
        if re.search(rf"^experiment:\s*['\"]?{re.escape(run.name)}['\"]?\s*(#.*)?$", text, re.MULTILINE):
            return f"{hint}; run `areal train {_shown(candidate)}` first"
    return hint + "; train that run first"


def _shown(path: Path) -> str:
    """`path` relative to the current directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path.resolve())


def path_problems(recipe: Recipe, recipe_dir: Path) -> list[PathProblem]:
    """Every local file or directory the recipe names that is missing or not what it should be."""
    wanted: list[tuple[Path_, str, str]] = []
    scorers = _trained_heads(recipe)
    for name, m in recipe.models.items():
        if m.path:
            wanted.append(
                (("models", name, "path"), m.path, REWARD_MODEL if name in scorers else "model directory")
            )
    if recipe.tokenizer is not None and recipe.tokenizer.path:
        wanted.append((("tokenizer", "path"), recipe.tokenizer.path, "tokenizer directory"))
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key)
        path = getattr(spec.args, "path", None) if spec is not None else None
        if isinstance(path, str):
            kind = (
                "data file" if path.endswith(".jsonl") else "data path"
            )  # others: files, folders, Hub names
            wanted.append(((key, "args", "path"), path, kind))
    out = []
    for where, path, what in wanted:
        try:
            full = resolve(path, recipe_dir)
            found = locate(path, recipe_dir, "dataset" if what.startswith("data") else "model")
        except (ValueError, OSError) as e:
            out.append(PathProblem(where, f"{what} {path!r} is not a usable path ({e})", False))
            continue
        if found is None:
            hub = (
                f", nor {path!r} in the Hugging Face cache ({hub_cache_dir()})" if REPO_ID.match(path) else ""
            )
            hint = _run_hint(full, recipe_dir) if what.endswith("directory") else ""
            out.append(PathProblem(where, f"{what} {full} does not exist{hub}{hint}", True))
        elif (problem := _kind_problem(found, what)) is not None:
            out.append(PathProblem(where, problem, False))
    return out

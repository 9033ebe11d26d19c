"""Validate a recipe completely: structure, every component's own args, and the dataflow graph.

All problems are collected (never only the first) as `Problem`s carrying the path into the recipe, so
the command layer can print each one as `file:line:col: path: message (got value)`.
"""

from __future__ import annotations

import difflib
import re
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from arealcli.schema import plan, presets
from arealcli.schema.recipe import DataflowSpec, ModelSpec, Recipe, on_rollout_side
from arealcli.schema.registry import (
    BACKENDS,
    DATASETS,
    INTERFACES,
    NEEDED_CAPABILITY,
    Registry,
    RegistryError,
    import_plugins,
    suggest,
)
from arealcli.schema.source import Located, Path_

_MISSING = object()


@dataclass
class Problem:
    path: Path_
    message: str
    value: Any = _MISSING

    def format(self, src: Located) -> str:
        dotted = ".".join(str(p) for p in src.display_path(self.path)) or "<recipe>"
        got = "" if self.value is _MISSING else f" (got {_short(self.value)})"
        return f"{src.where(self.path)}: {dotted}: {self.message}{got}"


class RecipeInvalid(Exception):
    def __init__(self, problems: list[Problem], src: Located):
        self.problems, self.src = problems, src
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per problem; a problem seen through several generated calls is said once."""
        return list(dict.fromkeys(p.format(self.src) for p in self.problems))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --------------------------------------------------------------------------- pydantic errors -> Problems


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes / containers an annotation may hold (Optional, unions, list, dict)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [x for arg in typing.get_args(annotation) for x in _unwrap(arg)]
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return [annotation]


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the field at `loc` (to suggest valid keys)."""
    current: Any = model
    for part in loc:
        found = None
        for candidate in _unwrap(current):
            origin = typing.get_origin(candidate)
            if isinstance(candidate, type) and issubclass(candidate, BaseModel) and isinstance(part, str):
                field = candidate.model_fields.get(part)
                if field is not None:
                    found = field.annotation
                    break
            elif origin in (list, dict) and typing.get_args(candidate):
                found = typing.get_args(candidate)[-1]
                break
        if found is None:
            return None
        current = found
    for candidate in _unwrap(current):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def problems_from_validation_error(
    err: ValidationError, model: type[BaseModel], prefix: Path_ = ()
) -> list[Problem]:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        if e["type"] == "extra_forbidden":
            owner = _model_at(model, loc[:-1])
            options = list(owner.model_fields) if owner else []
            out.append(Problem(prefix + loc, f"unknown key{suggest(str(loc[-1]), options)}"))
            continue
        message = e["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if e["type"] == "missing":
            message = "required field is missing"
            owner = _model_at(model, loc)
            field_doc = owner.__doc__.strip().splitlines()[0] if owner and owner.__doc__ else ""
            if field_doc and owner is not None and owner is not model:
                message += f" ({field_doc})"
            out.append(Problem(prefix + loc, message))
            continue
        out.append(Problem(prefix + loc, message, e.get("input", _MISSING)))
    return out


# --------------------------------------------------------------------------- component args


def _abstractions(data: dict) -> list[tuple[Path_, Registry, Any]]:
    """(path, registry, raw value) of every `{type_, args}` in the raw recipe data."""
    found: list[tuple[Path_, Registry, Any]] = []
    models = data.get("models")
    if isinstance(models, dict):
        for name, spec in models.items():
            if isinstance(spec, dict):
                if spec.get("backend") is None:
                    spec["backend"] = {"type_": "hf"}  # the default, resolved like a written one
                found.append((("models", name, "backend"), BACKENDS, spec["backend"]))
    for key in ("dataset", "eval_dataset"):
        if isinstance(data.get(key), dict):
            found.append(((key,), DATASETS, data[key]))
    calls = (data.get("dataflow") or {}).get("calls") if isinstance(data.get("dataflow"), dict) else None
    if isinstance(calls, list):
        for i, call in enumerate(calls):
            if isinstance(call, dict) and "interface" in call:
                found.append((("dataflow", "calls", i, "interface"), INTERFACES, call["interface"]))
    return found


Typed = dict[Path_, BaseModel]  # path of a `{type_, args}` -> its validated, typed args


def _check_args(path: Path_, registry: Registry, raw: Any, typed: Typed) -> list[Problem]:
    if not isinstance(raw, dict) or not isinstance(raw.get("type_"), str):
        return []  # the structural pass reports it
    try:
        entry = registry.get(raw["type_"])
    except RegistryError as e:
        return [Problem(path + ("type_",), str(e))]
    args = raw.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return []  # the structural pass reports it
    try:
        # strict: the same rules as the recipe's own models (no coercion), for plugins' Args too
        typed[path] = entry.args_model.model_validate(args, strict=True)
    except ValidationError as e:
        return problems_from_validation_error(e, entry.args_model, path + ("args",))
    return []


def _at(recipe: Recipe, path: Path_) -> Any:
    """The object at `path` of a validated recipe (an `Abstraction`)."""
    node: Any = recipe
    for part in path:
        node = node[part] if isinstance(node, dict | list) else getattr(node, part)
    return node


# --------------------------------------------------------------------------- the dataflow graph


def _check_graph(data: dict, typed: Typed) -> list[Problem]:
    """Cross-references, checked on whichever parts of the recipe are themselves valid."""
    try:
        calls = DataflowSpec.model_validate(data.get("dataflow")).calls
    except ValidationError:
        return []  # reported by the structural pass
    raw_models = data.get("models") if isinstance(data.get("models"), dict) else {}
    models: dict[str, ModelSpec] = {}
    for name, raw in raw_models.items():
        try:
            models[name] = ModelSpec.model_validate(raw)
        except ValidationError:
            pass
    problems: list[Problem] = []
    produced_by: dict[str, str] = {}
    names: set[str] = set()
    for i, call in enumerate(calls):
        here: Path_ = ("dataflow", "calls", i)
        if call.name in names:
            problems.append(Problem(here + ("name",), "duplicate call name; names must be unique", call.name))
        names.add(call.name)
        try:
            entry = INTERFACES.get(call.interface.type_)
        except RegistryError:
            entry = None  # reported by the args pass
        if entry is not None:
            if call.type not in entry.call_types:
                problems.append(
                    Problem(
                        here + ("type",),
                        f"interface {entry.name!r} does not implement {call.type!r}; it implements "
                        f"{', '.join(sorted(entry.call_types)) or 'nothing'}",
                        call.type,
                    )
                )
            if entry.needs_model and call.model is None:
                problems.append(Problem(here + ("model",), f"interface {entry.name!r} needs a model"))
        if call.model is not None and call.model not in raw_models:
            problems.append(
                Problem(
                    here + ("model",), f"no such model{suggest(call.model, list(raw_models))}", call.model
                )
            )
        backend_args = typed.get(("models", call.model, "backend"))
        if call.type == "train_step" and backend_args is not None:
            if getattr(backend_args, "optimizer", "absent") is None:
                problems.append(
                    Problem(
                        ("models", call.model, "backend", "args"),
                        f"model {call.model!r} is trained by call {call.name!r} but its backend has no "
                        "optimizer; add `optimizer: {lr: ...}` to its backend args",
                    )
                )
        for j, key in enumerate(call.outputs):
            if key in produced_by:
                problems.append(
                    Problem(
                        here + ("outputs", j),
                        f"key {key!r} is already produced by call {produced_by[key]!r}",
                        key,
                    )
                )
            produced_by.setdefault(key, call.name)
    # Every input must be produced by an EARLIER call or come from the dataset. A key produced only by a
    # later call is a cycle (or a wrong order).
    dataset_keys = _dataset_keys(data.get("dataset"))
    for i, call in enumerate(calls):
        producers = {k: c for c in calls[:i] for k in c.outputs}
        earlier = set(producers)
        for j, key in enumerate(call.inputs):
            if key in producers and not _covers(producers[key], call):
                problems.append(
                    Problem(
                        ("dataflow", "calls", i, "inputs", j),
                        f"key {key!r} comes from {producers[key].name!r}, which does not run at every step "
                        f"{call.name!r} runs (check their start_step/end_step)",
                        key,
                    )
                )
            if key in earlier or dataset_keys is None or key in dataset_keys:
                continue
            later = [c.name for c in calls[i:] if key in c.outputs]
            if later:
                problems.append(
                    Problem(
                        ("dataflow", "calls", i, "inputs", j),
                        f"key {key!r} is produced by {later[0]!r}, which runs after {call.name!r}: "
                        "the graph has a cycle or the calls are out of order",
                        key,
                    )
                )
            else:
                problems.append(
                    Problem(
                        ("dataflow", "calls", i, "inputs", j),
                        f"key {key!r} is produced by no earlier call and not by the dataset"
                        f"{suggest(key, sorted(dataset_keys | earlier))}",
                        key,
                    )
                )
    problems.extend(_check_init_from(models, list(raw_models)))
    used = {c.model for c in calls if c.model is not None}
    sources = {getattr(m, k) for m in models.values() for k in ("init_from", "weights_from", "base_of")}
    for name in raw_models if used <= set(raw_models) else ():  # (a misspelled call model is said above)
        if name not in used and name not in sources:
            problems.append(
                Problem(
                    ("models", name),
                    f"model {name!r} is used by no call (and no model starts from or follows it)"
                    + _did_you_mean(name, sorted(used | {"actor", "ref", "critic", "actor_gen"})),
                )
            )
    trained = {c.model for c in calls if c.type == "train_step" and c.model is not None}
    for name, spec in models.items():
        src = spec.weights_from
        if src is None:
            continue
        where = ("models", name, "weights_from")
        if src == name:
            problems.append(Problem(where, "a model cannot follow its own weights", src))
        elif src not in raw_models:
            problems.append(Problem(where, f"no such model{suggest(src, list(raw_models))}", src))
        elif src not in trained:
            problems.append(
                Problem(
                    where,
                    f"model {src!r} is not trained by any call, so there are no weights to follow; "
                    f"name a trained model ({', '.join(sorted(trained)) or 'none'})",
                    src,
                )
            )
        if name in trained:
            problems.append(
                Problem(
                    where,
                    f"model {name!r} is trained and also follows {src!r}'s weights, which would overwrite "
                    "its training; drop weights_from or the train_step call",
                )
            )
    said: set[str] = set()
    for call in calls:  # a critic scores states: it needs a value head, and only a critic has one
        spec = models.get(call.model) if call.model is not None else None
        if spec is None or call.model in said:
            continue
        if call.interface.type_ == "ppo_critic" and not spec.value_head:
            problems.append(
                Problem(
                    ("models", call.model),
                    f"model {call.model!r} is the critic of call {call.name!r} but has no value head; "
                    "add `value_head: true`",
                )
            )
            said.add(call.model)
        elif call.interface.type_ in ("ppo_actor", "sft") and spec.value_head:
            problems.append(
                Problem(
                    ("models", call.model, "value_head"),
                    f"model {call.model!r} has a value head (a critic) but call {call.name!r} uses it as a "
                    f"language model ({call.interface.type_})",
                    True,
                )
            )
            said.add(call.model)
    problems.extend(_check_lora(calls, models, trained, typed))
    problems.extend(_check_capabilities(calls, models, trained))
    if data.get("rollout") is not None:
        problems.extend(_check_rollout(calls, models, trained, dataset_keys))
    trainer = data.get("trainer") if isinstance(data.get("trainer"), dict) else {}
    if trainer.get("eval_every_n_steps") is not None and data.get("eval_dataset") is None:
        problems.append(Problem(("trainer", "eval_every_n_steps"), "evaluation needs an `eval_dataset`"))
    return problems


def _check_lora(calls: list, models: dict[str, ModelSpec], trained: set[str], typed: Typed) -> list[Problem]:
    """LoRA: not on a value-head model; `base_of` names a LoRA model and is only used for inference."""
    problems = []
    lora = {n for n in models if getattr(typed.get(("models", n, "backend")), "lora", None) is not None}
    for name, spec in models.items():
        if name in lora and spec.value_head:
            problems.append(
                Problem(
                    ("models", name, "backend", "args", "lora"),
                    "LoRA on a value-head model (a critic) is not supported",
                )
            )
        if spec.base_of is None:
            continue
        where = ("models", name, "base_of")
        if spec.base_of not in models:
            problems.append(
                Problem(where, f"no such model{suggest(spec.base_of, list(models))}", spec.base_of)
            )
        elif spec.base_of not in lora:
            problems.append(
                Problem(
                    where,
                    f"model {spec.base_of!r} has no LoRA adapters (backend args `lora:`), so it has no separate base",
                    spec.base_of,
                )
            )
        if name in trained or spec.weights_from is not None:
            problems.append(
                Problem(
                    where,
                    "a base_of model shares another model's weights: it cannot be trained or follow weights",
                )
            )
    return problems


def _capabilities(spec: ModelSpec) -> frozenset[str] | None:
    if spec.base_of is not None:  # a view of another model's base weights
        return frozenset({"forward", "generate"})
    try:
        return BACKENDS.get(spec.backend.type_).capabilities
    except RegistryError:
        return None  # reported by the args pass


_CAN = {"train": "train", "forward": "run forward passes (log-probs, values)", "generate": "generate"}


def _check_capabilities(calls: list, models: dict[str, ModelSpec], trained: set[str]) -> list[Problem]:
    """Every call's model runs on a backend that can do the call; every follower can load weights."""
    problems = []
    for i, call in enumerate(calls):
        spec = models.get(call.model) if call.model is not None else None
        caps = _capabilities(spec) if spec is not None else None
        need = NEEDED_CAPABILITY[call.type]
        if caps is not None and need not in caps:
            fix = (
                "train a model on hf, fsdp or megatron and let this one follow it (`weights_from`)"
                if need == "train"
                else "run the call on a model with an in-process backend (hf, fsdp, megatron)"
            )
            problems.append(
                Problem(
                    ("dataflow", "calls", i, "type"),
                    f"call {call.name!r} is a {call.type} on model {call.model!r}, whose backend "
                    f"{spec.backend.type_!r} cannot {_CAN[need]} (it can: {', '.join(sorted(caps))}); {fix}",
                    call.type,
                )
            )
    for name, spec in models.items():
        caps = _capabilities(spec)
        if spec.weights_from is not None and caps is not None and "update_weights" not in caps:
            problems.append(
                Problem(
                    ("models", name, "backend", "type_"),
                    f"model {name!r} follows {spec.weights_from!r} (`weights_from`) but its backend "
                    f"{spec.backend.type_!r} cannot load new weights in place; use hf, local, sglang or vllm",
                    spec.backend.type_,
                )
            )
    return problems


def _check_rollout(
    calls: list, models: dict[str, ModelSpec], trained: set[str], dataset_keys: frozenset[str] | None
) -> list[Problem]:
    """Asynchronous rollout needs a generation model that follows a trained one on an inference backend,
    and rollout-side calls that need nothing from the training side."""
    problems = []
    where = ("rollout",)
    generators = [c for c in calls if c.type == "generate"]
    if not generators:
        return [
            Problem(where, "a rollout section needs a generate call (the rollout side has nothing to do)")
        ]
    for c in generators:
        spec = models.get(c.model) if c.model is not None else None
        if spec is None:
            continue  # a missing model is reported where the call names it
        caps = _capabilities(spec) or frozenset()
        if c.model in trained or spec.weights_from is None or "train" in caps:
            problems.append(
                Problem(
                    where,
                    f"asynchronous rollout generates on a generation model: call {c.name!r} runs on "
                    f"{c.model!r}, which "
                    + (
                        "is trained itself"
                        if c.model in trained
                        else "follows no trained model (`weights_from`)"
                        if spec.weights_from is None
                        else f"runs on the training backend {spec.backend.type_!r}"
                    )
                    + ". Add a model `actor_gen: {init_from: actor, weights_from: actor, backend: {type_: local}}`"
                    " (or sglang / vllm); the presets generate on it",
                )
            )
    produced = {c.name: set(c.outputs) for c in calls if on_rollout_side(c)}
    available = set(dataset_keys or ())
    for i, c in enumerate(calls):
        if not on_rollout_side(c):
            continue
        for j, key in enumerate(c.inputs):
            if (
                dataset_keys is not None
                and key not in available
                and not any(key in v for v in produced.values())
            ):
                problems.append(
                    Problem(
                        ("dataflow", "calls", i, "inputs", j),
                        f"call {c.name!r} runs on the rollout side (ahead of training) but needs {key!r}, "
                        "which only the training side produces",
                        key,
                    )
                )
    return problems


def _did_you_mean(name: str, options: list[str]) -> str:
    options = [o for o in options if o != name]
    close = difflib.get_close_matches(name.strip().lower(), options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_init_from(models: dict[str, ModelSpec], names: list[str]) -> list[Problem]:
    """`init_from` names another model of the recipe, and following it never comes back (no cycle)."""
    problems = []
    for name, spec in models.items():
        where = ("models", name, "init_from")
        if spec.init_from is None:
            continue
        if spec.init_from == name:
            problems.append(Problem(where, "a model cannot start from itself", spec.init_from))
        elif spec.init_from not in names:
            problems.append(Problem(where, f"no such model{suggest(spec.init_from, names)}", spec.init_from))
        else:
            chain, current = [name], spec.init_from
            while current in models and models[current].init_from is not None and current not in chain:
                chain.append(current)
                current = models[current].init_from
            if current in chain:
                cycle = " -> ".join([*chain[chain.index(current) :], current])
                problems.append(Problem(where, f"init_from forms a cycle: {cycle}", spec.init_from))
    return problems


def _covers(producer: Any, consumer: Any) -> bool:
    """Does the producer run at every step the consumer runs?"""
    if producer.start_step > consumer.start_step:
        return False
    if producer.end_step is None:
        return True
    return consumer.end_step is not None and consumer.end_step <= producer.end_step


def _dataset_keys(raw: Any) -> frozenset[str] | None:
    """Keys the training dataset provides; None when unknown (its own error is reported elsewhere)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type_"), str) or raw["type_"] not in DATASETS:
        return None
    return DATASETS.get(raw["type_"]).data_keys


# --------------------------------------------------------------------------- entry point


def validate(src: Located) -> Recipe:
    """Validate and resolve a located recipe; raises RecipeInvalid listing every problem.

    The returned recipe is fully typed: every `args` is its component's own argument model.
    """
    data = src.data
    plugin_paths(Path(src.file).resolve().parent)
    problems: list[Problem] = _check_imports(data.get("imports"))
    preset_problems = [Problem(path, msg) for path, msg in presets.expand_in_place(src)]
    typed: Typed = {}
    abstractions = _abstractions(data)
    for path, registry, raw in abstractions:
        problems.extend(_check_args(path, registry, raw, typed))
    recipe = None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        problems.extend(problems_from_validation_error(e, Recipe))
    if recipe is not None and len(typed) == len(abstractions):
        for path in typed:
            _at(recipe, path).args = typed[path]
        _paths_from_the_shell(recipe, src)
        problems.extend(Problem(path, msg) for path, msg in plan.plan_problems(recipe))
        problems.extend(_check_chat_workflows(recipe))
    problems.extend(_check_graph(data, typed))
    if preset_problems:  # the dataflow was not expanded: what else is said of it is noise
        problems = preset_problems + [p for p in problems if p.path[:1] != ("dataflow",)]
    if problems:
        problems.sort(key=lambda p: _line_of(src, src.display_path(p.path)))
        raise RecipeInvalid(problems, src)
    assert recipe is not None
    return recipe


def _check_chat_workflows(recipe: Recipe) -> list[Problem]:
    """The `function_calling` workflow renders whole conversations with the chat template: its prompts
    must be plain questions, and the tokenizer must have a template."""
    uses = any(
        getattr(getattr(call.interface.args, "workflow", None), "type_", None) == "function_calling"
        for call in recipe.dataflow.calls
    )
    if not uses:
        return []
    problems = []
    for name in ("dataset", "eval_dataset"):
        spec = getattr(recipe, name)
        if spec is not None and getattr(spec.args, "apply_chat_template", False):
            problems.append(
                Problem(
                    (name, "args", "apply_chat_template"),
                    "the function_calling workflow renders the conversation with the chat template itself: "
                    "give it plain questions (apply_chat_template: false)",
                    True,
                )
            )
    tok = recipe.tokenizer
    if tok is not None and tok.kind == "char" and tok.chat_template is None:
        problems.append(
            Problem(
                ("tokenizer",),
                "the function_calling workflow needs a chat template; the char tokenizer has none "
                "(set tokenizer.chat_template, one that writes <tool_call> calls)",
            )
        )
    return problems


def plugin_paths(recipe_dir: Path) -> None:
    """`imports:` finds modules in the current directory and beside the recipe (as `python -m` would
    find the first): both go on sys.path, after what is there."""
    for folder in (Path.cwd(), recipe_dir):
        entry = str(folder)
        if entry not in sys.path and folder.is_dir():
            sys.path.append(entry)


def _paths_from_the_shell(recipe: Recipe, src: Located) -> None:
    """A relative path given on the command line (`models.actor.path=ckpt/x`) means the shell's current
    directory, not the recipe's folder: make it absolute (a Hub name that is no local path stays)."""
    from arealcli.schema.paths import REPO_ID

    def overridden(path: Path_) -> bool:
        return any(tuple(path[:n]) in src.overridden for n in range(1, len(path) + 1))

    def fix(owner: Any, attr: str, path: Path_) -> None:
        value = getattr(owner, attr, None)
        if not isinstance(value, str) or not overridden(path) or value.startswith(("~", "/")):
            return  # (`~user` paths are expanded, and checked, where they are used)
        here = Path.cwd() / value
        if here.exists() or not REPO_ID.match(value):
            setattr(owner, attr, str(here))

    for name, spec in recipe.models.items():
        fix(spec, "path", ("models", name, "path"))
    if recipe.tokenizer is not None:
        fix(recipe.tokenizer, "path", ("tokenizer", "path"))
    for key in ("dataset", "eval_dataset"):
        spec = getattr(recipe, key)
        if spec is not None:
            fix(spec.args, "path", (key, "args", "path"))


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _check_imports(imports: Any) -> list[Problem]:
    """Import the recipe's plugin modules: a list of dotted module names (checked before importing)."""
    if imports is None:
        return []
    if not isinstance(imports, list):
        return []  # the structural pass reports it
    problems, modules = [], []
    for i, module in enumerate(imports):
        if isinstance(module, str) and _MODULE.match(module):
            modules.append((i, module))
        elif isinstance(module, str):
            problems.append(Problem(("imports", i), "not a module name (e.g. my_pkg.algo)", module))
    for i, module in modules:
        problems.extend(Problem(("imports", i), msg) for msg in import_plugins([module]))
    return problems


def _line_of(src: Located, path: Path_) -> tuple[int, int]:
    for n in range(len(path), -1, -1):
        if tuple(path[:n]) in src.positions:
            return src.positions[tuple(path[:n])]
    return (0, 0)

"""Name -> component registries, importable without torch.

Each registry entry carries the component's typed argument model, so `areal check` can validate a
recipe's `args` without importing the component (built-ins are named by `"module:Class"` strings and
imported only when built). User code registers with `register_*` from its own module, listed in the
recipe's `imports:` or exposed through the `arealcli.plugins` entry-point group.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, cast

from pydantic import BaseModel

from arealcli.schema.base import NoArgs

CALL_TYPES = ("generate", "inference", "train_step")
# What a backend's engine can do; a call type needs one of them, `weights_from` needs update_weights.
# "images": it gives a vision-language model its images (training and generating); a backend that does
# not say so is text only
BACKEND_CAPABILITIES = ("train", "forward", "generate", "update_weights", "images")
TEXT_CAPABILITIES = frozenset(BACKEND_CAPABILITIES) - {"images"}
NEEDED_CAPABILITY = {"train_step": "train", "inference": "forward", "generate": "generate"}


class RegistryError(Exception):
    """A name that is unknown or registered twice, or a plugin that cannot be imported."""


@dataclass
class Entry:
    name: str
    # "package.module:Class" (built-ins, imported lazily) or the object itself (a class, a function)
    target: str | Callable[..., Any]
    args_model: type[BaseModel]
    description: str
    origin: str
    # Interfaces only: the call types the interface implements, and whether it needs model weights.
    call_types: frozenset[str] = field(default_factory=frozenset)
    needs_model: bool = True
    # A weightless interface that must follow the trainer (it keeps training state, e.g. a KL
    # controller): with asynchronous rollout it runs on the training side, not ahead with the rewards.
    training_side: bool = False
    # Datasets only: the data keys every batch provides (tensor keys and meta keys).
    data_keys: frozenset[str] = field(default_factory=frozenset)
    # Backends only: what their engine can do (BACKEND_CAPABILITIES).
    capabilities: frozenset[str] = TEXT_CAPABILITIES
    # Interfaces only: what the checks, the batch plan and the progress line need to know of them.
    value_head: bool = False  # its model is a critic: it must have a value head
    trained_head: bool = False  # and that head must come trained (a reward model's checkpoint: `path`)
    language_model: bool = False  # it runs its model as a language model: it must have no value head
    learns_from_rewards: bool = False  # its train_step learns from rewards (metrics: reward, accuracy)
    trains_on_dataset: bool = False  # its train_step fits the dataset's sequences (one per prompt)
    trains_on_pairs: bool = False  # its train_step learns from preference pairs (a `pair` dataset)
    train_inputs: frozenset[str] = frozenset()  # keys its train_step must be given (another call makes)
    generates: bool = False  # its inference call generates on its model (a judge): the backend must generate
    # Rewards only: every score is 0 or 1 (held-out: an accuracy; otherwise the mean reward).
    binary: bool = False
    # Advantage estimators only: it compares the samples of one prompt (needs generation.n >= 2, and
    # sequence scores: the KL cannot be in the reward).
    group_based: bool = False
    # Preference losses only: it reads no reference model's log-probs (SimPO).
    reference_free: bool = False

    def load(self) -> Any:
        if isinstance(self.target, str):
            module, _, attr = self.target.partition(":")
            self.target = getattr(importlib.import_module(module), attr)
        return self.target


def did_you_mean(name: str, options: list[str]) -> str:
    """`; did you mean 'x'?` for the closest option, or nothing."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def suggest(name: str, options: list[str]) -> str:
    """`did_you_mean`, then every option: `; did you mean 'x'? available: a, b`."""
    available = ", ".join(sorted(options)) or "none"
    return f"{did_you_mean(name, options)} available: {available}"


class Registry:
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> None:
        old = self._entries.get(entry.name)
        if old is not None and old.target is not entry.target and old.target != entry.target:
            raise RegistryError(
                f"{self.kind} {entry.name!r} is registered twice: by {_describe(old)} and by {_describe(entry)}"
            )
        self._entries[entry.name] = entry

    def get(self, name: str) -> Entry:
        load_entry_point_plugins()
        if name not in self._entries:
            raise RegistryError(f"unknown {self.kind} {name!r}{suggest(name, list(self._entries))}")
        return self._entries[name]

    def find(self, name: str) -> Entry | None:
        """`get`, or None for an unknown name (reported where the name is checked)."""
        try:
            return self.get(name)
        except RegistryError:
            return None

    def validated(self, name: str) -> Entry:
        """`get` for a pydantic validator: an unknown name is a ValueError (with did-you-mean)."""
        try:
            return self.get(name)
        except RegistryError as e:
            raise ValueError(str(e)) from None

    def __contains__(self, name: str) -> bool:
        load_entry_point_plugins()
        return name in self._entries

    def entries(self) -> list[Entry]:
        load_entry_point_plugins()
        return sorted(self._entries.values(), key=lambda e: e.name)

    def names(self) -> list[str]:
        return [e.name for e in self.entries()]


def _describe(entry: Entry) -> str:
    t = entry.target
    return t if isinstance(t, str) else f"{t.__module__}:{t.__qualname__}"


INTERFACES = Registry("interface")
BACKENDS = Registry("backend")
DATASETS = Registry("dataset")
REWARDS = Registry("reward")
TOOLS = Registry("tool")
WORKFLOWS = Registry("workflow")
# Algorithm variants: plain functions over tensors, picked by name in an interface's args.
POLICY_LOSSES = Registry("policy loss")
ADVANTAGES = Registry("advantage estimator")
KL_ESTIMATORS = Registry("KL estimator")
PREFERENCE_LOSSES = Registry("preference loss")  # the `dpo` interface's `loss`
ALL = {
    "interfaces": INTERFACES,
    "backends": BACKENDS,
    "datasets": DATASETS,
    "rewards": REWARDS,
    "workflows": WORKFLOWS,
    "tools": TOOLS,
    "policy_losses": POLICY_LOSSES,
    "advantages": ADVANTAGES,
    "kl_estimators": KL_ESTIMATORS,
    "preference_losses": PREFERENCE_LOSSES,
}


def _args_model_of(obj: Any) -> type[BaseModel]:
    """The component's argument model: its `Args` (pydantic, or a dataclass made strict), or one made
    from its own dataclass fields (AReaL's style: `@dataclass class MyInterface(ModelInterface): eps:
    float = 0.2`)."""
    args = getattr(obj, "Args", None)
    if isinstance(args, type) and issubclass(args, BaseModel):
        return args
    if isinstance(args, type) and dataclasses.is_dataclass(args):  # `Args` a dataclass: cls(args) as usual
        model = dataclass_args_model(args)
        cast(Any, model).__dataclass_interface__ = False
        return model
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return dataclass_args_model(obj)
    return NoArgs


def dataclass_args_model(cls: type) -> type[BaseModel]:
    """A strict pydantic model of a dataclass's init fields (types, defaults; the field's `doc` metadata
    or nothing as description)."""
    from pydantic import ConfigDict, Field, create_model

    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # an annotation that does not resolve: say which class
        raise RegistryError(
            f"cannot read the argument types of {cls.__module__}.{cls.__qualname__}: {e}"
        ) from e
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        doc = f.metadata.get("doc") or f.metadata.get("help") or None
        if f.default is not dataclasses.MISSING:
            field = Field(f.default, description=doc)
        elif f.default_factory is not dataclasses.MISSING:
            field = Field(default_factory=f.default_factory, description=doc)
        else:
            field = Field(..., description=doc)
        fields[f.name] = (hints.get(f.name, Any), field)
    config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)
    model = create_model(f"{cls.__name__}Args", __config__=config, **fields)
    model.__doc__ = _doc_line(cls)
    # built from the fields: make_interface passes them as kwargs
    cast(Any, model).__dataclass_interface__ = True
    return model


def _doc_line(obj: Any) -> str:
    doc = (getattr(obj, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def implemented_call_types(cls: type) -> frozenset[str]:
    """Call types a ModelInterface subclass overrides (the base raises NotImplementedError)."""
    from_base = {}
    for base in cls.__mro__[1:]:
        if base.__name__ == "ModelInterface":
            from_base = {name: getattr(base, name) for name in CALL_TYPES}
    return frozenset(n for n in CALL_TYPES if getattr(cls, n, None) is not from_base.get(n))


def register_interface(
    name: str,
    cls: type,
    *,
    needs_model: bool | None = None,
    value_head: bool = False,
    language_model: bool = False,
    learns_from_rewards: bool = False,
    trains_on_dataset: bool = False,
    trains_on_pairs: bool = False,
) -> type:
    """Register a ModelInterface subclass; its `Args` (a pydantic model) validates recipe args. The flags
    say what it is (see `Entry`); the checks, the batch plan and the progress line read them."""
    INTERFACES.add(
        Entry(
            name,
            cls,
            _args_model_of(cls),
            _doc_line(cls),
            cls.__module__,
            implemented_call_types(cls),
            getattr(cls, "needs_model", True) if needs_model is None else needs_model,
            training_side=bool(getattr(cls, "training_side", False)),
            value_head=value_head,
            language_model=language_model,
            learns_from_rewards=learns_from_rewards,
            trains_on_dataset=trains_on_dataset,
            trains_on_pairs=trains_on_pairs,
        )
    )
    return cls


def register_backend(name: str, cls: type) -> type:
    """Register a ModelBackend subclass; its `Args` validates recipe args, its `capabilities` say which
    calls its models can run."""
    caps = frozenset(getattr(cls, "capabilities", TEXT_CAPABILITIES))
    unknown = sorted(caps - set(BACKEND_CAPABILITIES))
    if unknown:
        raise RegistryError(
            f"backend {name!r} declares unknown capabilities {unknown}; known: {BACKEND_CAPABILITIES}"
        )
    BACKENDS.add(Entry(name, cls, _args_model_of(cls), _doc_line(cls), cls.__module__, capabilities=caps))
    return cls


def dataset_keys(raw: Any) -> frozenset[str] | None:
    """Keys a raw `{type_, args}` dataset section provides; None when its type is unknown (reported
    elsewhere)."""
    kind = raw.get("type_") if isinstance(raw, dict) else None
    return DATASETS.get(kind).data_keys if isinstance(kind, str) and kind in DATASETS else None


def register_dataset(name: str, cls: type) -> type:
    """Register a dataset class built as `cls(args, tokenizer, base_dir)`; `cls.provides` lists its keys."""
    keys = frozenset(getattr(cls, "provides", ()))
    DATASETS.add(Entry(name, cls, _args_model_of(cls), _doc_line(cls), cls.__module__, data_keys=keys))
    return cls


def register_reward(name: str, fn: Any, binary: bool = False) -> Any:
    """Register a reward function `fn(prompts, responses, answers) -> list[float]` (one score per response;
    `answers[i]` is the list of reference answers of response i's prompt). `binary`: every score is 0 or
    1, so held-out evaluation reports it as `eval/accuracy` (else `eval/reward/<name>`, the mean)."""
    REWARDS.add(Entry(name, fn, NoArgs, _doc_line(fn), getattr(fn, "__module__", "?"), binary=binary))
    return fn


def register_workflow(name: str, cls: type) -> type:
    """Register an episode workflow: `cls(args)` with `run(engine, tokenizer, prompts, gconfig) -> [Episode]`
    (see arealcli.runtime.agents.workflows)."""
    WORKFLOWS.add(Entry(name, cls, _args_model_of(cls), _doc_line(cls), cls.__module__))
    return cls


def register_policy_loss(name: str, fn: Any) -> Any:
    """Register a policy loss `fn(logp, old_logp, advantages, mask, args, prox_logp=None) -> (loss,
    stats)`: (B, T) tensors (logp the only one with gradients), `args` the actor's PPOActorArgs; the
    actor picks it with `policy_loss: NAME`."""
    POLICY_LOSSES.add(Entry(name, fn, NoArgs, _doc_line(fn), getattr(fn, "__module__", "?")))
    return fn


def register_advantage(name: str, fn: Any, group_based: bool = False) -> Any:
    """Register an advantage estimator `fn(scores, advantages, mask, group_ids, args) -> (B, T)`: the
    sequence scores (B,), the returns call's GAE advantages and the loss mask (B, T), each sample's
    prompt group (B,), the actor's args; the actor picks it with `adv_norm: NAME`. `group_based`: it
    compares the n samples of a prompt."""
    ADVANTAGES.add(
        Entry(name, fn, NoArgs, _doc_line(fn), getattr(fn, "__module__", "?"), group_based=group_based)
    )
    return fn


def register_kl_estimator(name: str, fn: Any) -> Any:
    """Register a per-token KL estimator `fn(logp, ref_logp) -> (B, T)`; the actor's KL loss picks it
    with `kl_estimator: NAME`."""
    KL_ESTIMATORS.add(Entry(name, fn, NoArgs, _doc_line(fn), getattr(fn, "__module__", "?")))
    return fn


def register_preference_loss(name: str, fn: Any, reference_free: bool = False) -> Any:
    """Register a preference loss `fn(pairs, args) -> (loss (P,), chosen_reward (P,), rejected_reward
    (P,))`: `pairs` the summed log-probs of each pair's chosen and rejected response under the policy
    (with gradients) and the reference, and their token counts (runtime/interfaces/preference_losses.py);
    `args` the dpo interface's DPOArgs. `reference_free`: it reads no reference log-probs. The `dpo`
    interface picks it with `loss: NAME`."""
    PREFERENCE_LOSSES.add(
        Entry(name, fn, NoArgs, _doc_line(fn), getattr(fn, "__module__", "?"), reference_free=reference_free)
    )
    return fn


_entry_points_loaded = False
ENTRY_POINT_GROUP = "arealcli.plugins"


def load_entry_point_plugins() -> None:
    """Import every module exposed by installed packages under the `arealcli.plugins` group."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must not take down `areal list`
            raise RegistryError(f"plugin {ep.name!r} ({ep.value}) failed to import: {e}") from e


def import_plugins(modules: list[str]) -> list[str]:
    """Import a recipe's `imports:` list; returns one error message per module that fails. Modules in
    the current directory are found without PYTHONPATH."""
    import os
    import sys

    if modules and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    load_entry_point_plugins()
    errors = []
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            errors.append(f"cannot import {module!r}: {e}")
        except RegistryError as e:
            errors.append(f"importing {module!r}: {e}")
        except Exception as e:  # the plugin's own code failed: say where, without a traceback
            errors.append(f"importing {module!r} failed: {type(e).__name__}: {e}")
    return errors

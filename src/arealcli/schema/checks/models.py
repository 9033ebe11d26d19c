"""The models: where each starts from (`init_from`), which it follows (`weights_from`), that each is
used, that only a critic or a reward model has a value head, and that a reward model scoring responses
comes trained."""

from __future__ import annotations

from arealcli.schema.checks.context import Graph
from arealcli.schema.presets import MODEL_NAMES
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import CallSpec, ModelSpec
from arealcli.schema.registry import INTERFACES, did_you_mean, suggest


def check_init_from(g: Graph) -> list[Problem]:
    """`init_from` names another model of the recipe, and following it never comes back (no cycle)."""
    problems = []
    for name, spec in g.models.items():
        where = ("models", name, "init_from")
        if spec.init_from is None:
            continue
        if spec.init_from == name:
            problems.append(Problem(where, "a model cannot start from itself", spec.init_from))
        elif spec.init_from not in g.names:
            problems.append(
                Problem(where, f"no such model{suggest(spec.init_from, g.names)}", spec.init_from)
            )
        else:
            problems += _init_cycle(g.models, name, spec.init_from)
    return problems


def _init_cycle(models: dict[str, ModelSpec], name: str, first: str) -> list[Problem]:
    chain, current = [name], first
    while current in models and current not in chain:
        following = models[current].init_from
        if following is None:
            break
        chain.append(current)
        current = following
    if current not in chain:
        return []
    cycle = " -> ".join([*chain[chain.index(current) :], current])
    return [Problem(("models", name, "init_from"), f"init_from forms a cycle: {cycle}", first)]


def check_unused_models(g: Graph) -> list[Problem]:
    """Every model is run by a call, or is a model another one starts from or follows."""
    used = {c.model for c in g.calls if c.model is not None}
    if not used <= set(g.names):
        return []  # a misspelled call model is said where the call names it
    sources = {getattr(m, k) for m in g.models.values() for k in ("init_from", "weights_from", "base_of")}
    return [
        Problem(
            ("models", name),
            f"model {name!r} is used by no call (and no model starts from or follows it)"
            + did_you_mean(name.strip().lower(), [o for o in sorted(used | set(MODEL_NAMES)) if o != name]),
        )
        for name in g.names
        if name not in used and name not in sources
    ]


def check_weights_from(g: Graph) -> list[Problem]:
    """`weights_from` names another model that is trained, and the follower is not trained itself."""
    return [
        p
        for name, spec in g.models.items()
        if spec.weights_from is not None
        for p in _weights_from(g, name, spec.weights_from)
    ]


def _weights_from(g: Graph, name: str, src: str) -> list[Problem]:
    where = ("models", name, "weights_from")
    problems = []
    if src == name:
        problems.append(Problem(where, "a model cannot follow its own weights", src))
    elif src not in g.names:
        problems.append(Problem(where, f"no such model{suggest(src, g.names)}", src))
    elif src not in g.trained:
        message = (
            f"model {src!r} is not trained by any call, so there are no weights to follow; "
            f"name a trained model ({', '.join(sorted(g.trained)) or 'none'})"
        )
        problems.append(Problem(where, message, src))
    if name in g.trained:
        message = (
            f"model {name!r} is trained and also follows {src!r}'s weights, which would overwrite "
            "its training; drop weights_from or the train_step call"
        )
        problems.append(Problem(where, message))
    return problems


def check_value_heads(g: Graph) -> list[Problem]:
    """A critic scores states and a reward model responses: they need a value head, and only they have
    one (said once a model)."""
    problems, said = [], set()
    for call in g.calls:
        spec = g.spec_of(call)
        if spec is None or call.model is None or call.model in said:  # spec_of: None without a model
            continue
        problem = _value_head(call, call.model, spec)
        if problem is not None:
            problems.append(problem)
            said.add(call.model)
    return problems


def _value_head(call: CallSpec, model: str, spec: ModelSpec) -> Problem | None:
    entry = INTERFACES.find(call.interface.type_)
    if entry is not None and entry.value_head:
        if spec.value_head:
            return None
        return Problem(
            ("models", model),
            f"call {call.name!r} ({entry.name}: a critic or a reward model) reads a scalar head of model "
            f"{model!r}, which has none; add `value_head: true`",
        )
    if entry is not None and entry.language_model and spec.value_head:
        return Problem(
            ("models", model, "value_head"),
            f"model {model!r} has a value head (a critic) but call {call.name!r} uses it as a "
            f"language model ({call.interface.type_})",
            True,
        )
    return None


def check_trained_heads(g: Graph) -> list[Problem]:
    """A model that scores responses with its head (`rm_reward`) is a trained reward model: loaded from
    a checkpoint or export (`path`), not built from a config or another model (its head would be random)."""
    problems, said = [], set()
    for call in g.calls:
        entry = INTERFACES.find(call.interface.type_)
        spec = g.spec_of(call)
        if entry is None or not entry.trained_head or spec is None or spec.path is not None:
            continue
        if call.model in said:
            continue
        said.add(call.model)
        source = "`init_from`" if spec.init_from is not None else "`config`"
        problems.append(
            Problem(
                ("models", str(call.model)),
                f"model {call.model!r} scores responses in call {call.name!r} ({entry.name}), so it must be a "
                f"trained reward model, but it is built from {source} (its head would be random): give "
                "`path:` to a reward model's checkpoint or export (train one with the reward_model "
                "interface, e.g. recipes/rm-quickstart.yaml)",
            )
        )
    return problems

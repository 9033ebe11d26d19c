"""The calls of the dataflow: unique names, interfaces that implement them, models that exist, every key
produced once and before it is used."""

from __future__ import annotations

from typing import Any

from arealcli.schema.checks.context import Graph, call_path
from arealcli.schema.components.datasets import MARGIN, PAIR
from arealcli.schema.components.interfaces import REF_LOGPROBS, RETURNS_OUTPUTS, TOPK_IDS, TOPK_LOGPROBS
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import CallSpec
from arealcli.schema.registry import INTERFACES, suggest


def check_unique_name(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    if all(c.name != call.name for c in g.calls[:i]):
        return []
    return [Problem(call_path(i, "name"), "duplicate call name; names must be unique", call.name)]


def check_call_type(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    """The interface implements the call's type (an unknown interface is reported by the args pass)."""
    entry = INTERFACES.find(call.interface.type_)
    if entry is None or call.type in entry.call_types:
        return []
    implements = ", ".join(sorted(entry.call_types)) or "nothing"
    message = f"interface {entry.name!r} does not implement {call.type!r}; it implements {implements}"
    return [Problem(call_path(i, "type"), message, call.type)]


def check_needs_model(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    """The call names a model when its interface needs one (always, or as its args say: a judge
    without `url` is the call's model)."""
    entry = INTERFACES.find(call.interface.type_)
    if entry is None or call.model is not None:
        return []
    asked = getattr(g.typed.get(call_path(i, "interface")), "needs_model", None)
    if callable(asked) and asked():
        return [Problem(call_path(i, "model"), f"interface {entry.name!r} needs a model (or a `url`)")]
    if not entry.needs_model:
        return []
    return [Problem(call_path(i, "model"), f"interface {entry.name!r} needs a model")]


def check_model_exists(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    if call.model is None or call.model in g.names:
        return []
    return [Problem(call_path(i, "model"), f"no such model{suggest(call.model, g.names)}", call.model)]


def check_optimizer(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    """A trained model's backend has an optimizer (for backends whose args have one)."""
    if call.model is None:  # no backend args to look up (a missing model is said by check_needs_model)
        return []
    backend_args = g.typed.get(("models", call.model, "backend"))
    if call.type != "train_step" or backend_args is None:
        return []
    if getattr(backend_args, "optimizer", "absent") is not None:
        return []
    message = (
        f"model {call.model!r} is trained by call {call.name!r} but its backend has no "
        "optimizer; add `optimizer: {lr: ...}` to its backend args"
    )
    return [Problem(("models", call.model, "backend", "args"), message)]


# Where the keys an interface trains on come from, said when a train_step call is not given them.
_RETURNS = "made by a call of the `returns` interface before this one (the grpo and ppo presets add it)"
MADE_BY = {
    **dict.fromkeys(RETURNS_OUTPUTS, _RETURNS),
    REF_LOGPROBS: "made by an inference call of the reference model before this one (its packed_logprobs "
    "renamed: output_key_remap: {packed_logprobs: packed_ref_logprobs})",
    PAIR: "given by a dataset of preference pairs (dataset.type_: preference)",
    MARGIN: "given by a dataset of preference pairs (dataset.type_: preference)",
    **dict.fromkeys(
        (TOPK_IDS, TOPK_LOGPROBS),
        "made by an inference call of distill_topk on the teacher before this one (the distill preset "
        "with `topk:` adds it)",
    ),
}


def train_inputs(g: Graph, i: int, call: CallSpec) -> frozenset[str]:
    """The keys the call's interface trains on: its entry's, and those its args ask for (`dpo`: the
    reference's log-probs unless its loss is reference-free)."""
    entry = INTERFACES.find(call.interface.type_)
    wanted = entry.train_inputs if entry is not None else frozenset()
    asked = getattr(g.typed.get(call_path(i, "interface")), "train_inputs", None)
    return wanted | (frozenset(asked()) if callable(asked) else frozenset())


def check_train_inputs(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    """A train_step is given the keys its interface trains on (the actor and critic: the returns'; dpo:
    the pairs and the reference's log-probs), each group said with where it comes from."""
    if call.type != "train_step":
        return []
    missing = sorted(train_inputs(g, i, call) - set(call.inputs))
    by_source: dict[str, list[str]] = {}
    for key in missing:
        by_source.setdefault(MADE_BY.get(key, "made by an earlier call"), []).append(key)
    return [
        Problem(
            call_path(i, "inputs"),
            f"interface {call.interface.type_!r} trains on {', '.join(keys)}: add them to the inputs, {source}",
        )
        for source, keys in by_source.items()
    ]


def check_outputs_once(g: Graph, i: int, call: CallSpec) -> list[Problem]:
    """Each key is produced by one call only (the first producer is named)."""
    problems = []
    for j, key in enumerate(call.outputs):
        producers = [c.name for c in g.calls[:i] if key in c.outputs]
        producers += [call.name] if key in call.outputs[:j] else []
        if producers:
            message = f"key {key!r} is already produced by call {producers[0]!r}"
            problems.append(Problem(call_path(i, "outputs", j), message, key))
    return problems


# Run on each call in turn (the problems of one call stay together, in this order).
CALL_CHECKS = (
    check_unique_name,
    check_call_type,
    check_needs_model,
    check_model_exists,
    check_optimizer,
    check_train_inputs,
    check_outputs_once,
)


def check_calls(g: Graph) -> list[Problem]:
    return [p for i, call in enumerate(g.calls) for check in CALL_CHECKS for p in check(g, i, call)]


def _covers(producer: Any, consumer: Any) -> bool:
    """Does the producer run at every step the consumer runs?"""
    if producer.start_step > consumer.start_step:
        return False
    if producer.end_step is None:
        return True
    return consumer.end_step is not None and consumer.end_step <= producer.end_step


def check_producer_covers(g: Graph, i: int, j: int, key: str) -> list[Problem]:
    """The (last) earlier producer of an input runs at every step its consumer runs."""
    call = g.calls[i]
    producers = {k: c for c in g.calls[:i] for k in c.outputs}
    if key not in producers or _covers(producers[key], call):
        return []
    message = (
        f"key {key!r} comes from {producers[key].name!r}, which does not run at every step "
        f"{call.name!r} runs (check their start_step/end_step)"
    )
    return [Problem(call_path(i, "inputs", j), message, key)]


def check_produced_before(g: Graph, i: int, j: int, key: str) -> list[Problem]:
    """An input is produced by an EARLIER call or comes from the dataset. A key produced only by a later
    call is a cycle (or a wrong order)."""
    call = g.calls[i]
    earlier = {k for c in g.calls[:i] for k in c.outputs}
    if key in earlier or g.dataset_keys is None or key in g.dataset_keys:
        return []
    later = [c.name for c in g.calls[i:] if key in c.outputs]
    if later:
        message = (
            f"key {key!r} is produced by {later[0]!r}, which runs after {call.name!r}: "
            "the graph has a cycle or the calls are out of order"
        )
    else:
        message = (
            f"key {key!r} is produced by no earlier call and not by the dataset"
            f"{suggest(key, sorted(g.dataset_keys | earlier))}"
        )
    return [Problem(call_path(i, "inputs", j), message, key)]


# Run on each input of each call in turn.
INPUT_CHECKS = (check_producer_covers, check_produced_before)


def check_inputs(g: Graph) -> list[Problem]:
    return [
        p
        for i, call in enumerate(g.calls)
        for j, key in enumerate(call.inputs)
        for check in INPUT_CHECKS
        for p in check(g, i, j, key)
    ]

"""Recipe-wide rules: the plugin `imports:`, evaluation's data, preference pairs for the interfaces that
learn from them (and for no other), the function_calling workflow's needs."""

from __future__ import annotations

import re
from typing import Any

from arealcli.schema.checks.context import Graph, call_path
from arealcli.schema.components.datasets import PAIR
from arealcli.schema.problems import Problem
from arealcli.schema.recipe import Recipe
from arealcli.schema.registry import INTERFACES, dataset_keys, import_plugins
from arealcli.schema.source import mapping_at

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_imports(imports: Any) -> list[Problem]:
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


def check_eval_dataset(g: Graph) -> list[Problem]:
    trainer = mapping_at(g.data, "trainer")
    if trainer.get("eval_every_n_steps") is None or g.data.get("eval_dataset") is not None:
        return []
    return [Problem(("trainer", "eval_every_n_steps"), "evaluation needs an `eval_dataset`")]


def check_pair_data(g: Graph) -> list[Problem]:
    """An interface that learns from preference pairs (dpo) trains and is evaluated on a dataset of pairs;
    any other trains and is evaluated on one without (SFT on pairs would learn the rejected responses)."""
    problems = []
    evaluated = mapping_at(g.data, "trainer").get("eval_every_n_steps") is not None
    for section in ("dataset", "eval_dataset") if evaluated else ("dataset",):
        keys = g.dataset_keys if section == "dataset" else dataset_keys(g.data.get(section))
        if keys is None:
            continue  # an unknown type, or none: said elsewhere
        for i, call in enumerate(g.calls):
            entry = INTERFACES.find(call.interface.type_)
            if entry is None or call.type != "train_step" or entry.trains_on_pairs == (PAIR in keys):
                continue
            message = _pair_mismatch(entry.name, entry.trains_on_pairs, section, g.data[section].get("type_"))
            problems.append(Problem(call_path(i, "interface", "type_"), message, entry.name))
    return problems


def _pair_mismatch(interface: str, learns_from_pairs: bool, section: str, kind: str) -> str:
    if learns_from_pairs:
        return (
            f"interface {interface!r} learns from preference pairs, and the {section} ({kind}) has none: "
            "give it a dataset of type preference"
        )
    pairwise = " or ".join(e.name for e in INTERFACES.entries() if e.trains_on_pairs)
    return (
        f"the {section} ({kind}) holds preference pairs, which interface {interface!r} does not learn from "
        f"(SFT would learn the rejected responses too): train on pairs with {pairwise}, or give a dataset "
        "of prompts (prompt_answer, chat)"
    )


def check_chat_workflows(recipe: Recipe) -> list[Problem]:
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
                "(set tokenizer.chat_template, one that writes tool calls: Hermes <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS] or Qwen3-Coder)",
            )
        )
    return problems

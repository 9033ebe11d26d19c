"""MkDocs hook: the recipe reference and the CLI reference, generated from the code at build time.

A page's `<!-- generated: recipe-reference -->` ... `<!-- end generated -->` block is replaced by every recipe section's keys and
every registered component's `args` (type, default, meaning), walked the way `areal list` walks them
(the same pydantic models, so the two cannot disagree); a `cli-reference` block by every
command of the typer app with its usage, description and options, as `--help` prints them. Nothing is
written to docs/: the pages hold only the block (a note for readers of the plain file), so the
reference cannot go stale.
"""

from __future__ import annotations

import html
import re

GENERATED = re.compile(r"<!-- generated: ([a-z-]+) -->.*?<!-- end generated -->", re.S)

KIND_TITLES = {
    "interfaces": "Interfaces (`dataflow.calls.N.interface`, `dataflow.actor`, ...)",
    "backends": "Backends (`models.NAME.backend`)",
    "datasets": "Datasets (`dataset`, `eval_dataset`)",
    "rewards": "Reward functions (`reward_fn`, `eval_reward_fn`)",
    "workflows": "Workflows (`dataflow.actor.workflow`)",
    "tools": "Tools (a workflow's `tools`)",
    "policy_losses": "Policy losses (`dataflow.actor.policy_loss`)",
    "advantages": "Advantage estimators (`dataflow.actor.adv_norm`)",
    "kl_estimators": "KL estimators (`dataflow.actor.kl_estimator`)",
    "preference_losses": "Preference losses (the `dpo` interface's `loss`)",
}


def _prose(text: str) -> str:
    """Text with `<` / `>` outside code spans shown as written (`runs/<experiment>` is not an HTML tag)."""
    parts = str(text).split("`")
    return "`".join(p if i % 2 else html.escape(p, quote=False) for i, p in enumerate(parts))


def _cell(text: str) -> str:
    """Prose that stays inside one table cell: one line, pipes escaped."""
    return _prose(" ".join(str(text).split()).replace("|", "\\|"))


def _code(text: str) -> str:
    """A table cell's code: HTML, so a `|` (`float | None`) neither splits the row nor shows escaped."""
    text = html.escape(" ".join(str(text).split()), quote=False).replace("|", "&#124;")
    return f"<code>{text}</code>"


def _rows_table(rows: list[dict]) -> list[str]:
    """`key | type | default | meaning` rows of `areal list`'s walk, one per key."""
    from arealcli.schema.describe import readable

    if not rows:
        return ["No arguments.", ""]
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {_code(r['name'])} | {_code(r['type'])} | {_code(readable(r['default']))} "
            f"| {_cell(r['description'])} |"
        )
    return out + [""]


def section_keys() -> dict[str, list[dict]]:
    """Each recipe section's rows (`trainer.max_steps`, ...), as `areal list SECTION` shows them."""
    from arealcli.schema.describe import SECTIONS, section_rows

    return {name: section_rows(name) for name in SECTIONS}


def component_entries() -> dict[str, list[dict]]:
    """Each kind's registered components (built-ins and installed plugins), as `areal list KIND`."""
    from arealcli.schema.describe import KINDS, entry_payload
    from arealcli.schema.registry import ALL, import_plugins

    import_plugins([])
    return {k: [entry_payload(k, e, expand=True) for e in ALL[k].entries()] for k in KINDS}


def recipe_reference_markdown() -> str:
    """The recipe reference: every section and key, then every component's `args`."""
    from arealcli.schema.describe import entry_extras

    out = [
        "A recipe's top-level keys, then each section's keys as an override writes them "
        "(`areal train RECIPE trainer.max_steps=100`), then each registered component's `args` "
        "(`{type_: NAME, args: {...}}`). `NAME` and `N` stand for a model's name and a call's index. "
        "The same list in a terminal: `areal list SECTION` and `areal list NAME`.",
        "",
        "## Recipe sections",
        "",
    ]
    for name, rows in section_keys().items():
        title = "the recipe's top level" if name == "recipe" else f"`{name}`"
        out += [f"### {title} {{#section-{name}}}", "", *_rows_table(rows)]
    out += ["## Components", ""]
    for kind, entries in component_entries().items():
        title = KIND_TITLES.get(kind, kind.replace("_", " ").capitalize())
        out += [f"### {title} {{#{kind}}}", ""]
        for e in entries:
            extra = [
                f"{label}: {', '.join(f'`{v}`' for v in values)}" for label, values in entry_extras(kind, e)
            ]
            out += [f"#### `{e['name']}` {{#{kind}-{e['name']}}}", ""]
            about = _cell(e["description"])
            out += [f"{about}{' (' + '; '.join(extra) + ')' if extra else ''}", ""]
            out += _rows_table(e["args"])
    return "\n".join(out)


def _command_doc(name: str, command, parent_ctx) -> list[str]:
    """One command: usage, its docstring (examples as a code block) and its options."""
    from typer import _click as click

    ctx = click.Context(command, info_name=name, parent=parent_ctx)
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    help_text = command.help or ""
    about, _, examples = help_text.partition("\nExamples:\n")
    out = [f"## `areal {name}` {{#{name}}}", "", "```text", usage, "```", ""]
    out += [_prose(about.strip()), ""]
    params = [p.get_help_record(ctx) for p in command.params if not getattr(p, "hidden", False)]
    params = [p for p in params if p]
    if params:
        out += ["| argument / option | meaning |", "|---|---|"]
        out += [f"| {_code(sig)} | {_cell(meaning)} |" for sig, meaning in params]
        out += [""]
    examples, _, notes = examples.strip().partition("\n\n")  # the examples end at the first blank line
    if examples:
        out += ["Examples:", "", "```text", examples, "```", ""]
    if notes.strip():
        out += [_prose(notes.strip()), ""]
    return out


def cli_reference_markdown() -> str:
    """Every command of `areal`, in the order of `areal --help`."""
    import typer
    from typer import _click as click

    from arealcli.main import app

    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="areal")
    out = [
        f"{group.help} Each command's `--help` shows the same; a recipe's keys are in the "
        "[recipe reference](recipe.md).",
        "",
        "```text",
        group.get_usage(ctx).removeprefix("Usage: "),
        "```",
        "",
    ]
    for sig, meaning in (p.get_help_record(ctx) for p in group.params):
        out.append(f"- `{sig}`: {meaning}")
    out.append("")
    for name, command in group.commands.items():
        out += _command_doc(name, command, ctx)
    return "\n".join(out)


def reference_keys(markdown: str) -> set[str]:
    """The keys a generated reference lists (the first cell of its key tables)."""
    return {html.unescape(k) for k in re.findall(r"^\| <code>([^<]+)</code> \|", markdown, flags=re.M)}


GENERATORS = {"recipe-reference": recipe_reference_markdown, "cli-reference": cli_reference_markdown}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Put the generated references where their blocks stand."""
    return GENERATED.sub(lambda m: GENERATORS[m.group(1)](), markdown)

"""`areal init NAME [--from RECIPE]`: start a recipe from a shipped one (like torchtune's `tune cp`)."""

from __future__ import annotations

import re
from pathlib import Path

import typer
import yaml

from arealcli.commands.common import console, fail

SHIPPED = Path(__file__).resolve().parents[3] / "recipes"  # a clone's recipes/ (editable install)


def init(
    name: str = typer.Argument(
        None,
        metavar="NAME",
        help="Name of the new recipe (and its experiment): writes NAME.yaml here.",
        show_default=False,
    ),
    from_: str = typer.Option(
        "quickstart",
        "--from",
        metavar="RECIPE",
        help="A shipped recipe's name (areal init --list) or any recipe file.",
    ),
    list_: bool = typer.Option(False, "--list", help="List the shipped recipes.", metavar=""),
) -> None:
    """Copy a recipe to NAME.yaml with its experiment renamed and local paths made absolute.

    Examples:
    areal init --list
    areal init my-run
    areal init my-ppo --from ppo-quickstart
    """
    shipped = sorted(p.stem for p in SHIPPED.glob("*.yaml")) if SHIPPED.is_dir() else []
    if list_:
        for stem in shipped:
            first = (SHIPPED / f"{stem}.yaml").read_text().splitlines()[0].lstrip("# ")
            console.print(f"{stem:<24} {first}", highlight=False, soft_wrap=True)
        return
    if name is None:
        raise fail(
            [
                "give a NAME for the new recipe (areal init NAME [--from RECIPE]); --list shows the shipped ones"
            ]
        )
    source = Path(from_) if from_.endswith((".yaml", ".yml")) else SHIPPED / f"{from_}.yaml"
    if not source.is_file():
        hint = (
            f"; shipped: {', '.join(shipped)}"
            if shipped
            else " (shipped recipes come with a clone of the repository)"
        )
        raise fail([f"no recipe {from_!r}{hint}"])
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,99}", name):
        raise fail([f"{name!r} is not a name: use letters, digits, '_', '.' and '-'"])
    target = Path(f"{name}.yaml")
    if target.exists():
        raise fail([f"{target} already exists; pick another name or remove it"])
    text = rewrite(source.read_text(), source.resolve().parent, name)
    target.write_text(text)
    console.print(
        f"wrote {target} (from {source}); check it with: areal check {target}",
        highlight=False,
        soft_wrap=True,
    )


def rewrite(text: str, source_dir: Path, name: str) -> str:
    """The recipe text with `experiment: NAME`, relative local paths absolute (an environment server's
    `app` found where the source recipe's was: `app_dir`), and the `# Run:` comment naming the new file
    (other comments kept)."""
    data = yaml.safe_load(text) or {}
    paths: set[str] = set()
    for spec in (data.get("models") or {}).values():
        if isinstance(spec, dict) and isinstance(spec.get("path"), str):
            paths.add(spec["path"])
    for key in ("dataset", "eval_dataset"):
        args = (data.get(key) or {}).get("args") or {}
        if isinstance(args.get("path"), str):
            paths.add(args["path"])
    tok = data.get("tokenizer") or {}
    if isinstance(tok, dict) and isinstance(tok.get("path"), str):
        paths.add(tok["path"])
    for p in sorted(paths, key=len, reverse=True):
        if not Path(p).expanduser().is_absolute():
            text = re.sub(rf"(?<=[\s:{{,]){re.escape(p)}(?=[\s,}}]|$)", str((source_dir / p).resolve()), text)
    workflow = (((data.get("dataflow") or {}).get("actor") or {}).get("workflow") or {}).get("args") or {}
    if isinstance(workflow, dict) and workflow.get("app") and not workflow.get("app_dir"):
        # an environment server's module beside the source recipe: where the copy looks for it
        text = re.sub(r"(?m)^(\s+)app: .*$", rf"\g<0>\n\g<1>app_dir: {source_dir.resolve()}", text, count=1)
    text = re.sub(r"(?m)^experiment:.*$", f"experiment: {name}", text, count=1)
    text = re.sub(r"(?m)^(#.*\bRun: areal train )\S+", rf"\g<1>{name}.yaml", text)  # the new file's command
    schema = (source_dir / ".." / "recipe.schema.json").resolve()
    text = re.sub(
        r"(?m)^# yaml-language-server: \$schema=.*$", f"# yaml-language-server: $schema={schema}", text
    )
    return text

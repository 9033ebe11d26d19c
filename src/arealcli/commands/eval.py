"""`areal eval TARGET... [--data PATH] [--n 8] [--k 1,8] [-o results.json]`: greedy accuracy, avg@k,
pass@k and maj@k of checkpoints or served models on held-out prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from arealcli.commands.common import console, err_console, fail, say_error
from arealcli.commands.serve import Device
from arealcli.errors import UserError


def eval_(
    targets: list[str] = typer.Argument(
        ...,
        metavar="TARGET",
        help="Model folders, run directories (their latest checkpoint), checkpoints, or http(s) URLs of "
        "OpenAI-compatible servers; several are compared in one table.",
    ),
    data: str = typer.Option(
        None,
        "--data",
        metavar="PATH",
        help="Prompts with answers (a JSONL file, a folder, or a Hub dataset name); default: the run's "
        "eval_dataset.",
    ),
    recipe: Path = typer.Option(
        None,
        "--recipe",
        metavar="RECIPE",
        help="Take the tokenizer, eval_dataset, reward and generation settings from this recipe "
        "(default: the run's own recipe.yaml).",
    ),
    model: str = typer.Option(None, "--model", metavar="NAME", help="Run directory: which model."),
    step: int = typer.Option(
        None, "--step", min=0, metavar="N", help="Run directory: the checkpoint of step N."
    ),
    n: int = typer.Option(8, "--n", min=0, metavar="N", help="Samples per prompt (0: greedy only)."),
    k: str = typer.Option(
        None, "--k", metavar="K,K", help="The k of avg@k, pass@k, maj@k (default: 1 and n)."
    ),
    temperature: float = typer.Option(
        1.0, "--temperature", min=0.0, metavar="T", help="Sampling temperature."
    ),
    top_p: float = typer.Option(
        1.0, "--top-p", min=0.01, max=1.0, metavar="P", help="Nucleus sampling mass."
    ),
    max_new_tokens: int = typer.Option(
        None, "--max-new-tokens", min=1, metavar="N", help="Longest response (default: the recipe's)."
    ),
    greedy: bool = typer.Option(True, "--greedy/--no-greedy", help="Also decode greedily (greedy_accuracy)."),
    workflow: bool = typer.Option(
        True,
        "--workflow/--no-workflow",
        help="When the recipe's actor generates agentic episodes (a workflow): evaluate those, as training "
        "generates them (default), or plain completions.",
    ),
    reward: str = typer.Option(
        None,
        "--reward",
        metavar="NAME",
        help="Reward function (default: the recipe's held-out one, or math).",
    ),
    batch_size: int = typer.Option(
        None, "--batch-size", min=1, metavar="N", help="Prompts per generate call (default: the recipe's)."
    ),
    limit: int = typer.Option(None, "--limit", min=1, metavar="N", help="--data: the first N rows only."),
    split: str = typer.Option("test", "--split", metavar="NAME", help="--data: the split to read."),
    prompt_key: str = typer.Option("prompt", "--prompt-key", metavar="KEY", help="--data: the prompt field."),
    answer_key: str = typer.Option("answer", "--answer-key", metavar="KEY", help="--data: the answer field."),
    chat_template: bool = typer.Option(
        False, "--apply-chat-template", metavar="", help="--data: render prompts with the chat template."
    ),
    tokenizer: str = typer.Option(
        None, "--tokenizer", metavar="PATH", help="A tokenizer folder (URLs without a run or recipe)."
    ),
    device: Device = typer.Option(Device.auto, help="Local models: auto = cuda when available, else cpu."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the sampling and of the intervals."),
    output: Path = typer.Option(
        None, "--output", "-o", metavar="FILE", help="Write results here (JSON), and the samples beside it."
    ),
    send_key: bool = typer.Option(
        False,
        "--send-key",
        metavar="",
        help="URLs: send AREAL_API_KEY to those not on this machine too (loopback URLs get it always).",
    ),
) -> None:
    """Evaluate models on held-out prompts: greedy accuracy, avg@k, pass@k, maj@k.

    Examples:
    areal eval runs/quickstart
    areal eval runs/quickstart --data data/max3/test.jsonl --n 8 --k 1,8 -o results.json
    areal eval runs/quickstart/checkpoints/step_* --n 0
    areal eval http://127.0.0.1:30000 --recipe recipes/quickstart.yaml --n 4
    """
    from arealcli.runtime.eval.metrics import summarize
    from arealcli.runtime.eval.run import EvalPlan
    from arealcli.runtime.registry import reward_is_binary

    ks = _ks(k, n)
    try:
        setup = [_setup(t, recipe, model, step, tokenizer, data) for t in targets]
        settings = _settings(
            setup[0],
            data,
            reward,
            max_new_tokens,
            batch_size,
            limit,
            split,
            prompt_key,
            answer_key,
            chat_template,
            workflow,
        )
    except UserError as e:
        raise fail(e.lines) from None
    from arealcli.schema.components.engine import GenerationHyperparameters

    stop = settings["stop_token_ids"]
    plan = EvalPlan(
        settings["reward"],
        GenerationHyperparameters(greedy=True, max_new_tokens=settings["max_new_tokens"], stop_token_ids=stop)
        if greedy
        else None,
        GenerationHyperparameters(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=settings["max_new_tokens"],
            stop_token_ids=stop,
            greedy=temperature == 0,
        )
        if n > 0
        else None,
        seed,
    )
    if plan.greedy is None and plan.sampled is None:
        raise fail(["nothing to evaluate: --no-greedy and --n 0"])
    binary = reward_is_binary(plan.reward)
    _say_withheld_key([s.target for s in setup if s.found is None], send_key)
    reports = []
    for s in setup:
        try:
            results = _run_one(s, settings, plan, device.value, send_key)
        except UserError as e:
            raise fail(e.lines) from None
        metrics = summarize(results, ks, binary, seed=seed)
        reports.append((s.label, metrics, results))
    _table(reports)
    if output is not None:
        _write(
            output,
            reports,
            {
                **settings,
                "n": n,
                "k": ks,
                "temperature": temperature,
                "top_p": top_p,
                "greedy": greedy,
                "seed": seed,
                "targets": [s.label for s in setup],
            },
        )


def _say_withheld_key(urls: list[str], send_key: bool) -> None:
    """One line on stderr when AREAL_API_KEY is not sent to a URL target (not on this machine)."""
    from arealcli.runtime.serve.chat import key_withheld, withheld_note

    withheld = [url for url in urls if key_withheld(url, send_key)]
    if withheld:
        say_error(withheld_note(", ".join(withheld)), title="note")


def _ks(k: str | None, n: int) -> list[int]:
    if k is None:
        return sorted({1, n}) if n > 0 else []
    try:
        ks = sorted({int(x) for x in k.split(",") if x.strip()})
    except ValueError:
        raise fail([f"--k {k}: give integers separated by commas, e.g. --k 1,4,8"]) from None
    bad = [x for x in ks if not 1 <= x <= n]
    if bad:
        raise fail([f"--k {k}: every k must be between 1 and --n {n} (pass@k draws k of the n samples)"])
    return ks


@dataclass
class Target:
    """One TARGET: what the user typed, the model folder it means (None: a URL), and its recipe."""

    target: str
    found: Any  # ModelCheckpoint | None
    label: str  # how tables and results name it
    recipe: Any  # Recipe | None
    tokenizer: str | None  # --tokenizer
    recipe_dir: Path  # relative data paths of the recipe start here


def _setup(target, recipe_path, model, step, tokenizer_path, data) -> Target:
    """Where the target's model is, and the recipe that goes with it (a run's own, or --recipe)."""
    from arealcli.runtime.run.targets import find_model, is_url

    recipe = None
    if is_url(target):
        found, label = None, target
    else:
        found = find_model(Path(target), model, step)
        label = f"{found.run_dir} (step {found.step}, {found.model})" if found.run_dir is not None else target
    source = recipe_path or (found.run_dir / "recipe.yaml" if found is not None and found.run_dir else None)
    if source is not None:
        recipe = _load_recipe(source)
    if recipe is None and data is None:
        raise UserError(
            f"{target}: no recipe to take an eval_dataset from; give --data (and --recipe for URLs)"
        )
    recipe_dir = Path(source).resolve().parent if source is not None else Path.cwd()
    return Target(target, found, label, recipe, tokenizer_path, recipe_dir)


def _load_recipe(path: Path):
    from arealcli.schema.problems import RecipeInvalid
    from arealcli.schema.source import RecipeSourceError, load_recipe_source
    from arealcli.schema.validate import validate

    if not Path(path).is_file():
        raise UserError(f"{path}: no such recipe")
    try:
        return validate(load_recipe_source(Path(path)))
    except RecipeSourceError as e:
        raise UserError(*e.messages) from None
    except RecipeInvalid as e:
        raise UserError(f"{path} is not a valid recipe:", *e.lines()) from None


def _actor_args(recipe) -> Any:
    from arealcli.schema.components.interfaces import PPOActorArgs

    for c in recipe.dataflow.calls if recipe is not None else []:
        if isinstance(c.interface.args, PPOActorArgs):
            return c.interface.args
    return None


def _needs_answers(target: str, kind: str) -> None:
    """A run's eval_dataset without answers (a chat SFT run's conversations) has nothing to score: say so
    and what to give instead, before a model is loaded."""
    from arealcli.schema.registry import dataset_keys

    keys = dataset_keys({"type_": kind})
    if keys is not None and "answers" not in keys:
        raise UserError(
            f"{target}: its recipe's eval_dataset ({kind}) has no answers to score (its rows give "
            f"{', '.join(sorted(keys))}); give --data with prompts and answers (a JSONL file of "
            '{"prompt": ..., "answer": ...} rows, a folder or a Hub dataset)'
        )


def _settings(
    s, data, reward, max_new_tokens, batch_size, limit, split, prompt_key, answer_key, chat, use_workflow
):
    """Dataset, reward and generation settings: the flags, else the recipe's, else defaults."""
    from arealcli.runtime.registry import REWARDS

    recipe, actor = s.recipe, _actor_args(s.recipe)
    if data is not None:
        args = {
            "path": data,
            "split": split,
            "prompt_key": prompt_key,
            "answer_key": answer_key,
            "apply_chat_template": chat,
            **({"limit": limit} if limit else {}),
        }
        dataset = {
            "type_": "prompt_answer",
            "args": args,
            "batch_size": batch_size or 64,
            "base": str(Path.cwd()),
        }
    elif recipe.eval_dataset is None:
        raise UserError(f"{s.target}: its recipe has no eval_dataset; give --data")
    else:
        spec = recipe.eval_dataset
        _needs_answers(s.target, spec.type_)
        dataset = {
            "type_": spec.type_,
            "args": spec.args.model_dump(mode="json"),
            "batch_size": batch_size or spec.batch_size,
            "base": str(s.recipe_dir),
        }
    name = reward or (actor.eval_reward_fn if actor is not None and actor.eval_reward_fn else "math")
    if name not in REWARDS.names():
        raise UserError(
            f"--reward {name}: no such reward function (registered: {', '.join(REWARDS.names())})"
        )
    if max_new_tokens is None and actor is not None:
        max_new_tokens = actor.eval_max_new_tokens or actor.generation.max_new_tokens
    workflow = None
    if use_workflow and actor is not None and actor.workflow is not None:
        w = actor.workflow
        args = w.args.model_dump(mode="json") if hasattr(w.args, "model_dump") else w.args
        workflow = {"type_": w.type_, "args": args}
    return {
        "dataset": dataset,
        "workflow": workflow,
        "reward": name,
        "max_new_tokens": max_new_tokens or 256,
        "stop_token_ids": list(actor.generation.stop_token_ids) if actor is not None else [],
        "seed": recipe.seed if recipe is not None else 1,
    }


def _run_one(s, settings, plan, device: str, send_key: bool = False):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from arealcli.runtime.data.datasets import Batches
    from arealcli.runtime.data.tokenizer import load_tokenizer
    from arealcli.runtime.eval.run import evaluate
    from arealcli.runtime.registry import make_dataset
    from arealcli.runtime.serve.eval_targets import LocalTarget, RemoteTarget
    from arealcli.schema.recipe import DatasetSpec

    recipe, found = s.recipe, s.found
    tok_spec = recipe.tokenizer if recipe is not None else None
    fallback = s.tokenizer or (str(found.model_dir) if found is not None else None)
    if tok_spec is None and fallback is None:
        raise UserError(f"{s.target}: prompts go as token ids: give --tokenizer PATH or --recipe RECIPE")
    try:
        tok = load_tokenizer(tok_spec, fallback)
    except ValueError as e:
        raise UserError(f"{s.target}: {e}") from None
    d = settings["dataset"]
    spec = DatasetSpec(type_=d["type_"], args=d["args"], batch_size=d["batch_size"])
    dataset = make_dataset(spec, tok, d["base"])
    batches = Batches(dataset, min(spec.batch_size, len(dataset)), False, settings["seed"]).all_batches()
    target: LocalTarget | RemoteTarget
    if found is not None:
        target = LocalTarget(
            str(found.model_dir), tok, "cuda" if device == "cuda" else "cpu", workflow=settings["workflow"]
        )
    elif settings["workflow"] is not None:
        raise UserError(
            f"{s.target}: the recipe's actor generates episodes ({settings['workflow']['type_']}), which "
            "run their tools in this process: evaluate a checkpoint, or pass --no-workflow"
        )
    else:
        target = RemoteTarget(s.target, tok, send_key=send_key)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )
    try:
        with progress:
            task = progress.add_task(_short(s.label), total=len(dataset))
            return evaluate(target, batches, plan, lambda m: progress.advance(task, m))
    finally:
        target.close()


def _short(label: str, width: int = 40) -> str:
    return label if len(label) <= width else "…" + label[-(width - 1) :]


def _columns(reports) -> list[str]:
    return [m for m in reports[0][1] if not m.endswith("_ci95")]


def _fmt(name: str, v: float) -> str:
    return f"{v:.1f}" if name == "response_tokens" else f"{v:.3f}"


def _table(reports) -> None:
    cols = _columns(reports)
    if len(reports) == 1:
        label, metrics, results = reports[0]
        console.print(Text(f"{label}: {len(results)} prompts"), soft_wrap=True)
        table = Table()
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_column("95% interval", justify="right")
        for m in cols:
            lo, hi = metrics.get(f"{m}_ci95", (float("nan"), float("nan")))
            table.add_row(m, _fmt(m, metrics[m]), f"{_fmt(m, lo)} .. {_fmt(m, hi)}")
    else:
        table = Table()
        table.add_column("target", overflow="fold")
        for m in cols:
            table.add_column(m, justify="right")
        for label, metrics, _ in reports:
            table.add_row(_short(label), *(_fmt(m, metrics[m]) for m in cols))
    console.print(table)
    note = _footer(cols)
    if note:
        console.print(Text(note, style="dim"))


def _footer(cols: list[str]) -> str | None:
    """What the sampled scores mean, under the table: avg@k and pass@k differ even at k = 1 (avg@k
    reads the first k samples, pass@k all n), which a reader otherwise takes for a bug."""
    parts = []
    if any(c.startswith("avg@") for c in cols):
        parts.append("avg@k: mean reward of each prompt's first k samples")
    if any(c.startswith("pass@") for c in cols):
        parts.append("pass@k: chance that k of all n samples hold a correct one (unbiased estimator)")
    if any(c.startswith("maj@") for c in cols):
        parts.append("maj@k: majority answer of the first k samples is correct")
    if not parts:
        return None
    tail = "; avg@1 and pass@1 differ by sampling noise" if {"avg@1", "pass@1"} <= set(cols) else ""
    return "; ".join(parts) + tail + "."


def _write(output: Path, reports, config: dict[str, Any]) -> None:
    """results.json (config, metrics, per_prompt; `targets` when several) and the samples beside it."""

    def one(label, metrics, results) -> dict[str, Any]:
        return {"target": label, "metrics": metrics, "per_prompt": [r.row() for r in results]}

    body: dict[str, Any] = {"config": config}
    if len(reports) == 1:
        body.update(one(*reports[0]))
    else:
        body["targets"] = [one(*r) for r in reports]
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(body, indent=1) + "\n")
    samples = output.with_name(output.stem + ".samples.jsonl")
    with open(samples, "w") as f:
        for label, _, results in reports:
            for r in results:
                row = {
                    "target": label,
                    "prompt": r.prompt,
                    "answers": r.answers,
                    "greedy": r.greedy,
                    "greedy_reward": r.greedy_reward,
                    "completions": r.responses,
                    "rewards": r.rewards,
                }
                f.write(json.dumps(row) + "\n")
    console.print(Text(f"results: {output}; samples: {samples}"), soft_wrap=True)

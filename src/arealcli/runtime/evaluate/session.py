"""`areal eval`'s orchestration: what each TARGET is (`Target`), the settings every target is evaluated
with (`settings`), one target's evaluation (`run_one`), and the results written (`write`).

    flags = EvalFlags(...)                      -- the command line, as given
    job = plan(flags)                           -- targets, settings, EvalPlan; or UserError (exit 2)
    reports = [run_one(job, t, progress) ...]   -- (label, metrics, results) per target
    write(path, reports, job.config())          -- results.json + results.samples.jsonl

A reward model's folder (a sequence classifier) is scored on preference pairs instead: pairwise accuracy
(evaluate/pairs.py). Nothing here prints: the command shows the table (runtime/console/eval_table.py)
and the notes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arealcli.errors import UserError


@dataclass
class EvalFlags:
    """`areal eval`'s command line, as given."""

    targets: list[str]
    data: str | None
    recipe: Path | None
    model: str | None
    step: int | None
    n: int
    k: str | None
    temperature: float
    top_p: float
    max_new_tokens: int | None
    greedy: bool
    workflow: bool
    reward: str | None
    batch_size: int | None
    limit: int | None
    split: str
    prompt_key: str
    answer_key: str
    chat_template: bool
    tokenizer: str | None
    device: str
    seed: int
    output: Path | None
    send_key: bool


@dataclass
class Target:
    """One TARGET: what the user typed, the model folder it means (None: a URL), and its recipe."""

    target: str
    found: Any  # ModelCheckpoint | None
    label: str  # how tables and results name it
    recipe: Any  # Recipe | None
    tokenizer: str | None  # --tokenizer
    recipe_dir: Path  # relative data paths of the recipe start here


@dataclass
class EvalJob:
    """What `areal eval` will do: the targets, the settings they share, and the evaluation plan."""

    flags: EvalFlags
    ks: list[int]
    targets: list[Target]
    settings: dict[str, Any]
    plan: Any  # runtime.eval.run.EvalPlan; None for reward models (pairwise accuracy: evaluate/pairs.py)

    def binary(self) -> bool:
        from arealcli.runtime.registry import reward_is_binary

        if self.plan.scorer is not None:  # a judge: binary when its labels score 0 and 1
            return bool(self.plan.scorer.binary())
        return reward_is_binary(self.plan.reward)

    def withheld_urls(self) -> list[str]:
        """The URL targets AREAL_API_KEY is not sent to (not on this machine, no --send-key)."""
        from arealcli.runtime.serve.chat import key_withheld

        urls = [t.target for t in self.targets if t.found is None]
        return [url for url in urls if key_withheld(url, self.flags.send_key)]

    def config(self) -> dict[str, Any]:
        """results.json's `config`: the settings and the sampling flags."""
        f = self.flags
        if self.plan is None:  # reward models: nothing is sampled
            return {**self.settings, "seed": f.seed, "targets": [t.label for t in self.targets]}
        return {
            **self.settings,
            "n": f.n,
            "k": self.ks,
            "temperature": f.temperature,
            "top_p": f.top_p,
            "greedy": f.greedy,
            "seed": f.seed,
            "targets": [t.label for t in self.targets],
        }


def ks_of(k: str | None, n: int) -> list[int]:
    """The k of avg@k, pass@k and maj@k: --k, else 1 and n."""
    if k is None:
        return sorted({1, n}) if n > 0 else []
    try:
        ks = sorted({int(x) for x in k.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--k {k}: give integers separated by commas, e.g. --k 1,4,8") from None
    if any(not 1 <= x <= n for x in ks):
        raise UserError(f"--k {k}: every k must be between 1 and --n {n} (pass@k draws k of the n samples)")
    return ks


def plan(flags: EvalFlags) -> EvalJob:
    """Every target found and its recipe loaded (a run's checkpoints share one), the shared settings, the
    plan; or UserError, before any model is loaded (a bad last target costs no evaluation first)."""
    from arealcli.runtime.evaluate import pairs

    ks = ks_of(flags.k, flags.n)
    recipes: dict[Path, Any] = {}
    targets = [target_of(t, flags, recipes) for t in flags.targets]
    scorers = [pairs.is_reward_model(t) for t in targets]
    if any(scorers):
        if not all(scorers):
            raise UserError(
                "a reward model (scored on preference pairs) and generating models (on prompts) cannot share "
                "one table: evaluate them apart"
            )
        return EvalJob(flags, [], targets, pairs.settings(targets[0], flags), None)
    chosen = settings(targets[0], flags)
    job = EvalJob(flags, ks, targets, chosen, eval_plan(chosen, flags))
    if job.plan.greedy is None and job.plan.sampled is None:
        raise UserError("nothing to evaluate: --no-greedy and --n 0")
    for s in targets:
        _check_target(s, job)
    return job


def _check_target(s: Target, job: EvalJob) -> None:
    """What can be said of a target before its model loads: a server cannot run the recipe's episodes
    (their tools run here), and prompts go to it as token ids of a tokenizer we must have."""
    workflow = job.settings["workflow"]
    if s.found is None and workflow is not None:
        raise UserError(
            f"{s.target}: the recipe's actor generates episodes ({workflow['type_']}), which "
            "run their tools in this process: evaluate a checkpoint, or pass --no-workflow"
        )
    if _tokenizer_source(s) == (None, None):
        raise UserError(f"{s.target}: prompts go as token ids: give --tokenizer PATH or --recipe RECIPE")


def eval_plan(chosen: dict[str, Any], flags: EvalFlags):
    """Greedy decoding (unless --no-greedy) and n samples per prompt (unless --n 0)."""
    from arealcli.runtime.eval.run import EvalPlan
    from arealcli.schema.components.engine import GenerationHyperparameters

    stop, longest = chosen["stop_token_ids"], chosen["max_new_tokens"]
    greedy = (
        GenerationHyperparameters(greedy=True, max_new_tokens=longest, stop_token_ids=stop)
        if flags.greedy
        else None
    )
    sampled = (
        GenerationHyperparameters(
            n=flags.n,
            temperature=flags.temperature,
            top_p=flags.top_p,
            max_new_tokens=longest,
            stop_token_ids=stop,
            greedy=flags.temperature == 0,
        )
        if flags.n > 0
        else None
    )
    scorer = None
    if chosen["reward"] == JUDGE:
        from arealcli.runtime.evaluate.judge import JudgeScorer

        scorer = JudgeScorer(chosen.pop("_judge_args"), chosen["judge"].get("model"), None, flags.device)
    return EvalPlan(chosen["reward"], greedy, sampled, flags.seed, scorer)


def target_of(target: str, flags: EvalFlags, recipes: dict[Path, Any]) -> Target:
    """Where the target's model is, and the recipe that goes with it (a run's own, or --recipe)."""
    from arealcli.runtime.run.targets import find_model, is_url

    recipe = None
    if is_url(target):
        found, label = None, target
    else:
        found = find_model(Path(target), flags.model, flags.step)
        label = f"{found.run_dir} (step {found.step}, {found.model})" if found.run_dir is not None else target
    own = found.run_dir / "recipe.yaml" if found is not None and found.run_dir else None
    source = flags.recipe or own
    if source is not None:
        key = Path(source).resolve()
        if key not in recipes:
            recipes[key] = _load_recipe(source)
        recipe = recipes[key]
    if recipe is None and flags.data is None:
        raise UserError(
            f"{target}: no recipe to take an eval_dataset from; give --data (and --recipe for URLs)"
        )
    recipe_dir = Path(source).resolve().parent if source is not None else Path.cwd()
    return Target(target, found, label, recipe, flags.tokenizer, recipe_dir)


def _load_recipe(path: Path):
    from arealcli.schema.validate import RecipeUnusable, load_valid_recipe

    if not Path(path).is_file():
        raise UserError(f"{path}: no such recipe")
    try:
        return load_valid_recipe(Path(path))[0]
    except RecipeUnusable as e:
        raise UserError(e.heading or f"{path} is not a valid recipe:", *e.lines) from None


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


def _dataset(s: Target, flags: EvalFlags) -> dict[str, Any]:
    """--data (a prompt_answer dataset read from the current directory), else the recipe's eval_dataset."""
    if flags.data is not None:
        args = {
            "path": flags.data,
            "split": flags.split,
            "prompt_key": flags.prompt_key,
            "answer_key": flags.answer_key,
            "apply_chat_template": flags.chat_template,
            **({"limit": flags.limit} if flags.limit else {}),
        }
        return {
            "type_": "prompt_answer",
            "args": args,
            "batch_size": flags.batch_size or 64,
            "base": str(Path.cwd()),
        }
    if s.recipe.eval_dataset is None:
        raise UserError(f"{s.target}: its recipe has no eval_dataset; give --data")
    spec = s.recipe.eval_dataset
    _needs_answers(s.target, spec.type_)
    return {
        "type_": spec.type_,
        "args": spec.args.model_dump(mode="json"),
        "batch_size": flags.batch_size or spec.batch_size,
        "base": str(s.recipe_dir),
    }


JUDGE = "judge"  # --reward judge: the recipe's judge scores (runtime/evaluate/judge.py)


def settings(s: Target, flags: EvalFlags) -> dict[str, Any]:
    """Dataset, reward and generation settings: the flags, else the recipe's, else defaults."""
    from arealcli.runtime.registry import REWARDS
    from arealcli.schema.components.interfaces import ENVIRONMENT

    recipe, actor = s.recipe, _actor_args(s.recipe)
    dataset = _dataset(s, flags)
    name = flags.reward or (actor.eval_reward_fn if actor is not None and actor.eval_reward_fn else "math")
    judge: dict[str, Any] = {}
    if name == JUDGE:
        from arealcli.runtime.evaluate.judge import judge_of

        args, model_dir = judge_of(recipe, "its recipe" if flags.recipe is None else str(flags.recipe))
        where = {"url": args.url} if model_dir is None else {"model": model_dir}
        judge = {"judge": {**where, "template": args.template}, "_judge_args": args}
    elif name == ENVIRONMENT:
        if not (flags.workflow and actor is not None and actor.workflow is not None):
            raise UserError(
                f"--reward {ENVIRONMENT}: the environment of the recipe's workflow scores the episodes; "
                "the recipe has none" + ("" if flags.workflow else " in use (--no-workflow)")
            )
    elif name not in REWARDS.names():
        raise UserError(
            f"--reward {name}: no such reward function (registered: {', '.join(REWARDS.names())}, or "
            "judge: the recipe's judge)"
        )
    max_new_tokens = flags.max_new_tokens
    if max_new_tokens is None and actor is not None:
        max_new_tokens = actor.eval_max_new_tokens or actor.generation.max_new_tokens
    workflow = None
    if flags.workflow and actor is not None and actor.workflow is not None:
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
        **judge,
    }


def _tokenizer_source(s: Target) -> tuple[Any, str | None]:
    """(the recipe's tokenizer spec, the folder to fall back to): --tokenizer, else the model's own."""
    tok_spec = s.recipe.tokenizer if s.recipe is not None else None
    return tok_spec, s.tokenizer or (str(s.found.model_dir) if s.found is not None else None)


def _tokenizer(s: Target):
    from arealcli.errors import DataError
    from arealcli.runtime import vision
    from arealcli.runtime.data.tokenizer import load_tokenizer

    tok_spec, fallback = _tokenizer_source(s)
    folder = s.found.model_dir if s.found is not None else None
    seeing = folder is not None and vision.config_is_vision(folder)
    try:
        tok = load_tokenizer(tok_spec, fallback, vision=seeing)
        # a vision-language folder reads the dataset's images with its own image processor
        return vision.with_images(tok, vision.folder_image_processor(str(folder))) if seeing else tok
    except (ValueError, DataError) as e:
        raise UserError(f"{s.target}: {e}") from None


def _model(s: Target, job: EvalJob, tok):
    """The model to evaluate: a local model folder, or an OpenAI-compatible server."""
    from arealcli.runtime.evaluate.targets import LocalTarget, RemoteTarget

    if s.found is not None:
        cuda = job.flags.device == "cuda"
        return LocalTarget(
            str(s.found.model_dir), tok, "cuda" if cuda else "cpu", workflow=job.settings["workflow"]
        )
    return RemoteTarget(s.target, tok, send_key=job.flags.send_key)


# (label, total) -> a context manager giving `advance(n)`: how a command shows one target's progress
Progress = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


def run_one(job: EvalJob, s: Target, progress: Progress) -> tuple[str, dict[str, Any], list]:
    """Evaluate one target: its tokenizer, the dataset's batches, the loop; (label, metrics, results)."""
    from arealcli.runtime.data.datasets import Batches
    from arealcli.runtime.eval.metrics import summarize
    from arealcli.runtime.eval.run import evaluate
    from arealcli.runtime.registry import make_dataset
    from arealcli.schema.recipe import DatasetSpec

    tok = _tokenizer(s)
    if job.plan is None:  # a reward model: pairwise accuracy
        from arealcli.runtime.evaluate import pairs

        return pairs.run_one(job, s, tok, progress)
    d = job.settings["dataset"]
    spec = DatasetSpec(type_=d["type_"], args=d["args"], batch_size=d["batch_size"])
    dataset = make_dataset(spec, tok, d["base"])
    batches = Batches(dataset, min(spec.batch_size, len(dataset)), False, job.settings["seed"]).all_batches()
    model = _model(s, job, tok)
    judge = job.plan.scorer
    if judge is not None:
        judge.tokenizer, judge.unparsable = tok, 0
    try:
        with progress(s.label, len(dataset)) as advance:
            results = evaluate(model, batches, job.plan, advance)
    finally:
        model.close()
        if judge is not None:
            judge.close()
    metrics = summarize(results, job.ks, job.binary(), seed=job.flags.seed)
    if judge is not None:
        metrics["judge_unparsable"] = judge.unparsable  # replies its rule could not read
    return s.label, metrics, results


def write(output: Path, reports, config: dict[str, Any]) -> Path:
    """results.json (config, metrics, per_prompt; `targets` when several) and the samples beside it
    (returned)."""

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
                f.write(json.dumps({"target": label, **r.sample_row()}) + "\n")
    return samples

"""`areal eval` of reward models: pairwise accuracy on preference pairs.

A TARGET whose model folder is a reward model (a sequence classifier, as `reward_model` saves it) scores
each pair's chosen and rejected response; the metrics are the share of pairs it ranks right
(`pairwise_accuracy`) and the mean score difference (`pairwise_margin`), each with a bootstrap 95%
interval over the pairs. The pairs are the run's `eval_dataset` (a preference dataset) or `--data`
({prompt, chosen, rejected} rows; `--prompt-key`, `--split`, `--limit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arealcli.errors import UserError


@dataclass
class PairResult:
    """One preference pair, scored."""

    UNIT = "pairs"  # what the table counts

    prompt: str
    chosen: str
    rejected: str
    chosen_score: float
    rejected_score: float

    def row(self) -> dict[str, Any]:
        """Its line of `results.json`'s `per_prompt`."""
        return {
            "prompt": self.prompt,
            "correct": self.chosen_score > self.rejected_score,
            "margin": self.chosen_score - self.rejected_score,
        }

    def sample_row(self) -> dict[str, Any]:
        """Its line of the samples file."""
        return {
            "prompt": self.prompt,
            "chosen": self.chosen,
            "rejected": self.rejected,
            "chosen_score": self.chosen_score,
            "rejected_score": self.rejected_score,
        }


def is_reward_model(target: Any) -> bool:
    """Is the target (session.Target) a model folder holding a reward model?"""
    from arealcli.runtime.models.value_head import is_classifier_dir

    return target.found is not None and is_classifier_dir(target.found.model_dir)


def settings(target: Any, flags: Any) -> dict[str, Any]:
    """The pairs to score: --data (preference rows read from the current directory), else the recipe's
    eval_dataset, which must hold pairs."""
    from arealcli.schema.components.datasets import PAIR
    from arealcli.schema.registry import dataset_keys

    seed = target.recipe.seed if target.recipe is not None else 1
    if flags.data is not None:
        args = {"path": flags.data, "split": flags.split, "prompt_key": flags.prompt_key}
        args |= {"limit": flags.limit} if flags.limit else {}
        dataset = {"type_": "preference", "args": args, "batch_size": flags.batch_size or 64}
        return {"dataset": dataset | {"base": str(Path.cwd())}, "seed": seed}
    spec = target.recipe.eval_dataset if target.recipe is not None else None
    if spec is None or PAIR not in (dataset_keys({"type_": spec.type_}) or ()):
        has = f"its recipe's eval_dataset is {spec.type_}" if spec is not None else "there is no eval_dataset"
        raise UserError(
            f"{target.target} is a reward model, which is evaluated on preference pairs, and {has}: give "
            '--data with {"prompt": ..., "chosen": ..., "rejected": ...} rows (a JSONL file, a folder or a '
            "Hub dataset)"
        )
    dataset = {
        "type_": spec.type_,
        "args": spec.args.model_dump(mode="json"),
        "batch_size": flags.batch_size or spec.batch_size,
        "base": str(target.recipe_dir),
    }
    return {"dataset": dataset, "seed": seed}


def run_one(job: Any, target: Any, tokenizer: Any, progress: Any) -> tuple[str, dict[str, Any], list]:
    """Score every pair with the target's reward model: (label, metrics, results)."""
    from arealcli.runtime.data.datasets import Batches
    from arealcli.runtime.registry import make_dataset
    from arealcli.schema.recipe import DatasetSpec

    d = job.settings["dataset"]
    spec = DatasetSpec(type_=d["type_"], args=d["args"], batch_size=d["batch_size"])
    dataset = make_dataset(spec, tokenizer, d["base"])
    batches = Batches(dataset, min(spec.batch_size, len(dataset)), False, job.settings["seed"]).all_batches()
    model = _load(str(target.found.model_dir), tokenizer, job.flags.device)
    results: list[PairResult] = []
    try:
        with progress(target.label, len(dataset)) as advance:
            for batch in batches:
                scored = _scored_pairs(model, batch)
                results += scored
                advance(len(scored))
    finally:
        model.backend.destroy(model)
    return target.label, summarize(results, seed=job.flags.seed), results


def summarize(results: list[PairResult], seed: int = 0) -> dict[str, Any]:
    """`pairwise_accuracy`, `pairwise_margin` and their bootstrap 95% intervals over the pairs."""
    from arealcli.runtime.eval.metrics import bootstrap_means

    values = {
        "pairwise_accuracy": [float(r.chosen_score > r.rejected_score) for r in results],
        "pairwise_margin": [r.chosen_score - r.rejected_score for r in results],
    }
    return bootstrap_means(values, seed=seed)


def _load(model_dir: str, tokenizer: Any, device: str) -> Any:
    """The reward model on the hf engine (fp32, no optimizer)."""
    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.runtime.models.value_head import load_value_head_model
    from arealcli.schema.components.backends import HFBackendArgs

    try:
        module = load_value_head_model(model_dir, seed=0)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load the reward model in {model_dir}: {first}") from None
    backend = HFBackend(HFBackendArgs(device="cuda" if device == "cuda" else "cpu"))
    return backend.initialize(Model("reward_model", module, tokenizer), FinetuneSpec(1, 1, 1, 1))


def _scored_pairs(model: Any, batch: Any) -> list[PairResult]:
    from arealcli.runtime.data.preferences import pair_indices
    from arealcli.runtime.interfaces.reward_model import score
    from arealcli.schema.components.engine import MicroBatchSpec

    scores = score(model, batch, MicroBatchSpec()).tolist()  # (B,)
    seqs, prompts = batch.unpack("packed_input_ids"), batch.unpack("prompt_mask")

    def response(i: int) -> str:
        return model.tokenizer.decode(seqs[i][~prompts[i].bool()].tolist(), skip_special_tokens=True)

    chosen, rejected = pair_indices(batch)
    return [
        PairResult(batch.meta["prompt"][c], response(c), response(r), scores[c], scores[r])
        for c, r in zip(chosen, rejected, strict=True)
    ]

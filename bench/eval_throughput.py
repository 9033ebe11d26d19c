"""Evaluation throughput: `areal eval` vs the in-training held-out path, and through `areal serve`.

One quickstart-shaped model (the recipe's actor config, random weights, seeded), saved once; 256
held-out prompts of data/max3 x `--n` samples (plus the greedy pass), the same reward (math):

    in-training   PPOActorInterface.evaluate(model, batches, samples=trainer.eval) on the hf engine
    areal eval    runtime/eval on a LocalTarget loaded from the saved folder (what `areal eval DIR` runs)
    served        areal eval against `areal serve` on the same folder (OpenAI /v1/completions, n per request)

Each is timed `--repeat` times (the fastest counts) after one untimed warm-up pass; figures are generated samples per second (greedy
and sampled responses both count).

    python bench/eval_throughput.py            # n = 8
    python bench/eval_throughput.py --n 4 --prompts 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--no-served", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes each; the fastest is reported")
    args = ap.parse_args()

    import torch

    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.clients import launcher
    from arealcli.runtime.data.datasets import Batches
    from arealcli.runtime.data.tokenizer import char_tokenizer
    from arealcli.runtime.eval.run import EvalPlan, LocalTarget, RemoteTarget, evaluate
    from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
    from arealcli.runtime.models.model import FinetuneSpec, Model, build_module
    from arealcli.runtime.registry import make_dataset
    from arealcli.schema.components.backends import HFBackendArgs, SGLangBackendArgs
    from arealcli.schema.components.engine import GenerationHyperparameters
    from arealcli.schema.recipe import EvalSamplesSpec
    from arealcli.schema.source import load_recipe_source
    from arealcli.schema.validate import validate

    recipe = validate(load_recipe_source(ROOT / "recipes" / "quickstart.yaml"))
    tok = char_tokenizer()
    spec = recipe.eval_dataset.model_copy(
        update={"args": recipe.eval_dataset.args.model_copy(update={"limit": args.prompts})}
    )
    dataset = make_dataset(spec, tok, str(ROOT / "recipes"))
    batches = list(Batches(dataset, min(spec.batch_size, len(dataset)), False, recipe.seed).all_batches())
    actor_args = next(c.interface.args for c in recipe.dataflow.calls if c.name == "actor_train")
    max_new = actor_args.eval_max_new_tokens or actor_args.generation.max_new_tokens
    samples = EvalSamplesSpec(n=args.n)
    plan = EvalPlan(
        "math",
        GenerationHyperparameters(greedy=True, max_new_tokens=max_new),
        GenerationHyperparameters(n=args.n, max_new_tokens=max_new),
    )
    per_pass = len(dataset) * (args.n + 1)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        module = build_module(recipe.models["actor"], tok, recipe.seed, None)
        module.save_pretrained(folder)
        tok.save_pretrained(folder)

        def timed(name: str, fn) -> float:
            fn()  # warm-up
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            dt = min(times)
            print(
                f"{name:<12} {per_pass / dt:9.0f} samples/s   ({per_pass} samples in {dt:.2f} s)", flush=True
            )
            return dt

        print(
            f"{len(dataset)} prompts x (1 greedy + {args.n} sampled), max_new_tokens {max_new}; "
            f"torch threads {torch.get_num_threads()}"
        )
        model = HFBackend(HFBackendArgs(device="cpu")).initialize(
            Model("actor", build_module(recipe.models["actor"], tok, recipe.seed, None), tok),
            FinetuneSpec(1, 1, 1, 1),
        )
        actor = PPOActorInterface(actor_args)
        base = timed("in-training", lambda: actor.evaluate(model, batches, samples=samples))
        local = LocalTarget(str(folder), tok)
        ours = timed("areal eval", lambda: evaluate(local, batches, plan))
        print(f"areal eval / in-training: {base / ours:.2f}x")
        if not args.no_served:
            servers = launcher.launch(
                SGLangBackendArgs(launch="embedded", num_servers=1, device="cpu"),
                str(folder),
                Path(tmp),
                "srv",
            )
            try:
                launcher.wait_ready(servers, 120)
                remote = RemoteTarget(f"http://{servers[0].address}", tok)
                served = timed("served", lambda: evaluate(remote, batches, plan))
                print(f"served / in-training: {base / served:.2f}x")
            finally:
                launcher.stop(servers)


if __name__ == "__main__":
    main()

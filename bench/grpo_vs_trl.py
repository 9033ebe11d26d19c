"""One GRPO step, side by side: arealcli vs TRL's `GRPOTrainer`, same work, one run.

Same tiny model (the quickstart actor, saved and reloaded by TRL), the same prompts in the same order,
n completions per prompt, every completion exactly `--max-new-tokens` long (EOS suppressed on both
sides), the same reward function, one optimizer step per batch, no reference model, the same number of
torch threads. Ours is what `areal train recipes/quickstart.yaml` runs after its SFT warm-up:
actor generate -> reward -> actor train_step.

The sides alternate step by step (ours runs right after each TRL step, from a TRL callback, then ours
with `share_prompts` on, which computes each prompt once for its n samples), so a short load spike hits
all; `other load` says whether the machine was quiet enough to trust.

    python bench/grpo_vs_trl.py                       # 8 prompts x 8 x 32 tokens, then 16 x 4 x 64
    python bench/grpo_vs_trl.py --prompts 4 --n 4 --max-new-tokens 16 --steps 3 --warmup 1 --no-second
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.yaml"
CALLS = ("actor_gen", "reward", "actor_train")  # the quickstart's GRPO calls, in order


class Ours:
    """The quickstart's trainer with RL from step 0; `step()` runs and times one GRPO step."""

    def __init__(self, prompts: int, n: int, max_new: int, reward: str, run_dir: Path, share: bool = False):
        from arealcli.runtime.run.trainer import Trainer
        from arealcli.schema.source import apply_overrides, load_recipe_source
        from arealcli.schema.validate import validate

        overrides = [
            "dataflow.sft_warmup_steps=0",
            f"dataflow.actor.generation.n={n}",
            f"dataflow.actor.generation.max_new_tokens={max_new}",
            f"dataflow.actor.generation.min_new_tokens={max_new}",  # equal lengths: no early EOS
            f"dataflow.reward.reward_fn={reward}",
            f"dataset.batch_size={prompts}",
            "dataflow.actor.n_minibatches=1",  # one optimizer step per step, like TRL's num_iterations=1
            # prompt (14 chars) + completion must fit; RoPE has no weights: no parameter changes
            f"models.actor.config.max_position_embeddings={max(64, max_new + 16)}",
            f"models.actor.backend.args.share_prompts={str(share).lower()}",
        ]
        recipe = validate(apply_overrides(load_recipe_source(RECIPE), overrides))
        self.trainer = Trainer(recipe, RECIPE.parent, run_dir)
        self.trainer.setup()
        self.times: list[float] = []
        self.calls: list[dict[str, float]] = []  # per step: seconds of each call
        self.tokens: list[int] = []  # per step: generated tokens

    def batch(self, step: int):
        return self.trainer.batches.batch(0, step)

    def step(self) -> None:
        from arealcli.runtime.run.dataflow import run_calls

        step = len(self.times)
        batch = self.batch(step)
        t0 = time.perf_counter()
        out, stats = run_calls(self.trainer.calls, batch, step)
        self.times.append(time.perf_counter() - t0)
        self.calls.append({c: stats[f"timing/{c}_s"] for c in CALLS})
        self.tokens.append(int((~out.data["prompt_mask"].bool()).sum()))


def trl_trainer(model_dir: Path, rows: list[dict], args, prompts: int, n: int, max_new: int, after_step):
    """A GRPOTrainer doing our work; records step times, generated tokens and generation time."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from arealcli.runtime.registry import get_reward

    score = get_reward(args.reward)
    rec = {"times": [], "tokens": [], "gen": [], "prompts": [], "t0": 0.0}

    def reward_fn(prompts, completions, completion_ids, answers, **_):
        rec["gen"].append(time.perf_counter() - rec["t0"])  # step start -> here: generate + decode
        rec["tokens"].append(sum(len(c) for c in completion_ids))
        rec["prompts"].append(prompts)
        return score(prompts, completions, answers)

    reward_fn.__name__ = args.reward

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            rec["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            rec["times"].append(time.perf_counter() - rec["t0"])
            after_step()

    config = GRPOConfig(
        output_dir=str(model_dir / "trl"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,  # TRL's default is True; ours does not recompute
        optim="adamw_torch",  # torch.optim.AdamW, like ours (TRL's default is the fused one)
        per_device_train_batch_size=prompts * n,  # one step = all completions of a batch
        gradient_accumulation_steps=1,
        num_generations=n,
        max_completion_length=max_new,
        generation_kwargs={"min_new_tokens": max_new},  # equal lengths: no early EOS
        temperature=1.0,
        num_iterations=1,
        beta=0.0,  # no reference model, like the quickstart
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        shuffle_dataset=False,  # our batches' prompts, in our order
        use_vllm=False,
        report_to="none",
        logging_steps=10_000,
        save_strategy="no",
        disable_tqdm=True,
        seed=1,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward_fn,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[StepTimer()],
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-run metrics would bury the table
    return trainer, rec


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall s, CPU s used by the whole machine, CPU s used by this process); None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    except OSError:
        return None
    busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait, in clock ticks
    own = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def others_busy(a, b) -> float | None:
    """Fraction of the CPUs that other processes kept busy between two `cpu_clock()` readings."""
    if a is None or b is None:
        return None
    wall, all_cpu, own_cpu = (y - x for x, y in zip(a, b, strict=True))
    return max(0.0, (all_cpu - own_cpu) / (wall * (os.cpu_count() or 1)))


def run_config(args, prompts: int, n: int, max_new: int) -> dict:
    total, w = args.warmup + args.steps, args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ours = Ours(prompts, n, max_new, args.reward, tmp / "run")
        # ours with share_prompts on (each prompt computed once for its n samples), in the same run
        shared = Ours(prompts, n, max_new, args.reward, tmp / "run-shared", share=True)
        actor = ours.trainer.models["actor"]
        actor.module.save_to_hf(actor.tokenizer, str(tmp / "model"))  # initial weights, before any step
        rows = []  # TRL gets our batches' prompts, in our order
        for step in range(total):
            meta = ours.batch(step).meta
            rows += [
                {"prompt": q, "answers": a} for q, a in zip(meta["prompt"], meta["answers"], strict=True)
            ]

        def after_trl_step() -> None:
            ours.step()
            shared.step()

        trl, rec = trl_trainer(tmp / "model", rows, args, prompts, n, max_new, after_step=after_trl_step)
        clock = cpu_clock()
        trl.train()  # TRL step i, then our step i, then ours with shared prompts, ...
        others = others_busy(clock, cpu_clock())
        ours.trainer.close()
        shared.trainer.close()
        for step, got in enumerate(rec["prompts"]):  # the same prompts, each n times, on both sides
            assert sorted(got) == sorted(ours.batch(step).meta["prompt"] * n), f"prompts differ at {step}"
        assert len(ours.times) == len(rec["times"]) == total
    med = statistics.median
    return {
        "config": f"{prompts}p x {n} x {max_new}t",
        "ours": med(ours.times[w:]),
        "shared": med(shared.times[w:]),
        "shared_calls": {c: med(s[c] for s in shared.calls[w:]) for c in CALLS},
        "trl": med(rec["times"][w:]),
        "ours_best": min(ours.times[w:]),
        "trl_best": min(rec["times"][w:]),
        "ours_tokens": sorted(set(ours.tokens[w:])),  # one value when every step did equal work
        "trl_tokens": sorted(set(rec["tokens"][w:])),
        "ours_calls": {c: med(s[c] for s in ours.calls[w:]) for c in CALLS},
        "trl_gen": med(rec["gen"][w:]),
        "others": "?" if others is None else f"{others:.0%}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="completions per prompt (TRL num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="every completion has exactly this many")
    p.add_argument("--steps", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps per side")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reward", default="math", help="registered reward fn, both sides (quickstart: math)")
    p.add_argument("--no-second", action="store_true", help="skip the second config (16p x 4 x 64t)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    configs = [(args.prompts, args.n, args.max_new_tokens)] + ([] if args.no_second else [(16, 4, 64)])
    results = [run_config(args, *c) for c in configs]
    assert torch.get_num_threads() == args.threads, "a library changed the torch thread count"

    print(
        f"\ntorch threads {args.threads}, {os.cpu_count()} CPUs;"
        f" {args.steps} timed steps per side after {args.warmup} warm-up, sides alternating"
    )
    cols = [
        "config",
        "ours s/step",
        "TRL s/step",
        "TRL/ours",
        "best ours",
        "best TRL",
        "shared",
        "TRL/shared",
    ]
    cols += ["tokens ours", "tokens TRL", "other load"]
    head = f"{cols[0]:<14}" + "".join(f"{c:>12}" for c in cols[1:])
    print(head + "\n" + "-" * len(head))
    for r in results:
        tok = lambda t: ",".join(map(str, t))  # noqa: E731
        nums = (r["ours"], r["trl"], r["trl"] / r["ours"], r["ours_best"], r["trl_best"], r["shared"])
        nums += (r["trl"] / r["shared"],)
        print(
            f"{r['config']:<14}"
            + "".join(f"{x:>12.3f}" for x in nums)
            + f"{tok(r['ours_tokens']):>12}{tok(r['trl_tokens']):>12}{r['others']:>12}"
        )
    print("shared: ours with share_prompts on (each prompt prefilled and trained once for its n samples)")
    print("other load: CPU share used by other processes meanwhile; above ~10% the run is not a result")
    print("\nwhere the time goes (median s/step)")
    for r in results:
        c = r["ours_calls"]
        print(
            f"{r['config']:<14} ours: generate {c['actor_gen']:.3f}  reward {c['reward']:.3f}"
            f"  train {c['actor_train']:.3f} (shared: {r['shared_calls']['actor_gen']:.3f},"
            f" {r['shared_calls']['actor_train']:.3f})"
            f" | TRL: generate+decode {r['trl_gen']:.3f}"
            f"  reward+train {r['trl'] - r['trl_gen']:.3f}"
        )


if __name__ == "__main__":
    main()

"""The worker of tests/test_megatron_engine.py: one rank of a gloo world that trains the megatron
engine at several parallel layouts in turn (process start-up, ~10 s with megatron's imports, is the
dominant cost, so one job covers several layouts).

Per layout TPxPPxDP it builds the engine from the HF model in ``workdir/init``, runs the SFT steps of
``workdir/sft_batches.pt`` (each data-parallel replica on its contiguous slice of every global
batch), evaluates, generates greedily, exports with ``save_to_hf``; optionally one PPO actor step,
and an exact-resume check (save after step k, rebuild from the checkpoint, step again). Rank 0
writes ``workdir/<layout>/result.pt``; the test compares everything with the hf backend.
"""

from __future__ import annotations

from pathlib import Path

SFT_MB_SPEC = {"n_mbs": 2}
OPTIMIZER = {
    "lr": 1e-2,
    "lr_scheduler": "cosine",
    "warmup_steps_proportion": 0.3,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.01,
    "gradient_clipping": 1.0,
}


def launch(nprocs: int, args: list[str], timeout_s: float = 240) -> None:
    """Run this file as ``nprocs`` ranks of one gloo world; raise with their output if any fails."""
    from _dist_helpers import launch_workers

    # more ranks than cores: threads would only fight
    launch_workers(nprocs, args, timeout_s, script=__file__, env={"OMP_NUM_THREADS": "1"})


def dp_slice(batch, dp_rank: int, dp_world: int):
    """Contiguous near-even slice of the global batch for one data-parallel replica."""
    base, extra = divmod(batch.bs, dp_world)
    start = dp_rank * base + min(dp_rank, extra)
    return batch.subset(list(range(start, start + base + (1 if dp_rank < extra else 0))))


def build(workdir: Path, model_dir: Path, tp: int, pp: int, n_steps: int):
    from transformers import AutoModelForCausalLM

    from arealcli.runtime.backends.megatron.backend import MegatronBackend
    from arealcli.runtime.data.tokenizer import char_tokenizer
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import MegatronBackendArgs

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    args = MegatronBackendArgs(tensor_parallel_size=tp, pipeline_parallel_size=pp, optimizer=OPTIMIZER)
    backend = MegatronBackend(args)
    model = backend.initialize(Model("actor", module, char_tokenizer()), FinetuneSpec(1, 8, 8, n_steps))
    return backend, model


def run_layout(workdir: Path, tp: int, pp: int, tasks: set[str]) -> None:
    import torch
    import torch.distributed as dist

    from arealcli.runtime.interfaces.ppo_actor import PPOActorInterface
    from arealcli.runtime.interfaces.sft import SFTInterface, sft_loss
    from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec
    from arealcli.schema.components.interfaces import PPOActorArgs, SFTArgs

    batches = torch.load(workdir / "sft_batches.pt", weights_only=False)
    n_steps = len(batches)
    backend, model = build(workdir, workdir / "init", tp, pp, n_steps)
    engine = model.module
    dp = engine.dp_world
    out_dir = workdir / f"tp{tp}pp{pp}dp{dp}"
    sft = SFTInterface(SFTArgs())
    result: dict = {"steps": []}
    resume_at = n_steps - 1  # save after this many steps, then check a resumed last step
    for step, batch in enumerate(batches):
        if "resume" in tasks and step == resume_at:
            sft.save(model, str(out_dir / "ckpt"))
            backend.save(model, str(out_dir / "ckpt"))
        stats = sft.train_step(model, dp_slice(batch, engine.dp_rank, dp), MicroBatchSpec(**SFT_MB_SPEC))
        result["steps"].append(stats)
    result["final"] = engine.hf_state_dict()
    engine.save_to_hf(model.tokenizer, str(out_dir / "hf"))

    eval_batch = torch.load(workdir / "eval_batch.pt", weights_only=False)
    result["eval"] = sft.evaluate(model, [dp_slice(eval_batch, engine.dp_rank, dp)])
    result["eval_batch"] = engine.eval_batch(  # per rank: data-parallel rank 0's slice is saved
        dp_slice(eval_batch, engine.dp_rank, dp), MicroBatchSpec(n_mbs=2), sft_loss
    )
    if "generate" in tasks:
        prompts = torch.load(workdir / "prompts.pt", weights_only=False)
        g = GenerationHyperparameters(greedy=True, max_new_tokens=6)
        gen = engine.generate(prompts, MicroBatchSpec(n_mbs=2), model.tokenizer, g)
        result["generate"] = (gen.output_ids, gen.logprobs, gen.no_eos)
    if "ppo" in tasks:
        rollout = torch.load(workdir / "rollout.pt", weights_only=False)
        iface = PPOActorInterface(PPOActorArgs(**torch.load(workdir / "ppo_args.pt")))
        before = result["final"]
        result["ppo"] = iface.train_step(
            model, dp_slice(rollout, engine.dp_rank, dp), MicroBatchSpec(n_mbs=2)
        )
        result["ppo_final"] = engine.hf_state_dict()
        if before is not None:
            result["ppo_max_change"] = max(
                float((result["ppo_final"][k] - v).abs().max()) for k, v in before.items()
            )
    backend.destroy(model)

    if "resume" in tasks:  # a fresh engine from the step-k checkpoint: HF weights + optimizer state
        backend, model = build(workdir, out_dir / "ckpt", tp, pp, n_steps)
        backend.load(model, str(out_dir / "ckpt"))
        model.version.global_step = resume_at
        batch = batches[resume_at]
        stats = sft.train_step(
            model, dp_slice(batch, model.module.dp_rank, dp), MicroBatchSpec(**SFT_MB_SPEC)
        )
        result["resumed_step"] = stats
        result["resumed_final"] = model.module.hf_state_dict()
        backend.destroy(model)
    if dist.get_rank() == 0:
        torch.save(result, out_dir / "result.pt")
    dist.barrier()


def main() -> None:
    import argparse
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--layouts", required=True, help="comma-separated TPxPP[:task+task]")
    a = parser.parse_args()
    dist.init_process_group("gloo")
    for item in a.layouts.split(","):
        layout, _, tasks = item.partition(":")
        tp, pp = (int(x) for x in layout.split("x"))
        run_layout(a.workdir, tp, pp, set(filter(None, tasks.split("+"))))
    from _dist_helpers import leave_world

    leave_world()


if __name__ == "__main__":
    main()

"""Full fine-tuning vs LoRA on a Qwen2-0.5B-shaped model: trainable parameters, optimizer state, peak
memory and step time, each in its own process (so each peak is its own), side by side.

The model is built from its config (hidden 896, 24 layers, 14 / 2 heads, intermediate 4864, vocab
151936, tied embeddings) with random weights, fp32, through the hf backend as `areal train` builds it,
and takes `--steps` optimizer steps of SFT on `--batch` sequences of `--seq-len` tokens.

    python bench/lora_memory.py                       # CPU: 2 x 256 tokens, 2 steps
    python bench/lora_memory.py --device cuda --batch 8 --seq-len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

QWEN2_0_5B = {  # Qwen2-0.5B's layer shapes (bench/weight_sync.py uses them too)
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
SHAPE = QWEN2_0_5B
CONFIGS = {"full": None, "lora r=8": {"rank": 8, "alpha": 16.0}, "lora r=64": {"rank": 64, "alpha": 128.0}}


def worker(name: str, device: str, batch: int, seq_len: int, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from arealcli.runtime.backends.hf import HFBackend
    from arealcli.runtime.data.sample import SequenceSample
    from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss
    from arealcli.runtime.models.model import FinetuneSpec, Model
    from arealcli.schema.components.backends import HFBackendArgs
    from arealcli.schema.components.engine import MicroBatchSpec

    torch.manual_seed(0)
    module = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPE))
    args = {"device": device, "optimizer": {"lr": 1e-5}}
    if CONFIGS[name] is not None:
        args["lora"] = CONFIGS[name]
    model = HFBackend(HFBackendArgs.model_validate(args)).initialize(
        Model("m", module, None), FinetuneSpec(1, 1, 1, 10)
    )
    engine = model.module
    params = list(engine.module.parameters())
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, SHAPE["vocab_size"], (seq_len,), generator=g) for _ in range(batch)]
    masks = [torch.arange(seq_len) < seq_len // 4 for _ in range(batch)]
    data = SequenceSample.from_lists(list(range(batch)), {"packed_input_ids": ids, "prompt_mask": masks})
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.train_batch(data, MicroBatchSpec(), sft_loss, num_answer_tokens, 0)
        times.append(time.perf_counter() - t0)
    opt_bytes = sum(
        v.numel() * v.element_size()
        for s in engine.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if device == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    return {
        "name": name,
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "optimizer_gib": opt_bytes / 2**30,
        "peak_gib": peak,
        "step_s": min(times),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.device, args.batch, args.seq_len, args.steps)))
        return
    peak_kind = "GPU max allocated" if args.device == "cuda" else "process max RSS"
    print(f"Qwen2-0.5B shape, fp32 weights, {args.batch} x {args.seq_len} tokens, device {args.device}")
    print(
        f"{'config':<11}{'params':>9}{'trainable':>11}{'share':>8}{'optim GiB':>11}{'peak GiB':>10}{'step s':>8}"
    )
    for name in CONFIGS:
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            name,
            "--device",
            args.device,
            "--batch",
            str(args.batch),
        ]
        cmd += ["--seq-len", str(args.seq_len), "--steps", str(args.steps)]
        out = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{r['name']:<11}{r['params'] / 1e6:>8.1f}M{r['trainable'] / 1e6:>10.2f}M{r['trainable'] / r['params']:>8.2%}"
            f"{r['optimizer_gib']:>11.2f}{r['peak_gib']:>10.2f}{r['step_s']:>8.1f}"
        )
    print(f"(peak: {peak_kind}; params counts the adapters too)")


if __name__ == "__main__":
    main()

"""Training-step throughput: plain transformers vs our hf / fsdp / megatron engines.

One step = forward + backward + AdamW step (lr 1e-5, grad clip 1.0) with the SFT loss over every
token, on a Qwen2-0.5B-shaped model built from its config (random weights, no download). Two cases:

- fixed:  `--batch` sequences of exactly `--seq-len` tokens, one micro-batch.
- varlen: 2 x `--batch` sequences, lengths uniform in [seq_len / 8, seq_len]. The plain loop pads
  them in chunks of `--batch` (gradient accumulation, the usual HF way); our engines get the whole
  batch with `MicroBatchSpec(max_tokens_per_mb=batch * seq_len)`. Only real tokens count.

Rows: `plain` (bf16 weights: what a transformers user runs), `plain-amp` (fp32 weights + bf16
autocast: the precision our engines train in), and our engines, built as the trainer builds them
and driven through `train_batch(sft_loss, num_answer_tokens)`: `hf`, `fsdp` (packed rows, chunked
log-probs), `megatron`, and `hf-padded`, the hf engine as it ran before packing and chunking (every
micro-batch right-padded to (B, T), full (tokens, V) logits into the loss). `pad%`: the share of
computed positions that are padding. `best ms`: the fastest timed step, and `best vs` plain's fastest
over it (the closest to an idle machine on a shared one). `loss0`: the loss of the case's first step
(same weights everywhere).

    python bench/train_throughput.py                          # one GPU, bf16, batch 8 x 2048
    python bench/train_throughput.py --shape tiny --device cpu --steps 2 --warmup 1 --seq-len 128 --batch 2
    python bench/train_throughput.py --nproc 2 --shape tiny --device cpu --backends plain,hf,fsdp
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import os
import random
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from arealcli.runtime.models import flops

SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size")  # fmt: skip
SHAPES = {"0.5b": (896, 24, 14, 2, 4864, 151936), "tiny": (64, 2, 4, 2, 128, 1000)}
BACKENDS = ("plain", "plain-amp", "hf-padded", "hf", "fsdp", "megatron")
# With bf16 compute (fp32: fp32 everywhere); the others keep fp32 weights and compute under bf16 autocast.
PRECISION = {"plain": "bf16", "fsdp": "fp32 + bf16 FSDP mp", "megatron": "bf16 + fp32 master"}
FLOPS_FORMULA = (
    "FLOPs/step = 6 * N * tokens + 12 * layers * hidden * sum_i(len_i^2)  (N: matmul weights; forward + "
    "backward; attention not halved for causality, as PaLM's MFU counts it; real tokens only); %peak: "
    "achieved / the measured matmul peak"
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--batch", type=int, default=8, help="sequences per step in the fixed case")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per case (at least 1)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bf16 on cuda"
    )
    p.add_argument("--nproc", type=int, default=1, help="processes (re-launched under torch.distributed.run)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if unknown := sorted(set(args.backends.split(",")) - set(BACKENDS)):
        p.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    args.warmup = max(args.warmup, 1)
    return args


def hf_config(shape: str, seq_len: int):
    from transformers import Qwen2Config

    max_pos = max(seq_len, 32768 if shape == "0.5b" else seq_len)
    dims = dict(zip(SHAPE_KEYS, SHAPES[shape], strict=True))
    return Qwen2Config(**dims, tie_word_embeddings=True, use_cache=False, max_position_embeddings=max_pos)


def build_hf(cfg, device, seed: int):
    """fp32 weights on `device`, as the trainer's `build_module` hands them to a backend."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def make_cases(vocab: int, batch: int, seq_len: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """{case: sequences of token ids}; the same on every rank."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    varlen = [rng.randint(seq_len // 8, seq_len) for _ in range(2 * batch)]
    lens = {"fixed": [seq_len] * batch, "varlen": varlen}
    return {k: [torch.randint(0, vocab, (n,), generator=gen) for n in v] for k, v in lens.items()}


class PlainRunner:
    """The loop a transformers user writes: padded chunks of `batch` sequences, shifted-label CE."""

    def __init__(self, cfg, device, dtype, amp: bool, batch: int, seed: int, world: int):
        self.module = build_hf(cfg, device, seed)
        if not amp:
            self.module.to(dtype)  # pure bf16 weights, grads and AdamW state
        autocast = amp and dtype != torch.float32
        self.autocast = torch.autocast(device.type, dtype=dtype) if autocast else contextlib.nullcontext()
        self.model = self.module
        if world > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=ids)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-5)
        self.batch, self.device = batch, device

    def chunks(self, seqs):
        return [seqs[i : i + self.batch] for i in range(0, len(seqs), self.batch)]

    def padded_positions(self, seqs, case: str) -> int:
        return sum(len(c) * max(s.numel() for s in c) for c in self.chunks(seqs))

    def step(self, seqs, case: str) -> float:
        n_targets, total = sum(s.numel() - 1 for s in seqs), 0.0  # positions that predict a next token
        chunks = self.chunks(seqs)
        for i, chunk in enumerate(chunks):
            T = max(s.numel() for s in chunk)
            ids = torch.stack([F.pad(s, (0, T - s.numel())) for s in chunk]).to(self.device)  # (B, T)
            mask = torch.stack([torch.arange(T) < s.numel() for s in chunk]).long().to(self.device)  # (B, T)
            no_sync = i < len(chunks) - 1 and hasattr(self.model, "no_sync")  # DDP: reduce on the last
            with self.model.no_sync() if no_sync else contextlib.nullcontext():
                with self.autocast:
                    logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
                # transformers' ForCausalLMLoss: shift the labels (not the logits), fp32 CE, sum / n.
                labels = F.pad(ids.masked_fill(mask == 0, -100), (0, 1), value=-100)[:, 1:]  # (B, T)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
                (loss / n_targets).backward()
            total += float(loss.detach()) / n_targets
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total

    def close(self) -> None:
        del self.model, self.module, self.optimizer


class EngineRunner:
    """One of our backends, initialized as the trainer does it, stepped through `train_batch`."""

    def __init__(self, name: str, cfg, device, dtype, batch: int, seq_len: int, seed: int):
        from arealcli.runtime.models.model import FinetuneSpec, Model
        from arealcli.schema.components import backends as b
        from arealcli.schema.components.engine import MicroBatchSpec, OptimizerConfig

        opt = OptimizerConfig(lr=1e-5)  # AdamW, constant LR, clip 1.0
        dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
        self.layout = "padded" if name == "hf-padded" else None
        if name in ("hf", "hf-padded"):
            from arealcli.runtime.backends.hf import HFBackend as Backend

            args = b.HFBackendArgs(device=device.type, dtype=dt, optimizer=opt)
        elif name == "fsdp":
            from arealcli.runtime.backends.fsdp import FSDPBackend as Backend

            args = b.FSDPBackendArgs(device=device.type, optimizer=opt, mixed_precision_param=dt)
        else:
            from arealcli.runtime.backends.megatron.backend import MegatronBackend as Backend

            args = b.MegatronBackendArgs(dtype=dt, optimizer=opt, attention="sdpa")  # TP = PP = 1
        self.backend = Backend(args)
        model = Model("bench", build_hf(cfg, device, seed), None)  # no other reference: megatron frees it
        self.model = self.backend.initialize(model, FinetuneSpec(1, 2 * batch, 2 * batch, 10**6))
        if self.layout == "padded":
            self.model.module.run_microbatch = functools.partial(padded_full_logits, self.model.module)
        budget = batch * seq_len  # the tokens of one fixed-case batch
        self.mb_spec = {"fixed": MicroBatchSpec(), "varlen": MicroBatchSpec(max_tokens_per_mb=budget)}

    @staticmethod
    def sample(seqs):
        from arealcli.runtime.data.sample import SequenceSample

        masks = [torch.zeros(s.numel(), dtype=torch.bool) for s in seqs]  # no prompt: loss on every token
        data = {"packed_input_ids": seqs, "prompt_mask": masks}
        return SequenceSample.from_lists(list(range(len(seqs))), data)

    def padded_positions(self, seqs, case: str) -> int:
        from arealcli.runtime.backends import packing
        from arealcli.runtime.backends.hf import choose_layout

        engine = self.model.module
        mbs = engine.split_for_training(self.sample(seqs), self.mb_spec[case])
        lens = [mb.seqlens["packed_input_ids"] for mb in mbs]
        module = getattr(engine, "module", None)
        if module is None or not hasattr(module, "config"):  # megatron: each mb runs as (B, T_max)
            return sum(len(n) * max(n) for n in lens)
        return sum(
            packing.computed_positions(module, n, self.layout or choose_layout(module, n)) for n in lens
        )

    def step(self, seqs, case: str) -> float:
        from arealcli.runtime.interfaces.sft import num_answer_tokens, sft_loss

        engine = self.model.module
        loss_fn = full_logits_sft_loss if self.layout == "padded" else sft_loss
        stats = engine.train_batch(self.sample(seqs), self.mb_spec[case], loss_fn, num_answer_tokens, 0)
        return stats["loss"]

    def close(self) -> None:
        self.backend.destroy(self.model)
        del self.model, self.backend


def padded_full_logits(engine, mb):
    """The hf engine's forward before packing and chunking: (B, T) rows, packed (tokens, V) logits."""
    from arealcli.runtime.backends.hf import run_packed
    from arealcli.runtime.engines.lm_output import LMOutput

    out = run_packed(engine.module, mb, engine.device, layout="padded")
    return out.logits if isinstance(out, LMOutput) else out


def full_logits_sft_loss(logits, mb):
    """The SFT loss before chunked log-probs: `log_softmax` of the fp32 copy of all (tokens, V) logits."""
    from arealcli.runtime.interfaces.sft import answer_token_mask

    targets = torch.roll(mb.data["packed_input_ids"].to(logits.device), shifts=-1)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    mask = answer_token_mask(mb).to(logits.device)  # False at each sequence's last position
    return (-logp * mask).sum() / mask.sum().clamp(min=1), {"n_tokens": mask.sum().float()}


def measure(step, warmup: int, steps: int, cuda: bool) -> tuple[float, float, float, float | None]:
    """(first step's loss, seconds per timed step, seconds of the fastest timed step, peak GiB allocated
    over all steps)."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loss0 = step()
    for _ in range(warmup - 1):
        step()
    sync()
    t0 = time.perf_counter()
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync()
        best = min(best, time.perf_counter() - t)
    dt = (time.perf_counter() - t0) / max(steps, 1)
    return loss0, dt, best, torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def init_distributed(device: torch.device, need: bool) -> int:
    """The launcher's process group under torch.distributed.run, else a world of one if fsdp/megatron run."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    elif need:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_world_size() if dist.is_initialized() else 1


def main() -> None:
    args = parse_args()
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        run = f"-m torch.distributed.run --standalone --nproc-per-node={args.nproc}".split()
        rest = [a for a, prev in zip(sys.argv[1:], sys.argv, strict=False) if "--nproc" not in (a[:7], prev)]
        raise SystemExit(subprocess.call([sys.executable, *run, os.path.abspath(__file__), *rest]))
    import transformers

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" or (args.dtype == "auto" and cuda) else torch.float32
    backends = args.backends.split(",")
    if "megatron" in backends and not cuda and torch.cuda.is_available():
        backends.remove("megatron")  # megatron runs on CUDA whenever it sees a GPU
    world = init_distributed(device, need=bool({"fsdp", "megatron"} & set(backends)))
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    cfg = hf_config(args.shape, args.seq_len)
    shape = flops.shape_of(build_hf(cfg, "meta", 0))  # N: the matmul weights (the tied matrix once)
    n_params = shape.params
    # the peak of one device (GPU) or of this rank's cores (CPU), in the precision the matmuls run in
    peak_dtype = (
        torch.bfloat16 if cuda or flops.has_native_bf16() and dtype == torch.bfloat16 else torch.float32
    )
    peak = flops.matmul_peak(peak_dtype, 8192 if cuda else 1024, 1.0, str(device)) * world
    cases = make_cases(cfg.vocab_size, args.batch, args.seq_len, args.seed)

    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    say(f"{name} x {world} process(es); torch {torch.__version__}, transformers {transformers.__version__}")
    dims = ", ".join(f"{k} {getattr(cfg, k)}" for k in SHAPE_KEYS)
    say(f"model {args.shape}: {n_params / 1e6:.1f}M params ({dims}, tied embeddings), SDPA; {dtype}")
    for case, seqs in cases.items():
        n = [s.numel() for s in seqs]
        say(f"case {case}: {len(n)} sequences/rank, {sum(n)} real tokens/rank, lengths {min(n)}..{max(n)}")
    say(f"matmul peak, measured: {peak / 1e12:.3g} TFLOP/s ({str(peak_dtype)[6:]}, {world} x {name})")
    say(f"{FLOPS_FORMULA}\n{args.warmup} warm-up + {args.steps} timed steps per case; AdamW 1e-5, clip 1\n")

    rows = []
    for name in backends:
        if name == "megatron" and importlib.util.find_spec("megatron") is None:
            say("megatron: skipped (megatron-core is not installed)")
            continue
        if name.startswith("plain"):
            runner = PlainRunner(cfg, device, dtype, name == "plain-amp", args.batch, args.seed, world)
        else:
            runner = EngineRunner(name, cfg, device, dtype, args.batch, args.seq_len, args.seed)
        for case, seqs in cases.items():
            step = functools.partial(runner.step, seqs, case)
            loss0, dt, best, mem = measure(step, args.warmup, args.steps, cuda)
            lens = [s.numel() for s in seqs]
            prec = "fp32" if dtype == torch.float32 else PRECISION.get(name, "fp32 + bf16 autocast")
            tflops = flops.train_flops(shape, lens) * world / dt / 1e12
            pad = 1 - sum(lens) / runner.padded_positions(seqs, case)
            rows.append(
                (case, name, prec, sum(lens) * world / dt, tflops, dt * 1e3, best * 1e3, pad, mem, loss0)
            )
        runner.close()
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    base = {r[0]: (r[3], r[6]) for r in rows if r[1] == "plain"}
    head = f"{'case':<7}{'backend':<10}{'precision':<21}{'tokens/s':>10}{'TFLOP/s':>9}{'step ms':>9}{'best ms':>9}"
    head += f"{'%peak':>6}{'pad%':>6}{'peak GiB':>9}{'vs plain':>9}{'best vs':>8}{'loss0':>8}"
    say(head + "\n" + "-" * len(head))
    rows.sort(key=lambda r: list(cases).index(r[0]))  # grouped by case, backends in run order
    for case, name, prec, tok_s, tflops, ms, best_ms, pad, mem, loss0 in rows:
        mem = "-" if mem is None else f"{mem:.1f}"
        ratio = f"{tok_s / base[case][0]:.2f}" if case in base else "-"
        best_ratio = f"{base[case][1] / best_ms:.2f}" if case in base else "-"
        line = f"{case:<7}{name:<10}{prec:<21}{tok_s:>10,.0f}{tflops:>9.2f}{ms:>9.1f}{best_ms:>9.1f}"
        share = 100 * tflops * 1e12 / peak
        say(f"{line}{share:>6.1f}{100 * pad:>6.0f}{mem:>9}{ratio:>9}{best_ratio:>8}{loss0:>8.4f}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

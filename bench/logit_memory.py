"""Peak memory of SFT with a real vocabulary: log-probs from full logits (before) vs chunked (now).

The run: `recipes/sft-quickstart.yaml` on a 2-layer Qwen2 with Qwen's vocabulary (151,936 tokens,
hidden 256, tied embeddings, 40M parameters, `torch.manual_seed(0)`), batch 256, 3 steps, on CPU.
Each side is its own `areal train` process under `/usr/bin/time -v` (peak RSS of that process alone):

- `full-logits`: the path before chunking, kept as a plugin (written next to the run): each
  micro-batch runs right-padded to (B, T), its packed (tokens, V) logits go to the SFT loss, which takes
  `log_softmax(logits.float())` — the full-vocabulary fp32 copies.
- `chunked`: the shipped `hf` backend and `sft` interface: packed rows, and log-probs from the hidden
  states and the LM head chunk by chunk of tokens (`LMOutput`), in the forward and the backward pass.

Printed per side: peak RSS, the run's wall time (process start to end), and at each logged step (the
last one, with the recipe's logging) the loss and the `train_step` time; the last losses must agree
(same weights, same data, same formula).

    python bench/logit_memory.py                 # about a minute on two cores
    python bench/logit_memory.py --batch 64 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""The path before chunked log-probs: padded micro-batches, full (tokens, V) logits to the loss."""
import math

import torch

from arealcli import api
from arealcli.runtime.backends.hf import HFBackend, run_packed
from arealcli.runtime.engines.lm_output import LMOutput
from arealcli.runtime.interfaces.sft import SFTInterface, answer_token_mask, num_answer_tokens


def full_logits_sft_loss(logits, mb):
    ids = mb.data["packed_input_ids"].to(logits.device)
    targets = torch.roll(ids, shifts=-1)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    mask = answer_token_mask(mb).to(logits.device)
    loss = (-logp * mask).sum() / mask.sum().clamp(min=1)
    return loss, {"n_tokens": mask.sum().float()}


class FullLogitsSFT(SFTInterface):
    def train_step(self, model, data, mb_spec):
        stats = model.module.train_batch(
            data, mb_spec, loss_fn=full_logits_sft_loss, loss_weight_fn=num_answer_tokens,
            version_steps=model.version.global_step, lr_scale=self.args.lr_scale,
            token_normalize_scope=self.args.token_normalize_scope,
        )
        stats["ppl"] = math.exp(min(stats["loss"], 50.0))
        model.inc_version()
        return stats


class PaddedHFBackend(HFBackend):
    def _initialize(self, model, spec):
        model = super()._initialize(model, spec)
        engine = model.module

        def padded_logits(mb):
            out = run_packed(engine.module, mb, engine.device, layout="padded")
            return out.logits if isinstance(out, LMOutput) else out

        engine.run_microbatch = padded_logits
        return model


api.register_interface("sft_full_logits", FullLogitsSFT)
api.register_backend("hf_padded", PaddedHFBackend)
'''


def save_model(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)


def run_side(name: str, model: Path, work: Path, batch: int, steps: int) -> dict:
    out = work / name
    cmd = [
        "/usr/bin/time", "-v", sys.executable, "-m", "arealcli.main", "train", "recipes/sft-quickstart.yaml",
        "models.default.config=null", f"models.default.path={model}", f"trainer.max_steps={steps}",
        "trainer.eval_every_n_steps=null", "trainer.eval_at_start=false", "trainer.save_every_n_steps=null",
        f"dataset.batch_size={batch}", "-o", str(out),
    ]  # fmt: skip
    env = dict(os.environ)
    if name == "full-logits":
        cmd += [
            "imports=[logit_memory_plugin]",
            "models.default.backend.type_=hf_padded",
            "dataflow.calls.0.interface.type_=sft_full_logits",
        ]
        env["PYTHONPATH"] = os.pathsep.join([str(work), env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in logged if "sft/loss" in m]
    losses = [(m["step"], m["sft/loss"], m["timing/sft_s"]) for m in logged]
    return {"name": name, "rss_gb": rss_kb * 1024 / 1e9, "losses": losses, "wall_s": wall}


def load_line() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--sides", default="full-logits,chunked")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "logit_memory_plugin.py").write_text(PLUGIN)
        save_model(work / "model")
        print(f"before: {load_line()}")
        rows = [run_side(s, work / "model", work, args.batch, args.steps) for s in args.sides.split(",")]
        print(f"after:  {load_line()}")
    print(f"\nSFT, Qwen2 vocab 151936 / hidden 256 / 2 layers, batch {args.batch}, {args.steps} steps, CPU")
    head = f"{'path':<13}{'peak RSS GB':>12}{'vs first':>10}{'run s':>7}  logged steps: loss (train_step s)"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        ratio = r["rss_gb"] / rows[0]["rss_gb"]
        losses = "  ".join(f"step {s}: {loss:.4f} ({t:.1f} s)" for s, loss, t in r["losses"])
        print(f"{r['name']:<13}{r['rss_gb']:>12.2f}{ratio:>10.2f}{r['wall_s']:>7.1f}  {losses}")
    if len(rows) > 1:
        a, b = rows[0]["losses"][-1][1], rows[-1]["losses"][-1][1]
        print(f"last-step loss relative difference: {abs(a - b) / abs(a):.2e}")


if __name__ == "__main__":
    main()

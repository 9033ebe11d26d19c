"""The embedded backend: a transformers model in this process, on CPU or one GPU.

Under `areal train --nproc-per-node N` every rank holds a full replica: forward and generation run on
the rank's own slice, and a training step averages the gradients over the ranks before the (then
identical) optimizer step — plain replicated data parallelism. Only rank 0 writes checkpoints.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

from arealcli.runtime import distributed, generation
from arealcli.runtime.backends.base import LossFn, LossWeightFn, ModelBackend
from arealcli.runtime.backends.train_batch import accumulate_gradients, average_gradients, clip_and_step
from arealcli.runtime.data import SequenceSample
from arealcli.runtime.model import DTYPES, FinetuneSpec, Model
from arealcli.runtime.optim import begin_step, build_optimizer
from arealcli.schema.components.backends import HFBackendArgs
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig


def run_packed(module, mb: SequenceSample, device) -> torch.Tensor:
    """Forward a micro-batch of packed sequences: pad to (B, T), run, re-pack the outputs.

    Returns logits (tokens, vocab) for language models, values (tokens,) for value-head models.
    """
    ids, mask = mb.padded("packed_input_ids", pad_value=0)  # (B, T), right-padded
    ids, mask = ids.to(device), mask.to(device)
    # No attention mask: with right padding the causal mask alone keeps every real token from seeing the
    # pads after it (the pads' own outputs are dropped below), and SDPA keeps its fast causal kernel.
    out = module(input_ids=ids)
    out = out.logits if hasattr(out, "logits") else out
    return out[mask]  # row-major: sample 0's tokens, then sample 1's, ... = the packed order


class HFEngine:
    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        compute_dtype: torch.dtype,
        optimizer_cfg: OptimizerConfig | None,
        total_train_steps: int,
    ):
        self.module = module
        self.device = device
        self.compute_dtype = compute_dtype
        self.optimizer_cfg = optimizer_cfg
        self.total_train_steps = total_train_steps
        self.optimizer = build_optimizer(module.parameters(), optimizer_cfg) if optimizer_cfg else None

    def _autocast(self):
        if self.compute_dtype == torch.float32 or next(self.module.parameters()).dtype == self.compute_dtype:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _run(self, mb: SequenceSample) -> torch.Tensor:
        return run_packed(self.module, mb, self.device)

    def train_batch(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        version_steps: int,
        token_normalize_scope: str = "global",
        lr_scale: float = 1.0,
    ) -> dict[str, float]:
        lr = begin_step(self.optimizer, self.optimizer_cfg, self.total_train_steps, version_steps, lr_scale)
        self.module.train()
        stats = accumulate_gradients(
            self._run,
            input_,
            mb_spec,
            loss_fn,
            loss_weight_fn,
            token_normalize_scope,
            self.device,
            autocast=self._autocast(),
        )
        average_gradients(self.module.parameters())  # no-op in a single process
        stats["grad_norm"] = clip_and_step(
            self.module.parameters(), self.optimizer, self.optimizer_cfg.gradient_clipping
        )
        stats["lr"] = lr
        return stats

    @torch.no_grad()
    def eval_batch(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, loss_fn: LossFn
    ) -> dict[str, float]:
        self.module.eval()
        total, stats = 0, {}
        for mb in input_.split(mb_spec)[0]:
            with self._autocast():
                loss, mb_stats = loss_fn(self._run(mb), mb)
            stats["loss"] = stats.get("loss", 0.0) + float(loss) * mb.bs
            for k, v in mb_stats.items():
                stats[k] = stats.get(k, 0.0) + float(v) * mb.bs
            total += mb.bs
        return {k: v / max(total, 1) for k, v in stats.items()}

    @torch.no_grad()
    def forward(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        post_hook: Callable[[torch.Tensor, SequenceSample], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any:
        """Run every micro-batch; results per sample come back in the input's order.

        `post_hook(outputs, mb)` maps a micro-batch's packed outputs to one tensor per sample (a list)
        or to a packed tensor split like `packed_input_ids`; without it the outputs themselves are split.
        """
        self.module.eval()
        mbs, _, backward = input_.split(mb_spec)
        per_sample: list[torch.Tensor] = []
        for mb in mbs:
            with self._autocast():
                out = self._run(mb)
                res = post_hook(out, mb) if post_hook is not None else out
            if isinstance(res, torch.Tensor):
                res = list(torch.split(res, mb.seqlens["packed_input_ids"]))
            per_sample.extend(res)
        return aggregate_fn([per_sample[i] for i in backward])

    @torch.no_grad()
    def generate(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, tokenizer, gconfig: GenerationHyperparameters
    ) -> generation.GenerationResult:
        """Sample from `packed_prompts`; one result per prompt (repeat prompts for n > 1)."""
        self.module.eval()
        mbs, _, backward = input_.split(mb_spec)
        parts = []
        for mb in mbs:
            prompts = [t.tolist() for t in mb.unpack("packed_prompts")]
            with self._autocast():
                parts.append(
                    generation.generate(
                        self.module,
                        prompts,
                        gconfig,
                        {tokenizer.eos_token_id},
                        tokenizer.pad_token_id,
                        self.device,
                    )
                )
        ids = [x for p in parts for x in p.output_ids]
        lps = [x for p in parts for x in p.logprobs]
        no_eos = [x for p in parts for x in p.no_eos]
        return generation.GenerationResult(
            [ids[i] for i in backward], [lps[i] for i in backward], [no_eos[i] for i in backward]
        )

    def save_to_hf(self, tokenizer, save_dir: str) -> None:
        if distributed.rank() != 0:  # the replicas are identical: rank 0 writes
            return
        os.makedirs(save_dir, exist_ok=True)
        self.module.save_pretrained(save_dir, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(save_dir)


class HFBackend(ModelBackend):
    """The embedded transformers backend: one process, CPU or one GPU."""

    Args = HFBackendArgs

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        a: HFBackendArgs = self.args
        device = torch.device(
            "cuda"
            if a.device == "auto" and torch.cuda.is_available()
            else ("cpu" if a.device == "auto" else a.device)
        )
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU
        dtype = DTYPES[a.dtype]
        module = model.module
        if a.optimizer is None:
            module = module.to(dtype)  # inference only: keep weights in the compute dtype
        elif a.gradient_checkpointing:
            module.gradient_checkpointing_enable()
        if hasattr(module, "config"):
            module.config._attn_implementation = a.attn_implementation
        module = module.to(device)
        model.module = HFEngine(module, device, dtype, a.optimizer, spec.total_train_steps)
        model.device, model.dtype = device, dtype
        return model

    def save(self, model: Model, save_dir: str) -> None:
        engine: HFEngine = model.module
        if engine.optimizer is not None and distributed.rank() == 0:
            torch.save(
                {"optimizer": engine.optimizer.state_dict()}, os.path.join(save_dir, "engine_state.pt")
            )

    def load(self, model: Model, load_dir: str) -> None:
        engine: HFEngine = model.module
        path = os.path.join(load_dir, "engine_state.pt")
        if engine.optimizer is not None and os.path.exists(path):
            state = torch.load(path, map_location=engine.device, weights_only=True)
            engine.optimizer.load_state_dict(state["optimizer"])

    def update_weights(self, model: Model, path: str, version: int) -> None:
        """Load another model's HF export in place (a model with `weights_from`)."""
        from pathlib import Path

        from arealcli.runtime.checkpoint import load_hf_weights

        load_hf_weights(model.module.module, Path(path))

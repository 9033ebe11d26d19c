"""The training engine: one forward/backward-over-micro-batches primitive, and everything built on it.

A backend (hf, fsdp, megatron) subclasses `TrainEngine` and implements a few primitives:

    run_microbatches(mbs, on_output, backward)   forward every micro-batch; hand each one's outputs to
                                                 `on_output(mb, outputs)` (on the rank that has them: the
                                                 last pipeline stage); with `backward`, backpropagate the
                                                 loss it returns. Keeps the rank's collectives in step.
    begin_train_step(version_steps, lr_scale)    learning rate for this step, zeroed gradients
    finish_train_step(stepped)                   gradients synchronized, clipped, optimizer step -> norm
    generate_prompts(prompts, gconfig, eos, pad, stop_texts)
                                                 sample one micro-batch of prompts (stopping at the
                                                 stop texts where the backend can)
    save_to_hf(tokenizer, save_dir)

and gets, written once here: `train_batch` (loss-weighted gradient accumulation, global or per-rank
token normalization), `forward` (post-hook per micro-batch, results back in input order), `eval_batch`
and `generate`, with one cross-rank reduction of the statistics for all of them.

Outputs. A language model's micro-batch outputs are an `LMOutput` (hidden states and the LM head: the
loss computes per-token log-probs and entropy chunk by chunk, never the (tokens, vocab) logits), or its
packed logits (tokens, vocab); a value-head model's are values (tokens,). A loss function or post-hook
marked `@takes_lm_output` gets an `LMOutput`, any other one packed logits (`engines.lm_output`).

Loss weighting. Micro-batch i's loss is weighted by w_i / W, with w_i = `loss_weight_fn(mb_i)` and W
the sum of the weights of every micro-batch of this rank ("dp") or of every data-parallel rank
("global"). Every backend averages gradients over the data-parallel ranks, so with "global" the
weight is multiplied by the data-parallel size: the sum of the ranks' gradients is then the gradient
of sum_i w_i L_i / W over the whole batch, whatever the split into micro-batches and ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.base import Engine
from arealcli.runtime.engines.lm_output import LMOutput, outputs_for
from arealcli.runtime.generation.sampling import GenerationResult, StopTexts, stop_texts_of
from arealcli.runtime.models.flops import FlopShape, shape_of
from arealcli.runtime.vision import per_sample_images
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec

# loss_fn(outputs, mb) -> (scalar loss, {stat: scalar tensor}); outputs are packed logits (tokens, vocab),
# an LMOutput for functions marked `@takes_lm_output`, or values (tokens,) for value-head models.
LossFn = Callable[[Any, SequenceSample], tuple[torch.Tensor, dict[str, torch.Tensor]]]
LossWeightFn = Callable[[SequenceSample], float]
# What a backend's forward of one micro-batch returns: an LMOutput, logits (tokens, V) or values (tokens,)
Outputs = torch.Tensor | LMOutput
# on_output(mb, outputs) -> the loss to backpropagate (training), or None
OnOutput = Callable[[SequenceSample, Outputs], torch.Tensor | None]


def group_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class TrainEngine(Engine):
    """Base of the engines that train. Subclasses set `device` (and `dp_group` when data-parallel
    ranks are not the whole world) and implement the primitives listed in the module docstring."""

    device: torch.device = torch.device("cpu")
    dp_group: Any = None  # None: every rank of the world is a data-parallel rank

    # ------------------------------------------------------------------ primitives

    def run_microbatch(self, mb: SequenceSample) -> Outputs:
        """Outputs of one micro-batch (engines without pipeline stages)."""
        raise NotImplementedError

    def run_microbatches(self, mbs: list[SequenceSample], on_output: OnOutput, backward: bool) -> None:
        """Default: one forward (+ backward) per micro-batch, no collectives in between."""
        for mb in mbs:
            with torch.set_grad_enabled(backward), self.autocast():
                loss = on_output(mb, self.run_microbatch(mb))
            if backward and loss is not None:
                loss.backward()

    def begin_train_step(self, version_steps: int, lr_scale: float) -> float:
        raise NotImplementedError

    def finish_train_step(self, stepped: bool) -> float:
        """Synchronize, clip and apply the gradients; `stepped` is False when no rank had any weight."""
        raise NotImplementedError

    def generate_prompts(
        self,
        prompts: list[list[int]],
        g: GenerationHyperparameters,
        eos_ids: set[int],
        pad_id: int,
        stop_texts: StopTexts | None = None,
        images: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> GenerationResult:
        """`stop_texts` (when `g.stop` is set): end a sample at the token completing one while
        generating; a backend that cannot leaves it to `generate`, which cuts every sample after.
        `images`: a vision-language model's images per prompt (runtime/vision.py)."""
        raise NotImplementedError

    def save_to_hf(self, tokenizer: Any, save_dir: str) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks (defaults fit hf / fsdp)

    def autocast(self) -> AbstractContextManager:
        return nullcontext()

    def eval_mode(self) -> None:
        """Put the module in eval mode (no dropout) before forward-only passes."""
        self.train(False)

    def _torch_module(self) -> torch.nn.Module | None:
        module = getattr(self, "module", None) or getattr(self, "model", None)
        return module if isinstance(module, torch.nn.Module) else None

    def train(self, mode: bool = True) -> TrainEngine:
        """Like `nn.Module.train` (interfaces written for AReaL call `module.train()` / `module.eval()`)."""
        module = self._torch_module()
        if module is not None:
            module.train(mode)
        return self

    def adapters_off(self):
        module = self._torch_module()
        if module is None or not hasattr(module, "disable_adapter"):
            return super().adapters_off()
        return module.disable_adapter()  # peft's context manager

    def flop_shape(self) -> FlopShape | None:
        return shape_of(self._torch_module())

    def parameter_counts(self) -> tuple[int, int] | None:
        module = self._torch_module()
        if module is None:
            return None
        params = list(module.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    def eval(self) -> TrainEngine:
        return self.train(False)

    def check_batch(self, input_: SequenceSample, key: str) -> None:
        """Megatron: every rank of a model-parallel replica must hold the same batch."""

    def split_for_training(self, input_: SequenceSample, mb_spec: MicroBatchSpec) -> list[SequenceSample]:
        return input_.split(mb_spec)[0]

    def share_from_last(self, obj: Any) -> Any:
        """Pipelines: the last stage's `obj` on every stage. Otherwise `obj` itself."""
        return obj

    def loss_scale(self) -> float:
        """fp16 loss scaling (megatron's optimizer); 1 otherwise."""
        return 1.0

    def generation_context(self) -> AbstractContextManager:
        """Around a whole `generate` call (fsdp: the weights gathered once)."""
        return nullcontext()

    @property
    def dp_world(self) -> int:
        return group_size(self.dp_group)

    # ------------------------------------------------------------------ reductions over dp ranks

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.dp_world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.dp_group)
        return t.tolist()

    def _comm_device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend(self.dp_group) == "nccl":
            return self.device
        return torch.device("cpu")

    def _gather(self, obj: Any) -> list[Any]:
        if self.dp_world == 1:
            return [obj]
        parts: list[Any] = [None] * self.dp_world
        dist.all_gather_object(parts, obj, group=self.dp_group)
        return parts

    # ------------------------------------------------------------------ built on the primitives

    def accumulate_gradients(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        loss_fn: LossFn,
        loss_weight_fn: LossWeightFn,
        token_normalize_scope: str = "global",
    ) -> tuple[dict[str, float], float]:
        """Forward + backward every micro-batch with its weight (see the module docstring).

        Returns the stats (weighted means over every data-parallel rank, `loss_weight` the global
        total, `n_mbs`) and the global total weight.
        """
        if token_normalize_scope not in ("global", "dp"):
            raise ValueError(f"token_normalize_scope must be 'global' or 'dp', got {token_normalize_scope!r}")
        mbs = self.split_for_training(input_, mb_spec)
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        local_total = sum(weights)
        global_total = self.all_reduce([local_total])[0]
        scale: float
        total, scale = (
            (global_total, self.dp_world) if token_normalize_scope == "global" else (local_total, 1)
        )
        scale *= self.loss_scale()
        work = [mb for mb, w in zip(mbs, weights, strict=True) if w > 0 and total > 0]
        weight_of = {id(mb): w for mb, w in zip(mbs, weights, strict=True)}
        loss_sum = 0.0
        sums: dict[str, float] = {}

        def weighted_loss(mb: SequenceSample, outputs: Outputs) -> torch.Tensor:
            nonlocal loss_sum
            w = weight_of[id(mb)]
            loss, mb_stats = _loss_and_stats(loss_fn(outputs_for(loss_fn, outputs), mb))
            loss_sum += float(loss.detach()) * w
            for k, v in mb_stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            return loss * (w / total * scale)

        self.run_microbatches(work, weighted_loss, backward=True)
        loss_sum, sums = self.share_from_last((loss_sum, sums))
        stats = self._weighted_means(loss_sum, sums, local_total, token_normalize_scope)
        stats["n_mbs"] = float(len(mbs))
        return stats, global_total

    def _weighted_means(
        self, loss_sum: float, sums: dict[str, float], local_total: float, scope: str
    ) -> dict[str, float]:
        """Weighted sums -> means over every data-parallel rank: "global" the token mean over all
        ranks, "dp" the mean of the ranks' own means; `loss_weight` the global total."""
        parts = self._gather((loss_sum, sums, local_total))
        total = sum(p[2] for p in parts)
        denom = total if total > 0 else 1.0
        out: dict[str, float] = {}
        for _, s, _ in parts:
            for k, v in s.items():
                out[k] = out.get(k, 0.0) + v / denom
        if scope == "global" or len(parts) == 1:
            out["loss"] = sum(p[0] for p in parts) / denom
        else:
            out["loss"] = sum(p[0] / p[2] for p in parts if p[2] > 0) / len(parts)
        out["loss_weight"] = total
        return out

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
        """One optimizer step over `input_`; the LR is the schedule at `version_steps` x `lr_scale`."""
        self.check_batch(input_, "packed_input_ids")
        lr = self.begin_train_step(version_steps, lr_scale)
        stats, global_total = self.accumulate_gradients(
            input_, mb_spec, loss_fn, loss_weight_fn, token_normalize_scope
        )
        stats["grad_norm"] = self.finish_train_step(global_total > 0)
        stats["lr"] = lr
        return stats

    @torch.no_grad()
    def eval_batch(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, loss_fn: LossFn
    ) -> dict[str, float]:
        """`loss_fn`'s loss and stats, each micro-batch weighted by its samples, averaged over the
        samples of every data-parallel rank."""
        self.check_batch(input_, "packed_input_ids")
        self.eval_mode()
        sums: dict[str, float] = {}

        def record(mb: SequenceSample, outputs: Outputs) -> None:
            loss, mb_stats = _loss_and_stats(loss_fn(outputs_for(loss_fn, outputs), mb))
            for k, v in {"loss": loss, **mb_stats}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * mb.bs

        self.run_microbatches(input_.split(mb_spec)[0], record, backward=False)
        parts = self._gather((self.share_from_last(sums), input_.bs))
        n = sum(p[1] for p in parts)
        out: dict[str, float] = {}
        for s, _ in parts:
            for k, v in s.items():
                out[k] = out.get(k, 0.0) + v
        return {k: v / max(n, 1) for k, v in out.items()}

    @torch.no_grad()
    def forward(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        post_hook: Callable[[Any, SequenceSample], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any:
        """Run every micro-batch; per-sample results come back in the input's order, on every rank.

        `post_hook(outputs, mb)` maps a micro-batch's packed outputs to one tensor per sample (a list)
        or to a packed tensor split like `packed_input_ids`; without it the outputs themselves (packed
        logits or values) are split. With pipeline stages the results travel from the last stage: keep
        them small.
        """
        self.check_batch(input_, "packed_input_ids")
        self.eval_mode()
        mbs, _, backward = input_.split(mb_spec)
        per_sample: list[Any] = []

        def record(mb: SequenceSample, outputs: Outputs) -> None:
            res = post_hook(outputs_for(post_hook, outputs), mb) if post_hook is not None else outputs
            res = res.logits if isinstance(res, LMOutput) else res
            if isinstance(res, torch.Tensor):
                res = list(torch.split(res, mb.seqlens["packed_input_ids"]))
            per_sample.extend(res)

        self.run_microbatches(mbs, record, backward=False)
        per_sample = self.share_from_last(per_sample)
        return aggregate_fn([per_sample[i] for i in backward])

    @torch.no_grad()
    def generate(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, tokenizer, gconfig: GenerationHyperparameters
    ) -> GenerationResult:
        """Sample from `packed_prompts`, micro-batch by micro-batch; one result per prompt (repeat prompts
        for n > 1), in input order."""
        self.check_batch(input_, "packed_prompts")
        self.eval_mode()
        mbs, _, backward = input_.split(mb_spec)
        eos = {tokenizer.eos_token_id}
        texts = stop_texts_of(gconfig, tokenizer)
        with self.generation_context():
            parts = [
                self.generate_prompts(
                    [t.tolist() for t in mb.unpack("packed_prompts")],
                    gconfig,
                    eos,
                    tokenizer.pad_token_id,
                    texts,
                    images=per_sample_images(mb),
                )
                for mb in mbs
            ]
        result = GenerationResult.concat(parts).reordered(backward)
        return texts.cut(result) if texts is not None else result


def _loss_and_stats(result: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A loss function's result: `(loss, stats)`, or a bare scalar loss."""
    stats: dict[str, Any]
    if isinstance(result, torch.Tensor):
        loss, stats = result, {}
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
        loss, stats = result
    else:
        raise TypeError(
            f"a loss function returns a scalar tensor, or (scalar tensor, {{stat: value}}); got {type(result).__name__}"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"a loss function's loss must be a scalar tensor; got {shape}")
    return loss, stats


def clip_and_step(params, optimizer: torch.optim.Optimizer, max_norm: float | None) -> float:
    """Clip the global gradient norm, step (skipped if the norm is not finite), zero the grads."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    norm_value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if torch.isfinite(torch.tensor(norm_value)):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm_value


def average_gradients(params, group=None, bucket_numel: int = 1 << 25) -> None:
    """Average `.grad` over the ranks of `group` (replicated data parallelism without DDP).

    A parameter without a gradient on some rank counts as zeros there. Gradients travel in flat
    buckets of at most `bucket_numel` elements (one all-reduce each).
    """
    world = group_size(group)
    if world == 1:
        return
    grads: list[torch.Tensor] = []  # each parameter's .grad (the same tensors, averaged in place)
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat /= world
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    size = 0
    for g in grads:
        if bucket and (size + g.numel() > bucket_numel or g.dtype != bucket[0].dtype):
            flush()
            size = 0
        bucket.append(g)
        size += g.numel()
    if bucket:
        flush()

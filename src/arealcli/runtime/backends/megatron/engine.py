"""The megatron engine: a Megatron-Core ``GPTModel`` shard behind the same API as the hf engine.

Each rank holds one (tensor-parallel rank, pipeline stage) shard; data parallelism replicates that
layout ``dp = world / (tp * pp)`` times. Every rank of one data-parallel replica (its TP x PP ranks)
must receive the same ``input_`` (the replica's slice of the global batch: slice by ``dp_rank`` /
``dp_world``); the engine checks that and fails loudly otherwise.

A micro-batch of packed sequences runs like the hf backend's ``run_packed``: right-padded to (B, T),
position ids 0..T-1 in every row, forward, logits re-packed to (tokens, vocab) with the same
row-major order. No explicit attention mask is passed to megatron: with right padding, the causal
mask already hides every pad from every real token (a real token at position t only sees positions
<= t, all real), and without a mask SDPA stays on its fused causal kernel. Outputs at pad positions
differ from the hf backend's and are dropped by the re-packing.

Tensor parallelism: the last stage's logits are vocab-parallel (B, T, V/tp); they are all-gathered
to the full vocab (autograd-aware: backward keeps each rank's slice of the gradient) so that
``loss_fn`` sees exactly what it sees on the hf backend. The cost: every TP rank materialises the
full (tokens, V) logits and their gradient, as a single GPU would. Megatron's vocab-parallel cross
entropy avoids that, but cannot serve arbitrary ``loss_fn``s (PPO needs log-probs and entropy).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from arealcli.runtime import generation
from arealcli.runtime.backends.base import LossFn, LossWeightFn
from arealcli.runtime.backends.megatron.schedule import Stage, run_schedule
from arealcli.runtime.data import SequenceSample
from arealcli.runtime.optim import begin_step
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig


class MegatronEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        hf_config: Any,
        optimizer: Any | None,
        optimizer_cfg: OptimizerConfig | None,
        total_train_steps: int,
        dtype: torch.dtype,
        device: torch.device,
        distributed_optimizer: bool = False,
        make_vocab_size_divisible_by: int = 128,
    ):
        from megatron.core import parallel_state as ps

        self.model = model  # megatron DistributedDataParallel(GPTModel) when training, else the GPTModel
        self.gpt = getattr(model, "module", model)
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size
        self.optimizer = optimizer
        self.optimizer_cfg = optimizer_cfg
        self.total_train_steps = total_train_steps
        self.dtype = dtype
        self.device = device
        self.distributed_optimizer = distributed_optimizer
        self.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        self.stage = Stage.current()
        self.tp_rank, self.tp_world = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
        )
        self.pp_rank, self.pp_world = ps.get_pipeline_model_parallel_rank(), self.stage.size
        self.dp_group = ps.get_data_parallel_group()
        self.dp_rank, self.dp_world = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.mp_group = ps.get_model_parallel_group()  # the TP x PP ranks of this replica

    # ------------------------------------------------------------------ one micro-batch, one stage

    def _forward_step(self, mb: SequenceSample, x: torch.Tensor | None) -> torch.Tensor:
        """This stage's forward of one micro-batch. First stages read token ids, the others the
        received activation ``x`` [s, b, h]. Returns the activation to send on, or on the last
        stage the packed full-vocab logits (tokens, V)."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        ids, valid = mb.padded("packed_input_ids", pad_value=0)  # (B, T)
        ids = ids.to(self.device)
        b, s = ids.shape
        position_ids = torch.arange(s, device=self.device).expand(b, s)  # from 0 in every row
        if x is not None:
            self.gpt.set_input_tensor(x)
        out = self.model(ids, position_ids, None)  # last stage (B, T, V_padded/tp), else [s, b, h]
        if not self.stage.last:
            return out
        logits = gather_from_tensor_model_parallel_region(out)  # (B, T, V_padded)
        return logits[..., : self.vocab_size][valid.to(self.device)]  # (tokens, V), packed order

    def _activation_shape(self, mb: SequenceSample) -> tuple[int, int, int]:
        return (max(mb.seqlens["packed_input_ids"]), mb.bs, self.hf_config.hidden_size)  # [s, b, h]

    def _schedule(self, mbs, last_stage_fn, backward: bool) -> None:
        run_schedule(
            self.stage,
            mbs,
            self._forward_step,
            last_stage_fn,
            self._activation_shape,
            self.dtype,
            self.device,
            backward,
        )

    # ------------------------------------------------------------------ batch bookkeeping

    def _check_same_batch(self, input_: SequenceSample, key: str) -> None:
        """Every TP / PP rank of this replica must hold the same samples (the pipeline's activation
        shapes and the TP collectives depend on it): compare a cheap fingerprint over the group."""
        if self.mp_group.size() == 1:
            return
        ids = input_.data[key].long().cpu()
        weights = torch.arange(ids.numel()) % 1009 + 1
        sig = torch.tensor([input_.bs, ids.numel(), int((ids * weights).sum())], dtype=torch.float64)
        both = torch.cat([sig, -sig]).to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.mp_group)
        if not torch.equal(both[:3], -both[3:]):
            raise RuntimeError(
                "megatron: the tensor/pipeline-parallel ranks of one data-parallel replica received "
                "different batches. Give every rank of a replica the same slice of the global batch: "
                f"slice by the engine's dp_rank / dp_world (this rank: {self.dp_rank} / {self.dp_world}), "
                "not by the global rank."
            )

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        if self.dp_world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op, group=self.dp_group)
        return t.tolist()

    def _split_evenly(self, input_: SequenceSample, mb_spec: MicroBatchSpec) -> list[SequenceSample]:
        """Micro-batches, as many on every data-parallel rank as the most any rank needs (as far as
        its samples allow), so that the replicas run balanced, equally long schedules."""
        mbs = input_.split(mb_spec)[0]
        n = int(self._all_reduce([float(len(mbs))], dist.ReduceOp.MAX)[0])
        if n > len(mbs):
            mbs = input_.split(mb_spec.model_copy(update={"n_mbs": n}))[0]
        return mbs

    def _reduce_stats(
        self, loss_sum: float, sums: dict[str, float], local_total: float, scope: str
    ) -> dict[str, float]:
        """Weighted sums -> means over the whole data-parallel group (the hf backend's convention):
        "global" the token mean over every rank, "dp" the mean of the ranks' own means;
        ``loss_weight`` the global total."""
        parts = [(loss_sum, sums, local_total)]
        if self.dp_world > 1:
            parts = [None] * self.dp_world
            dist.all_gather_object(parts, (loss_sum, sums, local_total), group=self.dp_group)
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

    # ------------------------------------------------------------------ training

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
        """One optimizer step over ``input_`` (this replica's slice of the global batch); the LR is
        the schedule at ``version_steps`` times ``lr_scale``.

        Micro-batch i's loss is weighted by w_i / W * dp: W sums the weights over every micro-batch
        of every data-parallel rank ("global"; this rank's only for "dp"), and megatron's DDP
        averages the gradients over the dp ranks, which the factor dp turns back into a sum.
        """
        from megatron.core.distributed import finalize_model_grads

        if token_normalize_scope not in ("global", "dp"):
            raise ValueError(f"token_normalize_scope must be 'global' or 'dp', got {token_normalize_scope!r}")
        self._check_same_batch(input_, "packed_input_ids")
        self.model.train()
        lr = begin_step(self.optimizer, self.optimizer_cfg, self.total_train_steps, version_steps, lr_scale)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        mbs = self._split_evenly(input_, mb_spec)
        weights = [float(loss_weight_fn(mb)) for mb in mbs]
        local_total = sum(weights)
        global_total = self._all_reduce([local_total])[0]
        if token_normalize_scope == "global":
            total, scale = global_total, self.dp_world
        else:
            total, scale = local_total, 1
        scale *= float(self.optimizer.get_loss_scale())  # fp16 loss scaling (1 otherwise)
        work = [(mb, w) for mb, w in zip(mbs, weights, strict=True) if w > 0 and total > 0]

        loss_sum, sums = 0.0, {}

        def weighted_loss(item: tuple[SequenceSample, float], logits: torch.Tensor) -> torch.Tensor:
            nonlocal loss_sum
            mb, w = item
            loss, mb_stats = loss_fn(logits, mb)
            loss_sum += float(loss.detach()) * w
            for k, v in mb_stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w
            return loss * (w / total * scale)

        run_schedule(
            self.stage,
            work,
            lambda item, x: self._forward_step(item[0], x),
            weighted_loss,
            lambda item: self._activation_shape(item[0]),
            self.dtype,
            self.device,
            backward=True,
        )
        # DP all-reduce of the gradient buffers; tied-embedding gradients across first / last stage.
        finalize_model_grads([self.model])
        # Every replica must take the same decision (its optimizer step is collective, and the
        # replicas would drift apart otherwise): step unless no rank had anything to learn from.
        if global_total > 0:
            _, grad_norm, _ = self.optimizer.step()
            grad_norm = float("nan") if grad_norm is None else float(grad_norm)
        else:  # as the hf backend, whose gradients then stay None
            grad_norm = 0.0

        loss_sum, sums = self.stage.broadcast_from_last((loss_sum, sums))
        stats = self._reduce_stats(loss_sum, sums, local_total, token_normalize_scope)
        stats.update({"grad_norm": grad_norm, "lr": lr, "n_mbs": float(len(mbs))})
        return stats

    # ------------------------------------------------------------------ evaluation / inference

    @torch.no_grad()
    def eval_batch(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, loss_fn: LossFn
    ) -> dict[str, float]:
        """``loss_fn`` averaged over this rank's samples (weighted by micro-batch size), like hf."""
        self._check_same_batch(input_, "packed_input_ids")
        self.model.eval()
        sums: dict[str, float] = {}

        def record(mb: SequenceSample, logits: torch.Tensor) -> None:
            loss, mb_stats = loss_fn(logits, mb)
            sums["loss"] = sums.get("loss", 0.0) + float(loss) * mb.bs
            for k, v in mb_stats.items():
                sums[k] = sums.get(k, 0.0) + float(v) * mb.bs

        self._schedule(input_.split(mb_spec)[0], record, backward=False)
        sums = self.stage.broadcast_from_last(sums)
        return {k: v / max(input_.bs, 1) for k, v in sums.items()}

    @torch.no_grad()
    def forward(
        self,
        input_: SequenceSample,
        mb_spec: MicroBatchSpec,
        post_hook: Callable[[torch.Tensor, SequenceSample], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any:
        """Per-sample outputs in the input's order, on every rank (see ``HFEngine.forward``). With
        pipeline parallelism the last stage computes them and broadcasts them (pickled, via the CPU)
        to the other stages: keep ``post_hook``'s outputs small (log-probs, not logits)."""
        self._check_same_batch(input_, "packed_input_ids")
        self.model.eval()
        mbs, _, backward = input_.split(mb_spec)
        per_sample: list[Any] = []

        def record(mb: SequenceSample, logits: torch.Tensor) -> None:
            res = post_hook(logits, mb) if post_hook is not None else logits
            if isinstance(res, torch.Tensor):
                res = list(torch.split(res, mb.seqlens["packed_input_ids"]))
            per_sample.extend(res)

        self._schedule(mbs, record, backward=False)
        if self.stage.size > 1:
            moved = [r.cpu() if isinstance(r, torch.Tensor) else r for r in per_sample]
            moved = self.stage.broadcast_from_last(moved)
            if not self.stage.last:
                per_sample = [r.to(self.device) if isinstance(r, torch.Tensor) else r for r in moved]
        return aggregate_fn([per_sample[i] for i in backward])

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self, input_: SequenceSample, mb_spec: MicroBatchSpec, tokenizer, gconfig: GenerationHyperparameters
    ) -> generation.GenerationResult:
        """Sample from ``packed_prompts``; one result per prompt.

        SLOW by design: no KV cache, every new token re-runs the full forward over every sequence
        (O(T^2) work per sample). It exists for evaluation and debugging; for RL rollouts use an
        hf / sglang / vllm generation model that receives this model's weights (``save_to_hf``).
        """
        self._check_same_batch(input_, "packed_prompts")
        self.model.eval()
        mbs, _, backward = input_.split(mb_spec)
        eos = {tokenizer.eos_token_id} | set(gconfig.stop_token_ids)
        parts = [self._generate_mb(mb, gconfig, eos, tokenizer.pad_token_id) for mb in mbs]
        ids = [x for p in parts for x in p.output_ids]
        lps = [x for p in parts for x in p.logprobs]
        no_eos = [x for p in parts for x in p.no_eos]
        return generation.GenerationResult(
            [ids[i] for i in backward], [lps[i] for i in backward], [no_eos[i] for i in backward]
        )

    def _generate_mb(
        self, mb: SequenceSample, g: GenerationHyperparameters, eos: set[int], pad_id: int
    ) -> generation.GenerationResult:
        from megatron.core import parallel_state as ps

        seqs = [t.tolist() for t in mb.unpack("packed_prompts")]
        B = len(seqs)
        stop = torch.tensor(sorted(eos), device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for t in range(g.max_new_tokens):
            batch = SequenceSample.from_lists(
                list(range(B)), {"packed_input_ids": [torch.tensor(s) for s in seqs]}
            )
            picked = torch.zeros(2, B, dtype=torch.float64, device=self.device)  # [token; logp]

            def sample_next(cur: SequenceSample, logits: torch.Tensor, t=t, picked=picked) -> None:
                last = (cur.cu_seqlens("packed_input_ids")[1:] - 1).to(self.device)
                nxt = logits[last].float()  # (B, V) logits of each sequence's next token
                if t < g.min_new_tokens:
                    nxt[:, stop] = float("-inf")
                token, logp = generation.sample(nxt, g)
                picked[0], picked[1] = token.double(), logp.double()

            self._schedule([batch], sample_next, backward=False)
            # Sampling is random: TP rank 0 of the last stage decides, then every stage hears it.
            if self.stage.last and self.tp_world > 1:
                dist.broadcast(
                    picked,
                    src=ps.get_tensor_model_parallel_src_rank(),
                    group=ps.get_tensor_model_parallel_group(),
                )
            if self.stage.size > 1:
                dist.broadcast(picked, src=self.stage.last_rank, group=self.stage.group)
            token = torch.where(
                finished, torch.full_like(finished, pad_id, dtype=torch.long), picked[0].long()
            )
            tokens.append(token)
            logps.append(picked[1].float())
            finished = finished | torch.isin(token, stop)
            if bool(finished.all()):
                break
            for s, tok in zip(seqs, token.tolist(), strict=True):
                s.append(tok)
        return generation.trim_at_stop(torch.stack(tokens, 1), torch.stack(logps, 1), set(stop.tolist()))

    # ------------------------------------------------------------------ checkpoints

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The full HF state dict, merged from every shard of data-parallel replica 0, on global rank
        0 (None elsewhere). Collective: every rank must call it."""
        from arealcli.runtime.backends.megatron.convert import megatron_to_hf

        mine = None
        if self.dp_rank == 0:
            shard = {
                k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                for k, v in self.gpt.state_dict().items()
            }
            mine = (self.tp_rank, self.pp_rank, shard)
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if dist.get_rank() != 0:
            return None
        shards = [[None] * self.tp_world for _ in range(self.pp_world)]
        for item in gathered:
            if item is not None:
                tp_rank, pp_rank, shard = item
                shards[pp_rank][tp_rank] = shard
        return megatron_to_hf(shards, self.hf_config, self.tp_world, self.pp_world)

    def save_to_hf(self, tokenizer, save_dir: str) -> None:
        """Write an HF checkpoint (safetensors) that ``AutoModelForCausalLM.from_pretrained`` loads.
        Collective: every rank calls it; global rank 0 gathers the shards and writes."""
        state = self.hf_state_dict()
        if state is not None:
            from transformers import AutoModelForCausalLM

            os.makedirs(save_dir, exist_ok=True)
            with torch.device("meta"):  # a skeleton for save_pretrained: no weights allocated
                skeleton = AutoModelForCausalLM.from_config(self.hf_config, dtype=self.dtype)
            skeleton.save_pretrained(save_dir, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(save_dir)
        dist.barrier()

    @torch.no_grad()
    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Replace the weights by a full HF state dict (every rank takes its own shard of it)."""
        from arealcli.runtime.backends.megatron.convert import hf_to_megatron

        shard = hf_to_megatron(
            hf_state,
            self.hf_config,
            self.tp_rank,
            self.tp_world,
            self.pp_rank,
            self.pp_world,
            make_vocab_size_divisible_by=self.make_vocab_size_divisible_by,
        )
        self.gpt.load_state_dict(shard, strict=True)  # copies into the existing parameters
        if self.optimizer is not None and hasattr(self.optimizer, "reload_model_params"):
            self.optimizer.reload_model_params()  # megatron's fp32 master copies follow

    def _optimizer_file(self, save_dir: str, kind: str) -> str:
        return os.path.join(save_dir, "megatron_optimizer", f"{kind}_tp{self.tp_rank}_pp{self.pp_rank}.pt")

    def save_state(self, save_dir: str) -> None:
        """Optimizer state for resume, one file per (TP, PP) shard (data-parallel replicas hold the
        same state; a distributed optimizer's shards are gathered to DP rank 0 by megatron)."""
        if self.optimizer is None:
            return
        os.makedirs(os.path.join(save_dir, "megatron_optimizer"), exist_ok=True)
        if self.distributed_optimizer:
            self.optimizer.save_parameter_state(self._optimizer_file(save_dir, "param_state"))
        if self.dp_rank == 0:
            torch.save({"optimizer": self.optimizer.state_dict()}, self._optimizer_file(save_dir, "state"))
        dist.barrier()

    def load_state(self, load_dir: str) -> None:
        path = self._optimizer_file(load_dir, "state")
        if self.optimizer is None or not os.path.exists(path):
            return
        # Our own file; megatron's optimizer state holds more than tensors.
        state = torch.load(path, map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.distributed_optimizer:
            self.optimizer.load_parameter_state(self._optimizer_file(load_dir, "param_state"))

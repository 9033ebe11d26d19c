"""The megatron engine: a Megatron-Core ``GPTModel`` shard behind the same API as the hf engine.

Each rank holds one (tensor-parallel rank, pipeline stage) shard; data parallelism replicates that
layout ``dp = world / (tp * pp)`` times. Every rank of one data-parallel replica (its TP x PP ranks)
must receive the same ``input_`` (the replica's slice of the global batch: slice by ``dp_rank`` /
``dp_world``); the engine checks that and fails loudly otherwise.

A micro-batch of packed sequences runs right-padded to (B, T) (the hf backend's "padded" layout;
megatron's packed-sequence attention needs Transformer Engine), position ids 0..T-1 in every row,
forward, outputs re-packed to the tokens' packed order. No explicit attention mask is passed to megatron: with right padding, the causal
mask already hides every pad from every real token (a real token at position t only sees positions
<= t, all real), and without a mask SDPA stays on its fused causal kernel. Outputs at pad positions
differ from the hf backend's and are dropped by the re-packing.

The last stage returns an ``LMOutput``: the final hidden states (captured at the input of megatron's
output layer, whose own matmul then runs on an empty slice) and this rank's vocab-parallel rows of the
head (V_padded/tp of them, the padding rows cut off). Log-probs and entropy come from those chunk by
chunk of tokens, vocab-parallel in the manner of megatron's ``vocab_parallel_cross_entropy`` (maximum,
sum of exponentials, target logit and sum p z all-reduced over the tensor-parallel group; the hidden
states' gradient summed over it), so no rank ever holds the (tokens, V) logits. A loss that takes packed
logits gets them from ``.logits``: the local logits all-gathered to the full vocab (autograd-aware),
as a single GPU would hold them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from arealcli.runtime.algo.logprobs import VocabShard
from arealcli.runtime.backends.megatron.schedule import Stage, run_schedule
from arealcli.runtime.data.sample import SequenceSample
from arealcli.runtime.engines.lm_output import LMOutput, as_lm_output
from arealcli.runtime.engines.train import TrainEngine
from arealcli.runtime.generation import sampling as generation
from arealcli.runtime.models.weights import load_plain
from arealcli.runtime.optim import begin_step, require_optimizer
from arealcli.runtime.vision import save_tokenizer
from arealcli.schema.components.engine import GenerationHyperparameters, MicroBatchSpec, OptimizerConfig


def _map_tensors(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(x, fn) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class MegatronEngine(TrainEngine):
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

        # megatron DistributedDataParallel(GPTModel) when training, else the GPTModel (duck-typed)
        self.model: Any = model
        self.gpt: Any = getattr(model, "module", model)
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
        self.dp_rank = ps.get_data_parallel_rank()  # dp_world: the size of dp_group (TrainEngine)
        self.mp_group = ps.get_model_parallel_group()  # the TP x PP ranks of this replica

    # ------------------------------------------------------------------ one micro-batch, one stage

    def _forward_step(self, mb: SequenceSample, x: torch.Tensor | None) -> Any:
        """This stage's forward of one micro-batch. First stages read token ids, the others the
        received activation ``x`` [s, b, h]. Returns the activation to send on, or on the last
        stage the micro-batch's ``LMOutput`` (tokens in packed order, the vocab-parallel head)."""
        ids, valid = mb.padded("packed_input_ids", pad_value=0)  # (B, T)
        ids = ids.to(self.device)
        b, s = ids.shape
        position_ids = torch.arange(s, device=self.device).expand(b, s)  # from 0 in every row
        if x is not None:
            self.gpt.set_input_tensor(x)
        if not self.stage.last:
            return self.model(ids, position_ids, None)  # [s, b, h]
        captured: list[tuple[torch.Tensor, torch.Tensor]] = []

        def take_hidden(module, args, kwargs):
            # the final hidden states [s, b, h] and the head's weight (the embeddings' when tied)
            weight = kwargs.get("weight")
            captured.append((args[0], module.weight if weight is None else weight))
            return (args[0][:0], *args[1:]), kwargs  # the layer's own matmul: on no tokens

        handle = self.gpt.output_layer.register_forward_pre_hook(take_hidden, with_kwargs=True)
        try:
            self.model(ids, position_ids, None)
        finally:
            handle.remove()
        hidden, weight = captured[0]
        hidden = hidden.transpose(0, 1)[valid.to(self.device)]  # (tokens, h), packed order
        return self._lm_output(hidden, weight)

    def _lm_output(self, hidden: torch.Tensor, weight: torch.Tensor) -> LMOutput:
        """This rank's rows [start, start + V_r) of the head, without megatron's vocabulary padding."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        rows = weight.shape[0]  # V_padded / tp
        start = self.tp_rank * rows
        valid = max(0, min(rows, self.vocab_size - start))
        shard = VocabShard(ps.get_tensor_model_parallel_group(), start, valid) if self.tp_world > 1 else None

        def full_logits(h: torch.Tensor) -> torch.Tensor:  # (tokens, V), as one GPU would hold them
            local = torch.nn.functional.linear(h, weight)  # (tokens, V_padded/tp)
            return gather_from_tensor_model_parallel_region(local)[..., : self.vocab_size]

        return LMOutput(hidden, weight[:valid], shard=shard, logits_fn=full_logits)

    def _activation_shape(self, mb: SequenceSample) -> tuple[int, int, int]:
        return (max(mb.seqlens["packed_input_ids"]), mb.bs, self.hf_config.hidden_size)  # [s, b, h]

    # ------------------------------------------------------------------ the TrainEngine primitives

    def run_microbatches(self, mbs, on_output, backward: bool) -> None:
        """The pipeline schedule over the micro-batches; `on_output` runs on the last stage."""
        run_schedule(
            self.stage,
            mbs,
            self._forward_step,
            on_output,
            self._activation_shape,
            self.dtype,
            self.device,
            backward,
        )

    def check_batch(self, input_: SequenceSample, key: str) -> None:
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

    def split_for_training(self, input_: SequenceSample, mb_spec: MicroBatchSpec) -> list[SequenceSample]:
        """Micro-batches, as many on every data-parallel rank as the most any rank needs (as far as
        its samples allow), so that the replicas run balanced, equally long schedules."""
        mbs = input_.split(mb_spec)[0]
        n = int(self.all_reduce([float(len(mbs))], op="max")[0])
        if n > len(mbs):
            mbs = input_.split(mb_spec.model_copy(update={"n_mbs": n}))[0]
        return mbs

    def share_from_last(self, obj: Any) -> Any:
        """The last stage's `obj` on every stage (tensors travel through the CPU)."""
        if self.stage.size == 1:
            return obj
        moved = _map_tensors(obj, lambda t: t.cpu())
        moved = self.stage.broadcast_from_last(moved)
        return obj if self.stage.last else _map_tensors(moved, lambda t: t.to(self.device))

    def loss_scale(self) -> float:
        optimizer, _ = require_optimizer(self.optimizer, self.optimizer_cfg)  # only asked while training
        return float(optimizer.get_loss_scale())  # fp16 loss scaling (1 otherwise)

    def begin_train_step(self, version_steps: int, lr_scale: float) -> float:
        self.model.train()
        lr = begin_step(self.optimizer, self.optimizer_cfg, self.total_train_steps, version_steps, lr_scale)
        optimizer, _ = require_optimizer(self.optimizer, self.optimizer_cfg)  # begin_step checked them
        self.model.zero_grad_buffer()
        optimizer.zero_grad()
        return lr

    def finish_train_step(self, stepped: bool) -> float:
        """DP all-reduce of the gradient buffers, tied-embedding gradients across first / last stage,
        then the (collective) optimizer step. Every replica takes the same decision: step unless no rank
        had anything to learn from (as the hf backend, whose gradients then stay None)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        if not stepped:
            return 0.0
        optimizer, _ = require_optimizer(self.optimizer, self.optimizer_cfg)  # checked by begin_train_step
        _, grad_norm, _ = optimizer.step()
        return float("nan") if grad_norm is None else float(grad_norm)

    def generate_prompts(
        self,
        prompts,
        g: GenerationHyperparameters,
        eos_ids: set[int],
        pad_id: int,
        stop_texts=None,
        images=None,
    ):
        """SLOW by design: no KV cache, every new token re-runs the full forward over every sequence
        (O(T^2) work per sample). It exists for evaluation and debugging; for RL rollouts use an
        hf / sglang / vllm generation model that receives this model's weights (``save_to_hf``). Stop
        texts are not checked while generating (`generate` cuts the samples after)."""
        if images:
            raise NotImplementedError("the megatron backend builds text-only models: it reads no images")
        return self._generate_mb(prompts, g, eos_ids | set(g.stop_token_ids), pad_id)

    def _generate_mb(
        self, prompts: list[list[int]], g: GenerationHyperparameters, eos: set[int], pad_id: int
    ) -> generation.GenerationResult:
        from megatron.core import parallel_state as ps

        seqs = [list(p) for p in prompts]
        B = len(seqs)
        stop = torch.tensor(sorted(eos), device=self.device)
        finished = torch.zeros(B, dtype=torch.bool, device=self.device)
        tokens, logps = [], []
        for t in range(g.max_new_tokens):
            batch = SequenceSample.from_lists(
                list(range(B)), {"packed_input_ids": [torch.tensor(s) for s in seqs]}
            )
            picked = torch.zeros(2, B, dtype=torch.float64, device=self.device)  # [token; logp]

            def sample_next(cur: SequenceSample, outputs: Any, t=t, picked=picked) -> None:
                last = cur.cu_seqlens("packed_input_ids")[1:] - 1
                nxt = as_lm_output(outputs).rows(last).logits.float()  # (B, V) each sequence's next token
                if t < g.min_new_tokens:
                    nxt[:, stop] = float("-inf")
                token, logp = generation.sample(nxt, g)
                picked[0], picked[1] = token.double(), logp.double()

            self.run_microbatches([batch], sample_next, backward=False)
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
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if gathered is None:  # not global rank 0
            return None
        shards: list[list[Any]] = [[None] * self.tp_world for _ in range(self.pp_world)]
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
                save_tokenizer(tokenizer, save_dir)
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

    def update_weights(self, path: str, version: int) -> None:
        """Load another model's HF export in place (a model with `weights_from`)."""
        from arealcli.runtime.models.weights import read_hf_state

        self.load_hf_state(read_hf_state(path))

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
        """The trained weights (the checkpoint's HF export, each rank its shard), then the optimizer."""
        self.update_weights(load_dir, 0)
        path = self._optimizer_file(load_dir, "state")
        if self.optimizer is None or not os.path.exists(path):
            return
        # tensors and plain data only (a crafted file cannot construct objects here)
        state = load_plain(path, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.distributed_optimizer:
            self.optimizer.load_parameter_state(self._optimizer_file(load_dir, "param_state"))

"""The ``megatron`` backend: turns the trainer's HF causal LM into a ``MegatronEngine``.

torch.distributed must already be initialised (``areal train --nproc-per-node N`` does it; tests do
it themselves). Every rank gets the same full HF module from the trainer; ``_initialize`` builds this
rank's ``GPTModel`` shard, copies its slice of the HF weights in (``hf_to_megatron``), and for a
trained model wraps it in megatron's ``DistributedDataParallel`` and builds the optimizer:

- GPU: megatron's own optimizer (``get_megatron_optimizer``: fp32 master weights for bf16 / fp16,
  optionally the distributed optimizer that shards its state over data-parallel ranks).
- CPU: ``cpu_compat.MainGradOptimizer`` (megatron's optimizer is CUDA-only).

The DDP wrapper is used at every data-parallel size, 1 included: megatron's optimizer reads the
gradients from its contiguous ``main_grad`` buffers, and ``finalize_model_grads`` (which also
all-reduces tied-embedding gradients between the first and last pipeline stage) expects it.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from arealcli.runtime import distributed
from arealcli.runtime.backends.base import ModelBackend
from arealcli.runtime.backends.megatron import cpu_compat
from arealcli.runtime.backends.megatron.engine import MegatronEngine
from arealcli.runtime.models.model import DTYPES, FinetuneSpec, Model
from arealcli.schema.components.backends import MegatronBackendArgs
from arealcli.schema.components.engine import OptimizerConfig

logger = logging.getLogger(__name__)

# Megatron's parallel state is process-global: every megatron model of a run shares one TP x PP
# layout. It is set up by the first engine and torn down when the last one is destroyed.
_parallel_users = 0


def _acquire_parallel(tp: int, pp: int) -> None:
    global _parallel_users
    from megatron.core import parallel_state as ps

    from arealcli.runtime.backends.megatron.model import init_parallel

    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(
                f"every megatron model of a run must use the same parallel layout: this one asks for "
                f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}, an earlier one set up "
                f"{have[0]} and {have[1]}."
            )
    else:
        world = dist.get_world_size()
        if world % (tp * pp) != 0:
            raise ValueError(
                f"tensor_parallel_size ({tp}) x pipeline_parallel_size ({pp}) must divide the number of "
                f"processes ({world}); data parallelism takes the rest."
            )
        init_parallel(tp, pp)
    _parallel_users += 1


def _release_parallel() -> None:
    global _parallel_users
    from arealcli.runtime.backends.megatron.model import destroy_parallel

    _parallel_users -= 1
    if _parallel_users == 0:
        destroy_parallel()


def _check_causal_lm(module) -> None:
    config = getattr(module, "config", None)
    if config is None or not hasattr(module, "lm_head"):
        raise NotImplementedError(
            f"the megatron backend trains Qwen2 / Llama causal LMs; got {type(module).__name__}. "
            "Value-head models (critics) need the hf or fsdp backend."
        )


def build_megatron_optimizer(model, cfg: OptimizerConfig, dtype: torch.dtype, distributed: bool):
    """megatron's optimizer (GPU) with the hf backend's semantics: AdamW (decoupled weight decay
    on every parameter, biases and norms included) or momentum-free SGD, clipped at the global
    norm ``gradient_clipping`` (none: norm still computed, never clipped)."""
    from megatron.core.optimizer import OptimizerConfig as MCoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcfg = MCoreOptimizerConfig(
        optimizer="adam" if cfg.type == "adamw" else "sgd",
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.beta1,
        adam_beta2=cfg.beta2,
        adam_eps=cfg.eps,
        sgd_momentum=0.0,
        clip_grad=cfg.gradient_clipping if cfg.gradient_clipping is not None else float("inf"),
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=distributed,
    )
    # config_overrides={}: no megatron default of "no weight decay on biases / 1-D params".
    return get_megatron_optimizer(mcfg, [model], config_overrides={})


class MegatronBackend(ModelBackend):
    """Megatron-Core GPTModel with tensor / pipeline / data parallelism."""

    Args = MegatronBackendArgs
    builds_weights = True  # converts the source's HF weights into its own sharded model
    resumes_weights = True  # load_state reads the checkpoint's HF export into the shards

    def _initialize(self, model: Model, spec: FinetuneSpec) -> Model:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from arealcli.runtime.backends.megatron.convert import hf_to_megatron
        from arealcli.runtime.backends.megatron.model import build_gpt_model

        a: MegatronBackendArgs = self.args
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "the megatron backend runs under torch.distributed: start the run with "
                "`areal train RECIPE --nproc-per-node N` (N = a multiple of tensor_parallel_size x "
                "pipeline_parallel_size; 1 works too)."
            )
        module = model.initial_module()
        _check_causal_lm(module)
        hf_config = module.config
        tp, pp = a.tensor_parallel_size, a.pipeline_parallel_size
        _acquire_parallel(tp, pp)
        try:
            cpu = cpu_compat.cpu_only()
            device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
            dtype = DTYPES[a.dtype]
            gpt = build_gpt_model(
                hf_config,
                attention=a.attention,
                dtype=dtype,
                make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                # Random init stays on although every weight is overwritten below: megatron marks
                # its TP-sharded weights (`tensor_model_parallel`, which the gradient norm reads)
                # inside the init functions, so perform_initialization=False would lose the marks.
            )
            shard = hf_to_megatron(
                module.state_dict(),
                hf_config,
                ps.get_tensor_model_parallel_rank(),
                tp,
                ps.get_pipeline_model_parallel_rank(),
                pp,
                make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
            )
            gpt.load_state_dict(shard, strict=True)
            del shard

            optimizer, distributed_opt, wrapped = None, False, gpt
            if a.optimizer is not None:
                distributed_opt = a.use_distributed_optimizer and not cpu
                if a.use_distributed_optimizer and cpu:
                    logger.warning("use_distributed_optimizer needs CUDA; ignored on CPU.")
                ddp_config = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=not cpu and dtype != torch.float32,
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=distributed_opt,
                )
                wrapped = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
                if cpu:
                    optimizer = cpu_compat.MainGradOptimizer(wrapped.parameters(), a.optimizer)
                else:
                    optimizer = build_megatron_optimizer(wrapped, a.optimizer, dtype, distributed_opt)
            else:
                gpt.requires_grad_(False)
        except BaseException:
            _release_parallel()
            raise

        model.module = MegatronEngine(
            wrapped,
            hf_config,
            optimizer,
            a.optimizer,
            spec.total_train_steps,
            dtype,
            device,
            distributed_optimizer=distributed_opt,
            make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
        )
        # Ranks of one TP x PP replica share their data: the trainer slices batches by replica.
        distributed.set_data_parallel(model.module.dp_rank, model.module.dp_world)
        model.device, model.dtype = device, dtype
        return model

    def destroy(self, model: Model) -> None:
        if isinstance(model.module, MegatronEngine):
            model.module = None
            _release_parallel()

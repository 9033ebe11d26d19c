"""CPU-only workarounds for megatron-core 0.16 (no CUDA, no transformer-engine, no apex).

megatron-core assumes CUDA in a handful of places that the local (non-TE) GPT path reaches. Every
workaround for that lives in this module and nowhere else, and each one is a no-op when
``torch.cuda.is_available()``: on a GPU megatron runs unpatched.

The workarounds (each found by running megatron-core 0.16 on CPU under torchrun/gloo):

1. RNG tracker: ``model_parallel_cuda_manual_seed`` snapshots CUDA RNG states. On CPU we ask for
   megatron's inference tracker (``inference_rng_tracker=True``), whose ``fork()`` is a null context.
   Dropout inside the tracker's region is then not TP-rank-decorrelated, which is fine for LLM
   fine-tuning with dropout 0 (what ``transformer_config_from_hf`` sets).
2. Model construction: ``TransformerConfig(use_cpu_initialization=True)`` and all fusions off. That
   is config, not patching; ``cpu_config_overrides()`` returns the fields.
3. ``torch.cuda.current_device()`` in forward: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to it,
   ``GlobalMemoryBuffer.get_tensor`` (the scratch buffer of the local ``DotProductAttention``) and the
   tensor-parallel gather / reduce-scatter helpers (used when TP > num_key_value_heads, or for
   ``gather_output``) allocate on it. We run exactly those functions with
   ``torch.cuda.current_device`` answering ``cpu``. Without CUDA that function can only raise, so
   nothing else can observe the change.
4. Tied embeddings with pipeline parallelism: ``LanguageModule.setup_embeddings_and_output_layer``
   calls ``weight.data.cuda()`` before all-reducing the tied embedding between the first and last
   stage. On CPU we run it with that step skipped and do the same all-reduce on the CPU tensor.
5. The stock local attention (``DotProductAttention``, ``attention="local"``) builds its default causal
   mask with ``get_default_causal_mask``, which allocates on ``device="cuda"`` (a literal, not
   ``current_device``). On CPU ``fused_softmax`` gets the same function allocating on the CPU.

6. megatron's ``DistributedDataParallel`` allocates its contiguous gradient buffers
   (``_ParamAndGradBuffer``) on ``torch.cuda.current_device()``: on CPU that constructor runs with the
   same shim as 3.
7. megatron's optimizer (``get_megatron_optimizer``) allocates on 'cuda' and its gradient-norm /
   clipping helpers (``optimizer/clip_grads.py``) build CUDA tensors. On CPU the engine uses
   ``MainGradOptimizer`` below instead: a torch optimizer (AdamW / SGD, as the hf backend) over the
   DDP-wrapped parameters, fed with ``p.grad = p.main_grad`` after ``finish_grad_sync()``, clipped by
   the global norm over the model-parallel ranks exactly as megatron computes it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

_APPLIED = False


def cpu_only() -> bool:
    """True when the workarounds apply: this process sees no CUDA device."""
    return not torch.cuda.is_available()


def cpu_config_overrides() -> dict[str, Any]:
    """TransformerConfig fields for CPU: initialise on CPU, and no fused CUDA kernels."""
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "bias_dropout_fusion": False,
        "apply_rope_fusion": False,
    }


def seed_model_parallel_rng(seed: int) -> None:
    """Seed torch and megatron's model-parallel RNG tracker, on GPU and on CPU alike.

    Megatron layers fork the tracker (e.g. around attention dropout) and initialise weights from
    it, so it has to be seeded after ``initialize_model_parallel`` and before building a model.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if cpu_only():
        # Workaround 1: the CUDA tracker cannot snapshot RNG state without CUDA.
        tensor_parallel.model_parallel_cuda_manual_seed(
            seed, inference_rng_tracker=True, force_reset_rng=True
        )
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


def _on_cpu_device(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    return wrapper


def _tied_embedding_setup_without_cuda(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any) -> None:
        in_embedding_group = self._is_in_embd_group()
        # Hide the group from megatron's method so that it skips its `.cuda()` + all-reduce ...
        self._is_in_embd_group = lambda: False
        try:
            method(self)
        finally:
            del self._is_in_embd_group
        # ... and do megatron's all-reduce here, on the CPU tensor, under the same conditions.
        shared = self.share_embeddings_and_output_weights or getattr(self.config, "mtp_num_layers", 0)
        if (
            shared
            and self.config.pipeline_model_parallel_size > 1
            and torch.distributed.is_initialized()
            and in_embedding_group
        ):
            weight = self.shared_embedding_or_output_weight()
            torch.distributed.all_reduce(weight.data, group=self.embd_group)

    return wrapper


def _default_causal_mask_cpu(sq: int) -> torch.Tensor:
    """megatron.core.transformer.utils.get_default_causal_mask, on the CPU: True above the diagonal."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply_cpu_workarounds() -> bool:
    """Install workarounds 3, 4, 5 and 6 when there is no CUDA device. Idempotent.

    Returns True when they are (now) installed, False on a machine with CUDA, where it does nothing.
    """
    global _APPLIED
    if not cpu_only():
        return False
    if _APPLIED:
        return True

    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel import mappings

    RotaryEmbedding.get_emb = _on_cpu_device(RotaryEmbedding.get_emb)
    mcore_utils.GlobalMemoryBuffer.get_tensor = _on_cpu_device(mcore_utils.GlobalMemoryBuffer.get_tensor)
    for name in ("_gather_along_last_dim", "_gather_along_first_dim", "_reduce_scatter_along_first_dim"):
        setattr(mappings, name, _on_cpu_device(getattr(mappings, name)))
    from megatron.core.distributed import param_and_grad_buffer

    buffer_cls = param_and_grad_buffer._ParamAndGradBuffer
    buffer_cls.__init__ = _on_cpu_device(buffer_cls.__init__)
    LanguageModule.setup_embeddings_and_output_layer = _tied_embedding_setup_without_cuda(
        LanguageModule.setup_embeddings_and_output_layer
    )
    fused_softmax.get_default_causal_mask = _default_causal_mask_cpu
    _APPLIED = True
    return True


# ---------------------------------------------------------------------------------------------
# Workaround 7: the optimizer
# ---------------------------------------------------------------------------------------------


def model_parallel_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """Global L2 norm of ``p.grad`` over the whole model (every TP / PP shard), as megatron's
    ``get_grad_norm_fp32`` computes it: a parameter replicated over TP ranks (norms, biases of
    row-parallel layers) and the last stage's copy of a tied embedding (``shared``) count once."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    squares = torch.zeros(1, dtype=torch.float64)
    for p in params:
        if p.grad is not None and param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.double().square().sum()
    if parallel_state.get_model_parallel_group().size() > 1:
        torch.distributed.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return float(squares.sqrt())


class MainGradOptimizer:
    """The CPU stand-in for megatron's optimizer, with the part of its interface the engine uses:
    ``param_groups``, ``zero_grad``, ``get_loss_scale``, ``step() -> (ok, grad_norm, None)``,
    ``state_dict`` / ``load_state_dict``.

    The parameters belong to a megatron ``DistributedDataParallel`` module, whose backward hooks
    accumulate gradients into ``p.main_grad`` (all-reduced over data-parallel ranks by
    ``finish_grad_sync``). ``step`` points ``p.grad`` at them, clips by the model-parallel global
    norm (torch's ``clip_grad_norm_`` rule), and steps unless the norm is not finite.
    """

    def __init__(self, params, cfg) -> None:
        from arealcli.runtime.optim import build_optimizer

        self.params = [p for p in params if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg)
        self.max_norm = cfg.gradient_clipping

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return torch.ones(())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        for p in self.params:
            p.grad = p.main_grad if p.main_grad.dtype == p.dtype else p.main_grad.to(p.dtype)
        norm = model_parallel_grad_norm(self.params)
        ok = math.isfinite(norm)
        if ok:
            if self.max_norm is not None:
                coef = min(1.0, self.max_norm / (norm + 1e-6))  # torch.nn.utils.clip_grad_norm_
                if coef < 1.0:
                    for p in self.params:
                        p.grad.mul_(coef)
            self.optimizer.step()
        self.zero_grad()
        return ok, norm, None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

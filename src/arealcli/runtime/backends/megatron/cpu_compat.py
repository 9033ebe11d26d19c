"""CPU-only workarounds for megatron-core 0.16 (no CUDA, no transformer-engine, no apex).

megatron-core assumes CUDA in a handful of places that the local (non-TE) GPT path reaches. Every
workaround for that lives in this module and nowhere else, and each one is a no-op when
``torch.cuda.is_available()``: on a GPU megatron runs unpatched.

The workarounds (see /work/shared/ENVIRONMENT.md, "megatron-core"):

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

(megatron's own optimizer is CUDA-only as well; that concerns the engine, not this layer.)
"""

from __future__ import annotations

import contextlib
import functools
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
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
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
    """Install workarounds 3, 4 and 5 when there is no CUDA device. Idempotent.

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
    LanguageModule.setup_embeddings_and_output_layer = _tied_embedding_setup_without_cuda(
        LanguageModule.setup_embeddings_and_output_layer
    )
    fused_softmax.get_default_causal_mask = _default_causal_mask_cpu
    _APPLIED = True
    return True

"""Build a megatron-core ``GPTModel`` shard from a Hugging Face Qwen2 / Llama config.

Usage, once per process after ``torch.distributed.init_process_group``::

    init_parallel(tp=2, pp=1)
    model = build_gpt_model(hf_config)          # this rank's (tp_rank, pp_rank) shard
    model.load_state_dict(hf_to_megatron(hf_sd, hf_config, tp_rank, tp, pp_rank, pp))

The layer spec is megatron's local (no transformer-engine) spec with RMSNorm, with the core attention
swapped for ``SDPAttention`` unless ``attention="local"``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

from arealcli.runtime.backends.megatron import cpu_compat

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
DEFAULT_VOCAB_DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default

AttentionImpl = Literal["sdpa", "local"]


# ---------------------------------------------------------------------------------------------
# Parallel state
# ---------------------------------------------------------------------------------------------


def init_parallel(tp: int, pp: int, *, seed: int = 1234) -> None:
    """Initialise megatron's TP x PP process groups (DP takes the rest of the world) and its RNG.

    torch.distributed must already be initialised (gloo on CPU, nccl on GPU); the world size must
    be a multiple of ``tp * pp``. On a machine without CUDA this also installs the CPU workarounds.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError(
            "init_parallel needs torch.distributed initialised first: call "
            "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU) before it."
        )
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp) != 0:
        raise ValueError(f"tp={tp} x pp={pp} must divide the world size {world}.")
    cpu_compat.apply_cpu_workarounds()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    cpu_compat.seed_model_parallel_rng(seed)


def destroy_parallel() -> None:
    """Tear down megatron's process groups (not torch.distributed itself)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Vocab rows the embedding / output layer get, as Megatron-LM pads them
    (``_vocab_size_with_padding``): a multiple of ``divisible_by * tp_size``."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def layers_per_stage(num_layers: int, pp_size: int) -> int:
    """Transformer layers on each pipeline stage; megatron splits them evenly."""
    if num_layers % pp_size != 0:
        raise ValueError(f"num_hidden_layers={num_layers} must be divisible by the pipeline size {pp_size}.")
    return num_layers // pp_size


# ---------------------------------------------------------------------------------------------
# HF config -> TransformerConfig
# ---------------------------------------------------------------------------------------------


def _check_supported(hf_config: Any) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"The megatron backend supports model types {SUPPORTED_MODEL_TYPES}, got {model_type!r}."
        )
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"Only SwiGLU (hidden_act='silu') is supported, got {hf_config.hidden_act!r}."
        )
    if model_type == "llama" and (
        getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)
    ):
        raise NotImplementedError("Llama configs with attention_bias or mlp_bias are not supported.")
    if model_type == "qwen2" and (
        getattr(hf_config, "use_sliding_window", False)
        or "sliding_attention" in (getattr(hf_config, "layer_types", None) or [])
    ):
        raise NotImplementedError("Qwen2 sliding-window attention is not supported.")


def head_dim(hf_config: Any) -> int:
    """Per-head width: ``head_dim`` when the config sets it, else hidden_size / num_attention_heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def num_kv_heads(hf_config: Any) -> int:
    return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads


def rope_settings(hf_config: Any) -> dict[str, Any]:
    """GPTModel rotary kwargs (``rotary_base``, ``rope_scaling``, ``rope_scaling_factor``).

    transformers 5 keeps ``rope_parameters = {"rope_type", "rope_theta", ...}``; 4.x keeps top-level
    ``rope_theta`` plus an optional ``rope_scaling`` dict. Both are read.
    """
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.update(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        theta = 10000.0
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return {"rotary_base": theta, "rope_scaling": False}
    # megatron's RotaryEmbedding knows only Llama 3.1's scaling, with its fixed constants.
    llama3_fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if rope_type == "llama3" and all(float(params.get(k, v)) == v for k, v in llama3_fixed.items()):
        return {"rotary_base": theta, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise NotImplementedError(f"RoPE scaling {params} is not supported by the megatron backend.")


def transformer_config_from_hf(hf_config: Any, dtype: torch.dtype = torch.float32, **overrides: Any):
    """Megatron ``TransformerConfig`` for a Qwen2 / Llama ``PretrainedConfig``.

    TP / PP sizes come from megatron's parallel state when it is initialised (else 1). On a machine
    without CUDA, CPU initialisation is on and CUDA fusions are off. ``overrides`` win over all of it.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_supported(hf_config)
    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
    else:
        tp, pp = 1, 1
    fields: dict[str, Any] = {
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_query_groups": num_kv_heads(hf_config),  # GQA
        "kv_channels": head_dim(hf_config),
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,  # SwiGLU: silu(gate) * up
        "activation_func": F.silu,
        "add_bias_linear": False,
        "add_qkv_bias": hf_config.model_type == "qwen2",  # Qwen2: q/k/v biases, no o_proj bias
        "hidden_dropout": 0.0,
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "init_method_std": getattr(hf_config, "initializer_range", 0.02),
        "params_dtype": dtype,
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "pipeline_dtype": dtype if pp > 1 else None,
        "sequence_parallel": False,
        "cuda_graph_scope": [],  # megatron's default "full" means the same, with a deprecation warning
    }
    if cpu_compat.cpu_only():
        fields.update(cpu_compat.cpu_config_overrides())
    fields.update(overrides)
    return TransformerConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Layer spec and model
# ---------------------------------------------------------------------------------------------


def gpt_layer_spec(attention: AttentionImpl = "sdpa"):
    """megatron's local GPT layer spec with RMSNorm; core attention SDPA (default) or megatron's own."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")  # a fresh spec tree on every call
    if attention == "sdpa":
        from arealcli.runtime.backends.megatron.sdpa_attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "local":
        raise ValueError(f"attention must be 'sdpa' or 'local', got {attention!r}.")
    return spec


def build_gpt_model(
    hf_config: Any,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    *,
    attention: AttentionImpl = "sdpa",
    dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    max_sequence_length: int | None = None,
    **config_overrides: Any,
):
    """This rank's ``GPTModel`` shard for a Qwen2 / Llama config. Needs ``init_parallel`` first.

    ``pre_process`` / ``post_process`` default to "this is the first / last pipeline stage"; the
    layers are split evenly over the stages. The vocab is padded to
    ``padded_vocab_size(vocab, tp, make_vocab_size_divisible_by)`` (``hf_to_megatron`` pads the
    weights the same way), so logits have that many columns in total, ``vocab / tp`` per TP rank.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_gpt_model needs megatron's parallel state: call init_parallel(tp, pp) first."
        )
    cpu_compat.apply_cpu_workarounds()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    layers_per_stage(hf_config.num_hidden_layers, parallel_state.get_pipeline_model_parallel_world_size())
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()

    config = transformer_config_from_hf(hf_config, dtype, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=gpt_layer_spec(attention),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=max_sequence_length or hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        **rope_settings(hf_config),
    )
    # The local spec's norms are plain torch.nn.RMSNorm, created on the CPU in the default dtype;
    # megatron's linears are already on the current CUDA device (CPU here) in `dtype`. Match them.
    device = (
        torch.device("cpu") if cpu_compat.cpu_only() else torch.device("cuda", torch.cuda.current_device())
    )
    return model.to(device=device, dtype=dtype)

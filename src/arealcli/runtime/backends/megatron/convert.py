"""HF <-> Megatron weight conversion for Qwen2 / Llama (megatron-core local GPT layer spec).

``hf_to_megatron`` gives exactly the state dict of one (tp_rank, pp_rank) ``GPTModel`` shard as built
by ``model.build_gpt_model``; ``megatron_to_hf`` merges all shards back, bit-identically.

The mapping, per HF key (layer i on PP stage p is megatron's local layer i - p * layers_per_stage):

    model.embed_tokens.weight           -> embedding.word_embeddings.weight   vocab-parallel, first stage
    model.layers.i.input_layernorm      -> decoder.layers.j.input_layernorm          replicated
    model.layers.i.self_attn.{q,k,v}    -> decoder.layers.j.self_attention.linear_qkv  fused, column-parallel
    model.layers.i.self_attn.o_proj     -> decoder.layers.j.self_attention.linear_proj row-parallel
    model.layers.i.post_attention_layernorm -> decoder.layers.j.pre_mlp_layernorm    replicated
    model.layers.i.mlp.{gate,up}_proj   -> decoder.layers.j.mlp.linear_fc1        fused, column-parallel
    model.layers.i.mlp.down_proj        -> decoder.layers.j.mlp.linear_fc2        row-parallel
    model.norm.weight                   -> decoder.final_layernorm.weight          replicated, last stage
    lm_head.weight                      -> output_layer.weight            vocab-parallel, last stage

Tied embeddings (``tie_word_embeddings``): with one stage the output layer reuses the embedding and has
no weight of its own; with several stages the last one holds a copy (megatron keeps the two in sync).

Where the layouts come from (megatron-core 0.16):
- ``ColumnParallelLinear`` keeps rows [r * out/tp, (r+1) * out/tp) of the full weight on TP rank r,
  ``RowParallelLinear`` the same slice of the columns (``tensor_parallel/layers.py``).
- ``SelfAttention.get_query_key_value_tensors`` (``transformer/attention.py``) reads the fused QKV
  output as ng groups of [np/ng query heads, 1 key head, 1 value head], each head hn wide.
- ``MLP`` with ``gated_linear_unit`` chunks each rank's fc1 output in two halves, act(first) * second
  (``transformer/mlp.py``), so each rank holds [its gate rows; its up rows].
- ``VocabParallelEmbedding`` and the output ``ColumnParallelLinear`` split the padded vocab on dim 0;
  Megatron-LM pads the vocab to a multiple of make_vocab_size_divisible_by * tp (padded rows are 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from arealcli.runtime.backends.megatron.model import (
    DEFAULT_VOCAB_DIVISIBLE_BY,
    head_dim,
    layers_per_stage,
    num_kv_heads,
    padded_vocab_size,
)

Tensor = torch.Tensor
# megatron's local linears carry a TE-compatible `_extra_state` entry, always None without TE.
EXTRA_STATE = "._extra_state"
# Older checkpoints store the rotary frequencies; they are recomputed from the config.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------------------------
# One function per tensor kind: full HF tensor(s) <-> this rank's slice
# ---------------------------------------------------------------------------------------------


def _shard(full: Tensor, dim: int, tp_rank: int, tp_size: int) -> Tensor:
    """TP rank's contiguous slice along ``dim``, copied so that it owns its (small) storage."""
    if full.shape[dim] % tp_size != 0:
        raise ValueError(f"dim {dim} of shape {tuple(full.shape)} does not split over tp={tp_size}.")
    return full.chunk(tp_size, dim=dim)[tp_rank].clone()


def column_parallel_to_megatron(full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    return _shard(full, 0, tp_rank, tp_size)


def row_parallel_to_megatron(full: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    return _shard(full, 1, tp_rank, tp_size)


def column_parallel_from_megatron(shards: Sequence[Tensor]) -> Tensor:
    return torch.cat(list(shards), dim=0)


def row_parallel_from_megatron(shards: Sequence[Tensor]) -> Tensor:
    return torch.cat(list(shards), dim=1)


def vocab_to_megatron(full: Tensor, padded_vocab: int, tp_rank: int, tp_size: int) -> Tensor:
    """[vocab, h] -> this rank's rows of the zero-padded [padded_vocab, h] table."""
    padding = full.new_zeros(padded_vocab - full.shape[0], *full.shape[1:])
    return _shard(torch.cat([full, padding], dim=0), 0, tp_rank, tp_size)


def vocab_from_megatron(shards: Sequence[Tensor], vocab_size: int) -> Tensor:
    """Concatenate the TP shards and strip the padding rows."""
    return torch.cat(list(shards), dim=0)[:vocab_size].clone()


def qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, num_query_groups: int) -> Tensor:
    """HF q [nh*hn, ...], k / v [ng*hn, ...] -> megatron's fused [(nh + 2ng)*hn, ...], grouped as
    [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...]. Weights (2-D) and biases (1-D)."""
    ng = num_query_groups
    per_group = [t.reshape(ng, -1, *t.shape[1:]) for t in (q, k, v)]  # (ng, heads_in_group*hn, ...)
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def qkv_from_megatron(
    fused: Tensor, num_heads: int, num_query_groups: int, hn: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``qkv_to_megatron`` on the full (TP-merged) fused tensor."""
    ng = num_query_groups
    grouped = fused.reshape(ng, (num_heads // ng + 2) * hn, *fused.shape[1:])
    q, k, v = grouped.split([num_heads // ng * hn, hn, hn], dim=1)
    return tuple(t.reshape(-1, *fused.shape[1:]).clone() for t in (q, k, v))


def fc1_to_megatron(gate: Tensor, up: Tensor, tp_rank: int, tp_size: int) -> Tensor:
    """HF gate / up [ffn, h] -> this rank's [gate rows; up rows]."""
    return torch.cat([_shard(gate, 0, tp_rank, tp_size), _shard(up, 0, tp_rank, tp_size)], dim=0)


def fc1_from_megatron(shards: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    gates, ups = zip(*(s.chunk(2, dim=0) for s in shards), strict=True)
    return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


# ---------------------------------------------------------------------------------------------
# Whole state dicts
# ---------------------------------------------------------------------------------------------


def _has_qkv_bias(hf_config: Any) -> bool:
    return hf_config.model_type == "qwen2"


def expected_hf_keys(hf_config: Any) -> list[str]:
    """The keys of the HF model's state dict, in ``model.state_dict()`` order."""
    keys = ["model.embed_tokens.weight"]
    for i in range(hf_config.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in "qkv":
            keys.append(p + f"self_attn.{n}_proj.weight")
            if _has_qkv_bias(hf_config):
                keys.append(p + f"self_attn.{n}_proj.bias")
        keys.append(p + "self_attn.o_proj.weight")
        keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return keys + ["model.norm.weight", "lm_head.weight"]


def _check_hf_keys(hf_state_dict: Mapping[str, Tensor], hf_config: Any) -> None:
    expected = set(expected_hf_keys(hf_config))
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    present = {k for k in hf_state_dict if not k.endswith(_IGNORED_HF_SUFFIXES)}
    missing = expected - present - ({"lm_head.weight"} if tied else set())
    unexpected = present - expected
    if missing or unexpected:
        raise KeyError(
            f"HF state dict does not match a {hf_config.model_type} config with "
            f"{hf_config.num_hidden_layers} layers: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}."
        )


def _hf_qkv(hf: Mapping[str, Tensor], layer: str, kind: str) -> tuple[Tensor, Tensor, Tensor]:
    """The q, k and v projections' `kind` (weight or bias) of HF layer `layer` (its key prefix)."""
    q, k, v = (hf[layer + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
    return q, k, v


def hf_to_megatron(
    hf_state_dict: Mapping[str, Tensor],
    hf_config: Any,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> dict[str, Tensor | None]:
    """State dict of GPTModel shard (tp_rank, pp_rank): ``model.load_state_dict(sd)`` loads it
    strictly. Tensors are fresh copies (no storage shared with ``hf_state_dict``)."""
    _check_hf_keys(hf_state_dict, hf_config)
    hf = hf_state_dict
    ng = num_kv_heads(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    n_local = layers_per_stage(hf_config.num_hidden_layers, pp_size)
    padded = padded_vocab_size(hf_config.vocab_size, tp_size, make_vocab_size_divisible_by)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, Tensor | None] = {}

    if first:
        out["embedding.word_embeddings.weight"] = vocab_to_megatron(
            hf["model.embed_tokens.weight"], padded, tp_rank, tp_size
        )
    for j in range(n_local):
        i = pp_rank * n_local + j  # global layer index
        h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        # Same key order as GPTModel.state_dict(): Attention registers linear_proj before linear_qkv.
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = row_parallel_to_megatron(
            hf[h + "self_attn.o_proj.weight"], tp_rank, tp_size
        )
        out[m + "self_attention.linear_proj" + EXTRA_STATE] = None
        fused_w = qkv_to_megatron(*_hf_qkv(hf, h, "weight"), ng)
        out[m + "self_attention.linear_qkv.weight"] = column_parallel_to_megatron(fused_w, tp_rank, tp_size)
        if _has_qkv_bias(hf_config):
            fused_b = qkv_to_megatron(*_hf_qkv(hf, h, "bias"), ng)
            out[m + "self_attention.linear_qkv.bias"] = column_parallel_to_megatron(fused_b, tp_rank, tp_size)
        out[m + "self_attention.linear_qkv" + EXTRA_STATE] = None
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        out[m + "mlp.linear_fc1.weight"] = fc1_to_megatron(
            hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"], tp_rank, tp_size
        )
        out[m + "mlp.linear_fc1" + EXTRA_STATE] = None
        out[m + "mlp.linear_fc2.weight"] = row_parallel_to_megatron(
            hf[h + "mlp.down_proj.weight"], tp_rank, tp_size
        )
        out[m + "mlp.linear_fc2" + EXTRA_STATE] = None
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not (tied and first):  # tied on one stage: the output layer reads the embedding weight
            head = hf["model.embed_tokens.weight"] if tied else hf["lm_head.weight"]
            out["output_layer.weight"] = vocab_to_megatron(head, padded, tp_rank, tp_size)
        out["output_layer" + EXTRA_STATE] = None
    return out


def megatron_to_hf(
    shards: Sequence[Sequence[Mapping[str, Tensor | None]]],
    hf_config: Any,
    tp_size: int,
    pp_size: int,
) -> dict[str, Tensor]:
    """Merge ``shards[pp_rank][tp_rank]`` (GPTModel state dicts) into the HF state dict, with the
    keys and order of ``expected_hf_keys`` (tied models: ``lm_head.weight`` is the embedding tensor,
    as in HF's own state dict). Raises on any megatron key it does not consume."""
    if len(shards) != pp_size or any(len(stage) != tp_size for stage in shards):
        raise ValueError(f"shards must be a list of {pp_size} PP stages, each a list of {tp_size} TP shards.")
    nh, ng, hn = hf_config.num_attention_heads, num_kv_heads(hf_config), head_dim(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    n_local = layers_per_stage(hf_config.num_hidden_layers, pp_size)
    remaining = [  # every value but the extra states (dropped here) is a tensor
        [{k: cast(Tensor, v) for k, v in sd.items() if not k.endswith(EXTRA_STATE)} for sd in stage]
        for stage in shards
    ]

    def take(pp_rank: int, key: str) -> list[Tensor]:
        """The TP shards of one megatron key on one stage (removed from ``remaining``)."""
        try:
            return [remaining[pp_rank][r].pop(key) for r in range(tp_size)]
        except KeyError:
            raise KeyError(f"megatron shard of PP stage {pp_rank} has no {key!r}.") from None

    out: dict[str, Tensor] = {}
    out["model.embed_tokens.weight"] = vocab_from_megatron(
        take(0, "embedding.word_embeddings.weight"), hf_config.vocab_size
    )
    for p in range(pp_size):
        for j in range(n_local):
            h, m = f"model.layers.{p * n_local + j}.", f"decoder.layers.{j}."
            out[h + "input_layernorm.weight"] = take(p, m + "input_layernorm.weight")[0].clone()
            out[h + "post_attention_layernorm.weight"] = take(p, m + "pre_mlp_layernorm.weight")[0].clone()
            q, k, v = qkv_from_megatron(
                column_parallel_from_megatron(take(p, m + "self_attention.linear_qkv.weight")), nh, ng, hn
            )
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = row_parallel_from_megatron(
                take(p, m + "self_attention.linear_proj.weight")
            )
            if _has_qkv_bias(hf_config):
                qb, kb, vb = qkv_from_megatron(
                    column_parallel_from_megatron(take(p, m + "self_attention.linear_qkv.bias")), nh, ng, hn
                )
                out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"] = qb, kb
                out[h + "self_attn.v_proj.bias"] = vb
            gate, up = fc1_from_megatron(take(p, m + "mlp.linear_fc1.weight"))
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = row_parallel_from_megatron(take(p, m + "mlp.linear_fc2.weight"))
    out["model.norm.weight"] = take(pp_size - 1, "decoder.final_layernorm.weight")[0].clone()
    if tied:
        if pp_size > 1:  # the last stage's copy of the embedding: consumed, not returned
            take(pp_size - 1, "output_layer.weight")
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    else:
        out["lm_head.weight"] = vocab_from_megatron(
            take(pp_size - 1, "output_layer.weight"), hf_config.vocab_size
        )

    leftover = sorted({k for stage in remaining for sd in stage for k in sd})
    if leftover:
        raise KeyError(f"megatron shards hold keys this converter does not map: {leftover[:8]}")
    return {k: out[k] for k in expected_hf_keys(hf_config)}

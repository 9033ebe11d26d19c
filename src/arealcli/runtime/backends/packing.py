"""Rows for a micro-batch's forward: sequences packed side by side, so nothing is computed on padding.

A micro-batch of B sequences runs as R rows of T tokens, each sequence's position ids restarting at 0.
"padded": one sequence per row (R = B, T = the longest), the rest padding. "packed": with a varlen
attention every sequence goes into one row (R = 1, T = the micro-batch's tokens: no padding at all):
the `sdpa` models of our backends attend within each sequence by causal SDPA, one batched call per
distinct sequence length (`VARLEN_SDPA`: the same fused causal kernel as a padded batch, and sum_i L_i^2
attention work), a
flash-attention model by its varlen kernel. Without one (eager attention, sliding-window layers) the
sequences are spread over rows of max(longest, `ROW_TOKENS`) tokens by a balanced longest-first
partition, and transformers turns the restarting position ids into a block-diagonal causal mask; the
padding at the end of a row is a sequence of its own, its outputs dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arealcli.runtime.data.sample import pack_bins

# Row capacity of the "packed" layout without a varlen kernel (at least the longest sequence): the
# attention of a row with a mask costs T^2 whatever the mask, and its mask takes T^2 memory.
ROW_TOKENS = 512
# The attention implementation our backends give `sdpa` models, and the forward keyword that carries the
# sequences' boundaries in a packed row to it.
VARLEN_SDPA = "arealcli_varlen_sdpa"
CU_SEQLENS = "arealcli_cu_seqlens"
# The forward keyword that carries a shared-prompt row's blocks to `VARLEN_SDPA` (see `shared_prompt_row`).
PREFIX_BLOCKS = "arealcli_prefix_blocks"


@dataclass
class Rows:
    ids: torch.Tensor  # (R, T) token ids, padded with 0
    position_ids: torch.Tensor | None  # (R, T), restarting at 0 for every sequence; None: 0..T-1
    index: torch.Tensor  # (N,) flat position in (R, T) of each packed token, in packed order
    cu_seqlens: list[int]  # with one packed row: where its sequences start, and its end; else []
    # a shared-prompt row: its blocks (start, length, prefix start, prefix length); else None
    blocks: tuple[tuple[int, int, int, int], ...] | None = None


def takes_position_ids(module) -> bool:
    """Whether the module is a transformers model (bare or peft-wrapped), whose attention follows
    per-sequence position ids."""
    from transformers import PreTrainedModel

    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    return isinstance(base, PreTrainedModel)


def attention_implementation(name: str, config) -> str:
    """The implementation a backend sets on a transformers config for the recipe's `attn_implementation`:
    `VARLEN_SDPA` for "sdpa" (per-sequence attention in packed rows; plain SDPA otherwise) unless some
    layers use sliding windows, else `name` itself."""
    sliding = getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(config, "layer_types", None) or []
    )
    if name != "sdpa" or sliding:
        return name
    register_varlen_sdpa()
    return VARLEN_SDPA


def set_attention(module, name: str) -> None:
    """Give a transformers module the attention implementation of `attention_implementation`; a
    vision-language model's language model only (its vision tower keeps plain SDPA: its attention runs
    over image patches, and packed rows' sequence boundaries mean nothing there)."""
    from arealcli.runtime.vision import text_config

    config = module.config
    impl = attention_implementation(name, text_config(config))
    if getattr(config, "vision_config", None) is not None:
        config._attn_implementation = {"": impl, "text_config": impl, "vision_config": "sdpa"}
    else:
        config._attn_implementation = impl


def register_varlen_sdpa() -> None:
    """Register `VARLEN_SDPA` with transformers (attention and mask functions); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, or in one packed row attention within each sequence: with
    `CU_SEQLENS` causal SDPA per sequence (blocks without a prefix), with `PREFIX_BLOCKS` a
    shared-prompt row's blocks (`prefix_sdpa`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.pop(CU_SEQLENS, None)
    blocks = kwargs.pop(PREFIX_BLOCKS, None)
    if blocks is None and cu is not None:
        blocks = tuple((s, e - s, 0, 0) for s, e in zip(cu[:-1], cu[1:], strict=True))
    if blocks is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return prefix_sdpa(query, key, value, blocks, dropout, scaling), None


def prefix_sdpa(query, key, value, blocks, dropout: float, scaling) -> torch.Tensor:
    """Attention over the blocks of one packed row: each block attends causally to itself after all of
    its prefix block (a prompt shared by several samples, `shared_prompt_row`); a block without a prefix
    is a sequence of its own (causal SDPA). One batched call per distinct (length, prefix length): the
    blocks of that shape gathered into an (n, heads, length, d) batch, so no padding and as few kernel
    launches as there are shapes; with a prefix the explicit mask [prefix: all | block: causal]."""
    gqa = query.shape[1] != key.shape[1]
    groups, inverse = block_groups(tuple(blocks), query.device)
    q, k, v = query[0], key[0], value[0]  # (heads, N, d)
    parts = []
    for length, prefix, n, q_idx, kv_idx, mask in groups:
        width = prefix + length
        qg = q[:, q_idx].view(q.shape[0], n, length, q.shape[-1]).transpose(0, 1)
        kg, vg = (x[:, kv_idx].view(x.shape[0], n, width, x.shape[-1]).transpose(0, 1) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qg,
            kg,
            vg,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=mask is None,
            enable_gqa=gqa,
        )  # (n, h, L, d)
        parts.append(o.transpose(0, 1).reshape(q.shape[0], n * length, q.shape[-1]))
    out = torch.cat(parts, dim=1)[:, inverse]  # (h, N, d) back in row order
    return out.transpose(0, 1).unsqueeze(0).contiguous()  # (1, N, heads, d)


_BLOCK_GROUPS: dict = {}


def block_groups(blocks: tuple[tuple[int, int, int, int], ...], device):
    """The blocks of a shared-prompt row grouped by (length, prefix length): per group (length, prefix,
    how many, the query positions (n * length,), the key positions (n * (prefix + length),): prefix
    then block, and the mask (None: causal)); and the permutation back to row order. Cached per row."""
    cache_key = (blocks, str(device))
    if cache_key not in _BLOCK_GROUPS:
        by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for start, length, prefix_start, prefix in blocks:
            by_shape.setdefault((length, prefix), []).append((start, prefix_start))
        groups = []
        for (length, prefix), members in sorted(by_shape.items()):
            starts = torch.tensor([s for s, _ in members])[:, None]
            q_idx = (starts + torch.arange(length)[None]).reshape(-1)
            kv = torch.arange(length)[None] + starts
            mask = None
            if prefix:
                kv = torch.cat(
                    [torch.tensor([p for _, p in members])[:, None] + torch.arange(prefix)[None], kv], 1
                )
                causal = torch.ones(length, length, dtype=torch.bool).tril()
                mask = torch.cat([torch.ones(length, prefix, dtype=torch.bool), causal], 1).to(device)
            groups.append((length, prefix, len(members), q_idx.to(device), kv.reshape(-1).to(device), mask))
        order = torch.cat([g[3].cpu() for g in groups]) if groups else torch.zeros(0, dtype=torch.long)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        if len(_BLOCK_GROUPS) > 64:  # one micro-batch's entry is reused by its layers, forward and backward
            _BLOCK_GROUPS.clear()
        _BLOCK_GROUPS[cache_key] = (groups, inverse.to(device))
    return _BLOCK_GROUPS[cache_key]


def varlen_sdpa_mask(*, attention_mask=None, q_length=0, kv_length=0, q_offset=0, kv_offset=0, **kwargs):
    """transformers' SDPA mask, but none for a full forward without a padding mask: there the attention
    is causal (one sequence) or per sequence (a packed row, `CU_SEQLENS`)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not q_offset and not kv_offset:
        return None
    return sdpa_mask(
        attention_mask=attention_mask,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        **kwargs,
    )


def varlen_attention(module) -> str | None:
    """How the module attends within each sequence of one packed row: "sdpa" (`VARLEN_SDPA`),
    "flash" (transformers' flash-attention varlen path, from the position ids), or None."""
    from arealcli.runtime.vision import text_config

    config = getattr(module, "config", None)
    impl = str(getattr(text_config(config), "_attn_implementation", ""))
    if impl == VARLEN_SDPA:
        return "sdpa"
    return "flash" if impl.startswith("flash_attention") else None


def row_capacity(module, lens: list[int]) -> int:
    """Tokens per packed row: all of them with a varlen attention, else max(longest, ROW_TOKENS)."""
    if varlen_attention(module) is not None:
        return max(sum(lens), 1)
    return max(max(lens, default=1), ROW_TOKENS)


def rows_of(lens: list[int], layout: str, capacity: int) -> list[list[int]]:
    """The sample indices in each row."""
    if layout == "padded":
        return [[i] for i in range(len(lens))]
    if layout != "packed":
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    return pack_bins(lens, 1, capacity)


def build_rows(ids: torch.Tensor, lens: list[int], rows: list[list[int]], with_positions: bool) -> Rows:
    """The (R, T) batch of `rows` (sample indices per row) from packed ids (N,) with lengths `lens`."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    width = max((sum(lens[i] for i in row) for row in rows), default=0)
    out = ids.new_zeros(len(rows), width)
    pos = torch.zeros(len(rows), width, dtype=torch.long) if with_positions else None
    index = torch.empty(sum(lens), dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lens[i]
            out[r, col : col + n] = ids[starts[i] : starts[i] + n]
            if pos is not None:
                pos[r, col : col + n] = torch.arange(n)
            index[starts[i] : starts[i] + n] = torch.arange(r * width + col, r * width + col + n)
            col += n
        if pos is not None:
            pos[r, col:] = torch.arange(width - col)  # the padding: a sequence of its own
    cu = [0]
    if len(rows) == 1:
        for i in rows[0]:
            cu.append(cu[-1] + lens[i])
    return Rows(out, pos, index, cu if len(rows) == 1 else [])


def prompt_groups(ids: torch.Tensor, lens: list[int], prompt_lens: list[int]) -> list[list[int]]:
    """The samples grouped by identical prompt (its first `prompt_lens[i]` tokens), groups in order of
    first appearance; a sample without a prompt is a group of its own."""
    groups: dict[object, list[int]] = {}
    start = 0
    for i, (n, p) in enumerate(zip(lens, prompt_lens, strict=True)):
        key = (p, ids[start : start + p].numpy().tobytes()) if p else ("alone", i)
        groups.setdefault(key, []).append(i)
        start += n
    return list(groups.values())


def shared_prompt_row(
    ids: torch.Tensor, lens: list[int], prompt_lens: list[int], groups: list[list[int]]
) -> Rows:
    """One row in which each prompt a group of samples shares is computed once: [prompt, the rest of
    sample a, the rest of sample b, ...], the rest of each sample positioned after the prompt (position
    ids p, p + 1, ...) and attending to the prompt and causally to itself (`prefix_sdpa`). The index
    maps every packed token to its place in the row, so a prompt token of n samples maps to one place
    n times: gathering the row's outputs with it gives each sample its full sequence back, and the
    gradients of the n copies add up in the shared prompt. The math is that of separate sequences (a
    causal model's outputs on a prompt do not depend on what follows it); only the work is less."""
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    pieces: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    index = torch.empty(sum(lens), dtype=torch.long)
    blocks: list[tuple[int, int, int, int]] = []
    col = 0

    def block(tokens: torch.Tensor, first_position: int, prefix_start: int, prefix: int) -> int:
        nonlocal col
        at = col
        pieces.append(tokens)
        positions.append(torch.arange(first_position, first_position + tokens.numel()))
        blocks.append((at, tokens.numel(), prefix_start, prefix))
        col += tokens.numel()
        return at

    for group in groups:
        head, p = group[0], prompt_lens[group[0]]
        if len(group) == 1 or p == 0:
            for i in group:
                at = block(ids[starts[i] : starts[i] + lens[i]], 0, 0, 0)
                index[starts[i] : starts[i] + lens[i]] = torch.arange(at, at + lens[i])
            continue
        prompt_at = block(ids[starts[head] : starts[head] + p], 0, 0, 0)
        for i in group:
            index[starts[i] : starts[i] + p] = torch.arange(prompt_at, prompt_at + p)
            rest = lens[i] - p
            if rest:
                at = block(ids[starts[i] + p : starts[i] + lens[i]], p, prompt_at, p)
                index[starts[i] + p : starts[i] + lens[i]] = torch.arange(at, at + rest)
    row = torch.cat(pieces)[None]
    return Rows(row, torch.cat(positions)[None], index, [], tuple(blocks))


def computed_positions(module, lens: list[int], layout: str) -> int:
    """Positions the forward computes (R x T) for sequences of `lens` in `layout`."""
    rows = rows_of(lens, layout, row_capacity(module, lens))
    return len(rows) * max((sum(lens[i] for i in row) for row in rows), default=0)

"""KV-cached decoding for Qwen2/Llama-family transformers modules, without transformers' per-call
machinery (cache objects, mask builders, output wrappers), which dominates the cost of small models.

It uses the module's own submodules and weights (embedding, rotary embedding, norms, projections, MLP,
LM head), so it computes what the module computes; a test checks tokens and log-probs against the
transformers path. The cache is preallocated: (B, kv_heads, prompt + max_new_tokens, head_dim).

`LeanDecoder` runs one fixed batch (left-padded prompts, every row at the same step); `RowDecoder` runs a
batch whose rows come and go (continuous batching: prompts are prefilled into new rows between decoding
steps, finished rows are dropped), each row at its own position.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F

FAMILIES = ("qwen2", "llama")


def supports(module) -> bool:
    cfg = getattr(module, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in FAMILIES:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    if any(hasattr(m, "lora_A") for m in module.modules()):  # LoRA layers: the lean path reads raw weights
        return False
    return all(hasattr(module, a) for a in ("model", "lm_head")) and hasattr(module.model, "rotary_emb")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# kv(layer index, k, v) stores the new keys and values in the cache and returns those to attend to
KV = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _layers(
    m,
    h: torch.Tensor,
    pos: torch.Tensor,
    allowed: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv: KV,
) -> torch.Tensor:
    """The decoder layers over hidden states h (B, S, H) at positions pos (B, S): per layer, q/k/v with
    rotary embeddings, `kv` keeps k and v and gives what to attend, SDPA under `allowed`, the output
    projection and the MLP, each with its residual. Returns the last layer's hidden states (B, S, H)."""
    B, S = h.shape[:2]
    cos, sin = m.rotary_emb(h, pos)  # (B, S, head_dim)
    cos, sin = cos[:, None], sin[:, None]
    for li, layer in enumerate(m.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).view(B, S, heads, head_dim).transpose(1, 2)  # (B, h, S, d)
        k = attn.k_proj(x).view(B, S, kv_heads, head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, S, kv_heads, head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = kv(li, k, v)
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed, scale=attn.scaling, enable_gqa=kv_heads != heads
        )
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, S, heads * head_dim))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


class LeanDecoder:
    def __init__(self, module, batch: int, max_len: int, device, dtype):
        self.m = module
        cfg = module.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_layers = len(module.model.layers)
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.key_valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)  # (B, L)
        self.length = 0

    def expanded(self, rows: torch.Tensor) -> LeanDecoder:
        """A decoder whose row i continues this one's row rows[i] (its cache copied): a prompt prefilled
        once, then decoded in several rows."""
        out = copy.copy(self)
        out.k = [k[rows] for k in self.k]
        out.v = [v[rows] for v in self.v]
        out.key_valid = self.key_valid[rows]
        return out

    @torch.no_grad()
    def step(self, ids: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Feed ids (B, S) at positions pos (B, S); `valid` (B, S) marks real (non-pad) tokens.

        Returns the logits of the last fed position (B, V).
        """
        B, S = ids.shape
        t0, t1 = self.length, self.length + S
        self.key_valid[:, t0:t1] = valid
        # allowed[b, i, j]: query i (absolute t0+i) sees key j if j is real and j <= t0+i; every query also
        # sees itself, so a pad query never has an empty row (whose softmax would be NaN)
        j = torch.arange(t1, device=ids.device)
        i = torch.arange(t0, t1, device=ids.device)
        causal = j[None, :] <= i[:, None]  # (S, t1)
        allowed = (causal[None] & self.key_valid[:, None, :t1]) | (j[None, :] == i[:, None])[None]
        allowed = allowed[:, None]  # (B, 1, S, t1)

        m = self.m.model

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.k[li][:, :, t0:t1] = k
            self.v[li][:, :, t0:t1] = v
            return self.k[li][:, :, :t1], self.v[li][:, :, :t1]

        h = _layers(m, m.embed_tokens(ids), pos, allowed, self.heads, self.kv_heads, self.head_dim, kv)
        self.length = t1
        return self.m.lm_head(m.norm(h[:, -1]))  # (B, V)


class RowDecoder:
    """A KV cache whose rows are sequences at their own lengths, and the two forward passes over it.

    Row b holds its sequence's keys and values at cache positions 0 .. lengths[b] - 1 (position = token
    index, no padding in front). `add` prefills prompts into new rows at the end of the batch, `step` feeds
    one token to every row, `keep` drops rows. The cache grows (reallocated, rows copied) when a batch
    needs more rows or positions than it holds, and is freed when the last row leaves; a row's `limit`
    (prompt + tokens it may generate) is the most positions it will use.
    """

    def __init__(self, module, device, dtype) -> None:
        self.m = module
        cfg = module.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.n_layers = len(module.model.layers)
        self.device, self.dtype = torch.device(device), dtype
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # (B,) positions filled per row
        self.limits: list[int] = []  # per row: the most positions it will fill
        self.rows = 0

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, positions) the cache holds now."""
        return (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)

    def _reserve(self, rows: int, positions: int) -> None:
        cap_rows, cap_pos = self.capacity
        if rows <= cap_rows and positions <= cap_pos:
            return
        new_rows = max(rows, cap_rows, 1 << max(0, (rows - 1).bit_length()))  # next power of two
        new_pos = max(positions, cap_pos)
        new_pos = -(-new_pos // 16) * 16
        shape = (new_rows, self.kv_heads, new_pos, self.head_dim)
        for cache in (self.k, self.v):
            for li in range(self.n_layers):
                grown = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if cache and self.rows:
                    grown[: self.rows, :, :cap_pos] = cache[li][: self.rows]
                if len(cache) < self.n_layers:
                    cache.append(grown)
                else:
                    cache[li] = grown

    @torch.no_grad()
    def add(self, prompts: list[list[int]], limits: list[int]) -> torch.Tensor:
        """Prefill `prompts` into new rows (after the current ones); the next-token logits of each (Bn, V)."""
        Bn, P = len(prompts), max(len(p) for p in prompts)
        self._reserve(self.rows + Bn, max([P, *limits, *self.limits]))
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        ids = torch.zeros(Bn, P, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):  # right-padded: position = token index
            ids[i, : len(p)] = torch.tensor(p, device=self.device)
        j = torch.arange(P, device=self.device)
        valid = j[None, :] < lens[:, None]  # (Bn, P)
        # query i sees key j if j is real and j <= i; every query also sees itself (no empty softmax row)
        allowed = ((j[None, :] <= j[:, None])[None] & valid[:, None, :]) | torch.eye(
            P, dtype=torch.bool, device=self.device
        )
        allowed = allowed[:, None]  # (Bn, 1, P, P)
        m = self.m.model
        rows = slice(self.rows, self.rows + Bn)

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.k[li][rows, :, :P] = k
            self.v[li][rows, :, :P] = v
            return k, v

        positions = j[None].expand(Bn, P)
        h = _layers(m, m.embed_tokens(ids), positions, allowed, self.heads, self.kv_heads, self.head_dim, kv)
        self.lengths = torch.cat([self.lengths, lens])
        self.limits += list(limits)
        self.rows += Bn
        last = h[torch.arange(Bn, device=self.device), lens - 1]  # (Bn, H): each prompt's last token
        return self.m.lm_head(m.norm(last))  # (Bn, V)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (B,), at each row's own position; the next-token logits (B, V)."""
        B = self.rows
        pos = self.lengths  # (B,) where each row's token goes
        span = int(pos.max()) + 1  # keys attended: up to the furthest row's new token (masked per row)
        keys = torch.arange(span, device=self.device)
        allowed = (keys[None, :] <= pos[:, None])[:, None, None]  # (B, 1, 1, span)
        b = torch.arange(B, device=self.device)
        m = self.m.model

        def kv(li: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            self.k[li][b, :, pos] = k[:, :, 0]
            self.v[li][b, :, pos] = v[:, :, 0]
            return self.k[li][:B, :, :span], self.v[li][:B, :, :span]

        h = _layers(
            m,
            m.embed_tokens(tokens[:, None]),
            pos[:, None],
            allowed,
            self.heads,
            self.kv_heads,
            self.head_dim,
            kv,
        )
        self.lengths = pos + 1
        return self.m.lm_head(m.norm(h[:, -1]))  # (B, V)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in this order) as rows 0 .. len(rows) - 1; the others are dropped. With no
        rows left the cache is freed (the next `add` allocates what it needs)."""
        if not rows:
            self.k, self.v, self.limits, self.rows = [], [], [], 0
            self.lengths = self.lengths[:0]
            return
        if rows == list(range(self.rows)):
            return
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        for cache in (self.k, self.v):
            for t in cache:
                t[: len(rows)] = t[idx]
        self.lengths = self.lengths[idx]
        self.limits = [self.limits[i] for i in rows]
        self.rows = len(rows)

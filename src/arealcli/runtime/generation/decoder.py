"""KV-cached decoding for Qwen2/Llama-family transformers modules, without transformers' per-call
machinery (cache objects, mask builders, output wrappers), which dominates the cost of small models.

It uses the module's own submodules and weights (embedding, rotary embedding, norms, projections, MLP,
LM head), so it computes what the module computes; a test checks tokens and log-probs against the
transformers path. The cache is preallocated: (B, kv_heads, prompt + max_new_tokens, head_dim).
"""

from __future__ import annotations

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
        h = m.embed_tokens(ids)  # (B, S, H)
        cos, sin = m.rotary_emb(h, pos)  # (B, S, head_dim)
        cos, sin = cos[:, None], sin[:, None]
        for li, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)  # (B, h, S, d)
            k = attn.k_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k[li][:, :, t0:t1] = k
            self.v[li][:, :, t0:t1] = v
            o = F.scaled_dot_product_attention(
                q,
                self.k[li][:, :, :t1],
                self.v[li][:, :, :t1],
                attn_mask=allowed,
                scale=attn.scaling,
                enable_gqa=self.kv_heads != self.heads,
            )
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.length = t1
        return self.m.lm_head(m.norm(h[:, -1]))  # (B, V)

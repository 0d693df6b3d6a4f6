"""Qwen-style decoder layers shared by SDAR/TraDo (Qwen3: q/k RMSNorm, no biases) and Dream (Qwen2: q/k/v biases).

Parameter names match the public checkpoints: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from models.common import AttentionLayout, KVCache, RMSNorm, apply_rope, attend, merge_heads, split_heads


class QwenAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        q = split_heads(self.q_proj(x), self.n_heads, self.head_dim)
        k = split_heads(self.k_proj(x), self.n_kv, self.head_dim)
        v = split_heads(self.v_proj(x), self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attend(q, k, v, layout, cache, self.layer_idx, store_kv, backend)
        return self.o_proj(merge_heads(out))


class QwenMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = QwenAttention(config, layer_idx, qkv_bias, qk_norm)
        self.mlp = QwenMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache, store_kv, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

"""Qwen-style decoder layers shared by SDAR/TraDo (Qwen3: q/k RMSNorm, no biases) and Dream (Qwen2: q/k/v biases).

Parameter names match the public checkpoints: ``self_attn.{q,k,v,o}_proj``, ``self_attn.{q,k}_norm``,
``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``post_attention_layernorm``.
"""

from __future__ import annotations

from torch import Tensor, nn

from models.common import AttentionLayout, KVCache, attend
from models.layers import Projections, RMSNorm, attention_heads, merge_heads, plain_head_weight, silu_mul


class QwenAttention(Projections, nn.Module):
    projection_groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "out": ("o_proj",)}

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
        qk_norm = (self.q_norm, self.k_norm) if self.q_norm is not None else None
        q, k, v = attention_heads(self.project("qkv", x, split=False), self.n_heads, self.n_kv, self.head_dim, cos,
                                  sin, qk_norm)
        out = attend(q, k, v, layout, cache, self.layer_idx, store_kv, backend)
        return self.project("out", merge_heads(out))


class QwenMLP(Projections, nn.Module):
    projection_groups = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}

    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.project("down", silu_mul(*self.project("gate_up", x)))


class QwenDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = QwenAttention(config, layer_idx, qkv_bias, qk_norm)
        self.mlp = mlp if mlp is not None else QwenMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache, store_kv, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenBackboneMixin:
    """embed_tokens -> QwenDecoderLayer x N -> norm, for SDAR (q/k norm) and Dream (q/k/v biases).

    Combine with ``models.base.BackboneMixin`` and the family's PreTrainedModel; call ``build_backbone`` in
    ``__init__``.
    """

    def build_backbone(self, config, qkv_bias: bool = False, qk_norm: bool = False, mlp_of_layer=None,
                       layer_of=None) -> None:
        """``mlp_of_layer(i)``: the MLP module of layer i (None: the dense QwenMLP), e.g. a sparse MoE block;
        ``layer_of(i)``: a family's own decoder layer i instead of a QwenDecoderLayer (same submodule names)."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            layer_of(i) if layer_of else QwenDecoderLayer(config, i, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                                          mlp=mlp_of_layer(i) if mlp_of_layer else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @property
    def rope_head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope_theta = property(lambda self: self.config.rope_theta)
    decoder_layers = property(lambda self: self.layers)

    def embed(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value


class QwenLMHeadMixin(Projections):
    """``model`` (the backbone) + an untied-by-default ``lm_head``; combine with ``models.base.LMHeadMixin``."""

    projection_groups = {"logits": ("lm_head",)}
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # used only when tie_word_embeddings

    def build_head(self, config, backbone_cls: type) -> None:
        self.model = backbone_cls(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    backbone = property(lambda self: self.model)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        return self.project("logits", hidden)

    def lm_head_weight(self) -> Tensor | None:
        """The weight of ``lm_logits`` where it is a plain product (``models.layers.plain_head_weight``)."""
        return plain_head_weight(self.lm_head)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

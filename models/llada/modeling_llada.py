"""LLaDA / MMaDA: an OLMo-style LLaMA decoder trained from scratch as a masked diffusion model.

Full bidirectional attention with a real key-padding mask: pads never influence real tokens (the reference either
attends to pads or silently turns causal when given a mask: Gen-Verse/dLLM-RL models/llada/modeling_llada.py). Position
ids skip left padding.
Parameter names equal the public checkpoints' (``model.transformer.{wte, blocks.i.*, ln_f, ff_out}``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin, full_weights
from models.common import attend
from models.layers import (
    Projections,
    RMSNorm,
    attention_heads,
    init_linear_normal,
    merge_heads,
    plain_head_weight,
    silu_mul,
)
from models.llada.configuration_llada import LLaDAConfig, MMadaConfig


class LLaDALlamaBlock(Projections, nn.Module):
    projection_groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "attn_out": ("attn_out",),
                         "ff_up": ("ff_proj", "up_proj"), "ff_out": ("ff_out",)}

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.n_heads, config.n_kv_heads
        self.head_dim = config.d_model // config.n_heads
        d, bias = config.d_model, config.include_qkv_bias
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=bias)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout, cache, store_kv: bool, backend: str) -> Tensor:
        qkv = self.project("qkv", self.attn_norm(x), split=False)
        q, k, v = attention_heads(qkv, self.n_heads, self.n_kv, self.head_dim, cos, sin)
        x = x + self.project("attn_out", merge_heads(attend(q, k, v, layout, cache, self.layer_idx, store_kv, backend)))
        return x + self.project("ff_out", silu_mul(*self.project("ff_up", self.ff_norm(x))))


class LLaDAPreTrainedModel(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDALlamaBlock"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.init_std)


class LLaDAModel(BackboneMixin, LLaDAPreTrainedModel):
    default_attention = "full"
    block_size = None

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        blocks = nn.ModuleList(LLaDALlamaBlock(config, i) for i in range(config.n_layers))
        modules = {"wte": nn.Embedding(config.embedding_size, config.d_model), "emb_drop": nn.Dropout(0.0),
                   "ln_f": RMSNorm(config.d_model, config.rms_norm_eps), "blocks": blocks}
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=False)
        self.transformer = nn.ModuleDict(modules)
        self.post_init()

    rope_head_dim = property(lambda self: self.config.d_model // self.config.n_heads)
    rope_theta = property(lambda self: self.config.rope_theta)
    decoder_layers = property(lambda self: self.transformer["blocks"])

    def embed(self, ids: Tensor) -> Tensor:
        return self.transformer["emb_drop"](self.transformer["wte"](ids))

    def final_norm(self, x: Tensor) -> Tensor:
        return self.transformer["ln_f"](x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer["wte"]


class LLaDAModelLM(LMHeadMixin, LLaDAPreTrainedModel):
    """The LM class of the public checkpoints (`architectures: ["LLaDAModelLM"]`)."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    backbone = property(lambda self: self.model)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        """Logits of (a selection of) hidden states. Trainers call this outside ``forward``: the output
        projection is called as a module (so ZeRO-3 gathers its partitioned weight); a tied embedding weight is
        gathered explicitly."""
        t = self.model.transformer
        if not self.config.weight_tying:
            return t["ff_out"](hidden)[..., : self.config.vocab_size]
        with full_weights(t["wte"].weight):
            return F.linear(hidden, t["wte"].weight)[..., : self.config.vocab_size]

    def lm_head_weight(self) -> Tensor | None:
        """The weight of ``lm_logits`` where it is a plain product (``models.layers.plain_head_weight``): its
        first ``vocab_size`` rows (the rest pad the embedding)."""
        t = self.model.transformer
        weight = plain_head_weight(t["wte"].weight if self.config.weight_tying else t["ff_out"])
        return None if weight is None else weight[: self.config.vocab_size]

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer["wte"]


class MMadaModelLM(LLaDAModelLM):
    """MMaDA's text model: identical parameter names, `model_type` "mmada" (Gen-Verse/dLLM-RL
    models/mmada/modeling_mmada.py)."""

    config_class = MMadaConfig

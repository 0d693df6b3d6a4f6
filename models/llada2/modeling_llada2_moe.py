"""LLaDA2.0 / LLaDA2.1 (inclusionAI): a block-diffusion MoE decoder (Ling 2.0 architecture).

Attention is block-causal (bidirectional inside a block of ``block_size`` tokens, causal across blocks), as the
authors' generate function lays it out; the shared backbone loop (models/base.py) and KV cache serve it as they
serve SDAR. What is LLaDA2's own (yjyddq/DARE models/LLaDA2.0-mini/modeling_llada2_moe.py):

* one fused ``query_key_value`` projection laid out [q heads | k heads | v heads], per-head RMSNorm of q and k
  (``query_layernorm``, ``key_layernorm``) before RoPE, RoPE on the first ``rotary_dim`` (half) of each head only,
  output projection ``dense``;
* the first ``first_k_dense_replace`` layers have a dense SwiGLU MLP, the others a sparse block: a sigmoid router
  in fp32 with ``expert_bias`` added for the choice only, group-limited top-k, weights renormalised over the chosen
  experts and scaled by ``routed_scaling_factor`` (models/moe.py ``sigmoid_group_limited_routing``), plus shared
  experts that see every token;
* ``model.word_embeddings``, ``model.norm``, an untied ``lm_head``; logits are not shifted (position i predicts
  token i).

Saved keys equal the public checkpoints': ``model.layers.N.attention.{query_key_value,dense,query_layernorm,
key_layernorm}``, ``mlp.gate.weight``, ``mlp.gate.expert_bias``, ``mlp.experts.{i}.{gate,up,down}_proj`` (fused in
memory: models/moe.py ``FusedExperts``), ``mlp.shared_experts.{gate,up,down}_proj``. ``expert_bias`` is a buffer:
the authors update it outside the gradient (auxiliary-loss-free balancing), so fine-tuning here keeps it as loaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.common import AttentionLayout, KVCache, attend
from models.layers import Projections, RMSNorm, attention_heads, init_linear_normal, merge_heads
from models.llada2.configuration_llada2_moe import LLaDA2MoeConfig
from models.moe import ExpertMLP, FusedExperts, register_fused_experts, sigmoid_group_limited_routing
from models.qwen_layers import QwenLMHeadMixin, QwenMLP


class LLaDA2Attention(Projections, nn.Module):
    projection_groups = {"qkv": ("query_key_value",), "out": ("dense",)}

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, (self.n_heads + 2 * self.n_kv) * self.head_dim,
                                         bias=False)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.dense = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        q, k, v = attention_heads(self.project("qkv", x), self.n_heads, self.n_kv, self.head_dim, cos, sin,
                                  (self.query_layernorm, self.key_layernorm))
        out = attend(q, k, v, layout, cache, self.layer_idx, store_kv, backend)
        return self.project("out", merge_heads(out))


class LLaDA2Router(nn.Module):
    """The router's parameters under the checkpoint's names: ``weight`` [E, H] and the ``expert_bias`` buffer."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        nn.init.normal_(self.weight, std=config.initializer_range)

    def forward(self, flat: Tensor) -> Tensor:
        """Router logits [T, E] in fp32."""
        return F.linear(flat.float(), self.weight.float())


class LLaDA2SparseMoeBlock(nn.Module):
    """Routed experts (group-limited sigmoid router) plus shared experts that every token goes through."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.config = config
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.gate = LLaDA2Router(config)
        self.shared_experts = (ExpertMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(router logits fp32, weights fp32, expert indices) for flattened tokens [T, H]."""
        cfg = self.config
        logits = self.gate(flat)
        # the authors renormalise whenever top_k > 1, whatever the config's norm_topk_prob says
        weights, index = sigmoid_group_limited_routing(logits, self.gate.expert_bias, cfg.num_experts_per_tok,
                                                       cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        return logits, weights, index

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.route(flat)
        out = self.experts(flat, weights, index)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape)


class LLaDA2DecoderLayer(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2Attention(config, layer_idx)
        sparse = config.num_experts and layer_idx >= config.first_k_dense_replace
        self.mlp = LLaDA2SparseMoeBlock(config) if sparse else QwenMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        x = x + self.attention(self.input_layernorm(x), cos, sin, layout, cache, store_kv, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LLaDA2MoePreTrainedModel(PreTrainedModel):
    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDA2DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)
        if isinstance(module, LLaDA2Router):
            module.weight.data.normal_(0.0, self.config.initializer_range)
            module.expert_bias.zero_()


class LLaDA2MoeModel(BackboneMixin, LLaDA2MoePreTrainedModel):
    default_attention = "block"
    block_size = property(lambda self: self.config.block_size)
    rope_head_dim = property(lambda self: self.config.rotary_dim)  # partial rotary: cos / sin span these dims
    rope_theta = property(lambda self: self.config.rope_theta)
    decoder_layers = property(lambda self: self.layers)

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def embed(self, ids: Tensor) -> Tensor:
        return self.word_embeddings(ids)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.word_embeddings = value

    def moe_blocks(self) -> list[LLaDA2SparseMoeBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, LLaDA2SparseMoeBlock)]


class LLaDA2MoeModelLM(LMHeadMixin, QwenLMHeadMixin, LLaDA2MoePreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}  # used only when tie_word_embeddings

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.build_head(config, LLaDA2MoeModel)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings


# per-expert tensors on disk, fused in memory (models/moe.py)
register_fused_experts(LLaDA2MoeModelLM.__name__, LLaDA2MoeModel.__name__)

"""LLaDA-MoE (inclusionAI LLaDA-MoE-7B-A1B, arXiv 2509.24389): masked diffusion with full bidirectional attention on
an OLMoE-style sparse decoder.

The decoder is the Qwen-style one of models/qwen_layers.py (``self_attn.{q,k,v,o}_proj``, per-head ``q_norm`` /
``k_norm``, ``input_layernorm``, ``post_attention_layernorm``, ``model.embed_tokens``, ``model.norm``, an untied
``lm_head``); what is LLaDA-MoE's own (ZHZisZZ/dllm dllm/pipelines/llada/models/modeling_lladamoe.py):

* attention is bidirectional; q and k are normalised per head (``qk_layernorm``), q, k and v clamped to
  ``+-clip_qkv`` when set, and RoPE turns the first ``head_dim x partial_rotary_factor`` dims of each head;
* each layer's MLP is a sparse block where ``moe_layer_freq`` says 1, a dense SwiGLU of ``dense_intermediate_size``
  where it says 0; the router is an fp32 softmax whose top-k probabilities are the weights as they are (never
  renormalised), with ``expert_bias`` (a buffer, when ``moe_router_enable_expert_bias``) added to the
  probabilities before the choice, so the weights carry it too, as in the authors' code;
* a ``shared_expert`` beside the sparse block (on the decoder layer, not inside ``mlp``) when
  ``shared_expert_intermediate_size`` is set;
* logits are not shifted (position i predicts token i); the embedding's ``padding_idx`` row gets no gradient, as
  the authors' ``nn.Embedding(..., padding_idx=pad_token_id)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.common import AttentionLayout, KVCache, attend
from models.layers import RMSNorm, apply_rope, init_linear_normal, merge_heads
from models.llada_moe.configuration_llada_moe import LLaDAMoEConfig
from models.moe import ExpertMLP, MoeBackboneMixin, SparseMoeBlock, register_fused_experts
from models.qwen_layers import QwenAttention, QwenBackboneMixin, QwenLMHeadMixin, QwenMLP


class LLaDAMoEAttention(QwenAttention):
    """Qwen3-style attention (per-head q/k norm, no biases); with ``clip_qkv``, q, k, v are clamped after the norm
    and before RoPE."""

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int):
        super().__init__(config, layer_idx, qkv_bias=False, qk_norm=bool(config.qk_layernorm))
        self.clip = config.clip_qkv

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        if self.clip is None:
            return super().forward(x, cos, sin, layout, cache, store_kv, backend)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2) for t in self.project("qkv", x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, layout, cache, self.layer_idx, store_kv,
                     backend)
        return self.project("out", merge_heads(out))


class LLaDAMoESparseMoeBlock(SparseMoeBlock):
    """Softmax top-k without renormalisation; ``expert_bias`` (optional buffer) added to the probabilities."""

    def __init__(self, config: LLaDAMoEConfig):
        super().__init__(config)
        self.norm_topk_prob = False  # the authors' block hard-codes it, whatever the config says
        if config.moe_router_enable_expert_bias:
            self.expert_bias = torch.zeros(config.num_experts)  # fills the base block's buffer (saved, not trained)


class LLaDAMoEDecoderLayer(nn.Module):
    def __init__(self, config: LLaDAMoEConfig, layer_idx: int):
        super().__init__()
        sparse = bool(config.moe_layer_freq[layer_idx])
        self.self_attn = LLaDAMoEAttention(config, layer_idx)
        self.mlp = LLaDAMoESparseMoeBlock(config) if sparse else QwenMLP(config)
        width = config.shared_expert_intermediate_size
        self.shared_expert = ExpertMLP(config.hidden_size, width) if sparse and width else None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: AttentionLayout, cache: KVCache | None,
                store_kv: bool, backend: str) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layout, cache, store_kv, backend)
        h = self.post_attention_layernorm(x)
        out = self.mlp(h)
        return x + (out + self.shared_expert(h) if self.shared_expert is not None else out)


class LLaDAMoEPreTrainedModel(PreTrainedModel):
    config_class = LLaDAMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDAMoEDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)
        if isinstance(module, LLaDAMoESparseMoeBlock) and module.expert_bias is not None:
            module.expert_bias.zero_()


class LLaDAMoEModel(MoeBackboneMixin, BackboneMixin, QwenBackboneMixin, LLaDAMoEPreTrainedModel):
    default_attention = "full"
    block_size = None
    rope_head_dim = property(lambda self: self.config.rotary_dim)  # partial rotary: cos / sin span these dims

    def __init__(self, config: LLaDAMoEConfig):
        super().__init__(config)
        self.build_backbone(config, layer_of=lambda i: LLaDAMoEDecoderLayer(config, i))
        pad = config.pad_token_id
        if isinstance(pad, int) and 0 <= pad < config.vocab_size:
            self.embed_tokens.padding_idx = pad
        self.post_init()


class LLaDAMoEModelLM(LMHeadMixin, QwenLMHeadMixin, LLaDAMoEPreTrainedModel):
    def __init__(self, config: LLaDAMoEConfig):
        super().__init__(config)
        self.build_head(config, LLaDAMoEModel)
        self.post_init()


# per-expert tensors on disk, fused in memory (models/moe.py)
register_fused_experts(LLaDAMoEModelLM.__name__, LLaDAMoEModel.__name__)

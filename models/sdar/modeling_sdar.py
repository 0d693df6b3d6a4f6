"""SDAR / TraDo: a Qwen3 decoder whose attention is block-causal (bidirectional inside a block of `block_size`
tokens, causal across blocks) with a commit-semantics KV cache. State-dict keys equal the public checkpoints'.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.layers import init_linear_normal
from models.qwen_layers import QwenBackboneMixin, QwenLMHeadMixin
from models.sdar.configuration_sdar import SDARConfig


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QwenDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)


class SDARModel(BackboneMixin, QwenBackboneMixin, SDARPreTrainedModel):
    default_attention = "block"
    block_size = property(lambda self: self.config.block_size)

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.build_backbone(config, qkv_bias=config.attention_bias, qk_norm=getattr(config, "qk_norm", True))
        self.post_init()


class SDARForCausalLM(LMHeadMixin, QwenLMHeadMixin, SDARPreTrainedModel):
    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.build_head(config, SDARModel)
        self.post_init()

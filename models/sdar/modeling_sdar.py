"""SDAR / TraDo: a Qwen3 decoder whose attention is block-causal (bidirectional inside a block of `block_size`
tokens, causal across blocks) with a commit-semantics KV cache. State-dict keys equal the public checkpoints'.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.common import RMSNorm, init_linear_normal
from models.qwen_layers import QwenDecoderLayer
from models.sdar.configuration_sdar import SDARConfig


class SDARPreTrainedModel(PreTrainedModel):
    config_class = SDARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QwenDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)


class SDARModel(BackboneMixin, SDARPreTrainedModel):
    default_attention = "block"

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, i, qkv_bias=config.attention_bias, qk_norm=True)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    block_size = property(lambda self: self.config.block_size)
    rope_head_dim = property(lambda self: self.config.head_dim)
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


class SDARForCausalLM(LMHeadMixin, SDARPreTrainedModel):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SDARConfig):
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    backbone = property(lambda self: self.model)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

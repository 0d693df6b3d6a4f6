"""Dream / DiffuCoder: a Qwen2 decoder (q/k/v biases, no q/k norm) run with full bidirectional attention.

Adapted from an autoregressive model, Dream keeps the AR logit convention: the logit at position i-1 predicts the
token at position i (the adapter exposes this as ``shift_logits``). Position ids are honoured (the reference's
sampling copy ignores them, REFERENCE 2.4), so left padding does not shift positions.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.common import RMSNorm, init_linear_normal
from models.dream.configuration_dream import DreamConfig
from models.qwen_layers import QwenDecoderLayer


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QwenDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)


class DreamBaseModel(BackboneMixin, DreamPreTrainedModel):
    default_attention = "full"
    block_size = None

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            QwenDecoderLayer(config, i, qkv_bias=True, qk_norm=False) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    rope_head_dim = property(lambda self: self.config.hidden_size // self.config.num_attention_heads)
    rope_theta = property(lambda self: self.config.rope_theta)
    decoder_layers = property(lambda self: self.layers)

    def embed(self, ids: Tensor) -> Tensor:
        return self.embed_tokens(ids)

    def final_norm(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens


class DreamModel(LMHeadMixin, DreamPreTrainedModel):
    """The LM class of the public checkpoints (`architectures: ["DreamModel"]`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    backbone = property(lambda self: self.model)

    def lm_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

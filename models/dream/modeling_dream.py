"""Dream / DiffuCoder: a Qwen2 decoder (q/k/v biases, no q/k norm) run with full bidirectional attention.

Adapted from an autoregressive model, Dream keeps the AR logit convention: the logit at position i-1 predicts the
token at position i (the adapter exposes this as ``shift_logits``). Position ids are honoured (the reference's
sampling copy, Gen-Verse/dLLM-RL sample/dream/modeling_dream.py, ignores them), so left padding does not shift
positions.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel

from models.base import BackboneMixin, LMHeadMixin
from models.dream.configuration_dream import DreamConfig
from models.layers import init_linear_normal
from models.qwen_layers import QwenBackboneMixin, QwenLMHeadMixin


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["QwenDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        init_linear_normal(module, self.config.initializer_range)


class DreamBaseModel(BackboneMixin, QwenBackboneMixin, DreamPreTrainedModel):
    default_attention = "full"
    block_size = None

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.build_backbone(config, qkv_bias=getattr(config, "attention_bias", True),
                            qk_norm=getattr(config, "qk_norm", False))
        self.post_init()


class DreamModel(LMHeadMixin, QwenLMHeadMixin, DreamPreTrainedModel):
    """The LM class of the public checkpoints (`architectures: ["DreamModel"]`)."""

    def __init__(self, config: DreamConfig):
        super().__init__(config)
        self.build_head(config, DreamBaseModel)
        self.post_init()

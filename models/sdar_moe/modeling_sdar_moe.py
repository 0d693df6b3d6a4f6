"""SDAR-MoE (SDAR-30B-A3B): SDAR's block-diffusion Qwen3 decoder with the dense MLP of each sparse layer replaced
by the shared Qwen3-MoE block (models/moe.py). Attention and decoder layers are SDAR's own; saved keys equal the
public checkpoint's (``mlp.gate.weight``, ``mlp.experts.{i}.{gate,up,down}_proj.weight``; the experts are fused in
memory, ``mlp.experts.gate_up_proj`` / ``down_proj``).
"""

from __future__ import annotations

from models.moe import MoeBackboneMixin, SparseMoeBlock, is_moe_layer, register_fused_experts
from models.sdar.modeling_sdar import SDARForCausalLM, SDARModel, SDARPreTrainedModel
from models.sdar_moe.configuration_sdar_moe import SDARMoeConfig


class SDARMoeModel(MoeBackboneMixin, SDARModel):
    config_class = SDARMoeConfig

    def __init__(self, config: SDARMoeConfig):
        SDARPreTrainedModel.__init__(self, config)
        # sparse layers get the MoE block at construction: a dense MLP built and then replaced would transiently
        # allocate a dense MLP of intermediate_size in every layer of the 48
        self.build_backbone(config, qkv_bias=config.attention_bias, qk_norm=getattr(config, "qk_norm", True),
                            mlp_of_layer=lambda i: SparseMoeBlock(config) if is_moe_layer(config, i) else None)
        self.post_init()


class SDARMoeForCausalLM(SDARForCausalLM):
    config_class = SDARMoeConfig
    _no_split_modules = ["QwenDecoderLayer"]

    def __init__(self, config: SDARMoeConfig):
        SDARPreTrainedModel.__init__(self, config)
        self.build_head(config, SDARMoeModel)
        self.post_init()


# per-expert tensors on disk, fused in memory (models/moe.py)
register_fused_experts(SDARMoeForCausalLM.__name__, SDARMoeModel.__name__)

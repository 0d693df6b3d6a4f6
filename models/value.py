"""A diffusion value model for every family: the policy's backbone plus a zero-initialised scalar head.

``ValueModel`` has a real config class and model type (``dllm_value``), so ``save_pretrained`` /
``from_pretrained`` / ``AutoModel`` work (the reference builds its value class dynamically, so its checkpoints only
reload through that factory: Gen-Verse/dLLM-RL train/init_trado_value_model.py). The backbone keeps the policy's
parameter names (``model.*``), so a policy checkpoint initialises it directly; the head is
``value_head.weight`` [1, hidden]. A value is read from the final normalised hidden state through the same
attention layouts as the policy, so it is computed at exactly the state the sampler was in.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel

from models.base import full_weights
from models.common import AttentionLayout
from models.moe import register_fused_experts
from models.registry import FAMILIES


def _backbones() -> dict[str, tuple[type, type]]:
    """model_type of a policy config -> (config class, backbone class), from the family table: each family's own
    spellings of its config's model_type (not a model_type it only accepts at load, as MMaDA accepts "llada")."""
    out = {}
    for spec in FAMILIES.values():
        config_class = spec.model_class.config_class
        for model_type in spec.model_types:
            if model_type.lower() == config_class.model_type.lower():
                out[model_type] = (config_class, spec.backbone_class)
    return out


BACKBONES = _backbones()


class ValueConfig(PretrainedConfig):
    """The policy's config (as a dict, with its model_type) wrapped as a value model's config."""

    model_type = "dllm_value"

    def __init__(self, policy: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.policy = dict(policy or {})

    def policy_config(self) -> PretrainedConfig:
        fields = dict(self.policy)
        model_type = fields.pop("model_type", None)
        if model_type not in BACKBONES:
            raise ValueError(f"value model: unknown policy model_type {model_type!r} (expected one of "
                             f"{sorted(BACKBONES)})")
        return BACKBONES[model_type][0](**fields)


UNUSED_HEAD = "transformer.ff_out."  # LLaDA / MMaDA backbones hold their LM head under the public names


def _drop_lm_head(backbone: nn.Module) -> None:
    """Remove an LM head the backbone holds: a value model never uses it, and a trainable parameter that gets no
    gradient stops DDP at its second step (and an 8B model's head is 2 GB of fp32)."""
    modules = getattr(backbone, "transformer", None)
    if isinstance(modules, nn.ModuleDict) and "ff_out" in modules:
        del modules["ff_out"]


class ValueModel(PreTrainedModel):
    """Backbone (the policy's parameter names) + ``value_head``; ``forward`` returns values [B, N] in fp32."""

    config_class = ValueConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True

    def __init__(self, config: ValueConfig):
        super().__init__(config)
        policy = config.policy_config()
        self.model = BACKBONES[policy.model_type][1](policy)
        _drop_lm_head(self.model)
        hidden = getattr(policy, "hidden_size", None) or policy.d_model
        self.value_head = nn.Linear(hidden, 1, bias=False)
        self.post_init()
        nn.init.zeros_(self.value_head.weight)

    def _init_weights(self, module: nn.Module) -> None:
        if module is getattr(self, "value_head", None):
            nn.init.zeros_(module.weight)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, layout: AttentionLayout | None = None,
                **kwargs: Any) -> Tensor:
        hidden = self.model(input_ids, position_ids=position_ids, layout=layout, **kwargs).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()


with contextlib.suppress(ValueError):  # already registered
    AutoConfig.register(ValueConfig.model_type, ValueConfig)
with contextlib.suppress(ValueError):
    AutoModel.register(ValueConfig, ValueModel)
register_fused_experts(ValueModel.__name__)  # a MoE backbone's experts: per expert on disk, fused in memory


def value_model_from_policy(policy: PreTrainedModel) -> ValueModel:
    """A value model whose backbone is a copy of ``policy``'s and whose head is zero (every value starts at 0)."""
    cfg = ValueConfig(policy=policy.config.to_dict())
    value = ValueModel(cfg).to(next(policy.parameters()).dtype)
    backbone = policy.backbone if hasattr(policy, "backbone") else policy.model
    with full_weights(*backbone.parameters()):  # loaded under ZeRO-3 the policy is partitioned: copy it whole
        missing, unexpected = value.model.load_state_dict(backbone.state_dict(), strict=False)
    unexpected = [k for k in unexpected if not k.startswith(UNUSED_HEAD)]
    if missing or unexpected:
        raise ValueError(f"policy backbone does not fit the value backbone (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    nn.init.zeros_(value.value_head.weight)
    return value.to(next(policy.parameters()).device)


def load_value_model(path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
    return ValueModel.from_pretrained(str(path), dtype=dtype)

"""Forward logic shared by every family: one backbone loop and one LM-head wrapper.

Families only declare their modules (names match the public checkpoints); the way positions, layouts, the KV
cache and gradient checkpointing are handled is written once here.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from models.common import AttentionLayout, KVCache, stored_columns
from models.layers import rope_cos_sin


def positions_from_mask(valid: Tensor, offset: int | Tensor = 0) -> Tensor:
    """Position ids that skip padding: real tokens get offset, offset + 1, ... whatever the left padding (``offset``
    an int or a [B, 1] tensor: each row's tokens already cached)."""
    pos = valid.long().cumsum(-1) - 1
    return (pos.clamp(min=0) + offset).masked_fill(~valid.bool(), 0)


class BackboneMixin:
    """Embedding -> decoder layers -> final norm, with layouts and the commit-semantics KV cache."""

    gradient_checkpointing = False

    # subclasses provide: embed(ids), decoder_layers (ModuleList), final_norm(x), rope_head_dim, rope_theta,
    # default_attention ("block" | "full"), block_size
    def default_layout(self, position_ids: Tensor, valid: Tensor) -> AttentionLayout:
        if self.default_attention == "block":
            return AttentionLayout.block_causal(position_ids, self.block_size, valid)
        return AttentionLayout.full(valid)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        layout: AttentionLayout | None = None,
        past_key_values: KVCache | None = None,
        store_kv: bool | int = False,  # True: keep the new K/V in the cache; n: keep only the first n columns
        inputs_embeds: Tensor | None = None,
        attn_backend: str | None = None,
        **_: object,
    ) -> BaseModelOutputWithPast:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b, n = x.shape[:2]
        valid = (attention_mask.bool() if attention_mask is not None and attention_mask.dim() == 2
                 else torch.ones(b, n, dtype=torch.bool, device=x.device))
        if position_ids is None:  # each row goes on from its real cached tokens (left padding is no position)
            cached = past_key_values.valid if past_key_values is not None else None
            offset = cached.sum(-1, keepdim=True).to(x.device) if cached is not None else 0
            position_ids = positions_from_mask(valid, offset) if attention_mask is not None else (
                torch.arange(n, device=x.device)[None] + offset).expand(b, n)
        if layout is None:
            layout = self.default_layout(position_ids, valid)
        backend = attn_backend or getattr(self.config, "attn_backend", "sdpa")
        cos, sin = rope_cos_sin(position_ids, self.rope_head_dim, self.rope_theta, x.dtype)
        for layer in self.decoder_layers:
            args = (x, cos, sin, layout, past_key_values, store_kv, backend)
            if self.gradient_checkpointing and self.training and (past_key_values is None
                                                                  or past_key_values.checkpointable):
                x = checkpoint(layer, *args, use_reentrant=False)
            else:
                x = layer(*args)
        if store_kv is not False and past_key_values is not None:
            past_key_values.append_valid(layout.valid[:, :stored_columns(store_kv, n)])
        return BaseModelOutputWithPast(last_hidden_state=self.final_norm(x), past_key_values=past_key_values)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.decoder_layers))


class LMHeadMixin:
    """``forward`` returning logits (optionally only the last ``logits_to_keep`` or indexed positions)."""

    # subclasses provide: backbone (the base model), lm_logits(hidden)
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        layout: AttentionLayout | None = None,
        past_key_values: KVCache | None = None,
        store_kv: bool = False,
        logits_to_keep: int | Tensor = 0,
        labels: Tensor | None = None,
        **kwargs: object,
    ) -> CausalLMOutputWithPast:
        out = self.backbone(input_ids, attention_mask=attention_mask, position_ids=position_ids, layout=layout,
                            past_key_values=past_key_values, store_kv=store_kv, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_logits(hidden)
        loss = None
        if labels is not None:  # unshifted masked-diffusion cross entropy; -100 ignored
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values,
                                      hidden_states=(out.last_hidden_state,))

    def new_cache(self) -> KVCache:
        return self.backbone.new_cache()


def full_weights(*params: torch.nn.Parameter):
    """Context in which parameters partitioned by DeepSpeed ZeRO-3 are whole (a no-op otherwise): for weights
    used outside their own module's forward, e.g. a tied embedding as the output projection."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(params))
    return contextlib.nullcontext()

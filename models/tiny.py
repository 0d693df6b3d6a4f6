"""Tiny random models built from configs: for tests, the CPU demo and benchmarks (no download needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.dream import DreamConfig
from models.llada import LLaDAConfig, MMadaConfig
from models.llada2 import LLaDA2MoeConfig
from models.llada_moe import LLaDAMoEConfig
from models.registry import Adapter, family_spec, make_adapter
from models.sdar import SDARConfig
from models.sdar_moe import SDARMoeConfig

SIZES = {  # name -> (hidden, layers, heads, kv heads, mlp)
    "test": (32, 2, 4, 2, 64),
    "demo": (128, 4, 4, 2, 384),
    "bench": (256, 4, 8, 2, 768),
}


def tiny_config(model_base: str, tokenizer: Any, size: str = "test", block_size: int = 4, **overrides: Any):
    """A small config of the right family whose vocabulary and special ids match ``tokenizer``."""
    hidden, layers, heads, kv, mlp = SIZES[size]
    vocab = len(tokenizer)
    ids = {"mask_token_id": tokenizer.mask_token_id, "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    family = family_spec(model_base).family
    if model_base == "sdar_moe":  # 8 experts, top-2: small enough for tests, sparse enough to route
        cfg = SDARMoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=mlp // 4,
                            block_size=block_size, max_position_embeddings=4096, **ids)
    elif model_base == "llada2":  # 8 experts in 4 groups, top-2 from the best 2 groups, one shared expert
        cfg = LLaDA2MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                              num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                              moe_intermediate_size=mlp // 4, first_k_dense_replace=1, block_size=block_size,
                              max_position_embeddings=4096, **ids)
    elif model_base == "llada_moe":  # 8 experts, top-2 (not renormalised), a dense first layer, a shared expert
        cfg = LLaDAMoEConfig(vocab_size=vocab, hidden_size=hidden, dense_intermediate_size=mlp,
                             expert_intermediate_size=mlp // 4, shared_expert_intermediate_size=mlp // 4,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                             num_experts=8, num_experts_per_tok=2, moe_layer_freq=[0] + [1] * (layers - 1),
                             max_position_embeddings=4096, **ids)
    elif family == "sdar":
        cfg = SDARConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                         block_size=block_size, max_position_embeddings=4096, **ids)
    elif family == "dream":
        cfg = DreamConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                          rope_theta=10000.0, **ids)
    else:
        cls = MMadaConfig if model_base == "mmada" else LLaDAConfig
        cfg = cls(d_model=hidden, n_heads=heads, n_kv_heads=kv, n_layers=layers, mlp_hidden_size=mlp,
                  vocab_size=vocab, embedding_size=vocab, max_sequence_length=4096, **ids)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny(model_base: str, tokenizer: Any, size: str = "test", seed: int = 0, **overrides: Any) -> Adapter:
    """A freshly initialised (seeded) tiny model of the family, wrapped in its adapter, in eval mode."""
    cfg = tiny_config(model_base, tokenizer, size, **overrides)
    torch.manual_seed(seed)
    model = family_spec(model_base).model_class(cfg).eval()
    return make_adapter(model, tokenizer, model_base)


def save_tiny_checkpoint(out_dir: str | Path, model_base: str, tokenizer: Any, size: str = "demo",
                         seed: int = 0) -> Path:
    """Write a loadable checkpoint folder (config, safetensors, tokenizer) for ``load_model``."""
    out = Path(out_dir)
    adapter = build_tiny(model_base, tokenizer, size, seed)
    adapter.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

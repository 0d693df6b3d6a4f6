"""Tiny random models built from configs: for tests, the CPU demo and benchmarks (no download needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.registry import Adapter, family_spec, make_adapter

SIZES = {  # name -> (hidden, layers, heads, kv heads, mlp)
    "test": (32, 2, 4, 2, 64),
    "demo": (128, 4, 4, 2, 384),
    "bench": (256, 4, 8, 2, 768),
}


def tiny_config(model_base: str, tokenizer: Any, size: str = "test", block_size: int = 4, **overrides: Any):
    """A small config of the right family (its config class's ``tiny``) whose vocabulary and special ids match
    ``tokenizer``."""
    hidden, layers, heads, kv, mlp = SIZES[size]
    config_class = family_spec(model_base).model_class.config_class
    cfg = config_class.tiny(hidden, layers, heads, kv, mlp, len(tokenizer), block_size,
                            mask_token_id=tokenizer.mask_token_id, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=tokenizer.eos_token_id)
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

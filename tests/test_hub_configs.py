"""Folders shaped like the public checkpoints (their config.json keys, their state-dict names) load unchanged.

Sizes are shrunk; every other field is as published (SDAR, Dream and LLaDA hub config.json files), including keys we do
not use
(auto_map, attn_implementation, torch_dtype, OLMo options), so `from_pretrained(local_dir)` on a real download
takes the same path.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import models.registry  # noqa: F401  (registers the Auto classes)

SDAR_HUB = {
    "architectures": ["SDARForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "block_size": 4, "bos_token_id": 151643, "eos_token_id": 151643, "fuse_cross_entropy": True,
    "attn_implementation": "flex_attention", "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "mask_token_id": 151669, "max_position_embeddings": 32768,
    "max_window_layers": 36, "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
DREAM_HUB = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "mask_token_id": 151666, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "Dream", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": 151643, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": False, "use_sliding_window": False, "vocab_size": 152064,
}
LLADA_HUB = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 32,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": 126336,
    "max_sequence_length": 4096, "mlp_hidden_size": 64, "mlp_ratio": 4, "model_type": "llada", "n_heads": 4,
    "n_kv_heads": 4, "n_layers": 2, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
    "use_cache": False, "vocab_size": 126464, "weight_tying": False,
}


def _write_checkpoint(folder, config: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors


def _qwen_shapes(cfg: dict, qk_norm: bool, bias: bool) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i)}
        if qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


def _llada_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    d, m, e = cfg["d_model"], cfg["mlp_hidden_size"], cfg["embedding_size"]
    shapes = {"model.transformer.wte.weight": (e, d), "model.transformer.ln_f.weight": (d,),
              "model.transformer.ff_out.weight": (e, d)}
    for n in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{n}."
        shapes |= {p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,), p + "q_proj.weight": (d, d),
                   p + "k_proj.weight": (d, d), p + "v_proj.weight": (d, d), p + "attn_out.weight": (d, d),
                   p + "ff_proj.weight": (m, d), p + "up_proj.weight": (m, d), p + "ff_out.weight": (d, m)}
    return shapes


CASES = {
    "sdar": (SDAR_HUB, lambda c: _qwen_shapes(c, qk_norm=True, bias=False)),
    "dream": (DREAM_HUB, lambda c: _qwen_shapes(c, qk_norm=False, bias=True)),
    "llada": (LLADA_HUB, _llada_shapes),
    "mmada": ({**LLADA_HUB, "model_type": "mmada", "architectures": ["MMadaModelLM"]}, _llada_shapes),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hub_shaped_folder_loads_every_tensor(tmp_path, name):
    config, shapes_fn = CASES[name]
    tensors = _write_checkpoint(tmp_path / name, config, shapes_fn(config))
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert set(state) == set(tensors)
    for key, value in tensors.items():
        assert torch.equal(state[key], value.float()), key
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert torch.isfinite(out).all()
    assert out.shape[-1] == config["vocab_size"]

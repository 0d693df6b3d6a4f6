"""A tiny Llama checkpoint written as a GGUF file, as llama.cpp lays one out (transformers reads GGUF but cannot write
it; the ``gguf`` package writes the container): metadata under llama.cpp's key names, the byte-level BPE vocabulary
with its merges and token types, and the weights in float32 under llama.cpp's tensor names, with the rows of the q
and k projections regrouped per head for llama.cpp's rotary convention (the pairs a rotation mixes adjacent, where
transformers keeps the two halves of a head apart), which transformers' GGUF reader undoes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# gguf token types (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def interleave_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """[heads * head_dim, in] rows of a q / k projection reordered per head from (first half, second half) to
    pairs (i, i + head_dim / 2) side by side: llama.cpp's order."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, -1).transpose(0, 2, 1, 3).reshape(weight.shape)


def _tensors(model) -> dict[str, np.ndarray]:
    cfg = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if ours in ("attn_q", "attn_k"):
                weight = interleave_rotary_rows(weight, cfg.num_attention_heads if ours == "attn_q"
                                                else cfg.num_key_value_heads)
            out[f"blk.{i}.{ours}.weight"] = weight
    return out


def write_llama_gguf(model, tokenizer, path: Path) -> Path:
    """``model`` (a transformers LlamaForCausalLM) and its byte-level BPE ``tokenizer`` as one GGUF file."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)

    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens))), "token ids must be dense"
    added = {t.content: t for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values()}
    types = [NORMAL if t not in added else CONTROL if added[t].special else USER_DEFINED for t in tokens]
    spelled = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]  # as tokenizer.json has them
    merges = [m if isinstance(m, str) else " ".join(m) for m in spelled]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_bos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    for name, weight in _tensors(model).items():
        writer.add_tensor(name, np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

"""LLaDAConfig / MMadaConfig with the OLMo-style field names of the public LLaDA and MMaDA checkpoints."""

from __future__ import annotations

from transformers import PretrainedConfig


class LLaDAConfig(PretrainedConfig):
    """Keeps the checkpoint's OLMo names (d_model, n_heads, n_layers, mlp_hidden_size, ...) (Gen-Verse/dLLM-RL
    models/llada/configuration_llada.py).

    Unknown OLMo keys of the hub config (alibi, init_fn, precision, ...) are kept as plain attributes; options we
    do not implement (alibi, attention layer norm, non-llama blocks) are rejected so a checkpoint never runs with
    silently different math.
    """

    model_type = "llada"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "intermediate_size": "mlp_hidden_size",
        "max_position_embeddings": "max_sequence_length",
    }

    def __init__(
        self,
        d_model: int = 4096,
        n_heads: int = 32,
        n_kv_heads: int | None = None,
        n_layers: int = 32,
        mlp_hidden_size: int = 12288,
        vocab_size: int = 126464,
        embedding_size: int | None = 126464,
        max_sequence_length: int = 4096,
        rope_theta: float = 500000.0,
        rms_norm_eps: float = 1e-5,
        weight_tying: bool = False,
        include_bias: bool = False,
        include_qkv_bias: bool = False,
        block_type: str = "llama",
        layer_norm_type: str = "rms",
        alibi: bool = False,
        attention_layer_norm: bool = False,
        scale_logits: bool = False,
        init_std: float = 0.02,
        mask_token_id: int = 126336,
        pad_token_id: int = 126081,
        eos_token_id: int = 126081,
        attn_backend: str = "sdpa",
        **kwargs,
    ):
        for flag, value in (("alibi", alibi), ("attention_layer_norm", attention_layer_norm),
                            ("scale_logits", scale_logits), ("include_bias", include_bias)):
            if value:
                raise ValueError(f"LLaDA option {flag}=True is not supported")
        if block_type != "llama" or layer_norm_type != "rms":
            raise ValueError(f"only block_type 'llama' with RMS norm is supported, got {block_type}/{layer_norm_type}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.n_layers = n_layers
        self.mlp_hidden_size = mlp_hidden_size
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size or vocab_size
        self.max_sequence_length = max_sequence_length
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.weight_tying = weight_tying
        self.include_bias = include_bias
        self.include_qkv_bias = include_qkv_bias
        self.block_type = block_type
        self.layer_norm_type = layer_norm_type
        self.alibi = alibi
        self.attention_layer_norm = attention_layer_norm
        self.scale_logits = scale_logits
        self.init_std = init_std
        self.mask_token_id = mask_token_id
        self.attn_backend = attn_backend
        kwargs.pop("tie_word_embeddings", None)
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, tie_word_embeddings=weight_tying,
                         **kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> LLaDAConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        # full attention: no block size
        return cls(d_model=hidden, n_heads=heads, n_kv_heads=kv_heads, n_layers=layers, mlp_hidden_size=mlp,
                   vocab_size=vocab, embedding_size=vocab, max_sequence_length=4096, **ids)


class MMadaConfig(LLaDAConfig):
    """MMaDA's text model: LLaDA's architecture and parameter names (Gen-Verse/dLLM-RL
    models/mmada/modeling_mmada.py)."""

    model_type = "mmada"

    def __init__(self, **kwargs):  # explicit: transformers 5 does not run an inherited __init__ for subclasses
        super().__init__(**kwargs)

"""DreamConfig: the config of the public Dream / DiffuCoder checkpoints (Qwen2 layout, `model_type` "Dream")."""

from __future__ import annotations

from transformers import PretrainedConfig


class DreamConfig(PretrainedConfig):
    """Field names and defaults follow Dream's configuration (Gen-Verse/dLLM-RL models/dream/configuration_dream.py):
    mask 151666, pad 151643."""

    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 32,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = False,
        tie_word_embeddings: bool = False,
        rope_theta: float = 10000.0,
        attention_dropout: float = 0.0,
        attention_bias: bool = True,  # Qwen2's q/k/v biases; false for a model converted from Llama / Qwen3 (a2d)
        qk_norm: bool = False,  # per-head q/k RMSNorm: true for a model converted from Qwen3 (a2d)
        mask_token_id: int = 151666,
        pad_token_id: int = 151643,
        attn_backend: str = "sdpa",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.attention_dropout = attention_dropout
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.mask_token_id = mask_token_id
        self.attn_backend = attn_backend
        if kwargs.get("rope_scaling"):  # the public checkpoints use none: refused rather than silently ignored
            raise ValueError(f"Dream rope_scaling {kwargs['rope_scaling']!r} is not supported")
        if kwargs.get("use_sliding_window"):
            raise ValueError("Dream use_sliding_window=true is not supported (every layer attends to the whole "
                             "context)")
        for unused in ("rope_scaling", "sliding_window", "use_sliding_window", "max_window_layers",
                       "attn_implementation"):
            kwargs.pop(unused, None)  # the hub's inert keys (rope_scaling null, use_sliding_window false)
        super().__init__(pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> DreamConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                   rope_theta=10000.0, **ids)

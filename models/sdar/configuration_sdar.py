"""SDARConfig: the config of the public TraDo / SDAR checkpoints (Qwen3 layout + block diffusion keys)."""

from __future__ import annotations

from transformers import PretrainedConfig


class SDARConfig(PretrainedConfig):
    """Field names and defaults follow SDAR-*-Chat `config.json` (JetAstra/SDAR
    training/model/SDAR-4B-Chat/config.json), so hub folders load as they are."""

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 22016,
        num_hidden_layers: int = 32,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 32,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 32768,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1_000_000.0,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        qk_norm: bool = True,  # Qwen3's per-head q/k RMSNorm; false for a model converted from Llama / Qwen2 (a2d)
        attention_dropout: float = 0.0,
        block_size: int = 4,
        mask_token_id: int = 151669,
        fuse_cross_entropy: bool = False,
        attn_backend: str = "sdpa",
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        if rope_scaling:  # the public checkpoints use none; refuse rather than silently ignore it
            raise ValueError(f"SDAR rope_scaling {rope_scaling!r} is not supported")
        if kwargs.get("use_sliding_window"):  # likewise: every layer here attends to its whole context
            raise ValueError("SDAR use_sliding_window=true is not supported (every layer attends to the whole "
                             "context)")
        self.attention_bias = attention_bias
        self.qk_norm = qk_norm
        self.attention_dropout = attention_dropout
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.fuse_cross_entropy = fuse_cross_entropy
        self.attn_backend = attn_backend
        kwargs.pop("attn_implementation", None)  # the hub config says flex_attention; we pick via attn_backend
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> SDARConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                   block_size=block_size, max_position_embeddings=4096, **ids)

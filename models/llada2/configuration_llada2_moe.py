"""LLaDA2MoeConfig: the config of the public LLaDA2.0 / LLaDA2.1 checkpoints (block-diffusion MoE, ``llada2_moe``).

Field names and defaults follow LLaDA2.0-mini's ``config.json`` (inclusionAI/LLaDA2.0-mini, vendored in
yjyddq/DARE models/LLaDA2.0-mini/), so hub folders load as they are. Two fields are ours, absent from the hub
config: ``block_size`` (32, the block length of the authors' generate function) and ``mask_token_id`` (156895,
``<|mask|>`` in the checkpoint's tokenizer).

Options the public checkpoints do not use and we do not implement are refused at construction, so a checkpoint
never runs with silently different math: biases, a normalised LM head, sliding-window attention, RoPE scaling,
a softmax router, a router auxiliary loss (the authors balance experts through ``expert_bias``, which
fine-tuning keeps frozen).
"""

from __future__ import annotations

from transformers import PretrainedConfig


class LLaDA2MoeConfig(PretrainedConfig):
    model_type = "llada2_moe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        intermediate_size: int = 5120,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 16,
        num_key_value_heads: int = 4,
        head_dim: int | None = 128,
        hidden_act: str = "silu",
        use_qkv_bias: bool = False,
        use_bias: bool = False,
        use_qk_norm: bool = True,
        norm_head: bool = False,
        rms_norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        max_position_embeddings: int = 32768,
        rope_theta: float = 600000.0,
        rope_scaling: dict | None = None,
        partial_rotary_factor: float = 0.5,
        rotary_dim: int | None = None,
        use_sliding_window: bool = False,
        num_experts: int = 256,
        num_shared_experts: int | None = 1,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        routed_scaling_factor: float = 2.5,
        moe_intermediate_size: int = 512,
        first_k_dense_replace: int = 1,
        score_function: str = "sigmoid",
        moe_router_enable_expert_bias: bool = True,
        output_router_logits: bool = False,
        pad_token_id: int = 156892,
        eos_token_id: int = 156892,
        mask_token_id: int = 156895,
        block_size: int = 32,
        attn_backend: str = "sdpa",
        **kwargs,
    ):
        refused = {"use_qkv_bias": use_qkv_bias, "use_bias": use_bias, "norm_head": norm_head,
                   "use_sliding_window": use_sliding_window, "rope_scaling": bool(rope_scaling),
                   "use_qk_norm=False": not use_qk_norm,
                   # the authors balance experts without an auxiliary loss (expert_bias, frozen here)
                   "output_router_logits (a router auxiliary loss)": output_router_logits,
                   f"score_function={score_function!r}": score_function != "sigmoid"}
        for option, on in refused.items():
            if on:
                raise ValueError(f"LLaDA2 option {option} is not supported (the public checkpoints do not use it)")
        head_dim = head_dim or hidden_size // num_attention_heads
        if num_experts % n_group or topk_group > n_group or num_experts_per_tok > num_experts:
            raise ValueError(f"LLaDA2 routing needs num_experts ({num_experts}) divisible by n_group ({n_group}), "
                             f"topk_group ({topk_group}) <= n_group and num_experts_per_tok ({num_experts_per_tok}) "
                             "<= num_experts")
        rotated = int(head_dim * partial_rotary_factor)  # what the authors' code rotates (rotary_dim is not read)
        if rotated % 2 or (rotary_dim is not None and rotary_dim != rotated):
            raise ValueError(f"LLaDA2 rotates head_dim x partial_rotary_factor = {rotated} dimensions, which must be "
                             f"even{'' if rotary_dim is None else f' and equal the config rotary_dim {rotary_dim}'}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.use_qkv_bias = use_qkv_bias
        self.use_bias = use_bias
        self.use_qk_norm = use_qk_norm
        self.norm_head = norm_head
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_dim = rotated  # the leading head dimensions RoPE rotates (64 of 128); the rest pass as they are
        self.use_sliding_window = use_sliding_window
        self.num_experts = num_experts
        self.num_shared_experts = num_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.score_function = score_function
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.output_router_logits = output_router_logits
        self.mask_token_id = mask_token_id
        self.block_size = block_size
        self.attn_backend = attn_backend
        kwargs.pop("attn_implementation", None)  # we pick the attention kernel via attn_backend
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> LLaDA2MoeConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        # 8 experts in 4 groups, top-2 from the best 2 groups, one shared expert, a dense first layer
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, num_experts=8,
                   num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=mlp // 4,
                   first_k_dense_replace=1, block_size=block_size, max_position_embeddings=4096, **ids)

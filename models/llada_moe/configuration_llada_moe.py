"""LLaDAMoEConfig: the config of LLaDA-MoE-7B-A1B (inclusionAI; a full-attention masked-diffusion model on an
OLMoE-style MoE decoder, arXiv 2509.24389).

Field names follow the authors' config class (ZHZisZZ/dllm dllm/pipelines/llada/models/configuration_lladamoe.py),
so hub folders load as they are. The hub ``config.json`` says ``model_type: "llada"``, as dense LLaDA-8B's does;
``models.registry.load_model`` tells them apart by the MoE fields (``num_experts``; ``architectures``
``LLaDAMoEModelLM``) and says which ``model_base`` to use. Saved checkpoints carry ``lladamoe`` (the name dllm
registers), which only this class claims.

Fields the authors' modeling code does not read keep their values but change nothing, as there:
``norm_topk_prob`` (the top-k weights are never renormalised), ``moe_router_score_function`` (always a softmax),
``routed_scaling_factor``, ``router_num_group`` / ``router_topk_group``. ``mask_token_id`` (156895, ``<|mask|>``) is
ours: the hub config has none. The defaults are LLaDA-MoE-7B-A1B's published shape (16 layers, hidden 2048, 16
heads, 64 experts top-8 of width 1024, dense width 8192, RoPE theta 50000, q/k norm); a hub config sets its own.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class LLaDAMoEConfig(PretrainedConfig):
    model_type = "lladamoe"
    keys_to_ignore_at_inference = ["past_key_values"]
    # the shared layers' names: a dense layer's MLP is intermediate_size wide, an expert moe_intermediate_size
    attribute_map = {"intermediate_size": "dense_intermediate_size",
                     "moe_intermediate_size": "expert_intermediate_size"}

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2048,
        dense_intermediate_size: int = 8192,
        expert_intermediate_size: int = 1024,
        shared_expert_intermediate_size: int | None = None,
        num_hidden_layers: int = 16,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 8192,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-5,
        pad_token_id: int | None = 156892,
        eos_token_id: int | list[int] | None = 156892,
        mask_token_id: int = 156895,
        tie_word_embeddings: bool = False,
        rope_theta: float = 50000.0,
        partial_rotary_factor: float = 1.0,
        rope_scaling: dict | None = None,
        attention_bias: bool = False,
        clip_qkv: float | None = None,
        qk_layernorm: bool = True,
        num_experts: int = 64,
        num_experts_per_tok: int = 8,
        moe_layer_freq: list[int] | None = None,
        moe_router_enable_expert_bias: bool | None = None,
        moe_router_score_function: str | None = None,
        norm_topk_prob: bool | None = None,
        routed_scaling_factor: float = 1.0,
        router_num_group: int | None = None,
        router_topk_group: int | None = None,
        output_router_logits: bool = False,
        router_aux_loss_coef: float = 0.01,
        attn_backend: str = "sdpa",
        **kwargs,
    ):
        for option, on in {"attention_bias": attention_bias, "rope_scaling": bool(rope_scaling),
                           f"hidden_act={hidden_act!r}": hidden_act != "silu"}.items():
            if on:
                raise ValueError(f"LLaDA-MoE option {option} is not supported (the public checkpoint does not use it)")
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok {num_experts_per_tok} exceeds num_experts {num_experts}")
        head_dim = hidden_size // num_attention_heads
        rotated = int(head_dim * partial_rotary_factor)
        if head_dim * num_attention_heads != hidden_size or rotated % 2 or not 0 < rotated <= head_dim:
            raise ValueError(f"LLaDA-MoE needs hidden_size ({hidden_size}) divisible by num_attention_heads and an "
                             f"even number of rotated dims (head_dim x partial_rotary_factor = {rotated})")
        freq = [1] * num_hidden_layers if moe_layer_freq is None else [int(f) for f in moe_layer_freq]
        if len(freq) != num_hidden_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries for {num_hidden_layers} layers")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.dense_intermediate_size = dense_intermediate_size
        self.expert_intermediate_size = expert_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        self.rotary_dim = rotated  # the leading head dimensions RoPE rotates; the rest pass as they are
        self.attention_bias = attention_bias
        self.clip_qkv = clip_qkv
        self.qk_layernorm = qk_layernorm
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_layer_freq = freq  # per layer: 1 a sparse MoE block, 0 a dense MLP
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        self.moe_router_score_function = moe_router_score_function
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.router_num_group = router_num_group
        self.router_topk_group = router_topk_group
        self.output_router_logits = output_router_logits
        self.router_aux_loss_coef = router_aux_loss_coef
        self.mask_token_id = mask_token_id
        self.attn_backend = attn_backend
        kwargs.pop("attn_implementation", None)  # we pick the attention kernel via attn_backend
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> LLaDAMoEConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        # 8 experts, top-2 (not renormalised), a dense first layer, a shared expert; full attention: no block size
        return cls(vocab_size=vocab, hidden_size=hidden, dense_intermediate_size=mlp,
                   expert_intermediate_size=mlp // 4, shared_expert_intermediate_size=mlp // 4,
                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, num_experts=8,
                   num_experts_per_tok=2, moe_layer_freq=[0] + [1] * (layers - 1), max_position_embeddings=4096,
                   **ids)

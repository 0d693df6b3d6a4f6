"""SDARMoeConfig: SDAR-30B-A3B's config (SDAR block diffusion on a Qwen3-MoE decoder)."""

from __future__ import annotations

from models.sdar.configuration_sdar import SDARConfig


class SDARMoeConfig(SDARConfig):
    """SDAR's fields plus the Qwen3-MoE ones, named and defaulted as SDAR-30B-A3B-Chat's config.json
    (JetAstra/SDAR; every layer sparse, 128 experts, top-8 renormalised)."""

    model_type = "sdar_moe"

    def __init__(
        self,
        num_experts: int = 128,
        num_experts_per_tok: int = 8,
        moe_intermediate_size: int = 768,
        norm_topk_prob: bool = True,
        decoder_sparse_step: int = 1,
        mlp_only_layers: list[int] | None = None,
        router_aux_loss_coef: float = 0.001,
        output_router_logits: bool = False,
        **kwargs,
    ):
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok {num_experts_per_tok} exceeds num_experts {num_experts}")
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.decoder_sparse_step = decoder_sparse_step
        self.mlp_only_layers = list(mlp_only_layers or [])
        self.router_aux_loss_coef = router_aux_loss_coef
        self.output_router_logits = output_router_logits
        super().__init__(**kwargs)

    @classmethod
    def tiny(cls, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, vocab: int, block_size: int,
             **ids: int) -> SDARMoeConfig:
        """A small config of this family for tests, demos and benchmarks (``models.tiny``); ``ids``: the special
        token ids (mask, pad, eos) of the tokenizer it is built for."""
        # 8 experts, top-2: small enough for tests, sparse enough to route
        return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                   num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=mlp // 4, block_size=block_size,
                   max_position_embeddings=4096, **ids)

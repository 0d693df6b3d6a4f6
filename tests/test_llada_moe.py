"""The llada_moe family (LLaDA-MoE-7B-A1B, models/llada_moe/): the router without renormalisation, the shared expert,
clip_qkv, logits against the authors' code, the model_type "llada" it shares with dense LLaDA, save / load, an SFT
job.

The golden logits in tests/fixtures/llada_moe_golden.json were computed by the authors' modeling file
(ZHZisZZ/dllm @ca176752 dllm/pipelines/llada/models/modeling_lladamoe.py, eager attention, no attention mask: full
bidirectional attention; run outside this repository under transformers 4.52.4) on the models that
``seeded_model`` builds, with and without ``clip_qkv``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models.common import AttentionLayout
from models.llada_moe import LLaDAMoEConfig, LLaDAMoEModelLM
from models.llada_moe.modeling_llada_moe import LLaDAMoESparseMoeBlock
from models.moe import naive_expert_compute
from models.registry import ModelLoadError, load_model, make_adapter
from tests.golden import fill_seeded

GOLDEN = Path(__file__).parent / "fixtures" / "llada_moe_golden.json"
# A tiny LLaDA-MoE with every feature the authors' code has: GQA, partial rotary (4 of 8 dims), a dense first layer
# (moe_layer_freq 0), 8 experts top-2 with an expert bias, a shared expert, per-head q/k norm.
TINY = dict(hidden_size=32, dense_intermediate_size=48, expert_intermediate_size=12, shared_expert_intermediate_size=12,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_layer_freq=[0, 1, 1], moe_router_enable_expert_bias=True, qk_layernorm=True,
            partial_rotary_factor=0.5, rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=256)


def seeded_model(vocab_size: int, mask_token_id: int, eos_token_id: int, clip_qkv: float | None = None
                 ) -> LLaDAMoEModelLM:
    """The golden model (tests/golden.py)."""
    cfg = LLaDAMoEConfig(vocab_size=vocab_size, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
                         pad_token_id=eos_token_id, clip_qkv=clip_qkv, **TINY)
    return fill_seeded(LLaDAMoEModelLM(cfg).eval(), 4321, weight=0.15, bias=0.05, head=0.25)


def golden_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 11), generator=torch.Generator().manual_seed(11))


def full_logits(model: LLaDAMoEModelLM, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model(ids, position_ids=pos, layout=AttentionLayout.full(torch.ones_like(ids, dtype=torch.bool))
                     ).logits


# ------------------------------------------------------------------------------------------ router + experts


def test_router_weights_are_the_top_k_probabilities_plus_bias_never_renormalised():
    torch.manual_seed(0)
    cfg = LLaDAMoEConfig(vocab_size=64, **TINY)
    block = LLaDAMoESparseMoeBlock(cfg)
    flat = torch.randn(6, 32)
    logits, weights, index = block.route(flat)
    probs = torch.softmax(logits, -1)
    assert torch.equal(index, probs.topk(2, dim=-1).indices)
    torch.testing.assert_close(weights, probs.gather(1, index))
    assert (weights.sum(-1) < 1).all()  # two of eight probabilities: not renormalised to 1
    with torch.no_grad():
        block.expert_bias.zero_()
        block.expert_bias[[3, 5]] = 1.0  # a probability is below 1: experts 3 and 5 win every choice
    _, weights, index = block.route(flat)
    assert index.sort(-1).values.tolist() == [[3, 5]] * 6
    # as in the authors' code, the bias was added to the probabilities before top-k, so the weights carry it
    torch.testing.assert_close(weights, probs.gather(1, index) + 1.0)


def test_sparse_block_computes_the_routed_experts_only(demo_tokenizer):
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    layer = model.model.layers[1]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    flat = x.reshape(-1, 32)
    _, weights, index = layer.mlp.route(flat)
    with torch.no_grad():
        torch.testing.assert_close(layer.mlp(x).reshape(-1, 32), naive_expert_compute(flat, weights, index,
                                                                                       layer.mlp.experts),
                                   rtol=0, atol=1e-6)
    assert layer.shared_expert is not None and model.model.layers[0].shared_expert is None  # dense layer: none


# ------------------------------------------------------------------------------------------ against the authors' code


@pytest.mark.parametrize("clip", [None, 0.4])
def test_logits_equal_the_authors_code(demo_tokenizer, clip):
    golden = json.loads(GOLDEN.read_text())[f"clip={clip}"]
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id, clip)
    logits = full_logits(model, golden_ids(len(demo_tokenizer)))
    torch.testing.assert_close(logits[..., :24], torch.tensor(golden["logits"]), rtol=0, atol=1e-5)
    assert golden["logits_abs_max"] > 1.0


def test_clip_qkv_changes_the_logits(demo_tokenizer):
    """The clipped path is not a no-op on the golden model (else the clip=0.4 golden would test nothing new)."""
    ids = golden_ids(len(demo_tokenizer))
    args = (len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    assert (full_logits(seeded_model(*args), ids) - full_logits(seeded_model(*args, 0.4), ids)).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ checkpoints


def _hub_style(folder: Path) -> None:
    """Rewrite a saved config as the hub's: model_type "llada" (dense LLaDA's too) and the authors' class name."""
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="llada", architectures=["LLaDAMoEModelLM"])
    (folder / "config.json").write_text(json.dumps(cfg))


def test_hub_config_with_model_type_llada_loads_as_llada_moe(tmp_path, demo_tokenizer):
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    _hub_style(tmp_path)
    loaded = load_model({"pretrained_model": str(tmp_path), "model_base": "llada_moe"})
    assert type(loaded.model) is LLaDAMoEModelLM and loaded.attention == "full" and not loaded.shift_logits
    torch.testing.assert_close(loaded.model.model.layers[2].mlp.expert_bias, model.model.layers[2].mlp.expert_bias,
                               rtol=0, atol=0)
    ids = golden_ids(len(demo_tokenizer))
    torch.testing.assert_close(full_logits(loaded.model, ids), full_logits(model, ids), rtol=0, atol=1e-5)
    with pytest.raises(ModelLoadError, match="is LLaDA-MoE .*set model.model_base=llada_moe"):
        load_model({"pretrained_model": str(tmp_path), "model_base": "llada"})


def test_dense_llada_checkpoint_is_refused_as_llada_moe(tmp_path, demo_tokenizer):
    from models.tiny import save_tiny_checkpoint

    save_tiny_checkpoint(tmp_path, "llada", demo_tokenizer, size="test")
    with pytest.raises(ModelLoadError, match="is dense LLaDA .*set model.model_base=llada or mmada"):
        load_model({"pretrained_model": str(tmp_path), "model_base": "llada_moe"})


def test_state_dict_uses_the_public_names(demo_tokenizer):
    from transformers.core_model_loading import revert_weight_conversion

    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    keys = set(revert_weight_conversion(model, model.state_dict()))  # what save_pretrained writes
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight",
            "model.layers.1.mlp.expert_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
            "model.layers.1.shared_expert.up_proj.weight", "model.layers.2.self_attn.q_norm.weight"} <= keys
    assert not any(k.startswith("model.layers.0.shared_expert") or k.startswith("model.layers.0.mlp.experts")
                   for k in keys)


@pytest.mark.parametrize("option,message", [({"attention_bias": True}, "attention_bias"),
                                            ({"moe_layer_freq": [1, 1]}, "2 entries for 3 layers"),
                                            ({"num_experts_per_tok": 9}, "exceeds num_experts")])
def test_options_we_do_not_implement_or_that_do_not_fit_are_refused(option, message):
    with pytest.raises(ValueError, match=message):
        LLaDAMoEConfig(**{**TINY, **option})


def test_adapter_stops_at_the_turn_end_of_the_ling_template(demo_tokenizer):
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    adapter = make_adapter(model, demo_tokenizer, "llada_moe")
    # the demo tokenizer has no <|role_end|>: the stops are its EOS only; the real one adds <|role_end|>
    assert adapter.stop_ids == (demo_tokenizer.eos_token_id,) and adapter.mask_id == demo_tokenizer.mask_token_id


def test_the_sft_script_of_each_model_base_exists():
    from jobs.config import FAMILY_BASES, script_family

    root = Path(__file__).resolve().parents[1]
    assert script_family("llada_moe") == "llada" and script_family("sdar_moe") == "sdar"
    for base in {b for bases in FAMILY_BASES.values() for b in bases}:
        script = script_family(base)
        assert base in FAMILY_BASES[script] and (root / "train" / f"sft_{script}.py").is_file()

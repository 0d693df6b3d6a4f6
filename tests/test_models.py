"""Model zoo: reference state-dict names, save/load round trips, attention invariants per family."""

from __future__ import annotations

import collections
import io
import json
import os

import pytest
import torch

from core.errors import UserError
from core.schema import SettingError
from models.common import AttentionLayout, predicting_columns
from models.registry import ModelLoadError, load_model, make_adapter
from models.tiny import save_tiny_checkpoint

FAMILY_BASES = ("sdar", "dream", "llada", "mmada")


def expected_keys(model_base: str, n_layers: int) -> set[str]:
    """State-dict names of the public checkpoints (JetLM/SDAR, Dream-org/Dream-v0, GSAI-ML/LLaDA-8B), written out."""
    if model_base == "sdar":
        per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight"]
        top = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        return set(top) | {f"model.layers.{i}.{k}" for i in range(n_layers) for k in per_layer}
    if model_base == "dream":
        per_layer = ["self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                     "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"]
        top = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        return set(top) | {f"model.layers.{i}.{k}" for i in range(n_layers) for k in per_layer}
    per_layer = ["attn_norm.weight", "ff_norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                 "attn_out.weight", "ff_proj.weight", "up_proj.weight", "ff_out.weight"]
    top = ["model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"]
    return set(top) | {f"model.transformer.blocks.{i}.{k}" for i in range(n_layers) for k in per_layer}


@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_state_dict_keys_match_reference_names(tiny, model_base):
    adapter = tiny(model_base)
    ref_base = "sdar" if model_base == "sdar" else ("dream" if model_base == "dream" else "llada")
    assert set(adapter.model.state_dict()) == expected_keys(ref_base, 2)


@pytest.mark.parametrize("model_base", ("trado", "sdar", "dream", "llada", "mmada", "sdar_moe", "llada2",
                                        "llada_moe"))
def test_save_load_round_trip_gives_identical_logits(tmp_path, demo_tokenizer, model_base):
    path = save_tiny_checkpoint(tmp_path / "ckpt", model_base, demo_tokenizer, size="test", seed=3)
    a = load_model({"pretrained_model": str(path), "model_base": model_base, "dtype": "float32"})
    b = load_model({"pretrained_model": str(path), "model_base": model_base, "dtype": "float32"})
    ids = torch.randint(0, 500, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la, lb = a.model(ids).logits, b.model(ids).logits
    assert torch.equal(la, lb)
    # And equal to the model before saving (same seed => same weights).
    from models.tiny import build_tiny

    with torch.no_grad():
        ref = build_tiny(model_base, demo_tokenizer, "test", seed=3).model(ids).logits
    # (to rounding: a loaded tensor may sit at another alignment, and CPU kernels may then sum in another order)
    torch.testing.assert_close(la, ref, rtol=0, atol=1e-6)
    assert a.mask_id == demo_tokenizer.mask_token_id
    assert a.tokenizer.mask_token == "<|MASK|>"


def _block_inputs(n=12):
    ids = torch.randint(0, 500, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)[None]
    return ids, pos


def test_block_model_cache_with_commit_semantics_equals_uncached(tiny):
    a = tiny("sdar", block_size=4)
    ids, pos = _block_inputs(12)
    full = a.forward(ids, pos, AttentionLayout.block_causal(pos, 4))
    cache = a.new_cache()
    with torch.no_grad():
        a.hidden(ids[:, :4], pos[:, :4], AttentionLayout.block_causal(pos[:, :4], 4), cache, store_kv=True)
        # Denoise block 1 several times without storing: the cache must not grow.
        for _ in range(3):
            out1 = a.forward(ids[:, 4:8], pos[:, 4:8], AttentionLayout.block_causal(pos[:, 4:8], 4), cache)
            assert cache.length == 4
        a.hidden(ids[:, 4:8], pos[:, 4:8], AttentionLayout.block_causal(pos[:, 4:8], 4), cache, store_kv=True)
        out2 = a.forward(ids[:, 8:], pos[:, 8:], AttentionLayout.block_causal(pos[:, 8:], 4), cache)
    assert cache.length == 8
    torch.testing.assert_close(out1, full[:, 4:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out2, full[:, 8:], atol=1e-5, rtol=1e-5)


def test_block_causality(tiny):
    a = tiny("sdar", block_size=4)
    ids, pos = _block_inputs(12)
    layout = AttentionLayout.block_causal(pos, 4)
    with torch.no_grad():
        base = a.forward(ids, pos, layout)
        later = ids.clone()
        later[0, 9] = (later[0, 9] + 1) % 500  # a token in block 2
        out = a.forward(later, pos, layout)
    assert torch.equal(out[:, :8], base[:, :8])  # blocks 0..1 unchanged
    assert not torch.allclose(out[:, 8:], base[:, 8:])  # block 2 (all positions, bidirectional) changes
    assert (out[0, 8:] - base[0, 8:]).abs().amax(-1).gt(0).all()
    with torch.no_grad():
        mid = ids.clone()
        mid[0, 5] = (mid[0, 5] + 1) % 500  # a token in block 1
        out = a.forward(mid, pos, layout)
    assert torch.equal(out[:, :4], base[:, :4])
    assert (out[0, 4:] - base[0, 4:]).abs().amax(-1).gt(0).all()  # block 1 and everything after


def test_dream_shift_convention(tiny):
    a = tiny("dream")
    assert a.shift_logits and a.attention == "full"
    # Dream's generation shifts by prepending the first logit (DreamLM/Dream, generation_utils.py:
    # cat([logits[:, :1], logits[:, :-1]])): column c is scored by the hidden state at c-1, column 0 by itself.
    assert predicting_columns(torch.arange(8), a.shift_logits, first=0).tolist() == [0, 0, 1, 2, 3, 4, 5, 6]
    assert predicting_columns(torch.arange(3, 8), a.shift_logits, first=3).tolist() == [3, 3, 4, 5, 6]  # a row from 3
    assert predicting_columns(torch.arange(3, 8), a.shift_logits).tolist() == [2, 3, 4, 5, 6]  # no first: c - 1
    assert predicting_columns(torch.arange(8), tiny("llada").shift_logits, first=0).tolist() == list(range(8))


@pytest.mark.parametrize("model_base", ("dream", "llada", "mmada"))
def test_left_pads_change_no_logits_of_real_tokens(tiny, model_base):
    a = tiny(model_base)
    ids = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = a.model(ids).logits
        for n_pad in (1, 3):
            padded = torch.cat([torch.full((1, n_pad), a.pad_id), ids], 1)
            mask = torch.cat([torch.zeros(1, n_pad), torch.ones(1, 7)], 1).long()
            out = a.model(padded, attention_mask=mask).logits[:, n_pad:]
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            # Pads also never influence real tokens when their content changes.
            padded2 = padded.clone()
            padded2[0, :n_pad] = 7
            out2 = a.model(padded2, attention_mask=mask).logits[:, n_pad:]
            torch.testing.assert_close(out2, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_bf16_forward_runs_on_cpu_and_tracks_fp32(tiny, model_base):
    a = tiny(model_base)
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = a.model(ids).logits
        a.model.to(torch.bfloat16)
        out = a.model(ids).logits
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max() + 0.05


def test_attention_backends_agree(tiny):
    """FlexAttention (eager on CPU) evaluates the same layout rule as the SDPA boolean mask; flash-attn needs CUDA
    and falls back to SDPA elsewhere. Checked on the TraceRL doubled layout with padding, not just block-causal."""
    a = tiny("sdar")
    ids, pos = _block_inputs(12)
    ids, pos = ids.expand(2, -1).clone(), pos.expand(2, -1).clone()
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, 10:] = False
    layout = AttentionLayout.block_causal(pos, 4, valid)
    layout.copy[:, 8:] = 1  # the last block is a noisy copy of block 1
    layout.block[:, 8:] = 1
    with torch.no_grad():
        ref = a.forward(ids, pos, layout)
        for backend in ("flex", "flash"):
            a.model.config.attn_backend = backend
            fresh = AttentionLayout(layout.block, layout.copy, layout.valid)
            torch.testing.assert_close(a.forward(ids, pos, fresh), ref, atol=1e-5, rtol=1e-5)
    a.model.config.attn_backend = "sdpa"


def test_dense_mask_matches_sdpa_with_explicit_additive_mask(tiny):
    """The boolean layout mask means what we think: compare to a hand-made block-causal matrix."""
    pos = torch.arange(6)[None]
    mask = AttentionLayout.block_causal(pos, 2).dense_mask()[0, 0]
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_annealed_layout_is_causal_plus_the_drawn_pairs_and_every_backend_reads_it(tiny):
    """Attention annealing (DiffuLLaMA): causal, plus each (query, key) pair of the draw where the key is valid;
    ratio 0 is the causal layout, ratio 1 the full one; the dense mask (SDPA) and FlexAttention's block mask agree,
    and a cut of rows and columns keeps the draw's corner."""
    from train.layouts import select_layout_rows

    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    g = torch.Generator().manual_seed(0)
    drawn = AttentionLayout.annealed(valid, 0.5, g)
    extra = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) < 0.5  # the same draw
    causal = AttentionLayout.causal(valid).dense_mask()[:, 0]
    assert torch.equal(drawn.extra, extra) and 0 < int(extra.triu(1).sum()) < 15  # some later keys, not all
    assert torch.equal(drawn.dense_mask()[:, 0], causal | (extra[None] & valid[:, None, :]))
    not_self = ~torch.eye(6, dtype=torch.bool)
    assert not (drawn.dense_mask()[1, 0] & not_self)[:, 4:].any()  # padding keys stay hidden (but to themselves)
    assert torch.equal(AttentionLayout.annealed(valid, 0.0).dense_mask(), AttentionLayout.causal(valid).dense_mask())
    assert torch.equal(AttentionLayout.annealed(valid, 1.0).dense_mask(), AttentionLayout.full(valid).dense_mask())
    cut = select_layout_rows(drawn, torch.tensor([1]), 4)
    assert torch.equal(cut.dense_mask(), drawn.dense_mask()[1:, :, :4, :4])
    a = tiny("dream")
    ids = torch.randint(0, 50, (2, 6), generator=g)
    pos = torch.arange(6).expand(2, -1)
    with torch.no_grad():
        ref = a.forward(ids, pos, drawn)
        a.model.config.attn_backend = "flex"
        try:
            flex = a.forward(ids, pos, AttentionLayout(drawn.block, drawn.copy, drawn.valid, drawn.extra))
        finally:
            a.model.config.attn_backend = "sdpa"
        causal_logits = a.forward(ids, pos, AttentionLayout.causal(valid))
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref[0], causal_logits[0], atol=1e-3)  # the drawn pairs change what row 0 computes


# ---------------------------------------------------------------- adapter / loading errors


def test_unknown_model_base(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown model_base 'gpt2'"):
        load_model({"pretrained_model": str(tmp_path), "model_base": "gpt2"})


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder with a config.json"):
        load_model({"pretrained_model": str(tmp_path / "nope"), "model_base": "sdar"})
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="holds a LoRA adapter, not a whole model: set it as model.adapter and "
                                             "its base model as model.pretrained_model"):
        load_model({"pretrained_model": str(tmp_path / "lora"), "model_base": "sdar"})


def test_a_typo_or_an_unknown_dtype_in_a_plain_dict_is_one_line(tmp_path, demo_tokenizer):
    with pytest.raises(ModelLoadError, match="unknown model key 'pretrained_modle' \\(did you mean "
                                             "'pretrained_model'\\?\\); load_model reads pretrained_model, "):
        load_model({"pretrained_modle": str(tmp_path), "model_base": "sdar"})
    path = save_tiny_checkpoint(tmp_path / "s", "sdar", demo_tokenizer, size="test")
    with pytest.raises(ModelLoadError, match="dtype 'bf16' is not one of float32, bfloat16, float16"):
        load_model({"pretrained_model": str(path), "model_base": "sdar", "dtype": "bf16"})


def test_model_load_keys_cover_every_job_model_key():
    """A job's model section passed as a dict (to_dict) must load: every field is a key load_model knows."""
    from core.schema import to_dict
    from jobs.config import load_config
    from models.registry import _check_model_keys

    for config, kind in (("configs/demo/rl_demo.yaml", "rl"), ("configs/demo/eval_demo.yaml", "eval"),
                         ("configs/demo/sft_demo.yaml", "sft")):
        _check_model_keys(to_dict(load_config([f"config={config}"], kind, stream=io.StringIO()).model))


def test_model_type_mismatch(tmp_path, demo_tokenizer):
    path = save_tiny_checkpoint(tmp_path / "d", "dream", demo_tokenizer, size="test")
    with pytest.raises(ModelLoadError, match=r"model_type 'Dream' does not match model_base 'sdar' \(expected "
                                             r"sdar\); this checkpoint loads with model.model_base=dream$"):
        load_model({"pretrained_model": str(path), "model_base": "sdar"})
    assert json.loads((path / "config.json").read_text())["model_type"] == "Dream"
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))  # an AR checkpoint
    with pytest.raises(ModelLoadError, match=r"model_type 'qwen2' does not match model_base 'sdar' \(expected sdar\): "
                                             r"an autoregressive qwen2 checkpoint; convert it first \(python -m "
                                             r"tools.a2d"):
        load_model({"pretrained_model": str(path), "model_base": "sdar"})


def test_tokenizer_without_mask_token(tiny, demo_tokenizer):
    import copy

    tok = copy.deepcopy(demo_tokenizer)
    tok.mask_token = None
    with pytest.raises(ModelLoadError, match="no mask token"):
        make_adapter(tiny("sdar").model, tok, "sdar")


def test_every_eos_id_a_config_lists_stops_the_sampler(tiny, demo_tokenizer):
    model = tiny("sdar").model
    old = model.config.eos_token_id
    extra = demo_tokenizer.convert_tokens_to_ids("<|MASK|>") - 1  # any id the tokenizer does not call EOS
    try:
        model.config.eos_token_id = [demo_tokenizer.eos_token_id, extra]  # a list, as Llama 3's config has
        adapter = make_adapter(model, demo_tokenizer, "sdar")
    finally:
        model.config.eos_token_id = old
    assert adapter.eos_ids == tuple(sorted({demo_tokenizer.eos_token_id, extra}))
    assert extra in adapter.stop_ids


def test_kv_cache_reads_in_place_and_commits_without_copying(tiny):
    """Denoising reads the cache through a view (no per-forward copy); a store only advances the used length."""
    a = tiny("sdar", block_size=4)
    ids, pos = _block_inputs(16)
    cache = a.new_cache()
    with torch.no_grad():
        a.hidden(ids[:, :4], pos[:, :4], AttentionLayout.block_causal(pos[:, :4], 4), cache, store_kv=True)
        buffers = [b.data_ptr() for b in cache._kbuf]
        for start in (4, 8):  # capacity (16 columns) suffices: the same storage must serve every pass
            blk = slice(start, start + 4)
            layout = AttentionLayout.block_causal(pos[:, blk], 4)
            for _ in range(3):
                a.hidden(ids[:, blk], pos[:, blk], layout, cache)
                assert cache.length == start and cache.keys[0].shape[2] == start
            a.hidden(ids[:, blk], pos[:, blk], layout, cache, store_kv=True)
            assert cache.length == start + 4
        assert [b.data_ptr() for b in cache._kbuf] == buffers
        assert all(k.data_ptr() == b for k, b in zip(cache.keys, buffers))
        out = a.forward(ids[:, 12:], pos[:, 12:], AttentionLayout.block_causal(pos[:, 12:], 4), cache)
    full = a.forward(ids, pos, AttentionLayout.block_causal(pos, 4))
    torch.testing.assert_close(out, full[:, 12:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_lean_rmsnorm_and_gated_product_match_autograd_of_the_formulas(dtype):
    """RMSNorm and silu(gate) * up keep less for backward (their own autograd functions): outputs are the formulas'
    bit for bit, and gradients equal autograd through the plain formulas (to fp32 / bf16 rounding)."""
    import torch.nn.functional as F

    from models.layers import RMSNorm, silu_mul

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    norm = RMSNorm(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g, dtype=torch.float64))
    w_out = torch.randn(3, 5, 16, generator=g, dtype=torch.float64).to(dtype)

    def plain_norm(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    out = norm(x)
    assert out.grad_fn is not None and "RMSNormFn" in type(out.grad_fn).__name__  # the lean path is the one taken
    expected = plain_norm(x, norm.weight)
    assert torch.equal(out, expected)
    got = torch.autograd.grad((out * w_out).sum(), (x, norm.weight))
    want = torch.autograd.grad((expected * w_out).sum(), (x, norm.weight))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():
        assert torch.equal(norm(x), expected)  # inference: the plain ops, no autograd function

    gate = (torch.randn(4, 24, generator=g, dtype=torch.float64) * 4).to(dtype).requires_grad_()
    up = torch.randn(4, 24, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w2 = torch.randn(4, 24, generator=g, dtype=torch.float64).to(dtype)
    prod, plain = silu_mul(gate, up), F.silu(gate) * up
    assert "SiluMulFn" in type(prod.grad_fn).__name__ and torch.equal(prod, plain)
    got = torch.autograd.grad((prod * w2).sum(), (gate, up))
    want = torch.autograd.grad((plain * w2).sum(), (gate, up))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_normalised_and_rotated_in_one_pass_equal_the_per_tensor_formulas(dtype):
    """``attention_heads`` runs Qwen3's q_norm / k_norm (different weights) and RoPE once over q and k side by
    side when no gradient is needed, and per tensor under autograd: both give q, k, v equal to the textbook
    per-tensor computation bit for bit, and the gradients of the projection output and of both norm weights equal
    autograd through it."""
    from models.layers import RMSNorm, attention_heads, rope_cos_sin

    g = torch.Generator().manual_seed(0)
    heads, kv, d, n, eps = 4, 2, 8, 5, 1e-6
    qkv = (torch.randn(2, n, (heads + 2 * kv) * d, generator=g, dtype=torch.float64) * 3).to(dtype)
    qkv.requires_grad_()
    q_norm, k_norm = RMSNorm(d, eps).to(dtype), RMSNorm(d, eps).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(d, generator=g, dtype=torch.float64))
        k_norm.weight.copy_(torch.randn(d, generator=g, dtype=torch.float64))
    cos, signed_sin = rope_cos_sin(torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 3, 9]]), d, 1e6, dtype)
    sin = torch.cat([-signed_sin[..., : d // 2], signed_sin[..., d // 2:]], -1)

    def textbook(x, w):  # [B, N, h, D] -> normalised, rotated, [B, h, N, D]
        x32 = x.float()
        x = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin).transpose(1, 2)

    q, k, v = qkv.split([heads * d, kv * d, kv * d], -1)
    want = (textbook(q.view(2, n, heads, d), q_norm.weight), textbook(k.view(2, n, kv, d), k_norm.weight),
            v.view(2, n, kv, d).transpose(1, 2))
    got = attention_heads(qkv, heads, kv, d, cos, signed_sin, (q_norm, k_norm))
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)
    w_out = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(dtype) for t in want]
    params = (qkv, q_norm.weight, k_norm.weight)
    grads = [torch.autograd.grad(sum((t * w).sum() for t, w in zip(ts, w_out)), params) for ts in (got, want)]
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():  # inference runs the same values
        for a, b in zip(attention_heads(qkv, heads, kv, d, cos, signed_sin, (q_norm, k_norm)), want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_training_forward_keeps_one_attention_mask_for_all_layers(tiny, model_base):
    """Dense masked attention under autograd keeps ONE additive [B, 1, N, N] mask for the backward pass (built once
    per forward), not a converted copy per layer; SDPA gives the same result with it as with the boolean mask."""
    import torch.nn.functional as F

    a = tiny(model_base)
    ids, pos = _block_inputs(12)
    layout = AttentionLayout.block_causal(pos, 4)
    shapes = []

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (12, 12) and t.dtype.is_floating_point:
            shapes.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a.forward(ids, pos, layout)
    assert len(shapes) >= 2 and len(set(shapes)) == 1  # saved by every layer (>= 2), one tensor
    mask = layout.dense_mask()
    additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    q = torch.randn(1, 2, 12, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                               F.scaled_dot_product_attention(q, q, q, attn_mask=additive), atol=0, rtol=0)


def test_rope_rotates_each_half_pair_by_position_times_frequency():
    """RoPE (rotate-half convention of Qwen / LLaDA): the pair (x[i], x[i + D/2]) at position p is rotated by the
    angle p * theta^(-2i/D); checked against that definition in float64, and bit for bit against the textbook
    x * cos + cat(-x2, x1) * sin with the unsigned sin."""
    from models.layers import apply_rope, rope_cos_sin

    g = torch.Generator().manual_seed(0)
    d, theta = 8, 10000.0
    pos = torch.tensor([[0, 1, 5, 37, 1000]])
    x = torch.randn(1, 5, 3, d, generator=g)  # [batch, positions, heads, D]
    cos, signed_sin = rope_cos_sin(pos, d, theta, torch.float32)
    out = apply_rope(x, cos, signed_sin)
    angle = pos[0, :, None, None].double() * theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    x1, x2 = x[..., : d // 2].double(), x[..., d // 2:].double()
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    sin = signed_sin.clone()
    sin[..., : d // 2] *= -1
    textbook = x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin
    assert torch.equal(out, textbook)


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="a torch build without oneDNN")


@needs_onednn
@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_packed_projections_match_the_modules_and_give_the_weights_back_bit_for_bit(tiny, model_base):
    """Inside ``packed_projections`` (CPU fp32, no autograd) each q/k/v, gate/up, output and head group is one
    pre-packed product: logits agree with the modules' to float32 rounding. The packed weights stand in for the
    layers' own, which are parked (empty) inside, except a weight shared with another module (a tied head); on
    exit, also on an exception, every parameter is back bit for bit, state_dict keys are untouched and nothing is
    left on the modules."""
    from models.layers import Projections, packed_projections, packing_applies

    a = tiny(model_base)
    assert packing_applies(a.model)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    keys = set(a.model.state_dict())
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    groups = [m for m in a.model.modules() if isinstance(m, Projections)]
    assert sum(len(m.projection_groups) for m in groups) >= 4 * a.model.config.num_hidden_layers
    uses = collections.Counter(id(p) for _, p in a.model.named_parameters(remove_duplicate=False))
    weights = [getattr(m, name).weight for m in groups for names in m.projection_groups.values() for name in names]
    shared = [w for w in weights if uses[id(w)] > 1]
    assert len(shared) == (1 if getattr(a.model.config, "tie_word_embeddings", False) else 0)  # the tied head
    parked = sum(w.numel() for w in weights if uses[id(w)] == 1)
    total = sum(p.numel() for p in a.model.parameters())
    with torch.no_grad():
        ref = a.model(ids).logits
        with packed_projections(a.model):  # not parked (a server's lifetime hold): the weights stay as they are
            torch.testing.assert_close(a.model(ids).logits, ref, atol=2e-5, rtol=1e-5)
            assert sum(p.numel() for p in a.model.parameters()) == total
        with packed_projections(a.model, park=True):
            assert all(set(m._packed) == set(m.projection_groups) for m in groups)
            torch.testing.assert_close(a.model(ids).logits, ref, atol=2e-5, rtol=1e-5)
            assert set(a.model.state_dict()) == keys
            assert all(w.numel() == 0 for w in weights if uses[id(w)] == 1) and all(w.numel() for w in shared)
            assert sum(p.numel() for p in a.model.parameters()) == total - parked  # one copy of them: packed
        for k, v in a.model.state_dict().items():
            assert torch.equal(v, before[k]), k
        with pytest.raises(RuntimeError), packed_projections(a.model, park=True):
            raise RuntimeError("boom")
        assert all(torch.equal(v, before[k]) for k, v in a.model.state_dict().items())
    assert all("_packed" not in m.__dict__ for m in groups)
    wrapped = groups[0]  # a group with a layer that is not a plain nn.Linear (e.g. an adapter) runs unpacked
    name = next(iter(wrapped.projection_groups.values()))[0]
    setattr(wrapped, name, torch.nn.Sequential(getattr(wrapped, name)))
    with packed_projections(a.model):
        assert set(wrapped._packed) == set(wrapped.projection_groups) - {next(iter(wrapped.projection_groups))}
        with torch.no_grad():
            torch.testing.assert_close(a.model(ids).logits, ref, atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(a.model(ids).logits, ref, atol=0, rtol=0)


@needs_onednn
def test_a_tied_head_is_packed_but_never_parked(tiny):
    """The LM head tied to the embeddings is one tensor for both: packing the head must leave it in place, since the
    embedding lookup still reads it while sampling."""
    from models.layers import packed_projections

    a = tiny("sdar")
    a.model.lm_head.weight = a.model.model.embed_tokens.weight
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    embed = a.model.model.embed_tokens.weight.clone()
    with torch.no_grad():
        ref = a.model(ids).logits
        with packed_projections(a.model, park=True):
            assert "logits" in a.model._packed and a.model.lm_head.weight.shape == embed.shape
            assert a.model.model.layers[0].mlp.up_proj.weight.numel() == 0  # untied weights are parked
            torch.testing.assert_close(a.model(ids).logits, ref, atol=2e-5, rtol=1e-5)
    assert a.model.lm_head.weight is a.model.model.embed_tokens.weight and torch.equal(embed, a.model.lm_head.weight)


@needs_onednn
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"),
                    reason="mappings are read from /proc (Linux): elsewhere nothing is parked")
def test_weights_mapped_from_their_checkpoint_are_never_parked(demo_tokenizer, tmp_path):
    """A model loaded memory-mapped shares one map with its whole file: parking one tensor would free nothing and
    its restored copy would add a copy, so mapped weights stay; read into the process's own memory
    (``map_weights=False``, what a LoRA policy on CPU does), they are parked."""
    from models.layers import packed_projections

    save_tiny_checkpoint(tmp_path / "m", "sdar", demo_tokenizer, size="test")
    for map_weights, parked in ((True, False), (False, True)):
        a = load_model({"pretrained_model": str(tmp_path / "m"), "model_base": "sdar"}, map_weights=map_weights)
        up = a.model.model.layers[0].mlp.up_proj
        before = up.weight.detach().clone()
        with torch.no_grad(), packed_projections(a.model, park=True):
            assert (up.weight.numel() == 0) == parked
        assert torch.equal(up.weight, before)


@needs_onednn
def test_packing_applies_only_to_whole_fp32_cpu_weights_that_fit_in_memory(tiny, monkeypatch):
    from models.layers import packing_applies

    a = tiny("sdar")
    assert packing_applies(a.model)
    next(a.model.parameters()).ds_id = 0  # a ZeRO-3 partition: whole only inside a gather, so never packed
    assert not packing_applies(a.model)
    assert not packing_applies(tiny("dream").model.to(torch.bfloat16))
    b = tiny("llada")
    params = sum(p.numel() * 4 for p in b.model.parameters())
    monkeypatch.setattr("models.layers._available_memory_bytes", lambda: 4 * params - 1)  # the copy must fit 4x
    assert not packing_applies(b.model)
    monkeypatch.setattr("models.layers._available_memory_bytes", lambda: 4 * params)
    assert packing_applies(b.model)


@needs_onednn
def test_sampling_runs_the_packed_products(tiny, monkeypatch):
    from models.layers import PackedLinear
    from sample.generate import generate
    from sample.params import SamplingParams

    calls = []
    real = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, x, *a: calls.append(x.shape) or real(self, x, *a))
    a = tiny("sdar", block_size=4)
    out = generate(a, [[5, 6, 7]], SamplingParams(max_tokens=8, block_size=4, denoising_steps=2, seed=0,
                                                  ignore_eos=True), progress=False)
    assert len(out[0].response_ids) == 8
    # qkv, out, gate_up, down in every layer of every forward; the head once per denoising forward
    assert len(calls) == 4 * a.model.config.num_hidden_layers * out.stats.forwards + out.stats.denoise_forwards


@pytest.mark.parametrize(("caps", "onednn", "native"), [
    ({"architecture": "x86_64", "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}, True, False),  # Ice Lake
    ({"architecture": "x86_64", "avx512_f": True, "avx512_bf16": True, "amx_bf16": False}, True, True),  # Zen 4
    ({"architecture": "x86_64", "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}, True, True),  # Sapphire R.
    ({"architecture": "x86_64", "avx2": True}, False, False),  # AVX2 only
    ({"architecture": "aarch64"}, True, True),  # elsewhere: oneDNN's own answer
    ({"architecture": "aarch64"}, False, False),
])
def test_native_bf16_needs_the_cpus_bf16_instructions(caps, onednn, native, monkeypatch):
    """oneDNN accepts bf16 on any AVX-512 CPU, but without AVX512-BF16 / AMX it converts around each product and runs
    slower than fp32 (4.4x on an Ice Lake Xeon): only the instructions count as native on x86."""
    from models import layers

    monkeypatch.delenv("DLLM_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn, raising=False)
    layers.native_cpu_bf16.cache_clear()
    try:
        assert layers.native_cpu_bf16() is native
    finally:
        layers.native_cpu_bf16.cache_clear()


@pytest.mark.parametrize("forced", ["0", "1", "yes"])
def test_dllm_cpu_bf16_decides_instead_of_the_cpu(forced, monkeypatch):
    """``DLLM_CPU_BF16=1`` forces bf16 on an AVX2-only CPU, ``0`` forbids it on an AMX one; another value: one line."""
    from models import layers

    caps = {"architecture": "x86_64", "avx512_bf16": forced == "0", "amx_bf16": forced == "0"}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setenv("DLLM_CPU_BF16", forced)
    layers.native_cpu_bf16.cache_clear()
    try:
        if forced == "yes":
            with pytest.raises(UserError, match=r"^DLLM_CPU_BF16='yes': expected 1 .* or 0"):
                layers.native_cpu_bf16()
        else:
            assert layers.native_cpu_bf16() is (forced == "1")
    finally:
        layers.native_cpu_bf16.cache_clear()


@pytest.mark.usefixtures("bf16_products")
@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_bf16_autocast_packs_bf16_copies_and_leaves_the_fp32_weights(tiny, model_base):
    """Under CPU bf16 autocast ``packed_projections`` packs bf16 copies of the fp32 weights (parked never: a copy
    cannot give the fp32 weights back): every group's product runs in bf16, as ``F.linear`` under autocast does, so
    the logits agree with the unpacked autocast forward to bf16 rounding and differ from fp32's by about as much;
    the fp32 parameters are untouched, bit for bit."""
    from models.layers import Projections, packed_projections

    a = tiny(model_base)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    groups = [m for m in a.model.modules() if isinstance(m, Projections)]
    with torch.no_grad():
        fp32 = a.model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = a.model(ids).logits.float()
            with packed_projections(a.model, park=True):
                products = [p for m in groups for p in m._packed.values()]
                assert products and all(p.dtype == torch.bfloat16 and not p.exact for p in products)
                assert all(p.dtype == torch.float32 and p.numel() for p in a.model.parameters())  # none parked
                packed = a.model(ids).logits
    assert packed.dtype == torch.bfloat16
    scale = fp32.abs().max()
    assert (ref - fp32).abs().max() > 1e-4 * scale  # bf16 rounding is visible at all
    torch.testing.assert_close(packed.float(), ref, atol=0.03 * scale, rtol=0)
    assert all(torch.equal(v, before[k]) for k, v in a.model.state_dict().items())
    assert all("_packed" not in m.__dict__ for m in groups)


@pytest.mark.usefixtures("bf16_products")
def test_sampling_with_compute_dtype_bf16_runs_bf16_products(tiny, monkeypatch):
    """``compute_dtype="bfloat16"``: the sampler runs under bf16 autocast, every packed product (the same calls as
    fp32 sampling) takes bf16 inputs, and the fp32 model is as it was."""
    from models.layers import PackedLinear
    from sample.generate import generate
    from sample.params import SamplingParams

    dtypes = []
    real = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, x, *a: dtypes.append(self.dtype) or real(self, x, *a))
    a = tiny("sdar", block_size=4)
    before = {k: v.clone() for k, v in a.model.state_dict().items()}
    params = SamplingParams(max_tokens=8, block_size=4, denoising_steps=2, seed=0, ignore_eos=True,
                            compute_dtype="bfloat16")
    out = generate(a, [[5, 6, 7], [8, 9]], params, progress=False)
    assert [len(t.response_ids) for t in out] == [8, 8]
    assert all(lp <= 0 for t in out for lp in t.logprobs)
    assert set(dtypes) == {torch.bfloat16}
    assert len(dtypes) == 4 * a.model.config.num_hidden_layers * out.stats.forwards + out.stats.denoise_forwards
    assert all(torch.equal(v, before[k]) for k, v in a.model.state_dict().items())
    with pytest.raises(SettingError, match="compute_dtype"):
        SamplingParams(compute_dtype="float16")


def test_grouped_query_attention_equals_sdpa_with_gqa():
    """Decode attention (CPU and CUDA) folds the query heads sharing a K/V head into the query axis: the same result as
    SDPA's ``enable_gqa`` (to float32 rounding; on CPU it is bit-identical) for any visibility pattern, with the
    layout's mask repeated per head group."""
    import torch.nn.functional as F

    from models.common import _grouped_query_attention, mask_per_group

    g = torch.Generator().manual_seed(0)
    for b, heads, kv, n, keys in ((3, 8, 2, 4, 21), (1, 6, 3, 8, 40), (2, 4, 1, 1, 9)):
        q, k, v = (torch.randn(b, h, t, 16, generator=g) for h, t in ((heads, n), (kv, keys), (kv, keys)))
        visible = torch.rand(b, 1, n, keys, generator=g) < 0.6
        visible[..., -1] = True  # every query sees at least one key
        mask = torch.zeros(b, 1, n, keys).masked_fill_(~visible, float("-inf"))
        torch.testing.assert_close(_grouped_query_attention(q, k, v, mask_per_group(mask, heads // kv)),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                                   atol=1e-6, rtol=1e-6)


def test_query_heads_fold_where_measured(monkeypatch):
    """``FOLD_QUERY_HEADS``: CPU folds with or without autograd; CUDA folds the sampler's no-grad forwards (what the
    H100 measured) and keeps ``enable_gqa`` under autograd; a device set False never folds; others fold."""
    from types import SimpleNamespace

    from models import common

    def queries(kind: str) -> SimpleNamespace:  # the two attributes the choice reads, without the device
        return SimpleNamespace(device=SimpleNamespace(type=kind), is_cuda=kind == "cuda")

    with torch.no_grad():
        assert [common.folds_query_heads(queries(k)) for k in ("cpu", "cuda", "mps")] == [True, True, True]
    with torch.enable_grad():
        assert [common.folds_query_heads(queries(k)) for k in ("cpu", "cuda", "mps")] == [True, False, True]
    monkeypatch.setitem(common.FOLD_QUERY_HEADS, "cuda", False)
    with torch.no_grad():
        assert not common.folds_query_heads(queries("cuda"))


def test_grouped_query_attention_takes_an_output_that_is_not_a_view(monkeypatch):
    """CUDA's fused kernels return the folded output [B, Hkv, G*Q, D] with [B, G*Q, Hkv, D] strides, which cannot be
    viewed as [B, H, Q, D] (an H100 run failed six GPU tests on it); the unfolding copies where it must."""
    import torch.nn.functional as F

    from models import common

    sdpa = F.scaled_dot_product_attention

    def kernel_layout(q, k, v, attn_mask=None):  # the same values, laid out as the CUDA kernels return them
        return sdpa(q, k, v, attn_mask=attn_mask).transpose(1, 2).contiguous().transpose(1, 2)

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, t, 8, generator=g) for h, t in ((8, 4), (2, 12), (2, 12)))
    expected = common._grouped_query_attention(q, k, v, None)
    monkeypatch.setattr(common.F, "scaled_dot_product_attention", kernel_layout)
    torch.testing.assert_close(common._grouped_query_attention(q, k, v, None), expected, atol=0, rtol=0)


@pytest.mark.parametrize("model_base", FAMILY_BASES)
def test_attention_without_a_mask_only_where_everything_is_visible(tiny, model_base, monkeypatch):
    """CPU attention skips the mask where every query sees every key: the same logits as with the mask built;
    a padded column or a second block still gets its mask."""
    import models.common as common

    a = tiny(model_base, block_size=4)
    ids, pos = _block_inputs(8)
    full_attention = a.attention == "full"
    layouts = {
        "visible": AttentionLayout.full(torch.ones(1, 8, dtype=torch.bool)) if full_attention
        else AttentionLayout.block_causal(pos[:, 4:], 4),
        "padded": AttentionLayout.full(torch.arange(8)[None] < 6),
        "two blocks": AttentionLayout.block_causal(pos, 4),
    }
    assert [common._all_visible(layout) for layout in layouts.values()] == [True, False, False]
    cols = slice(0, 8) if full_attention else slice(4, 8)
    with torch.no_grad():
        skipped = a.forward(ids[:, cols], pos[:, cols], layouts["visible"])
        monkeypatch.setattr(common, "_all_visible", lambda layout, cache=None: False)
        built = a.forward(ids[:, cols], pos[:, cols], AttentionLayout(*(getattr(layouts["visible"], f)
                                                                         for f in ("block", "copy", "valid"))))
    torch.testing.assert_close(skipped, built, atol=1e-5, rtol=1e-5)


def test_cached_forward_builds_one_grouped_mask_for_all_layers(tiny, monkeypatch):
    """Cached attention on CPU: one grouped mask (G*Q x keys) for every layer; none at all when every query sees
    every key (one row decoding one block over a fully valid cache). Both equal the uncached forward."""
    import models.common as common

    a = tiny("sdar", block_size=4)
    assert a.model.config.num_attention_heads > a.model.config.num_key_value_heads  # GQA
    masks = []
    real = common._grouped_query_attention
    monkeypatch.setattr(common, "_grouped_query_attention", lambda q, k, v, m: masks.append(m) or real(q, k, v, m))
    ids, pos = _block_inputs(8)
    ids, pos = ids.expand(2, -1).clone(), pos.expand(2, -1).clone()
    ids[1] = ids[1].flip(0)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 0] = False  # row 1: a padded prompt column, never visible
    groups = a.model.config.num_attention_heads // a.model.config.num_key_value_heads
    layers = a.model.config.num_hidden_layers
    for rows, expect_mask in ((slice(0, 1), False), (slice(0, 2), True)):
        masks.clear()
        cache = a.new_cache()
        r_ids, r_pos, r_valid = ids[rows], pos[rows], valid[rows]
        with torch.no_grad():
            prefix = AttentionLayout.block_causal(r_pos[:, :4], 4, r_valid[:, :4])
            a.hidden(r_ids[:, :4], r_pos[:, :4], prefix, cache, store_kv=True)
            assert masks == []  # nothing cached yet: plain SDPA
            out = a.forward(r_ids[:, 4:], r_pos[:, 4:], AttentionLayout.block_causal(r_pos[:, 4:], 4), cache)
            full = a.forward(r_ids, r_pos, AttentionLayout.block_causal(r_pos, 4, r_valid))
        assert len(masks) == layers and all(m is masks[0] for m in masks)
        if expect_mask:
            assert masks[0].shape == (2, 1, groups * 4, 8)
        else:
            assert masks[0] is None
        torch.testing.assert_close(out, full[:, 4:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base", ["sdar", "llada2"])
def test_a_left_padded_batch_through_the_model_api_with_a_cache_equals_the_uncached_forward(base, demo_tokenizer):
    # transformers-style calls (attention_mask + past_key_values, no position ids): a row goes on from its real
    # cached tokens, not from the cache's width with the padding
    from models.tiny import build_tiny

    a = build_tiny(base, demo_tokenizer, block_size=4)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([torch.full((2, 4), a.pad_id), ids], 1)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :4] = 0  # row 1 left-padded by a block; row 0 starts with 4 real tokens
    padded[0, :4] = ids[0, :4]
    with torch.no_grad():
        whole = a.model(padded, attention_mask=mask).logits
        cache = a.new_cache()
        a.model(padded[:, :12], attention_mask=mask[:, :12], past_key_values=cache, store_kv=True)
        rest = a.model(padded[:, 12:], attention_mask=mask[:, 12:], past_key_values=cache).logits
    torch.testing.assert_close(rest, whole[:, 12:], atol=1e-4, rtol=1e-4)

"""The llada2 family (LLaDA2.0 / LLaDA2.1, models/llada2/): partial RoPE, the router with shared experts, logits and
greedy tokens against the authors' code, save / load, config refusals, an SFT job (the public checkpoints' names:
tests/test_real_checkpoints.py).

The golden numbers in tests/fixtures/llada2_golden.json were computed by the authors' modeling file
(yjyddq/DARE @83ae8a30 models/LLaDA2.0-mini/modeling_llada2_moe.py; run outside this repository) on the model that
``seeded_model`` builds: logits under the block-causal mask its generate function builds (as an additive 0 / -inf
mask), and the tokens of its ``generate`` (greedy, threshold decoding; its sampling helper taken from the
LLaDA2.1 file, whose temperature-0 branch is the argmax: the 2.0 helper samples at temperature 1 whatever it is
given).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from models.common import AttentionLayout
from models.layers import apply_rope, rope_cos_sin
from models.llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
from models.llada2.modeling_llada2_moe import LLaDA2SparseMoeBlock
from models.moe import naive_expert_compute
from models.registry import Adapter, load_model, make_adapter
from tests.golden import fill_seeded

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = FIXTURES / "llada2_golden.json"
# A tiny LLaDA2 with every feature of the real one: GQA, partial rotary (4 of 8 dims), a dense first layer, 8 experts
# in 4 groups (top-2 from the best 2 groups), one shared expert, routed scaling 2.5.
TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, num_experts=8, num_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
            routed_scaling_factor=2.5, moe_intermediate_size=12, first_k_dense_replace=1, partial_rotary_factor=0.5,
            rope_theta=600000.0, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)


def seeded_model(vocab_size: int, mask_token_id: int, eos_token_id: int, block_size: int = 4) -> LLaDA2MoeModelLM:
    """The golden model (tests/golden.py)."""
    cfg = LLaDA2MoeConfig(vocab_size=vocab_size, mask_token_id=mask_token_id, eos_token_id=eos_token_id,
                          pad_token_id=eos_token_id, block_size=block_size, **TINY)
    return fill_seeded(LLaDA2MoeModelLM(cfg).eval(), 1234, weight=0.1, bias=0.1, head=0.5)


def golden_ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 14), generator=torch.Generator().manual_seed(7))


# ------------------------------------------------------------------------------------------ RoPE


def test_partial_rotary_rotates_the_leading_dimensions_only():
    x = torch.arange(1.0, 9.0).view(1, 1, 1, 8)  # [B, N, heads, D]: one head of 8 dims
    pos = torch.tensor([[3]])
    cos, sin = rope_cos_sin(pos, 4, 10000.0, torch.float32)  # rotate 4 of 8 dims
    out = apply_rope(x, cos, sin).flatten().tolist()
    # rotate_half within the first four (x1 = [1, 2], x2 = [3, 4]); frequencies 1 and 10000^-0.5 at position 3
    a0, a1 = 3 * 1.0, 3 * 10000 ** -0.5
    expected = [1 * math.cos(a0) - 3 * math.sin(a0), 2 * math.cos(a1) - 4 * math.sin(a1),
                3 * math.cos(a0) + 1 * math.sin(a0), 4 * math.cos(a1) + 2 * math.sin(a1), 5, 6, 7, 8]
    assert out == pytest.approx(expected, abs=1e-5)


# ------------------------------------------------------------------------------------------ router + experts


def test_sparse_block_is_routed_experts_plus_the_shared_expert():
    torch.manual_seed(0)
    cfg = LLaDA2MoeConfig(vocab_size=64, **TINY)
    block = LLaDA2SparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.expert_bias.copy_(torch.randn(8) * 0.1)
    x = torch.randn(2, 5, 32)
    flat = x.reshape(-1, 32)
    _, weights, index = block.route(flat)
    expected = naive_expert_compute(flat, weights, index, block.experts) + block.shared_experts(flat)
    torch.testing.assert_close(block(x).reshape(-1, 32), expected, rtol=0, atol=1e-6)
    # the LLaDA2.0-mini rule: renormalised over the chosen experts, then scaled by routed_scaling_factor
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), 2.5))


def test_expert_bias_chooses_experts_but_does_not_weigh_them():
    cfg = LLaDA2MoeConfig(vocab_size=64, **TINY)
    block = LLaDA2SparseMoeBlock(cfg)
    flat = torch.randn(6, 32)
    logits, _, _ = block.route(flat)
    with torch.no_grad():
        block.gate.expert_bias.zero_()
        block.gate.expert_bias[[1, 6]] = 10.0  # experts 1 and 6 (groups 0 and 3) win every token's choice
    _, weights, index = block.route(flat)
    assert index.sort(-1).values.tolist() == [[1, 6]] * 6
    scores = torch.sigmoid(logits)[:, [1, 6]]
    by_index = torch.where(index == 1, scores[:, :1], scores[:, 1:])  # each slot's unbiased score
    torch.testing.assert_close(weights, 2.5 * by_index / scores.sum(-1, keepdim=True))


def test_expert_bias_is_a_buffer_that_training_leaves_alone(demo_tokenizer):
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id).train()
    names = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith("expert_bias") for n in names)
    before = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(before) == 2  # layers 1 and 2 are sparse, layer 0 dense (first_k_dense_replace = 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(golden_ids(len(demo_tokenizer))).logits.logsumexp(-1).mean().backward()
    opt.step()
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers() if n in before)
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0  # the router itself does train


# ------------------------------------------------------------------------------------------ against the authors' code


def test_logits_equal_the_authors_code_under_the_block_causal_mask(demo_tokenizer):
    golden = json.loads(GOLDEN.read_text())
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    ids = golden_ids(len(demo_tokenizer))
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, position_ids=pos, layout=AttentionLayout.block_causal(pos, 4)).logits
    expected = torch.tensor(golden["logits"])  # [2, 14, 24]: the first 24 vocabulary entries
    torch.testing.assert_close(logits[..., :24], expected, rtol=0, atol=1e-5)
    assert golden["logits_abs_max"] > 1.0  # the numbers are not all near zero


def test_greedy_tokens_equal_the_authors_generate(demo_tokenizer):
    from sample.generate import generate
    from sample.params import SamplingParams

    golden = json.loads(GOLDEN.read_text())
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    adapter = make_adapter(model, demo_tokenizer, "llada2")
    for case in golden["generate"]:
        for cache in ("prefix", "none"):
            params = SamplingParams(max_tokens=case["gen_length"], temperature=0.0,
                                    remasking_strategy="low_confidence_dynamic", dynamic_threshold=case["threshold"],
                                    block_size=4, denoising_steps=4, stop_token_ids=[], cache=cache)
            tokens = generate(adapter, [case["prompt"]], params, progress=False)[0].response_ids
            # theirs stops after the first EOS; ours goes on to the budget when told not to stop (stop ids [])
            assert tokens[:len(case["tokens"])] == case["tokens"], (case, cache)
    assert sum(len(c["tokens"]) for c in golden["generate"]) >= 60


# ------------------------------------------------------------------------------------------ checkpoints


def test_save_and_load_keep_the_expert_bias_and_the_logits(tmp_path, demo_tokenizer):
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    model.save_pretrained(tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as fh:
        assert "model.layers.1.mlp.gate.expert_bias" in set(fh.keys())
    loaded = load_model({"pretrained_model": str(tmp_path), "model_base": "llada2"})
    assert type(loaded.model) is LLaDA2MoeModelLM and loaded.block_size == 4 and not loaded.shift_logits
    torch.testing.assert_close(loaded.model.model.layers[2].mlp.gate.expert_bias,
                               model.model.layers[2].mlp.gate.expert_bias, rtol=0, atol=0)
    ids = golden_ids(len(demo_tokenizer))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("option,message", [
    ({"norm_head": True}, "norm_head"), ({"use_qkv_bias": True}, "use_qkv_bias"),
    ({"output_router_logits": True}, "auxiliary loss"), ({"score_function": "softmax"}, "score_function"),
    ({"rotary_dim": 32}, "rotary_dim 32"), ({"n_group": 3}, "divisible by n_group")])
def test_options_we_do_not_implement_are_refused(option, message):
    with pytest.raises(ValueError, match=message):
        LLaDA2MoeConfig(**{**TINY, **option})


def test_token_editing_equals_the_authors_generate(demo_tokenizer):
    """LLaDA2.1's generate (its 0/1 block mask made additive) on the golden model: thresholds, editing thresholds
    and post-step budgets (0, 1, 3, 4, 16) whose runs rewrite hundreds of tokens."""
    from sample.generate import generate
    from sample.params import SamplingParams

    golden = json.loads(GOLDEN.read_text())
    model = seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id)
    adapter = make_adapter(model, demo_tokenizer, "llada2")
    rewrites = 0
    for case in golden["editing"]:
        params = SamplingParams(max_tokens=case["gen_length"], temperature=0.0, stop_token_ids=[],
                                remasking_strategy="low_confidence_dynamic", dynamic_threshold=case["threshold"],
                                block_size=4, denoising_steps=4, editing_threshold=case["editing_threshold"],
                                max_post_steps=case["max_post_steps"])
        for cache in ("prefix", "none"):
            traj = generate(adapter, [case["prompt"]], params, progress=False)[0]
            assert traj.response_ids[:len(case["tokens"])] == case["tokens"], (case, cache)
        rewrites += sum(traj.rewrites)
    assert rewrites > 100


class _Scripted(Adapter):
    """Each LM-head call returns the next scripted rows: per candidate position (in position order) the token the
    model prefers and its probability (the rest spread evenly)."""

    script: list = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self.script.pop(0)
        assert len(rows) == hidden.shape[0], "the sampler asked about other positions than scripted"
        vocab = self.model.config.vocab_size
        out = torch.empty(len(rows), vocab)
        for i, (token, p) in enumerate(rows):
            out[i] = math.log((1 - p) / (vocab - 1))
            out[i, token] = math.log(p)
        return out


def test_a_hand_made_editing_case_records_each_token_at_its_last_write(demo_tokenizer):
    from dataclasses import fields

    from core.schema import replace
    from sample.generate import generate
    from sample.params import SamplingParams

    base = make_adapter(seeded_model(len(demo_tokenizer), demo_tokenizer.mask_token_id, demo_tokenizer.eos_token_id),
                        demo_tokenizer, "llada2")
    adapter = _Scripted(**{f.name: getattr(base, f.name) for f in fields(base)})
    A, B, C, D, E, F, low = 30, 31, 32, 33, 34, 35, 0.05
    adapter.script = [
        [(A, 0.95), (B, low), (C, low), (D, low)],  # step 1: four masks; only position 0 passes 0.9
        [(E, 0.6), (B, 0.95), (C, low), (D, low)],  # step 2: position 0 (decoded) -> E at 0.6 > 0.5: rewritten
        [(E, 0.9), (B, 0.9), (C, 0.95), (D, low)],  # step 3: same tokens at 0 and 1: no rewrite; position 2 unmasked
        [(A, 0.4), (B, 0.9), (C, 0.9), (D, low)],  # step 4: A at 0.4 < 0.5 stays E; the last mask by top-1
        [(E, 0.9), (F, 0.7), (C, 0.9), (D, 0.9)],  # step 5, first post step: position 1 -> F
        [(E, 0.9), (F, 0.9), (C, 0.9), (D, 0.9)],  # step 6: nothing changes: the block is complete
    ]
    params = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[], block_size=4, denoising_steps=4,
                            remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.9,
                            editing_threshold=0.5, max_post_steps=3, cache="none")
    out = generate(adapter, [[40, 41, 42, 43]], params, progress=False)
    traj = out[0]
    assert traj.response_ids == [E, F, C, D]
    assert traj.step_map == [2, 5, 3, 4] and traj.rewrites == [1, 1, 0, 0]
    assert traj.logprobs == pytest.approx([math.log(0.6), math.log(0.7), math.log(0.95), math.log(low)], abs=1e-5)
    assert adapter.script == [] and out.stats.forwards == 6

    # max_post_steps bounds the edits after the last mask: with 1 the block ends after step 5's edit
    adapter.script = [[(A, 0.95), (B, 0.95), (C, 0.95), (D, 0.95)], [(E, 0.8), (B, 0.9), (C, 0.9), (D, 0.9)]]
    traj = generate(adapter, [[40, 41, 42, 43]], replace(params, max_post_steps=1), progress=False)[0]
    assert traj.response_ids == [E, B, C, D] and traj.step_map == [2, 1, 1, 1] and traj.rewrites == [1, 0, 0, 0]

    # TraceRL's rows treat a rewritten token as masked until its last write: not the sampler's states, so the view
    # is inexact (old log-probs recomputed); the same trajectory without rewrites is exact
    from train.settings import ViewConfig
    from train.traits import ModelTraits
    from train.views import build_view

    traits = ModelTraits.from_adapter(base)
    for rewrites, exact in (([1, 0, 0, 0], False), ([], True)):
        traj.rewrites, traj.sample_id = rewrites, "s"
        batch = build_view([traj], {"s": 1.0}, ViewConfig(method="tracerl"), traits)
        assert batch.exact is exact and sorted(batch.labels.tolist()) == sorted(traj.response_ids)


def test_token_editing_is_refused_for_full_attention_models(tiny):
    from core.schema import SettingError
    from sample.params import SamplingParams

    with pytest.raises(SettingError, match="token editing .* is for block models"):
        SamplingParams(editing_threshold=0.5).check_for(tiny("llada"))
    SamplingParams(editing_threshold=0.5).check_for(tiny("llada2"))  # block models accept it

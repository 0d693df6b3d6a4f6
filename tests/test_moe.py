"""The shared MoE block (models/moe.py) and the sdar_moe family: routing, grouped compute, parity with
transformers' Qwen3-MoE, checkpoint round trip."""

from __future__ import annotations

import pytest
import torch

from models.common import AttentionLayout
from models.moe import (
    FusedExperts,
    SparseMoeBlock,
    grouped_mm_runs,
    is_moe_layer,
    load_balancing_loss,
    naive_expert_compute,
    softmax_topk_routing,
)
from models.registry import load_model
from models.sdar_moe import SDARMoeConfig, SDARMoeForCausalLM


def test_softmax_top2_routing_renormalised_and_not():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.35, 0.05, 0.15, 0.45]]))  # softmax = these probs
    w, idx = softmax_topk_routing(logits, 2, normalize=False)
    assert idx.tolist() == [[1, 2], [3, 0]]
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.3], [0.45, 0.35]]), atol=1e-6, rtol=0)
    w, idx = softmax_topk_routing(logits, 2, normalize=True)
    torch.testing.assert_close(w, torch.tensor([[0.5 / 0.8, 0.3 / 0.8], [0.45 / 0.8, 0.35 / 0.8]]), atol=1e-6,
                               rtol=0)


def _experts(n: int, hidden: int, inner: int, seed: int = 0) -> FusedExperts:
    torch.manual_seed(seed)
    experts = FusedExperts(n, hidden, inner)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts


@pytest.mark.parametrize("hidden,inner,grouped", [(16, 24, True), (6, 10, False)])
def test_grouped_compute_equals_every_expert_on_every_token(hidden, inner, grouped):
    """Grouped product (rows 16-byte aligned) and the per-expert split (not aligned): values and gradients."""
    experts = _experts(6, hidden, inner)
    x = torch.randn(37, hidden, requires_grad=True)
    w, idx = softmax_topk_routing(torch.randn(37, 6), 3, normalize=True)
    assert grouped_mm_runs(x, experts.gate_up_proj) == grouped
    out = experts(x, w, idx)
    ref = naive_expert_compute(x, w, idx, experts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    probe = torch.randn_like(out)
    got = torch.autograd.grad((out * probe).sum(), [x, *experts.parameters()])
    want = torch.autograd.grad((ref * probe).sum(), [x, *experts.parameters()])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=0)


def test_grouped_compute_with_an_unused_expert_and_no_tokens():
    experts = _experts(4, 8, 8)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 0], [0, 1]])  # experts 2 and 3 get no token
    w = torch.full((3, 2), 0.5)
    torch.testing.assert_close(experts(x, w, idx), naive_expert_compute(x, w, idx, experts), atol=1e-6, rtol=0)
    assert experts(x[:0], w[:0], idx[:0]).shape == (0, 8)


def test_the_moe_forward_reads_nothing_back_to_the_host():
    """On the meta device a tensor has no data: a host read (``.tolist()``, ``.item()``, a data-dependent shape)
    fails there. The block's forward runs there in bf16, the grouped product's CUDA dtype: on CUDA it never waits
    for the device. The per-expert split (rows not 16-byte aligned) does read the counts, and fails."""
    cfg = SDARMoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        block = SparseMoeBlock(cfg).to(torch.bfloat16)
        out = block(torch.randn(2, 5, 32, dtype=torch.bfloat16))
        assert out.shape == (2, 5, 32) and out.device.type == "meta"
        unaligned = SparseMoeBlock(SDARMoeConfig(hidden_size=32, moe_intermediate_size=12, num_experts=8,
                                                 num_experts_per_tok=2)).to(torch.bfloat16)
        with pytest.raises((RuntimeError, NotImplementedError)):
            unaligned(torch.randn(2, 5, 32, dtype=torch.bfloat16))


def test_experts_are_fused_in_memory_and_per_expert_on_disk(tmp_path):
    from safetensors.torch import load_file

    cfg = SDARMoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=8, block_size=4, mask_token_id=63)
    torch.manual_seed(0)
    model = SDARMoeForCausalLM(cfg)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 16, 16)  # [E, 2I, H]
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    from transformers.core_model_loading import revert_weight_conversion

    expected = revert_weight_conversion(model, model.state_dict())  # what save_pretrained writes
    assert sorted(on_disk) == sorted(expected)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in on_disk and not any("gate_up" in k for k in on_disk)
    assert all(torch.equal(on_disk[k], expected[k]) for k in on_disk)
    gate, up, down = model.model.layers[1].mlp.experts.expert(3)
    assert torch.equal(on_disk["model.layers.1.mlp.experts.3.gate_proj.weight"], gate)
    assert torch.equal(on_disk["model.layers.1.mlp.experts.3.up_proj.weight"], up)
    assert torch.equal(on_disk["model.layers.1.mlp.experts.3.down_proj.weight"], down)
    loaded = SDARMoeForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_load_balancing_loss_by_hand():
    # two tokens, two experts, top-1: both go to expert 0; mean probs (0.75, 0.25) -> 2 * (1 * 0.75 + 0 * 0.25)
    logits = torch.log(torch.tensor([[0.9, 0.1], [0.6, 0.4]]))
    assert float(load_balancing_loss([logits], 1, 2)) == pytest.approx(1.5, abs=1e-6)


def test_load_balancing_loss_is_transformers_over_every_layer_at_top_k():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(10, 8, generator=g) * 2 for _ in range(3)]  # 3 sparse layers, 10 tokens, 8 experts
    ours = float(load_balancing_loss(layers, 4, 8))
    assert ours == pytest.approx(float(load_balancing_loss_func(tuple(layers), 8, 4)), rel=1e-6)
    # pooled over the layers, not a mean of per-layer losses; a balanced router scores top_k, not 1
    per_layer = sum(float(load_balancing_loss([x], 4, 8)) for x in layers) / 3
    assert abs(ours - per_layer) > 1e-3
    assert float(load_balancing_loss([torch.zeros(8, 8)], 4, 8)) == pytest.approx(4.0)


def test_sparse_layer_rule():
    cfg = SDARMoeConfig(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_moe_layer(cfg, i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ValueError, match="exceeds num_experts"):
        SDARMoeConfig(num_experts=4, num_experts_per_tok=8)


def _tiny_pair():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, attn_implementation="eager")).eval()
    ours = SDARMoeForCausalLM(SDARMoeConfig(**common, block_size=4, mask_token_id=96)).eval()
    return ref, ours


def test_logits_equal_transformers_qwen3_moe_with_the_same_state_dict(tmp_path):
    from safetensors.torch import load_file

    ref, ours = _tiny_pair()
    # both fuse experts in memory (the same layout) and write per-expert tensors on disk (the same names)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    ref.save_pretrained(tmp_path / "ref")
    ours.save_pretrained(tmp_path / "ours")
    ref_sd = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert sorted(load_file(str(tmp_path / "ours" / "model.safetensors"))) == sorted(ref_sd)
    assert "model.layers.1.mlp.gate_proj.weight" in ref_sd  # mlp_only_layers: dense layer 1 on both sides
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in ref_sd
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = ours.lm_logits(ours.model(ids, position_ids=pos,
                                        layout=AttentionLayout.block_causal(pos, 1)).last_hidden_state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_save_and_load_round_trip_keeps_keys_and_logits(tmp_path, tiny, demo_tokenizer):
    from safetensors.torch import load_file

    a = tiny("sdar_moe", seed=2)
    a.model.save_pretrained(tmp_path)
    demo_tokenizer.save_pretrained(tmp_path)
    b = load_model({"pretrained_model": str(tmp_path), "model_base": "sdar_moe"})
    assert type(b.model) is SDARMoeForCausalLM and b.model.config.model_type == "sdar_moe"
    assert sorted(b.model.state_dict()) == sorted(a.model.state_dict())
    assert any(k.endswith("mlp.experts.7.down_proj.weight") for k in load_file(str(tmp_path / "model.safetensors")))
    ids = torch.tensor([demo_tokenizer.encode("The quick brown fox")])
    pos = torch.arange(ids.shape[1])[None]
    layout = AttentionLayout.block_causal(pos, 4)
    with torch.no_grad():
        torch.testing.assert_close(b.forward(ids, pos, layout), a.forward(ids, pos, layout), atol=0, rtol=0)
    assert b.mask_id == demo_tokenizer.mask_token_id and b.attention == "block"


def test_router_aux_loss_only_when_asked(tiny):
    a = tiny("sdar_moe", seed=0)
    ids = torch.arange(8)[None]
    pos = torch.arange(8)[None]
    a.forward(ids, pos, AttentionLayout.block_causal(pos, 4))
    assert a.model.model.router_aux_loss() is None
    b = tiny("sdar_moe", seed=0, output_router_logits=True)
    b.forward(ids, pos, AttentionLayout.block_causal(pos, 4))
    loss = b.model.model.router_aux_loss()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    blocks = b.model.model.moe_blocks()
    expected = load_balancing_loss_func(tuple(blk.last_router_logits for blk in blocks), blocks[0].num_experts,
                                        blocks[0].top_k)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)


def test_load_balancing_loss_leaves_padding_out_as_transformers_attention_mask():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(1)
    layers = [torch.randn(2 * 5, 8, generator=g) * 2 for _ in range(2)]  # 2 layers, 2 rows of 5 tokens
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    ours = float(load_balancing_loss(layers, 2, 8, mask.reshape(-1).bool()))
    assert ours == pytest.approx(float(load_balancing_loss_func(tuple(layers), 8, 2, mask)), rel=1e-6)
    assert abs(ours - float(load_balancing_loss(layers, 2, 8))) > 1e-3  # the padding would have counted


def test_router_aux_loss_of_a_row_does_not_depend_on_its_batchs_padding(tiny):
    b = tiny("sdar_moe", seed=0, output_router_logits=True)
    ids = torch.arange(3, 11)[None]
    pos = torch.arange(8)[None]
    with torch.no_grad():
        b.forward(ids, pos, AttentionLayout.block_causal(pos, 4))
        alone = float(b.model.model.router_aux_loss())
        # the same row beside padding (a batch row of 8 pads: invalid tokens)
        padded_ids = torch.cat([ids, torch.full_like(ids, 5)])
        padded_pos = pos.expand(2, 8)
        valid = torch.tensor([[True] * 8, [False] * 8])
        b.forward(padded_ids, padded_pos, AttentionLayout.block_causal(padded_pos, 4, valid))
        padded = float(b.model.model.router_aux_loss())
    assert padded == pytest.approx(alone, rel=1e-5)


def test_llada2_sigmoid_group_limited_routing_by_hand():
    from models.moe import sigmoid_group_limited_routing

    # 8 experts in 4 groups of 2; sigmoid scores chosen directly through their logits
    probs = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.6, 0.6, 0.2, 0.3]])
    logits = torch.log(probs / (1 - probs))
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5])  # lifts group 3 (0.2 + 0.8 = 1.0) for choice only
    # biased group scores (sum of the group's two): g0 1.0, g1 0.95, g2 1.2, g3 1.0; no tie at either cut below:
    # topk_group=1 keeps g2 only, topk_group=3 keeps g2, g0, g3 and drops g1
    w, idx = sigmoid_group_limited_routing(logits, bias, top_k=2, n_group=4, topk_group=1, routed_scaling=2.5)
    assert sorted(idx[0].tolist()) == [4, 5]
    torch.testing.assert_close(w, torch.tensor([[1.25, 1.25]]), atol=1e-6, rtol=0)
    w, idx = sigmoid_group_limited_routing(logits, bias, top_k=2, n_group=4, topk_group=3, routed_scaling=2.5)
    assert idx[0].tolist() == [0, 7]  # biased 0.9 and 0.3 + 0.5 = 0.8 beat 0.6, 0.6
    # weights from the unbiased sigmoids 0.9 and 0.3: renormalised, times 2.5
    torch.testing.assert_close(w, torch.tensor([[0.9 / 1.2 * 2.5, 0.3 / 1.2 * 2.5]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("base", ["sdar_moe", "llada_moe"])
def test_the_router_aux_loss_trains_the_router_when_the_config_asks(demo_tokenizer, base):
    from models.tiny import build_tiny
    from tests.test_train_trainer import fake_batch, make_trainer, sampled

    def gate_delta(**overrides) -> torch.Tensor:
        adapter = build_tiny(base, demo_tokenizer, seed=3, **overrides)
        gate = adapter.model.model.moe_blocks()[0].gate.weight
        before = gate.detach().clone()
        trainer = make_trainer(adapter, learning_rate=1e-2)
        trajs = fake_batch(adapter, n=2) if adapter.attention == "block" else sampled(
            adapter, [demo_tokenizer.encode("Tom has three apples")] * 2, max_tokens=8, block_size=4, steps=8,
            cache="none")
        trainer.train_step(trajs, {t.sample_id: 0.0 for t in trajs})  # zero advantages: no policy gradient
        return gate.detach() - before

    assert torch.equal(gate_delta(), torch.zeros_like(gate_delta()))  # off by default: nothing moves the router
    assert torch.equal(gate_delta(output_router_logits=True, router_aux_loss_coef=0.0),
                       torch.zeros_like(gate_delta()))
    assert gate_delta(output_router_logits=True, router_aux_loss_coef=0.5).abs().max() > 0  # balancing moves it


@pytest.mark.slow
@pytest.mark.parametrize("base", ["sdar_moe", "llada2", "llada_moe"])
def test_zero3_two_process_sft_of_the_moe_families(tmp_path, demo_tokenizer, base):
    """Under ZeRO-3 the fused expert tensors are gathered by a collective when the experts module runs: ranks whose
    tokens leave different experts idle still gather the same tensors (else they would wait on each other for ever),
    and transformers fuses the per-expert checkpoint tensors into partitioned parameters and splits them on save."""
    from safetensors.torch import load_file

    from models.tiny import build_tiny
    from tests.test_sft import two_process_sft

    # top-1 of 8 experts behind a sharp router: each rank's tokens leave some experts idle, and not the same ones
    adapter = build_tiny(base, demo_tokenizer, seed=1, num_experts_per_tok=1, **({"n_group": 1, "topk_group": 1}
                                                                               if base == "llada2" else {}))
    with torch.no_grad():
        for name, p in adapter.model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40)
    ckpt = tmp_path / "base"
    adapter.model.save_pretrained(ckpt)
    demo_tokenizer.save_pretrained(ckpt)
    out = two_process_sft(tmp_path, ckpt, "cpu_zero3_2proc.yaml", **{
        "training.max_steps": 3, "model.model_base": base,
        **({"training.method": "random_masking"} if base == "llada_moe" else {})})
    start = load_file(str(ckpt / "model.safetensors"))
    end = load_file(str(out / "model.safetensors"))
    assert set(start) == set(end) and max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-4


@pytest.mark.parametrize("base", ["llada2", "llada_moe"])
def test_sft_job_trains_a_checkpoint_with_expert_bias_and_keeps_the_bias(tmp_path, demo_tokenizer, base):
    """The authors balance experts by moving ``expert_bias`` outside the gradient: fine-tuning keeps it as loaded."""
    import json
    import math

    from safetensors.torch import load_file

    from jobs.config import load_config
    from jobs.sft import run_sft
    from models.tiny import build_tiny
    from tests.test_sft import sft_args

    adapter = build_tiny(base, demo_tokenizer, seed=3, **({"moe_router_enable_expert_bias": True}
                                                          if base == "llada_moe" else {}))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, buffer in adapter.model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=g))
    adapter.model.save_pretrained(tmp_path / "base")
    demo_tokenizer.save_pretrained(tmp_path / "base")
    method = {"training.method": "random_masking"} if adapter.attention == "full" else {}
    out = run_sft(load_config(sft_args(tmp_path, tmp_path / "base", **{"model.model_base": base, **method,
                                                                      "training.max_steps": 4}), "sft"),
                  progress=False)
    start, end = load_file(str(tmp_path / "base" / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(start) == set(end)
    assert max(float((start[k] - end[k]).abs().max()) for k in start) > 1e-4
    bias = [k for k in start if k.endswith("expert_bias")]
    sparse_layers = adapter.model.config.num_hidden_layers - 1  # the first layer is dense in both tiny configs
    assert len(bias) == sparse_layers and all(torch.equal(start[k], end[k]) for k in bias)
    assert all(float(start[k].abs().max()) > 0 for k in bias)
    lines = [json.loads(x) for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 4 and all(math.isfinite(x["nll"]) for x in lines)


def test_the_router_gate_runs_in_the_model_dtype_and_its_softmax_in_fp32(tiny):
    block = tiny("sdar_moe", seed=0).model.model.moe_blocks()[0].to(torch.bfloat16)
    flat = torch.randn(16, block.gate.in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits, _, _ = block.route(flat)
    expected = torch.nn.functional.linear(flat, block.gate.weight).float()  # Qwen3-MoE: gate in bf16, then fp32
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)


@pytest.mark.parametrize("base,extra", [
    ("sdar_moe", {"remasking_strategy": "low_confidence_dynamic", "dynamic_threshold": 0.5}),
    ("llada2", {"remasking_strategy": "low_confidence_dynamic", "dynamic_threshold": 0.5}),
    ("llada2", {"editing_threshold": 0.05, "max_post_steps": 2}),  # LLaDA2.1's token editing (edits every row)
    ("llada_moe", {"block_size": 4, "steps": 8}),
])
def test_moe_batched_sampling_equals_one_prompt_at_a_time(demo_tokenizer, base, extra):
    """Greedy tokens, step maps and log-probs of a padded, continuously batched run equal each prompt's own run: a
    row's routing never depends on the other rows or the padding."""
    from sample.generate import generate
    from sample.params import SamplingParams
    from tests.test_sampler_utils import prompts_of, sharp_tiny

    model = sharp_tiny(base, demo_tokenizer, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[], ignore_eos=True, max_active=3, **extra)
    prompts = prompts_of()
    batched = generate(model, prompts, params, progress=False)
    singles = [generate(model, [p], params, progress=False)[0] for p in prompts]
    for b, s in zip(batched, singles, strict=True):
        assert (b.response_ids, b.step_map, b.tail_ids, b.tail_steps, b.rewrites, b.finish_reason) == (
            s.response_ids, s.step_map, s.tail_ids, s.tail_steps, s.rewrites, s.finish_reason)
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    assert len({tuple(t.response_ids) for t in batched}) > 1, "prompts should give different responses"
    if "editing_threshold" in extra:
        assert any(any(t.rewrites) for t in batched), "the editing case should edit"

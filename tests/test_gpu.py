"""CUDA checks (``pytest -m gpu``; skipped without CUDA): the sampler on CUDA gives the CPU's tokens, FlexAttention
and flash-attn give SDPA's numbers, and bf16 sampling records the log-probs the trainer computes. Run them first
whenever a GPU is at hand, with ``python -m bench.gpu``."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from models.common import AttentionLayout
from sample.generate import generate
from sample.params import SamplingParams
from tests.test_sampler_utils import prompts_of, sharp_tiny
from tests.test_train_trainer import PROMPTS, fake_batch, make_trainer, sampled
from train.views import build_view

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 products in full precision: a trainer turns TF32 on for the process (training.enable_tf32), which
    would make these comparisons depend on which test built a trainer first (on an H100 the MoE logits then
    differed from the CPU's by 2e-4)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


BF16_LOGP_TOLERANCE = 0.1  # |sampler - trainer| log-prob in bf16: ~2^-8 relative error on logits of magnitude ~10


def on(adapter, device: str, dtype: torch.dtype = torch.float32):
    """A copy of ``adapter`` whose model lives on ``device`` in ``dtype``."""
    return dataclasses.replace(adapter, model=copy.deepcopy(adapter.model).to(device=device, dtype=dtype))


@pytest.mark.parametrize(("model_base", "extra"), [("sdar", {}), ("llada", {"block_size": 4, "steps": 12}),
                                                   ("dream", {"block_size": 4, "steps": 12})])
def test_sampler_tokens_on_cuda_equal_cpu(demo_tokenizer, model_base, extra):
    cpu = sharp_tiny(model_base, demo_tokenizer, seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[], ignore_eos=True, **extra)
    want = generate(cpu, prompts_of(), params, progress=False)
    got = generate(on(cpu, "cuda"), prompts_of(), params, progress=False)
    assert [(t.response_ids, t.step_map) for t in got] == [(t.response_ids, t.step_map) for t in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_cuda_graphs_give_the_eager_tokens(demo_tokenizer, monkeypatch):
    """rollout.cuda_graphs on CUDA: decode forwards captured once per (batch bucket, shape) and replayed give the
    eager sampler's tokens and log-probs (fp32), with rows joining and leaving (max_active 3); in bf16 the run is
    captured too (no fallback warning) and completes every response."""
    import warnings

    from sample.block_runners import StaticRunner

    captures = []
    capture = StaticRunner._capture
    monkeypatch.setattr(StaticRunner, "_capture", lambda self, *a: captures.append(a) or capture(self, *a))
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[], ignore_eos=True, max_active=3,
                            cuda_graphs=False)
    adapter = on(sharp_tiny("sdar", demo_tokenizer, seed=1), "cuda")
    eager = generate(adapter, prompts_of(), params, progress=False)
    assert not captures
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to eager forwards fails the test
        graphed = generate(adapter, prompts_of(), dataclasses.replace(params, cuda_graphs=True), progress=False)
        assert captures  # captured once per (bucket, shape) and cache allocation (a grow captures again)
        bf16 = generate(on(adapter, "cuda", torch.bfloat16), prompts_of(),
                        dataclasses.replace(params, cuda_graphs=True), progress=False)
    assert [(t.response_ids, t.step_map) for t in graphed] == [(t.response_ids, t.step_map) for t in eager]
    for a, b in zip(graphed, eager):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert all(len(t.response_ids) == 12 for t in bf16)


@pytest.mark.parametrize(("model_base", "extra"), [  # full attention: prefix cache, rows joining mid-block
    ("sdar", {}), ("llada", {"block_size": 4, "steps": 16, "cache": "prefix", "further_horizon": 2, "max_active": 4,
                "max_tokens": 30})])
def test_a_decode_step_rarely_waits_for_the_device(demo_tokenizer, model_base, extra):
    """A denoising step syncs the host twice: to find the still-masked positions (the LM head runs there) and at
    its end (finished blocks, degenerate logits); admission, graph captures and finished blocks add a few. Counted
    by torch's sync debug mode (on an H100 the step synced ~13 times before the masked positions were found once,
    and still 292 times in this test's 36 forwards before row indices went to the device from pinned memory and
    finished rows were reset with index_fill_; tests/test_sampler_block.py and test_sampler_full.py pin those sites
    on CPU)."""
    import warnings

    params = SamplingParams(**{"max_tokens": 32, "temperature": 1.0, "stop_token_ids": [], "ignore_eos": True,
                               "seed": 0, **extra})
    adapter = on(sharp_tiny(model_base, demo_tokenizer, seed=1), "cuda")
    generate(adapter, prompts_of(), params, progress=False)  # kernels and allocator warm
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = generate(adapter, prompts_of(), params, progress=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs <= 3 * out.stats.forwards, f"{syncs} host syncs in {out.stats.forwards} forwards"


def test_flex_attention_equals_sdpa_in_training(tiny):
    adapter = on(tiny("sdar", seed=1, size="demo"), "cuda")  # head dimension 32: FlexAttention needs >= 16
    trajs = fake_batch(adapter, n=4)
    out = {}
    for backend in ("sdpa", "flex"):
        adapter.model.config.attn_backend = backend
        trainer = make_trainer(adapter, enable_tf32=False)  # full fp32 products in both backends
        batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
        out[backend] = trainer.logprobs(batch)
    torch.testing.assert_close(out["flex"], out["sdpa"], atol=1e-4, rtol=0)


def test_flex_attention_refuses_heads_under_16_in_one_line(tiny):
    adapter = on(tiny("sdar", seed=1), "cuda")  # head dimension 8
    adapter.model.config.attn_backend = "flex"
    trainer = make_trainer(adapter)
    batch = build_view(fake_batch(adapter, n=2), {"f0": 1.0, "f1": 1.0}, trainer.cfg, trainer.traits)
    with pytest.raises(ValueError, match="head dimension of at least 16"):
        trainer.logprobs(batch)


def test_flash_attention_equals_sdpa(tiny):
    pytest.importorskip("flash_attn")
    adapter = on(tiny("llada", seed=1), "cuda", torch.bfloat16)  # full attention, no padding: flash applies
    ids = torch.randint(0, 200, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(16, device="cuda").expand(2, 16)
    layout = AttentionLayout.full(torch.ones(2, 16, dtype=torch.bool, device="cuda"))
    out = {}
    with torch.no_grad():
        for backend in ("sdpa", "flash"):
            adapter.model.config.attn_backend = backend
            out[backend] = adapter.forward(ids, pos, layout).float()
    torch.testing.assert_close(out["flash"], out["sdpa"], atol=3e-2, rtol=0)  # bf16 kernels


def test_bf16_sampler_logprobs_match_the_trainer(tiny, demo_tokenizer):
    adapter = on(tiny("sdar", seed=1), "cuda", torch.bfloat16)
    trajs = sampled(adapter, [demo_tokenizer.encode(p) for p in PROMPTS], max_tokens=15, denoising_steps=3)
    trainer = make_trainer(adapter)
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    assert batch.exact and batch.num_tokens > 0
    diff = (trainer.logprobs(batch) - batch.old_logprobs).abs().max()
    assert diff < BF16_LOGP_TOLERANCE, float(diff)


@pytest.mark.parametrize("model_base", ["sdar_moe", "llada2", "llada_moe"])
def test_moe_logits_on_cuda_equal_cpu(tiny, model_base):
    adapter = tiny(model_base, seed=1)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).expand(2, 16)
    layout = AttentionLayout.full(torch.ones(2, 16, dtype=torch.bool))
    with torch.no_grad():
        want = adapter.forward(ids, pos, layout)
        cuda = on(adapter, "cuda")
        got = cuda.forward(ids.cuda(), pos.cuda(), AttentionLayout.full(torch.ones(2, 16, dtype=torch.bool,
                                                                                   device="cuda")))
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=0)


def test_moe_layer_in_bf16_never_waits_for_the_device_and_equals_the_per_expert_split():
    """The grouped expert product (models/moe.py) on CUDA in bf16: forward and backward without a host sync (sync
    debug mode "error" raises at one), the same numbers as one product per expert (bf16 rounding apart)."""
    from types import SimpleNamespace

    from models.moe import SparseMoeBlock, grouped_expert_compute, grouped_mm_runs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's fused grouped product needs Hopper or newer (older GPUs take the per-expert split)")
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=256, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                          norm_topk_prob=True)
    block = SparseMoeBlock(cfg).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert grouped_mm_runs(x, block.experts.gate_up_proj)
    block(x)  # warm-up (first-call allocations, cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = block(x)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.no_grad():
        _, weights, index = block.route(x)
        e = block.experts
        split = grouped_expert_compute(x, weights, index, e.gate_up_proj, e.down_proj, grouped=False)
        grouped = grouped_expert_compute(x, weights, index, e.gate_up_proj, e.down_proj, grouped=True)
    torch.testing.assert_close(grouped.float(), split.float(), atol=2e-2, rtol=2e-2)


def test_qlora_loads_a_4bit_base_and_trains_only_the_adapters(tmp_path, demo_tokenizer):
    """lora.load_in_4bit: the base's linear layers are bitsandbytes 4-bit NF4 on CUDA, the logits stay near the
    full-precision model's, a training step moves the adapters and nothing else, and sampling runs on it."""
    bnb = pytest.importorskip("bitsandbytes")
    from models.lora import LoraSettings, wrap
    from models.registry import load_model
    from models.tiny import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "sdar", "sdar", demo_tokenizer, size="test")
    cfg = {"pretrained_model": str(path), "model_base": "sdar", "dtype": "bfloat16"}
    full = load_model(cfg, device="cuda")
    adapter = wrap(load_model(cfg, device="cuda", load_in_4bit=True), LoraSettings(enabled=True, rank=4, alpha=8,
                                                                               load_in_4bit=True))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in adapter.model.modules())
    ids = torch.randint(0, 200, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    pos = torch.arange(12, device="cuda").expand(2, 12)
    layout = AttentionLayout.full(torch.ones(2, 12, dtype=torch.bool, device="cuda"))
    with torch.no_grad():
        want, got = full.forward(ids, pos, layout).float(), adapter.forward(ids, pos, layout).float()
    assert torch.corrcoef(torch.stack([want.flatten(), got.flatten()]))[0, 1] > 0.9  # NF4 rounding, not noise
    frozen = {n: p.detach().clone() for n, p in adapter.model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in adapter.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    trajs = sampled(adapter, [demo_tokenizer.encode(p) for p in PROMPTS], max_tokens=8, denoising_steps=2)
    assert all(len(t.response_ids) == 8 for t in trajs)
    trainer = make_trainer(adapter, learning_rate=1e-2)
    trainer.train_step(trajs, {t.sample_id: (1.0 if i % 2 else -1.0) for i, t in enumerate(trajs)})
    after = dict(adapter.model.named_parameters())
    assert any(not torch.equal(after[n].detach(), v) for n, v in lora.items())
    assert all(torch.equal(after[n].detach(), v) for n, v in frozen.items())

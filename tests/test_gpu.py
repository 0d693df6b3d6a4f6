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


def test_flex_attention_equals_sdpa_in_training(tiny):
    adapter = on(tiny("sdar", seed=1), "cuda")
    trajs = fake_batch(adapter, n=4)
    out = {}
    for backend in ("sdpa", "flex"):
        adapter.model.config.attn_backend = backend
        trainer = make_trainer(adapter)
        batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
        out[backend] = trainer.logprobs(batch)
    torch.testing.assert_close(out["flex"], out["sdpa"], atol=1e-4, rtol=0)


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

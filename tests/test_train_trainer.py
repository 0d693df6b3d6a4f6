"""PolicyTrainer: sampler <-> trainer log-prob parity, packed == per-round, accumulation, one learning step."""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import replace

import pytest
import torch

from core.schema import to_dict
from sample.generate import generate
from sample.params import SamplingParams
from tests.conftest import reset_accelerate_state
from tests.test_train_views import fake_block_trajectory
from train.accelerator import build_accelerator
from train.policy_trainer import PolicyTrainer
from train.settings import (
    LossConfig,
    LRSchedulerConfig,
    LRSchedulerParams,
    OptimizerParams,
    RLTrainingConfig,
    ViewConfig,
)
from train.views import ModelTraits, build_view


def fresh_accelerator(**kwargs):
    reset_accelerate_state()
    return build_accelerator(**kwargs)


def training_config(view=None, loss=None, micro_batch_size=1, gradient_checkpointing=False, **kw) -> RLTrainingConfig:
    """One RL training section from the view, loss and trainer settings of a test."""
    parts = {**to_dict(view or ViewConfig()), **to_dict(loss or LossConfig(beta=0.0))}
    return RLTrainingConfig(**parts, batch_size_lm=micro_batch_size,
                            gradient_checkpointing_enable=gradient_checkpointing, **kw)


def make_trainer(adapter, mixed_precision="no", gradient_accumulation_steps=1, learning_rate=1e-6,
                 lr_scheduler="constant", total_steps=None, min_lr_scale=0.0, epsilon=1e-8, **cfg) -> PolicyTrainer:
    config = training_config(mixed_precision=mixed_precision,
                             gradient_accumulation_steps=gradient_accumulation_steps, **cfg)
    acc = fresh_accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=gradient_accumulation_steps)
    schedule = LRSchedulerConfig(scheduler=lr_scheduler, params=LRSchedulerParams(min_lr_scale=min_lr_scale))
    return PolicyTrainer(adapter, config, OptimizerParams(learning_rate=learning_rate, epsilon=epsilon), schedule,
                         total_steps, accelerator=acc)


def sampled(adapter, prompts, **params):
    trajs = generate(adapter, prompts, SamplingParams(temperature=1.0, seed=0, **params), progress=False)
    for i, t in enumerate(trajs):
        t.sample_id = f"s{i}"
    return list(trajs)


def fake_batch(adapter, n=4, seed=0, n_resp=(6, 14)):
    rng = random.Random(seed)
    vocab = adapter.model.config.vocab_size
    return [fake_block_trajectory(rng, f"f{i}", rng.randint(1, 9), rng.randint(*n_resp), adapter.block_size, 3,
                                  vocab, adapter.mask_id) for i in range(n)]


# ---------------------------------------------------------------- the invariant: trainer log-prob == sampler's


PROMPTS = ["The quick brown fox", "A train travels sixty miles in one hour. How far", "Tom has three apples"]


@pytest.mark.parametrize("layout", ["packed", "per_round"])
@pytest.mark.parametrize("cache", ["prefix", "none"])
@pytest.mark.parametrize("model_base", ["sdar", "sdar_moe", "llada2"])
def test_trainer_logprobs_equal_sampler_logprobs_block_model(tiny, demo_tokenizer, layout, cache, model_base):
    adapter = tiny(model_base, seed=1)
    prompts = [demo_tokenizer.encode(p) for p in PROMPTS]  # lengths 10, 21, 6: P mod 4 = 2, 1, 2
    trajs = sampled(adapter, prompts, max_tokens=15, denoising_steps=3, cache=cache,
                    remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.05)
    trainer = make_trainer(adapter, view=ViewConfig(layout=layout, max_gen_length=13))
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    assert batch.exact and batch.num_tokens == sum(min(len(t.response_ids), 13) for t in trajs)
    torch.testing.assert_close(trainer.logprobs(batch), batch.old_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_base", ["dream", "llada", "llada_moe"])
def test_trainer_logprobs_equal_sampler_logprobs_full_attention(tiny, demo_tokenizer, model_base):
    adapter = tiny(model_base, seed=1)
    prompts = [demo_tokenizer.encode(p) for p in PROMPTS] + [[]]  # an empty prompt: shifted first token
    trajs = sampled(adapter, prompts, max_tokens=12, block_size=4, steps=8, cache="none")
    trainer = make_trainer(adapter)
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    assert batch.exact and batch.num_tokens == sum(len(t.response_ids) for t in trajs)
    torch.testing.assert_close(trainer.logprobs(batch), batch.old_logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("model_base,params", [("sdar", {"denoising_steps": 3}),
                                               ("dream", {"block_size": 4, "steps": 8, "cache": "none"})])
def test_a_training_step_applies_the_lm_head_to_trained_positions_only_in_chunks(tiny, demo_tokenizer, model_base,
                                                                                  params):
    """No [batch, seq, vocab] logits in training: the LM head sees one position per row from the model's forward
    (logits_to_keep=1) and then the trained positions, logits_chunk_size (4) at a time. (A hooked head is called
    as a module, a chunk of tokens at a time; a plain one goes through head_logprobs, whose bound is
    tests/test_train_loss.py's.)"""
    adapter = tiny(model_base, seed=1)
    trajs = sampled(adapter, [demo_tokenizer.encode(p) for p in PROMPTS], max_tokens=15, **params)
    trainer = make_trainer(adapter, logits_chunk_size=4, micro_batch_size=2)
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    positions = []
    hook = adapter.model.lm_head.register_forward_hook(lambda mod, args, out: positions.append(out.shape[:-1].numel()))
    try:
        (metrics,) = trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    finally:
        hook.remove()
    assert batch.input_ids.shape[1] > 4  # so a forward's full logits (every position of a row) would show below
    assert max(positions) == 4 and sum(positions) >= metrics["tokens"] > 4


@pytest.mark.parametrize("model_base,overrides,params", [
    ("sdar", {}, {"denoising_steps": 3}),
    ("sdar", {"tie_word_embeddings": True}, {"denoising_steps": 3}),  # the head is the embedding (SmolLM2's)
    # the head is the embedding's first vocab_size rows (LLaDA pads its embedding)
    ("llada", {"weight_tying": True, "embedding_size": 520}, {"block_size": 4, "steps": 8, "cache": "none"}),
])
def test_training_through_the_plain_head_equals_training_through_the_module(tiny, demo_tokenizer, monkeypatch,
                                                                           model_base, overrides, params):
    """The trainer takes the plain head's weight (train/logprobs.py head_logprobs): the same log-probs and the
    same gradients as the head module applied a chunk of tokens at a time, and a training step goes that way."""
    import train.logprobs

    adapter = tiny(model_base, seed=1, **overrides)
    weight = adapter.head_weight()
    assert weight is not None and weight.shape[0] == adapter.model.config.vocab_size
    if overrides:
        assert weight.data_ptr() == adapter.model.get_input_embeddings().weight.data_ptr()
    trajs = sampled(adapter, [demo_tokenizer.encode(p) for p in PROMPTS], max_tokens=12, **params)
    advantages = {t.sample_id: (-1.0) ** i for i, t in enumerate(trajs)}
    trainer = make_trainer(adapter, logits_chunk_size=4, micro_batch_size=2)
    batch = build_view(trajs, advantages, trainer.cfg, trainer.traits)
    params_ = [p for p in adapter.model.parameters() if p.requires_grad]

    def logprobs_and_grads():
        parts, grads = [], [torch.zeros_like(p) for p in params_]
        for mb in trainer.micro_batches(batch, 0, shuffle=False):
            logp = trainer.forward_logprobs(trainer.model, mb)
            for g, d in zip(grads, torch.autograd.grad((logp * mb.advantages).sum(), params_, allow_unused=True)):
                g += 0 if d is None else d
            parts.append(logp.detach())
        return torch.cat(parts), grads

    fused_calls = []
    fused = train.logprobs.head_logprobs
    monkeypatch.setattr(train.logprobs, "head_logprobs", lambda *a: fused_calls.append(1) or fused(*a))
    plain_logp, plain_grads = logprobs_and_grads()
    assert fused_calls
    monkeypatch.setattr("train.trainer.head_weight", lambda model: None)  # through the module now
    calls = len(fused_calls)
    module_logp, module_grads = logprobs_and_grads()
    assert len(fused_calls) == calls
    torch.testing.assert_close(plain_logp, module_logp, atol=1e-5, rtol=1e-5)
    assert max(float(g.abs().max()) for g in module_grads) > 1e-3
    for a, b in zip(plain_grads, module_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    monkeypatch.undo()
    monkeypatch.setattr(train.logprobs, "head_logprobs", lambda *a: fused_calls.append(1) or fused(*a))
    trainer.train_step(trajs, advantages)
    assert len(fused_calls) > calls  # the step's forwards take the plain head


def test_a_head_the_trainer_must_call_as_a_module_has_no_plain_weight(tiny):
    adapter = tiny("sdar")
    head = adapter.model.lm_head
    for register in (head.register_forward_hook,  # e.g. ZeRO-3's gathering hooks
                     head.register_full_backward_hook,
                     torch.nn.modules.module.register_module_forward_pre_hook):  # every module's
        hook = register(lambda *args: None)
        assert adapter.head_weight() is None
        hook.remove()
        assert adapter.head_weight() is head.weight
    head._hf_hook = object()  # accelerate's device-map hook replaces forward (it may offload the weight)
    assert adapter.head_weight() is None
    del head._hf_hook
    adapter.model.lm_head.weight.ds_id = 7  # partitioned by ZeRO-3: only its module's hooks gather it
    assert adapter.head_weight() is None


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_full_attention_cache_logprobs_are_recomputed_before_the_update(tiny, demo_tokenizer, cache):
    adapter = tiny("dream", seed=1)
    prompts = [demo_tokenizer.encode(p) for p in PROMPTS]
    trajs = sampled(adapter, prompts, max_tokens=12, block_size=4, steps=8, cache=cache, further_horizon=4)
    assert all(t.cached_logprobs for t in trajs)
    assert not any(t.cached_logprobs for t in sampled(adapter, prompts[:1], max_tokens=4, block_size=4, cache="none"))
    advantages = {t.sample_id: 1.0 for t in trajs}
    trainer = make_trainer(adapter)
    # taken as exact, the cached log-probs would be the old ones: they are not a plain forward's
    as_if_exact = build_view([replace(t, cached_logprobs=False) for t in trajs], advantages, trainer.cfg,
                             trainer.traits)
    assert (trainer.logprobs(as_if_exact) - as_if_exact.old_logprobs).abs().max() > 1e-3
    assert not build_view(trajs, advantages, trainer.cfg, trainer.traits).exact
    metrics = trainer.train_step(trajs, advantages)  # recomputed: the first update's ratio is 1
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics[0]["clip_frac"] == 0.0


def test_train_step_logs_sampler_difference(tiny, demo_tokenizer):
    adapter = tiny("sdar", seed=2)
    trajs = sampled(adapter, [demo_tokenizer.encode(p) for p in PROMPTS], max_tokens=9, denoising_steps=2)
    trainer = make_trainer(adapter, old_logp="recompute", learning_rate=1e-3, micro_batch_size=2)
    metrics = trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    assert metrics[0]["sampler_logp_max_abs_diff"] < 1e-4
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and metrics[0]["clip_frac"] == 0.0


# ---------------------------------------------------------------- packed == per-round, accumulation


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    total = 0.0
    for mb in trainer.micro_batches(batch, 0, shuffle=False):
        out = trainer.loss(mb, trainer.forward_logprobs(trainer.model, mb))
        out.loss.backward()
        total += out.loss.item()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_packed_and_per_round_layouts_give_equal_loss_and_gradients(tiny):
    adapter = tiny("sdar", seed=3)
    trajs = fake_batch(adapter, n=3)
    g = torch.Generator().manual_seed(0)
    for t in trajs:  # old log-probs away from the current ones, so ratios differ from 1 and some clip
        t.logprobs = (-6 + torch.rand(len(t.response_ids), generator=g)).tolist()
    adv = {t.sample_id: float(a) for t, a in zip(trajs, (1.0, -0.5, 2.0))}
    trainer = make_trainer(adapter, micro_batch_size=2, loss=LossConfig(beta=0.05, eps=0.2))
    results = {}
    for layout in ("packed", "per_round"):
        batch = build_view(trajs, adv, ViewConfig(layout=layout), trainer.traits)
        results[layout] = (batch.num_rows, *_loss_and_grads(trainer, batch))
    (rows_p, loss_p, grads_p), (rows_r, loss_r, grads_r) = results["packed"], results["per_round"]
    assert rows_p == 3 and rows_r > rows_p
    assert loss_p == pytest.approx(loss_r, rel=1e-5)
    assert grads_p.keys() == grads_r.keys() and len(grads_p) > 0
    for name in grads_p:
        torch.testing.assert_close(grads_p[name], grads_r[name], rtol=1e-4, atol=1e-7)


def test_packed_rows_under_a_token_budget_give_the_per_round_loss_and_gradients(tiny):
    adapter = tiny("sdar", seed=3)
    trajs = fake_batch(adapter, n=3)
    adv = {t.sample_id: float(a) for t, a in zip(trajs, (1.0, -0.5, 2.0))}
    trainer = make_trainer(adapter, micro_batch_size=2, loss=LossConfig(beta=0.05, eps=0.2))
    budgeted = build_view(trajs, adv, ViewConfig(max_row_tokens=40), trainer.traits)
    per_round = build_view(trajs, adv, ViewConfig(layout="per_round"), trainer.traits)
    assert 3 < budgeted.num_rows < per_round.num_rows
    loss_b, grads_b = _loss_and_grads(trainer, budgeted)
    loss_r, grads_r = _loss_and_grads(trainer, per_round)
    assert loss_b == pytest.approx(loss_r, rel=1e-5)
    for name in grads_r:
        torch.testing.assert_close(grads_b[name], grads_r[name], rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_divides_once(tiny):
    trajs = fake_batch(tiny("sdar"), n=4, seed=5)
    adv = {t.sample_id: 1.0 for t in trajs}
    norms = []
    for mbs, ga in ((1, 1), (100, 1), (2, 4)):
        trainer = make_trainer(tiny("sdar", seed=4), micro_batch_size=mbs, gradient_accumulation_steps=ga,
                               old_logp="recompute", max_grad_norm=1e9, view=ViewConfig(layout="per_round"))
        (m,) = trainer.train_step(trajs, adv)
        norms.append((m["grad_norm"], m["loss"], m["micro_batches"]))
    assert [n[2] for n in norms] == [norms[0][2], 1.0, math.ceil(norms[0][2] / 2)]
    for norm, loss, _ in norms[1:]:
        assert norm == pytest.approx(norms[0][0], rel=1e-4)
        assert loss == pytest.approx(norms[0][1], rel=1e-5)


# ---------------------------------------------------------------- learning


def test_one_step_with_positive_advantages_raises_logprobs(tiny):
    adapter = tiny("sdar", seed=6)
    trajs = fake_batch(adapter, n=3, seed=6)
    adv = {t.sample_id: 1.0 for t in trajs}
    trainer = make_trainer(adapter, learning_rate=3e-3, old_logp="recompute", micro_batch_size=2)
    batch = build_view(trajs, adv, trainer.cfg, trainer.traits)
    before = trainer.logprobs(batch)
    (metrics,) = trainer.train_step(trajs, adv)
    after = trainer.logprobs(batch)
    assert metrics["tokens"] == batch.num_tokens
    assert float(after.mean()) > float(before.mean()) + 0.01
    assert float((after > before).float().mean()) > 0.9


def test_a_frozen_integer_weight_does_not_stop_a_step(tiny):
    """A QLoRA base holds its weights as frozen packed 4-bit integers: the trainer's non-finite-weights check skips
    what it does not train (on an H100 it crashed on them: a norm of a Byte tensor)."""
    adapter = tiny("sdar", seed=6)
    adapter.model.register_parameter("packed", torch.nn.Parameter(torch.arange(8, dtype=torch.uint8),
                                                                  requires_grad=False))
    trajs = fake_batch(adapter, n=2, seed=6)
    (metrics,) = make_trainer(adapter, learning_rate=1e-3).train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    assert metrics["tokens"] > 0 and torch.equal(adapter.model.packed, torch.arange(8, dtype=torch.uint8))


def test_steps_schedule_and_dropped_samples(tiny):
    adapter = tiny("sdar", seed=7)
    trajs = fake_batch(adapter, n=5, seed=7)
    trajs[2].prompt_ids = trajs[2].prompt_ids * 20  # over-long: dropped and reported, others unaffected
    adv = {t.sample_id: 1.0 for t in trajs}
    trainer = make_trainer(adapter, samples_per_step=2, lr_scheduler="cosine", total_steps=3, min_lr_scale=0.5,
                           learning_rate=1e-3, old_logp="recompute", view=ViewConfig(max_prompt_len=30))
    metrics = trainer.train_step(trajs, adv)
    trainer.skip_step()  # an RL step whose samples were all dropped still moves the schedule on
    metrics += trainer.train_step(trajs, adv)
    # up to 3 optimiser steps per RL step (one may lose its samples to the drop), at one rate per RL step
    later = len(metrics) - 3
    assert trainer.schedule.step_count == 3 and [m["rl_step"] for m in metrics] == [1.0] * 3 + [3.0] * later
    last = 1e-3 * (0.5 + 0.5 * 0.5 * (1 + math.cos(2 * math.pi / 3)))  # the cosine at step 2 of 3, floor 0.5
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3] * 3 + [last] * later)
    assert [d[0] for d in trainer.dropped] == [trajs[2].sample_id]
    assert sum(m["tokens"] for m in metrics[:3]) == sum(len(t.response_ids) for i, t in enumerate(trajs) if i != 2)


def test_bf16_gradient_checkpointing_and_coupled_view(tiny):
    """Gradient checkpointing recomputes the forward in the backward: the same loss and gradient as without it."""
    steps = {}
    for checkpointing in (True, False):
        adapter = tiny("sdar", seed=8)
        trajs = fake_batch(adapter, n=2, seed=8)
        before = [p.detach().clone() for p in adapter.model.parameters()]
        trainer = make_trainer(adapter, mixed_precision="bf16", gradient_checkpointing=checkpointing,
                               learning_rate=1e-3, view=ViewConfig(method="coupled"), loss=LossConfig(beta=0.01))
        assert adapter.model.model.gradient_checkpointing == checkpointing
        (steps[checkpointing],) = trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
        assert any(not torch.equal(a, b) for a, b in zip(before, adapter.model.parameters()))
    metrics, plain = steps[True], steps[False]
    assert math.isfinite(metrics["loss"]) and metrics["ratio_mean"] == pytest.approx(1.0, abs=2e-2)
    assert metrics["loss"] == pytest.approx(plain["loss"], rel=1e-4, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-3) and plain["grad_norm"] > 0


def test_bf16_on_a_cpu_without_native_bf16_products_computes_in_float32(tiny, tmp_path, monkeypatch):
    # an AVX2-only CPU multiplies bf16 on reference kernels (hundreds of times slower than float32, models.layers):
    # the CPU recipes' bf16 (training.mixed_precision, rollout.compute_dtype) becomes float32 there, with a warning
    from models.registry import load_model
    from sample.generate import compute_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    adapter = tiny("sdar", seed=8)
    adapter.model.save_pretrained(tmp_path)
    adapter.tokenizer.save_pretrained(tmp_path)
    for native in (True, False):
        monkeypatch.setattr("models.layers.native_cpu_bf16", lambda native=native: native)
        monkeypatch.setattr("models.registry.native_cpu_bf16", lambda native=native: native)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            accelerator = fresh_accelerator(mixed_precision="bf16")
            with compute_precision(adapter, SamplingParams(compute_dtype="bfloat16")):
                autocast = torch.is_autocast_enabled("cpu")
            load_model({"pretrained_model": str(tmp_path), "model_base": "sdar", "dtype": "bfloat16"})
        assert accelerator.mixed_precision == ("bf16" if native else "no") and autocast == native
        settings = [str(w.message).split(" ")[0] for w in caught if "native bf16" in str(w.message)]
        assert settings == ([] if native else ["training.mixed_precision=bf16:", "rollout.compute_dtype=bfloat16:",
                                               "model.dtype=bfloat16"])


def test_reference_model_kl_term_in_trainer(tiny):
    adapter = tiny("sdar", seed=9)
    ref = tiny("sdar", seed=9).model  # same weights: KL to the reference is 0 at the first step
    trajs = fake_batch(adapter, n=2, seed=9)
    cfg = training_config(old_logp="recompute", loss=LossConfig(beta=0.0, ref_beta=0.1))
    trainer = PolicyTrainer(adapter, cfg, accelerator=fresh_accelerator(), ref_model=ref)
    (metrics,) = trainer.train_step(trajs, {t.sample_id: 1.0 for t in trajs})
    assert metrics["ref_kl"] == pytest.approx(0.0, abs=1e-6)
    assert not any(p.requires_grad for p in ref.parameters())


def test_view_ids_follow_the_adapter(tiny):
    ids = ModelTraits.from_adapter(tiny("dream"))
    assert ids.attention == "full" and ids.shift_logits and ids.block_size is None


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_larger_sampling_block_trains_on_its_own_blocks(tiny, demo_tokenizer, layout):
    """A block-4 model sampled with block 8 (block-size adaptation): the views use 8-token blocks and reproduce the
    sampler's log-probs exactly."""
    adapter = tiny("sdar", seed=1)
    assert adapter.block_size == 4
    prompts = [demo_tokenizer.encode(p) for p in PROMPTS]  # P mod 8 = 2, 5, 6
    trajs = sampled(adapter, prompts, max_tokens=21, block_size=8, denoising_steps=5,
                    remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.05)
    assert all(t.block_size == 8 for t in trajs)
    trainer = make_trainer(adapter, view=ViewConfig(layout=layout))
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    blocks_of = {}  # a block of 8 absolute positions may hold tokens of up to 5 distinct steps
    for t in trajs:
        for i, step in enumerate(t.step_map):
            blocks_of.setdefault((t.sample_id, (len(t.prompt_ids) + i) // 8), set()).add(step)
    assert max(len(v) for v in blocks_of.values()) > 4  # impossible with 4-token blocks at one token per step
    assert batch.exact and batch.num_tokens == sum(len(t.response_ids) for t in trajs)
    torch.testing.assert_close(trainer.logprobs(batch), batch.old_logprobs, atol=1e-4, rtol=0)


def _numbered(n: int, group_size: int):
    from sample.trajectory import Trajectory

    return [Trajectory(prompt_ids=[1], response_ids=[2], step_map=[1], logprobs=[0.0], sample_id=f"s{i}",
                       group_id=f"g{i // group_size}") for i in range(n)]


@pytest.mark.parametrize("n, world, per_step", [(13, 1, None), (13, 2, None), (13, 2, 3), (16, 3, 2)])
def test_samples_are_dealt_round_robin_and_cut_into_equal_step_counts(n, world, per_step):
    """Sample by sample (every algorithm but the pairwise ones): the shuffled order dealt round robin, each
    process's share cut into consecutive steps of ``samples_per_step``, the same step count everywhere."""
    from train.trainer import shard_steps

    trajs = _numbered(n, 4)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    per_process = math.ceil(n / world)
    size = per_step or per_process
    dealt = []
    for rank in range(world):
        steps = shard_steps(trajs, rank, world, per_step, False, torch.Generator().manual_seed(5))
        share = [trajs[i] for i in order[rank::world]]
        assert steps == [share[k * size:(k + 1) * size] for k in range(math.ceil(per_process / size))]
        assert len(steps) == math.ceil(per_process / size)  # the same step count on every process
        dealt += [t.sample_id for step in steps for t in step]
    assert sorted(dealt) == sorted(t.sample_id for t in trajs)  # every sample once: none lost, none doubled


@pytest.mark.parametrize("world, per_step", [(1, None), (2, None), (2, 8), (3, 4)])
def test_pairwise_losses_get_whole_prompt_groups_on_one_process_and_step(world, per_step):
    """VRPO pairs the responses of a prompt group: a group split over processes or steps loses its pairs."""
    from train.trainer import shard_steps

    trajs = _numbered(40, 8)  # 5 groups of 8
    placed = {}
    counts = set()
    for rank in range(world):
        steps = shard_steps(trajs, rank, world, per_step, True, torch.Generator().manual_seed(1))
        counts.add(len(steps))
        for k, step in enumerate(steps):
            for t in step:
                assert t.sample_id not in placed
                placed[t.sample_id] = (rank, k, t.group_id)
    assert len(counts) == 1 and sorted(placed) == sorted(t.sample_id for t in trajs)
    where = {}
    for rank, k, group in placed.values():
        assert where.setdefault(group, (rank, k)) == (rank, k)
    assert len(where) == 5 and len({rank for rank, _ in where.values()}) == min(world, 5)


def test_a_filler_micro_batch_adds_no_gradient_even_to_a_loss_that_ignores_weights(tiny):
    """Processes with fewer micro-batches run zero-weight copies so collectives stay in step; a loss that does not
    read the weights (VRPO's pair loss, a router's aux loss) must still add nothing through them."""
    from dataclasses import replace

    import torch

    from train.loss import LossOutput

    trajs = fake_batch(tiny("sdar"), n=2, seed=3)
    adv = {t.sample_id: 1.0 for t in trajs}
    norms = []
    for with_filler in (False, True):
        trainer = make_trainer(tiny("sdar", seed=4), micro_batch_size=100, max_grad_norm=1e9)
        trainer.loss = lambda mb, logp: LossOutput(logp.sum(), {"loss": float(logp.sum())})  # weights ignored
        (batch,) = trainer.build_views(trajs, adv)
        (mb,) = trainer.micro_batches(batch, 0)
        filler = replace(mb.with_weights(torch.zeros_like(mb.weights)), filler=True)
        norms.append(trainer.optimizer_step([mb, filler] if with_filler else [mb])["grad_norm"])
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-6)


@pytest.mark.parametrize("batch_size_lm", [1, 64])
def test_a_router_aux_loss_counts_once_per_step_however_many_micro_batches(tiny, monkeypatch, batch_size_lm):
    """The policy loss's micro-batches add up to the step's; a router's aux loss (a mean over one forward's tokens)
    must not add up with them: the step takes its mean over the micro-batches, so its gradient does not grow with
    the number of micro-batches."""
    adapter = tiny("sdar")
    trainer = make_trainer(adapter, micro_batch_size=batch_size_lm, max_grad_norm=0.0)  # no clipping
    norm = adapter.model.model.norm.weight
    monkeypatch.setattr(trainer, "_router_aux_loss", lambda: 0.5 * norm.sum())  # d/d(norm) = 0.5 per forward
    grads = []
    monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: grads.append(norm.grad.detach().clone()))
    trajs = fake_batch(adapter, n=3)
    trainer.train_step(trajs, {t.sample_id: 0.0 for t in trajs})  # zero advantages: no policy gradient
    (grad,) = grads
    torch.testing.assert_close(grad, torch.full_like(grad, 0.5))

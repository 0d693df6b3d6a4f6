"""Policy loss (ratio 1 case of the reference's loss + a clipped case by hand), gathered log-probs, LR schedules."""

from __future__ import annotations

import math

import pytest
import torch

from train.logprobs import full_logits_logprobs, gathered_logprobs
from train.loss import LossConfig, finalize_metrics, kl_estimate, policy_loss
from train.schedules import LRSchedule, lr_factor


def test_loss_with_equal_logprobs_is_minus_weighted_advantage_and_zero_kl():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(50, generator=g) * 5
    adv = torch.randn(50, generator=g)
    w = torch.full((50,), 1.0 / (4 * 30))  # padded_length weights: 1 / (rows * L1)
    out = policy_loss(logp.clone().requires_grad_(), logp, adv, w, LossConfig(beta=0.5, eps=0.2))
    assert out.loss.item() == pytest.approx(float(-(w * adv).sum()), abs=1e-6)
    assert out.metrics["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert finalize_metrics(out.metrics)["ratio_mean"] == pytest.approx(1.0)
    assert finalize_metrics(out.metrics)["clip_frac"] == 0.0


def test_clipped_case_by_hand():
    d = math.log(1.5)
    new = torch.tensor([d, d, -math.log(2), -math.log(2)])
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    w = torch.full((4,), 0.25)
    # ratio 1.5: A=+1 -> min(1.5, 1.2) = 1.2; A=-1 -> min(-1.5, -1.2) = -1.5
    # ratio 0.5: A=+1 -> min(0.5, 0.8) = 0.5; A=-1 -> min(-0.5, -0.8) = -0.8
    out = policy_loss(new, old, adv, w, LossConfig(eps=0.2, beta=0.0))
    assert out.loss.item() == pytest.approx(-0.25 * (1.2 - 1.5 + 0.5 - 0.8))
    # k3 by hand: exp(-d) - 1 + d
    k3 = torch.tensor([1 / 1.5 - 1 + d] * 2 + [2 - 1 - math.log(2)] * 2)
    torch.testing.assert_close(kl_estimate(new, old), k3)
    out_kl = policy_loss(new, old, adv, w, LossConfig(eps=0.2, beta=0.1))
    assert out_kl.loss.item() == pytest.approx(out.loss.item() + 0.1 * float((w * k3).sum()), abs=1e-6)
    assert finalize_metrics(out.metrics)["clip_frac"] == 1.0
    # the clamped log-ratio keeps exp finite however far the policies drift
    far = policy_loss(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), torch.ones(1),
                      LossConfig(beta=1.0))
    assert math.isfinite(far.loss.item()) and far.loss.item() == pytest.approx(math.exp(10) + 1 + 100 - 1, rel=1e-4)


def test_clip_gradient_is_zero_outside_trust_region():
    new = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    out = policy_loss(new, torch.zeros(2), torch.ones(2), torch.ones(2), LossConfig(eps=0.2))
    out.loss.backward()
    assert new.grad[0] == 0 and new.grad[1] == pytest.approx(-1.1)


def test_reference_model_kl_term():
    new, old, ref = torch.tensor([-1.0]), torch.tensor([-1.0]), torch.tensor([-2.0])
    out = policy_loss(new, old, torch.zeros(1), torch.ones(1), LossConfig(ref_beta=0.5), logp_ref=ref)
    assert out.loss.item() == pytest.approx(0.5 * (math.exp(-1) - 1 + 1))


def test_gathered_chunked_logprobs_equal_full_logits_and_grads():
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 37, bias=False)
    hidden = torch.randn(3, 10, 8, generator=g, requires_grad=True)
    rows, cols = torch.tensor([0, 0, 1, 2, 2]), torch.tensor([1, 9, 0, 4, 5])
    labels = torch.tensor([3, 36, 0, 7, 7])
    a = gathered_logprobs(head, hidden, rows, cols, labels, chunk_size=2)
    ga = torch.autograd.grad(a.sum(), (hidden, head.weight))
    b = full_logits_logprobs(head, hidden, rows, cols, labels)
    gb = torch.autograd.grad(b.sum(), (hidden, head.weight))
    torch.testing.assert_close(a, b)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y)
    assert a.dtype == torch.float32


# ---------------------------------------------------------------- schedules (a real min_lr_scale floor, stepped once)


def test_cosine_has_a_real_floor_and_never_rises_again():
    factors = [lr_factor("cosine", k, total_steps=10, warmup_steps=2, min_lr_scale=0.1) for k in range(30)]
    assert factors[:2] == [0.5, 1.0]
    assert factors[2] == pytest.approx(1.0) and factors[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert min(factors) == pytest.approx(0.1) and factors[-1] == pytest.approx(0.1)
    assert lr_factor("cosine", 6, total_steps=10, warmup_steps=2, min_lr_scale=0.0) == pytest.approx(0.5)


def test_other_schedules():
    assert [lr_factor("constant", k, warmup_steps=5) for k in (0, 9)] == [1.0, 1.0]
    assert [lr_factor("constant_with_warmup", k, warmup_steps=4) for k in (0, 3, 9)] == [0.25, 1.0, 1.0]
    assert lr_factor("linear", 5, total_steps=10, min_lr_scale=0.5) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor("cosine", 0)
    with pytest.raises(ValueError, match="not one of"):
        lr_factor("polynomial", 0)


def test_schedule_writes_lr_once_per_step():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = LRSchedule(opt, "linear", total_steps=4, min_lr_scale=0.0)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
    assert seen == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    state = sched.state_dict()
    other = LRSchedule(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), "linear", 4)
    other.load_state_dict(state)
    assert other.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

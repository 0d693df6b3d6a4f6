"""Policy loss (ratio 1 case of the reference's loss + a clipped case by hand), gathered log-probs, LR schedules."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.logprobs import full_logits_logprobs, gathered_logprobs, head_logprobs, token_logprobs
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


def _head_case(seed=0, tokens=5, vocab=37, hidden=8):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g))
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    labels = torch.tensor([0, 13, 14, 36, 29])[:tokens]  # in every slice of 14 columns (the last one 9 wide)
    return head, h, labels


def test_the_plain_head_function_gives_the_modules_logprobs_and_gradients():
    head, h, labels = _head_case()
    weight = torch.randn(37, 8, generator=torch.Generator().manual_seed(1))
    for chunk in (1, 2, 128):  # slices of 7 columns (5 tokens x 7 <= 1 x 37), of 14 (<= 2 x 37), one of 37
        fused = head_logprobs(h, head.weight, labels, chunk)
        module = token_logprobs(head, h, labels, chunk)
        torch.testing.assert_close(fused, module, atol=1e-5, rtol=1e-5)
        grads = [torch.autograd.grad((out * weight[:5, 0]).sum(), (h, head.weight)) for out in (fused, module)]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    expected = torch.log_softmax(h @ head.weight.T, -1)[torch.arange(5), labels]
    torch.testing.assert_close(head_logprobs(h, head.weight, labels, 2), expected, atol=1e-5, rtol=1e-5)


def test_the_plain_head_function_under_bf16_autocast_computes_as_the_module_does():
    head, h, labels = _head_case(tokens=5, vocab=37, hidden=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_logprobs(h, head.weight, labels, 2)
        module = token_logprobs(head, h, labels, 2)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, module, atol=0.05, rtol=0)  # both from bf16 products (rounding apart)
    exact = torch.log_softmax(h @ head.weight.T, -1)[torch.arange(5), labels]
    assert (fused - exact).abs().max() > 1e-4  # the products really were bf16 ones
    grads = [torch.autograd.grad(out.sum(), (h, head.weight)) for out in (fused, module)]
    assert grads[0][0].dtype == h.dtype and grads[0][1].dtype == head.weight.dtype
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)


def test_a_frozen_head_gets_no_gradient_and_labels_outside_the_vocabulary_are_refused():
    head, h, labels = _head_case()
    head.weight.requires_grad_(False)
    out = head_logprobs(h, head.weight, labels, 2)
    out.sum().backward()
    assert head.weight.grad is None and h.grad is not None
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 37\); got 0..37"):
        head_logprobs(h, head.weight, torch.tensor([0, 37]), 2)


def test_the_backward_keeps_the_forwards_dtype_under_an_enclosing_autocast():
    """A float32 forward's gradients are float32 products even if ``backward`` runs inside bf16 autocast."""
    head, h, labels = _head_case()
    grads = []
    for autocast in (False, True):
        out = head_logprobs(h, head.weight, labels, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            grads.append(torch.autograd.grad(out.sum(), (h, head.weight)))
    for plain, enclosed in zip(*grads):
        torch.testing.assert_close(enclosed, plain, rtol=1e-6, atol=1e-6)


class _Products(TorchDispatchMode):
    """The output shapes of the matrix products computed inside."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.shapes.append(tuple(out.shape))
        return out


def test_the_plain_head_function_holds_at_most_chunk_size_times_vocab_logits():
    head, h, labels = _head_case()
    with _Products() as products:
        head_logprobs(h, head.weight, labels, 2).sum().backward()
    logits = [s for s in products.shapes if s[0] == 5 and s != (5, 8)]  # [tokens, slice]; (5, 8): grad of h
    # forward, then the backward's recomputation: 3 slices each, 14 + 14 + 9 columns; 5 x 14 <= 2 x 37
    assert logits == [(5, 14), (5, 14), (5, 9)] * 2
    assert sorted(s for s in products.shapes if s[1] == 8 and s[0] != 5) == [(9, 8), (14, 8), (14, 8)]  # grad_w


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

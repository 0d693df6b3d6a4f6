"""The field's RL algorithms (train/algorithms/): each loss against a hand computation (value and gradient, fp32),
each view's rows for hand-written trajectories per family kind, every algorithm on every family, the refusals at
config load, fresh masks per inner iteration, and a resumed run with inner iterations."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from core.loader import ConfigError
from jobs.config import load_config
from sample.trajectory import Trajectory
from tests.test_train_trainer import PROMPTS, make_trainer, sampled
from tests.test_train_views import BLOCK2, DREAM, FULL, MASK, fake_block_trajectory, traj
from train.algorithms import RL_METHODS, algorithm
from train.algorithms.base import stratified_masks
from train.algorithms.bgpo import bgpo_surrogate
from train.algorithms.ebpo import per_block_stratified_masks
from train.algorithms.sequence_elbo import per_sample_elbo
from train.algorithms.spg import block_random_masks, spg_scores
from train.algorithms.wd1 import group_weights
from train.loss import policy_loss
from train.policy_trainer import PolicyTrainer
from train.settings import LossConfig, RLTrainingConfig, ViewConfig
from train.views import build_view

NEW = ("diffu_grpo", "wd1", "coupled_grpo", "spg", "bgpo", "espo", "ebpo", "cj_grpo", "vrpo")


def entries(logp, **fields):
    """A stand-in micro-batch: the per-token fields an algorithm's loss reads."""
    n = len(logp)
    base = {"sample_index": torch.zeros(n, dtype=torch.long), "unit": torch.zeros(n, dtype=torch.long),
            "token_index": torch.arange(n), "advantages": torch.ones(n), "weights": torch.full((n,), 1.0 / n),
            "old_logprobs": torch.zeros(n), "sample_ids": ["s0"], "num_units": 1, "num_tokens": n}
    extra = {"level": torch.ones(n), "resp_len": torch.full((n,), float(n)), "batch_resp_len": torch.full((n,), 4.0)}
    extra.update(fields.pop("extra", {}))
    base.update(fields)
    extra.setdefault("batch_samples", torch.full((n,), float(len(base["sample_ids"]))))  # as a view of one process
    extra.setdefault("batch_units", torch.full((n,), float(base["num_units"])))
    return SimpleNamespace(extra=extra, **base)


# ---------------------------------------------------------------- losses by hand


def test_wd1_weights_and_loss_by_hand():
    coef = group_weights([1.0, -1.0])
    assert coef == pytest.approx([math.tanh(1.0), -math.tanh(1.0)], abs=1e-12)  # e/(e+1/e) - (1/e)/(e+1/e)
    three = group_weights([0.5, 0.0, -0.5])
    assert sum(three) == pytest.approx(0.0, abs=1e-12) and three[1] == pytest.approx(0.0, abs=1e-12)
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    mb = entries(logp, sample_index=torch.tensor([0, 0, 1]), advantages=torch.tensor([0.7, 0.7, -0.7]),
                 weights=torch.full((3,), 0.5))
    out = algorithm("wd1").loss(logp, mb, RLTrainingConfig(method="wd1"))
    # -(1/2) [0.7 (-1 - 2) - 0.7 (-0.5)] = -(1/2)(-2.1 + 0.35) = 0.875
    assert float(out.loss.detach()) == pytest.approx(0.875, abs=1e-6)
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.35, -0.35, 0.35], abs=1e-6)


def test_wd1_groups_by_prompt():
    trajs = [Trajectory([5], [6], [1], [0.0], sample_id=f"s{i}", group_id=g) for i, g in enumerate("aab")]
    coef = algorithm("wd1").sample_advantages(trajs, {"s0": 1.0, "s1": -1.0, "s2": 2.0})
    assert coef["s0"] == pytest.approx(math.tanh(1.0)) and coef["s1"] == pytest.approx(-math.tanh(1.0))
    assert coef["s2"] == 0.0  # a group of one has nothing to prefer


def test_coupled_grpo_combines_a_tokens_three_passes_by_hand():
    # token 0: (a) -1.0, (b) at t = 0.25: -0.5; token 1: (a) -2.0, (c) at 1 - t = 0.75: -0.3
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.3], requires_grad=True)
    token = torch.tensor([0, 1, 0, 1])
    level = torch.tensor([1.0, 1.0, 0.25, 0.75])
    # combined new: 0.5 (-1) + 0.5 (-0.5) / 0.25 = -1.5 and 0.5 (-2) + 0.5 (-0.3) / 0.75 = -1.2
    old = torch.tensor([-1.0, -1.0, -0.55, -1.5])  # combined old: -1.6 and -1.5
    mb = entries(logp, token_index=token, old_logprobs=old, weights=torch.full((4,), 0.25),
                 unit=torch.tensor([0, 0, 1, 2]), extra={"level": level})
    cfg = RLTrainingConfig(method="coupled_grpo", eps=0.2)
    out = algorithm("coupled_grpo").loss(logp, mb, cfg)
    r0, r1 = math.exp(0.1), math.exp(0.3)  # token 1's ratio 1.35 is clipped to 1.2 (A > 0: min picks it)
    assert float(out.loss.detach()) == pytest.approx(-(0.5 * r0 + 0.5 * 1.2), abs=1e-6)
    out.loss.backward()
    # d/d l_entry = -w_token * ratio * coef_entry for the unclipped token; 0 for the clipped one
    assert logp.grad.tolist() == pytest.approx([-0.5 * r0 * 0.5, 0.0, -0.5 * r0 * 2.0, 0.0], abs=1e-6)
    assert r1 > 1.2


def test_spg_elbo_and_eubo_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    unit, token, level = torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1]), torch.tensor([0.5, 0.5, 0.25])
    elbo, eubo = (t.detach() for t in spg_scores(logp, unit, token, level, beta=1.0))
    assert float(elbo) == pytest.approx(-1.0)  # mean(mean(-1, -2), -0.5)
    p0 = math.exp(-1) / 0.5 / 2
    p1 = (math.exp(-2) / 0.5 + math.exp(-0.5) / 0.25) / 2
    assert float(eubo) == pytest.approx((math.log(p0) + math.log(p1)) / 2, abs=1e-6)
    # the whole loss: a negative advantage scores w EUBO + (1 - w) ELBO, weighted |o| / sum |o| = 3 / 4
    mb = entries(logp, unit=unit, token_index=token, advantages=torch.full((3,), -1.0), extra={"level": level})
    cfg = RLTrainingConfig(method="spg", eubo_beta=1.0, eubo_weight=0.5)
    out = algorithm("spg").loss(logp, mb, cfg)
    score = 0.5 * float(eubo) + 0.5 * float(elbo)
    assert float(out.loss.detach()) == pytest.approx(-(3 / 4) * -1.0 * score, abs=1e-6)
    positive = algorithm("spg").loss(logp, entries(logp, unit=unit, token_index=token, extra={"level": level}), cfg)
    assert float(positive.loss.detach()) == pytest.approx(-(3 / 4) * float(elbo), abs=1e-6)  # A > 0: the ELBO only
    positive.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.75 * 0.25, -0.75 * 0.25, -0.75 * 0.5], abs=1e-6)


def test_spg_eubo_is_summed_in_log_space_and_stays_finite_far_below_exp_range():
    """exp(1.5 x -80) underflows in float32: the EUBO must still be the formula's value (here one draw, t = 1: the
    mean of the log-probs) and a zero-advantage sample must add a zero gradient, not NaN."""
    logp = torch.tensor([-80.0, -1.0], requires_grad=True)
    _, eubo = spg_scores(logp, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]), beta=1.5)
    assert float(eubo.detach()) == pytest.approx(-40.5, abs=1e-4)
    (0.0 * eubo).backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_spg_gives_no_rows_for_a_response_with_nothing_to_train():
    from tests.test_train_views import BLOCK2, FULL, traj
    from train.settings import ViewConfig
    from train.views import build_view

    ok, pad = traj([5, 6], [7, 8], [1, 2], sid="ok"), traj([5, 6], [0, 0], [1, 2], sid="pad")  # padding only
    for traits in (BLOCK2, FULL):
        alone = build_view([ok], {"ok": 1.0}, ViewConfig(method="spg", mask_times_per_sample=2), traits)
        both = build_view([ok, pad], {"ok": 1.0, "pad": -1.0}, ViewConfig(method="spg", mask_times_per_sample=2),
                          traits)
        assert both.num_rows == alone.num_rows > 0


def test_bgpo_ratio_is_linear_for_positive_advantages_and_dual_clipped_for_negative():
    delta = torch.tensor([0.1, 0.1, 2.0, 0.5], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    surrogate, ratio = bgpo_surrogate(delta, adv, eps=0.2, eps_high=None, dual_clip=3.0)
    assert ratio.tolist() == pytest.approx([1.1, math.exp(0.1), math.exp(2.0), 1.5], abs=1e-6)
    # A > 0, r = 1.5 clipped to 1.2; A < 0 with r = e^2: min(-7.39, -1.2) = -7.39, floored at 3 A = -3
    assert surrogate.tolist() == pytest.approx([1.1, -math.exp(0.1), -3.0, 1.2], abs=1e-6)
    surrogate.sum().backward()
    assert delta.grad.tolist() == pytest.approx([1.0, -math.exp(0.1), 0.0, 0.0], abs=1e-6)  # Taylor: gradient A


def test_bgpo_loss_is_a_mean_over_draws():
    logp = torch.tensor([-1.0, -3.0, -0.5], requires_grad=True)
    mb = entries(logp, unit=torch.tensor([0, 0, 1]), old_logprobs=torch.tensor([-1.2, -3.0, -0.5]), num_units=2)
    out = algorithm("bgpo").loss(logp, mb, RLTrainingConfig(method="bgpo"))
    # unit 0: l = -2, l_old = -2.1, r = 1.1; unit 1: r = 1
    assert float(out.loss.detach()) == pytest.approx(-(1.1 + 1.0) / 2, abs=1e-6)


def test_espo_sequence_elbo_ratio_by_hand():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    unit, level = torch.tensor([0, 0, 1]), torch.tensor([0.5, 0.5, 0.25])
    samples, elbo = per_sample_elbo(logp.detach(), torch.zeros(3, dtype=torch.long), unit, level)
    assert float(elbo[0]) == pytest.approx((-3 / 0.5 - 3 / 0.25) / 2)  # -9
    old = torch.tensor([-1.0, -2.0, -3.1])  # ELBO_old = (-6 - 12.4) / 2 = -9.2
    mb = entries(logp, unit=unit, old_logprobs=old, extra={"level": level, "resp_len": torch.full((3,), 2.0)})
    out = algorithm("espo").loss(logp, mb, RLTrainingConfig(method="espo", eps=0.2))
    rho = math.exp(0.2 / 2)
    assert float(out.loss.detach()) == pytest.approx(-rho, abs=1e-6)
    out.loss.backward()
    # d loss / d l_k = -rho A (1/L) / (t_k n_units)
    assert logp.grad.tolist() == pytest.approx([-rho / 2 / 0.5 / 2, -rho / 2 / 0.5 / 2, -rho / 2 / 0.25 / 2],
                                               abs=1e-6)


@pytest.mark.parametrize("method", ["espo", "bgpo"])
def test_sequence_losses_weigh_samples_alike_on_every_process(method):
    """Two processes, shards [s0, s1] and [s2]: rescaled by the step's counts, the mean of their losses (data
    parallelism averages the gradients) is one process's loss on the whole batch; by their own counts the lone
    sample would weigh double (-1/3 became 0)."""
    from train.views import NORM_COUNTS, normalised_over_processes

    trajs = [traj([5, 6], [10, 11, 1], [1, 2, 2], sid=f"s{i}", finish="eos") for i in range(3)]
    adv = {"s0": 1.0, "s1": 1.0, "s2": -1.0}
    cfg, rl = ViewConfig(method=method, mask_times_per_sample=2), RLTrainingConfig(method=method)

    def loss(view):  # every ratio 1: the loss is minus the mean advantage over samples (ESPO) or draws (BGPO)
        zeros = torch.zeros(view.num_tokens)
        return float(algorithm(method).loss(zeros, replace(view, old_logprobs=zeros), rl).loss)

    views = [build_view(shard, adv, cfg, FULL) for shard in (trajs[:2], trajs[2:])]
    totals = {k: sum(v.counts[k] for v in views) for k in NORM_COUNTS}
    totals["longest"] = max(v.counts["longest"] for v in views)
    shards = [loss(normalised_over_processes(v, totals, 2)) for v in views]
    assert loss(build_view(trajs, adv, cfg, FULL)) == pytest.approx(-1 / 3, abs=1e-6)
    assert sum(shards) / 2 == pytest.approx(-1 / 3, abs=1e-6)
    assert sum(loss(v) for v in views) / 2 == pytest.approx(0.0, abs=1e-6)  # each shard by its own counts


def test_ebpo_composite_ratio_and_reference_kl():
    logp = torch.tensor([-1.0, -0.5], requires_grad=True)
    level = torch.tensor([0.5, 1.0])
    mb = entries(logp, old_logprobs=torch.tensor([-1.05, -0.5]), advantages=torch.full((2,), -1.0),
                 extra={"level": level})
    cfg = RLTrainingConfig(method="ebpo", eps=0.2, ref_beta=0.5)
    ref = torch.tensor([-1.0, -0.6])
    out = algorithm("ebpo").loss(logp, mb, cfg, ref)
    c, c_old, c_ref = -1 / 0.5 - 0.5, -1.05 / 0.5 - 0.5, -1 / 0.5 - 0.6  # -2.5, -2.6, -2.6
    ratio = math.exp(c - c_old)
    kl = math.exp(c_ref - c) - 1 - (c_ref - c)
    assert float(out.loss.detach()) == pytest.approx(ratio + 0.5 * kl, abs=1e-6)  # -(A ratio), A = -1
    k1 = algorithm("ebpo").loss(logp, mb, RLTrainingConfig(method="ebpo", eps=0.2, ref_beta=0.5,
                                                           use_kl_estimator_k3=False), ref)
    assert float(k1.loss.detach()) == pytest.approx(ratio + 0.5 * (c - c_ref), abs=1e-6)  # the plain log-ratio


def test_vrpo_pairs_chosen_and_rejected_responses_of_a_group_by_hand():
    # group 0: sample 0 chosen (A > 0), samples 1 and 2 rejected; group 1: sample 3 alone (no pair)
    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0, -0.5], requires_grad=True)
    ref = torch.tensor([-1.5, -2.0, -2.5, -4.0, -0.5])
    index = torch.tensor([0, 0, 1, 2, 3])
    mb = entries(logp, sample_index=index, unit=index, advantages=torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0]),
                 extra={"level": torch.tensor([0.5, 0.5, 1.0, 0.5, 1.0]), "group": torch.tensor([0, 0, 0, 0, 1]),
                        "resp_len": torch.tensor([2.0, 2.0, 1.0, 2.0, 1.0]), "batch_groups": torch.full((5,), 2.0)})
    out = algorithm("vrpo").loss(logp, mb, RLTrainingConfig(method="vrpo", preference_beta=0.5), ref)
    # margins (B - B_ref) / L: sample 0: (-6 - -7) / 2 = 0.5; sample 1: (-3 - -2.5) / 1 = -0.5; sample 2: 0
    pair = [-math.log(1 / (1 + math.exp(-0.5 * (0.5 - m)))) for m in (-0.5, 0.0)]
    assert float(out.loss.detach()) == pytest.approx(sum(pair) / 2 / 2, abs=1e-6) and out.metrics["pairs"] == 2
    out.loss.backward()
    sig = [1 / (1 + math.exp(0.5 * (0.5 - m))) for m in (-0.5, 0.0)]  # sigmoid(-beta x) = -d(-log sigmoid)/dx
    d_margin0 = -0.5 * sum(sig) / 2 / 2
    assert logp.grad[:2].tolist() == pytest.approx([d_margin0 / 0.5 / 2] * 2, abs=1e-6)  # dB/dl = 1 / (t L)
    assert float(logp.grad[4]) == 0.0  # a group without a pair does not train


def test_vrpo_micro_batch_without_a_pair_backpropagates_zeros():
    """Under DDP every micro-batch must run a backward; one holding only groups without a pair (all correct, kept
    by the reward filters) gives a zero loss that is still part of the graph."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    mb = entries(logp, sample_index=torch.tensor([0, 1]), unit=torch.tensor([0, 1]),
                 advantages=torch.tensor([0.0, 0.0]),
                 extra={"level": torch.tensor([0.5, 0.5]), "group": torch.tensor([0, 0]),
                        "resp_len": torch.tensor([1.0, 1.0]), "batch_groups": torch.full((2,), 1.0)})
    out = algorithm("vrpo").loss(logp, mb, RLTrainingConfig(method="vrpo"), torch.tensor([-1.0, -2.0]))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0 and out.metrics["pairs"] == 0 and logp.grad.tolist() == [0.0, 0.0]


def test_gspo_sequence_ratio_replaces_token_ratios():
    new = torch.tensor([-1.0, -1.0, -2.0], requires_grad=True)
    old = torch.tensor([-1.2, -1.0, -1.9])
    cfg = LossConfig(eps=0.3, ratio_level="sequence")
    out = policy_loss(new, old, torch.ones(3), torch.full((3,), 1 / 3), cfg, sequences=torch.tensor([4, 4, 7]))
    r_a, r_b = math.exp(0.1), math.exp(-0.1)  # sample 4: mean(0.2, 0) = 0.1; sample 7: -0.1
    assert float(out.loss.detach()) == pytest.approx(-(2 * r_a + r_b) / 3, abs=1e-6)
    out.loss.backward()
    # every token of sample 4 gets d/dl = -(1/3) * 2 tokens * r_a * (1/2) = -r_a / 3
    assert new.grad.tolist() == pytest.approx([-r_a / 3, -r_a / 3, -r_b / 3], abs=1e-6)


# ---------------------------------------------------------------- views by hand


def test_diffu_grpo_rows_mask_the_completion_and_noise_the_prompt():
    t = traj([5, 6, 7], [10, 11, 12, 1], [1, 1, 2, 2], finish="eos")
    full = build_view([t], {"a": 1.0}, ViewConfig(method="diffu_grpo", prompt_mask_p=1.0), FULL)
    assert full.input_ids.tolist() == [[MASK] * 7] and full.weights.tolist() == pytest.approx([0.25] * 4)
    dream = build_view([t], {"a": 1.0}, ViewConfig(method="diffu_grpo", prompt_mask_p=0.0), DREAM)
    assert dream.input_ids.tolist() == [[5, 6, 7, MASK, MASK, MASK, MASK]] and dream.cols.tolist() == [2, 3, 4, 5]
    # block model (block 2): [clean prompt + response | noisy copies of blocks 1..3]; the prompt's tail token 7
    # sits in block 1's copy and is masked there too; blocks before the last copied one stay clean
    block = build_view([t], {"a": 1.0}, ViewConfig(method="diffu_grpo", prompt_mask_p=1.0), BLOCK2)
    (row,) = block.input_ids.tolist()
    assert row == [MASK, MASK, MASK, 10, 11, 12] + [MASK] * 5  # copies of positions 2..6
    assert block.labels.tolist() == [10, 11, 12, 1] and not block.exact


def test_coupled_grpo_units_are_full_mask_and_complement():
    t = traj([5, 6], [10, 11, 12, 13, 14, 15], [1] * 6)
    batch = build_view([t], {"a": 1.0}, ViewConfig(method="coupled_grpo", seed=3), FULL)
    level = batch.extra["level"]
    ids = batch.input_ids[:, 2:]
    assert len(ids) == 3 and (ids[0] == MASK).all()  # (a): the completion fully masked
    assert torch.equal((ids[1] == MASK) ^ (ids[2] == MASK), torch.ones(6, dtype=torch.bool))  # (b), (c) complement
    t_level = float(level[batch.unit == 1][0])
    assert 0.1 <= t_level <= 0.9 and float(level[batch.unit == 2][0]) == pytest.approx(1 - t_level)
    assert sorted(batch.token_index[batch.unit > 0].tolist()) == list(range(6))  # each token once in (b) or (c)


def test_spg_block_random_masks_a_suffix_from_a_partial_block():
    gen = torch.Generator().manual_seed(0)
    block_of = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    masks, first = block_random_masks(block_of, torch.ones(8, dtype=torch.bool), 50, gen)
    for mask, b in zip(masks, first.tolist()):
        assert not mask[block_of < b].any() and mask[block_of > b].all()
        assert 1 <= int(mask[block_of == b].sum()) <= int((block_of == b).sum())
    assert set(first.tolist()) == {0, 1, 2}
    t = traj([5], list(range(10, 18)), [1] * 8)
    batch = build_view([t], {"a": 1.0}, ViewConfig(method="spg", mask_times_per_sample=2, prompt_mask_p=0.0), FULL)
    for unit in (0, 1):
        trained = batch.token_index[batch.unit == unit]
        assert float(batch.extra["level"][batch.unit == unit][0]) == pytest.approx(len(trained) / 8)


def test_spg_block_model_trains_every_token_after_the_chosen_block():
    rng = random.Random(1)
    t = fake_block_trajectory(rng, "a", 3, 7, 2, 2, 90, MASK, tail=False)
    batch = build_view([t], {"a": 1.0}, ViewConfig(method="spg", mask_times_per_sample=6, prompt_mask_p=0.0,
                                                   layout="per_round"), BLOCK2)
    block_of = (3 + torch.arange(7)) // 2  # absolute blocks of the response tokens
    assert batch.num_rows == 6
    for row in range(batch.num_rows):
        trained = batch.token_index[batch.rows == row]
        chosen = int(block_of[trained].min())
        assert set(range(7)) - set(trained.tolist()) <= set((block_of <= chosen).nonzero().squeeze(1).tolist())
        level = batch.extra["level"][batch.rows == row]
        assert float(level[0]) == pytest.approx(len(trained) / 7)


def test_stratified_and_per_block_masks():
    gen = torch.Generator().manual_seed(0)
    masks, level = stratified_masks(10, 4, gen)
    counts = masks.sum(1)
    assert counts.tolist() == sorted(counts.tolist()) and len(set(counts.tolist())) == 4  # one count per stratum
    assert level[:, 0].tolist() == pytest.approx((counts / 10).tolist())
    block_of = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    masks, level = per_block_stratified_masks(block_of, 3, gen)
    for mask, lv in zip(masks, level):
        for b in range(3):
            inside = block_of == b
            assert int(mask[inside].sum()) >= 1
            assert float(lv[inside][0]) == pytest.approx(float(mask[inside].float().mean()))


def test_cj_grpo_weighs_each_decoding_step_equally():
    t = traj([5], [10, 11, 12], [1, 2, 2])
    batch = build_view([t], {"a": 1.0}, ViewConfig(method="cj_grpo"), FULL)
    weights = {int(u): batch.weights[batch.unit == u].tolist() for u in batch.unit.unique()}
    assert weights == {0: pytest.approx([0.5]), 1: pytest.approx([0.25, 0.25])}



@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_cj_grpo_on_a_block_model_weighs_decoding_steps_not_rounds(layout):
    # blocks of 2: block 1 decoded at steps 1, 2; block 2 at steps 3, 3; block 3 at 4, 5. TraceRL's rounds mix
    # steps of several blocks (round 1: steps 1, 3, 4); CJ-GRPO's mean is per step: S = 5, 1/5 per step
    t = traj([5, 6], [10, 11, 12, 13, 14, 15], [1, 2, 3, 3, 4, 5])
    batch = build_view([t], {"a": 1.0}, ViewConfig(method="cj_grpo", layout=layout), BLOCK2)
    by_step = {}
    for step, w in zip(batch.steps.tolist(), batch.weights.tolist(), strict=True):
        by_step.setdefault(step, []).append(w)
    assert by_step == {1: pytest.approx([0.2]), 2: pytest.approx([0.2]), 3: pytest.approx([0.1, 0.1]),
                       4: pytest.approx([0.2]), 5: pytest.approx([0.2])}
    assert batch.counts["steps"] == 5 and batch.num_units == 2  # two TraceRL rounds


# ---------------------------------------------------------------- every algorithm on every family

FAMILIES = ("sdar", "dream", "llada", "mmada", "sdar_moe", "llada2", "llada_moe")


@pytest.fixture(scope="module")
def rollouts(demo_tokenizer):
    from models.tiny import build_tiny

    out = {}
    for base in FAMILIES:
        adapter = build_tiny(base, demo_tokenizer, seed=3)
        params = {} if adapter.attention == "block" else {"block_size": 4}
        trajs = sampled(adapter, PROMPTS * 2, max_tokens=8, **params)
        for i, t in enumerate(trajs):
            t.group_id = str(i % 3)
        out[base] = trajs
    return out


def _with_reference(ref_model):
    init = PolicyTrainer.__init__

    def with_reference(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "ref_model": ref_model})

    return with_reference


@pytest.mark.parametrize("base", FAMILIES)
@pytest.mark.parametrize("method", RL_METHODS)
def test_every_algorithm_trains_every_family_or_refuses_it(tiny, rollouts, base, method, monkeypatch):
    adapter = tiny(base, seed=3)
    trajs = rollouts[base]
    adv = {t.sample_id: (1.0 if i % 2 else -1.0) * (0.5 + i / 10) for i, t in enumerate(trajs)}
    view = ViewConfig(method=method, mask_times_per_sample=2)
    trainer_args = dict(learning_rate=1e-3, view=view, micro_batch_size=3, num_train_epochs=2)
    if method == "ebpo" and adapter.attention != "block":
        with pytest.raises(ValueError, match="cannot train full-attention models: it noises every block"):
            make_trainer(adapter, **trainer_args).train_step(trajs, adv)
        return
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    if method == "vrpo":  # a frozen reference is part of its loss
        with pytest.raises(ValueError, match="needs a frozen reference model"):
            make_trainer(adapter, **trainer_args)
        monkeypatch.setattr(PolicyTrainer, "__init__", _with_reference(tiny(base, seed=4).model))
    trainer = make_trainer(adapter, **trainer_args)
    pos, neg = [t for t in trajs if adv[t.sample_id] > 0], [t for t in trajs if adv[t.sample_id] < 0]
    start = _mean_logprob(trainer, pos), _mean_logprob(trainer, neg)
    metrics = trainer.train_step(trajs, adv)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) for m in metrics)
    changed = max(float((before[k] - v).abs().max()) for k, v in adapter.model.state_dict().items())
    assert changed > 1e-4
    # the update's direction: the positive-advantage responses gain likelihood against the negative ones
    rise_pos, rise_neg = _mean_logprob(trainer, pos) - start[0], _mean_logprob(trainer, neg) - start[1]
    assert rise_pos > rise_neg, (rise_pos, rise_neg)


def _mean_logprob(trainer, trajs) -> float:
    """Mean log-prob of the responses' tokens, each in the context the sampler wrote it in (the TraceRL view: one
    yardstick for every method, whatever its own view draws)."""
    yardstick = replace(trainer.cfg, method="tracerl")
    return float(trainer.logprobs(build_view(trajs, {t.sample_id: 1.0 for t in trajs}, yardstick,
                                             trainer.traits)).mean())


def test_fresh_masks_draw_new_rows_and_compute_every_old_logprob_before_any_update(tiny, rollouts, monkeypatch):
    adapter = tiny("llada", seed=3)
    trajs = rollouts["llada"]
    adv = {t.sample_id: 1.0 if i % 2 else -1.0 for i, t in enumerate(trajs)}
    trainer = make_trainer(adapter, learning_rate=1e-2, view=ViewConfig(method="diffu_grpo", prompt_mask_p=0.5),
                           micro_batch_size=64, num_train_epochs=3, old_logp="recompute")
    seen, updates = [], []
    compute, step = trainer.compute_old_logprobs, trainer.optimizer_step
    monkeypatch.setattr(trainer, "compute_old_logprobs",
                        lambda plan: (seen.append((len(updates), plan[0][0].input_ids.clone())), compute(plan))[1])
    monkeypatch.setattr(trainer, "optimizer_step", lambda micro: (updates.append(1), step(micro))[1])
    metrics = trainer.train_step(trajs, adv)
    assert [n for n, _ in seen] == [0, 0, 0]  # three iterations' old log-probs, all before the first update
    assert not torch.equal(seen[0][1], seen[1][1]) and not torch.equal(seen[1][1], seen[2][1])  # fresh prompt masks
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the first pass: old == new
    assert abs(metrics[1]["ratio_mean"] - 1.0) > 1e-4  # later iterations: old is the step's start policy


@pytest.mark.parametrize("method", ["vrpo", "espo"])
def test_micro_batches_hold_whole_groups_or_whole_samples(tiny, rollouts, method, monkeypatch):
    adapter = tiny("llada", seed=3)
    monkeypatch.setattr(PolicyTrainer, "__init__", _with_reference(tiny("llada", seed=4).model))
    trainer = make_trainer(adapter, view=ViewConfig(method=method, mask_times_per_sample=2), micro_batch_size=1)
    trajs = rollouts["llada"]
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, trainer.cfg, trainer.traits)
    key = "group" if method == "vrpo" else None
    micro = trainer.micro_batches(batch, 0)
    assert sum(mb.num_rows for mb in micro) == batch.num_rows and len(micro) > 1
    owners = [set((mb.extra["group"] if key else mb.sample_index).tolist()) for mb in micro]
    full = batch.extra["group"] if key else batch.sample_index
    for mb, own in zip(micro, owners):
        part = mb.extra["group"] if key else mb.sample_index
        assert all(int((part == o).sum()) == int((full == o).sum()) for o in own)  # every token of its owners
    assert sum(len(o) for o in owners) == len(set().union(*owners))  # no owner split over micro-batches


def test_refusals_at_config_load():
    base = ["config=configs/demo/rl_demo.yaml"]
    with pytest.raises(ConfigError, match="key .training.method.: method must be one of TraceRL, .*diffu-GRPO, wd1"):
        load_config([*base, "training.method=grpo_v9"], "rl")
    with pytest.raises(ConfigError, match="training.method 'ebpo' cannot train 'llada', a full-attention model: it "
                                          "noises every block on its own"):
        load_config([*base, "training.method=ebpo", "model.model_base=llada"], "rl")
    with pytest.raises(ConfigError, match="reward.advantage 'grpo' contradicts training.method 'diffu_grpo'"):
        load_config([*base, "training.method=d1", "reward.advantage=grpo"], "rl")
    with pytest.raises(ConfigError, match="training.method 'wd1' cannot train with the value model"):
        load_config(["config=configs/rl_trado_with_value.yaml", "training.method=wd1"], "rl")
    with pytest.raises(ConfigError, match="elbo_weight"):
        load_config([*base, "training.method=spg", "training.elbo_weight=true"], "rl")
    cfg = load_config([*base, "training.method=coupled-grpo"], "rl")
    assert cfg.training.method == "coupled_grpo" and cfg.reward.advantage == "rloo"
    # a key of the shared loss a method's own loss never reads, and a key only another method reads: refused
    for method, override, why in [("wd1", "training.ref_beta=0.04", "its loss does not read it"),
                                  ("spg", "training.eps=0.3", "its loss does not read it"),
                                  ("espo", "training.beta=0.01", "its loss does not read it"),
                                  ("vrpo", "training.use_kl_estimator_k3=false", "its loss does not read it"),
                                  ("tracerl", "training.dual_clip=2", "only BGPO's loss reads it"),
                                  ("bgpo", "training.preference_beta=0.5", "only VRPO's loss reads it")]:
        with pytest.raises(ConfigError, match=f"key 'training.{override[9:].split('=')[0]}'.*{why}"):
            load_config([*base, f"training.method={method}", override], "rl")
    for method, override in [("espo", "training.ref_beta=0.01"), ("ebpo", "training.use_kl_estimator_k3=false"),
                             ("bgpo", "training.dual_clip=2"), ("spg", "training.eubo_beta=1.0"),
                             ("diffu_grpo", "training.ref_beta=0.04")]:
        load_config([*base, f"training.method={method}", override], "rl")  # read by that method's loss


# ---------------------------------------------------------------- RL jobs


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, demo_tokenizer):
    from models.tiny import save_tiny_checkpoint

    base = tmp_path_factory.mktemp("algo_ckpts")
    return {m: save_tiny_checkpoint(base / m, m, demo_tokenizer, size="test") for m in ("sdar", "dream", "llada")}


@pytest.mark.parametrize("method", NEW)
def test_two_rl_steps_of_each_new_algorithm(tmp_path, ckpts, method, monkeypatch):
    from jobs.rl import run_rl
    from tests import rl_harness
    from tests.test_rl import demo_args, weights

    rl_harness.install(patch=monkeypatch.setattr)
    base = "sdar" if method in ("ebpo", "spg", "wd1") else ("dream" if method in ("coupled_grpo", "espo") else "llada")
    over = {"experiment.total_step": 2, "training.num_train_epochs": 2, "training.mask_times_per_sample": 2}
    if base != "sdar":
        over.update({"rollout.block_size": 4, "rollout.steps": 8, "evaluation.block_size": 4, "evaluation.steps": 8})
    cfg = load_config(demo_args(tmp_path, ckpts[base], base, **over), "rl")
    history = run_rl(cfg, progress=False)
    assert [m["step"] for m in history] == [1, 2]
    for step in (1, 2):
        d = tmp_path / "run" / f"step_{step}"
        assert (d / "ckpt" / "DONE").is_file() and json.loads((d / "metrics.json").read_text())["optimizer_steps"] >= 2
    from safetensors.torch import load_file

    start = load_file(str(ckpts[base] / "model.safetensors"))
    end = weights(tmp_path / "run" / "step_2")
    assert max(float((start[k].float() - end[k].float()).abs().max()) for k in start) > 1e-4


@pytest.mark.slow
def test_resume_after_sigkill_with_inner_iterations_equals_an_uninterrupted_run(tmp_path, ckpts):
    from tests.test_rl import _harness, comparable, demo_args, weights

    over = {"training.method": "diffu_grpo", "training.num_train_epochs": 2, "training.ref_beta": 0.0}
    whole = tmp_path / "whole"
    proc = _harness(demo_args(whole, ckpts["sdar"], **over))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = comparable([json.loads(x) for x in (whole / "run" / "metrics.jsonl").read_text().splitlines()])
    out = tmp_path / "killed"
    killed = _harness(demo_args(out, ckpts["sdar"], **over), kill="train:2")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _harness(demo_args(out, ckpts["sdar"], **over, **{"experiment.start_from_scratch": "false"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = comparable([json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()])
    assert got == reference
    final = weights(whole / "run" / "step_3")
    assert all(torch.equal(final[k], v) for k, v in weights(out / "run" / "step_3").items())

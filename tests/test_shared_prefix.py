"""Shared prompts in training (train/shared_prefix.py): the rows of one prompt forward its complete blocks once, and
the log-probs, gradients and updates equal those of one forward of every row."""

from __future__ import annotations

import random

import pytest
import torch

from models.lora import LoraSettings, wrap
from tests.test_train_trainer import make_trainer
from tests.test_train_views import fake_block_trajectory
from train.settings import ViewConfig
from train.shared_prefix import shared_prefix_plan
from train.trainer import grouped_order
from train.views import ModelTraits, build_view


def grouped_trajectories(adapter, prompt_lengths=(25, 22, 3), copies=3, seed=0):
    """``copies`` samples of each prompt (prompt lengths 25, 22, 3 at block 4: 24, 20 and 0 columns to share)."""
    rng = random.Random(seed)
    vocab, b = adapter.model.config.vocab_size, adapter.block_size
    out = []
    for g, length in enumerate(prompt_lengths):
        prompt = [rng.randrange(2, vocab) for _ in range(length)]
        for c in range(copies):
            t = fake_block_trajectory(rng, f"g{g}-{c}", length, rng.randint(5, 11), b, 3, vocab, adapter.mask_id)
            t.prompt_ids, t.group_id = list(prompt), f"g{g}"
            out.append(t)
    return out


def advantages_of(trajs):
    return {t.sample_id: (-1.0) ** i * (1 + i / 10) for i, t in enumerate(trajs)}


def logprobs_and_grads(adapter, batch, share, **cfg):
    trainer = make_trainer(adapter, micro_batch_size=64, share_prompts=share, **cfg)
    trainer.model.train()
    trainer.model.zero_grad()
    logp = trainer.forward_logprobs(trainer.model, batch)
    (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logp.detach(), grads


@pytest.mark.parametrize(("layout", "checkpointing", "lora"), [("packed", False, False), ("per_round", False, False),
                                                                ("packed", True, False), ("per_round", True, True)])
def test_shared_prompts_give_the_same_logprobs_and_gradients(tiny, monkeypatch, layout, checkpointing, lora):
    monkeypatch.setattr("train.shared_prefix.MAX_SHARED_FRACTION", 10.0)  # share even beside a row without a prefix
    adapter = tiny("sdar", seed=3, block_size=4)
    if lora:  # peft's wrapper passes the caches through (B = 0 at the start: only the B matrices get gradients)
        wrap(adapter, LoraSettings(enabled=True, rank=4, alpha=8))
    trajs = grouped_trajectories(adapter)
    cfg = ViewConfig(layout=layout, max_row_tokens=40 if layout == "packed" else None)
    batch = build_view(trajs, advantages_of(trajs), cfg, ModelTraits.from_adapter(adapter))
    plan = shared_prefix_plan(batch)
    assert plan is not None
    # one prefix per prompt with complete blocks (25 -> 24 columns, 22 -> 20; the 3-token prompt has none)
    assert sorted(int(v.sum()) for v in plan.prefix_layout.valid) == [20, 24]
    assert sorted(batch.shared_cols.tolist()) == sorted(
        {25: 24, 22: 20, 3: 0}[len(trajs[int(s)].prompt_ids)] for s in batch.row_sample)
    assert not plan.visible[batch.shared_cols == 0].any()
    kw = {"gradient_checkpointing": checkpointing}
    shared_logp, shared_grads = logprobs_and_grads(adapter, batch, True, **kw)
    plain_logp, plain_grads = logprobs_and_grads(adapter, batch, False, **kw)
    torch.testing.assert_close(shared_logp, plain_logp, rtol=0, atol=2e-5)
    assert shared_grads.keys() == plain_grads.keys() and len(plain_grads) > 5
    for name, grad in plain_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def one_step_trainer(tiny, **cfg):
    """A trainer of a fresh tiny SDAR (seed 4) taking one smooth optimiser step: AdamW's epsilon at 1 makes the
    first update g / (|g| + 1). At 1e-8 it would be lr x sign(g) for any gradient above 1e-8, so a rounding-level
    difference on a near-zero gradient could flip a weight's whole step."""
    return make_trainer(tiny("sdar", seed=4, block_size=4), micro_batch_size=4, learning_rate=1.0, epsilon=1.0,
                        old_logp="recompute", **cfg)


def flat_parameters(trainer_or_adapter) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer_or_adapter.model.parameters()])


def assert_the_same_update(start: torch.Tensor, after: list[torch.Tensor]) -> None:
    assert all(float((a - start).abs().max()) > 1e-4 for a in after)  # each step moved the weights
    torch.testing.assert_close(after[0], after[1], rtol=0, atol=1e-5)


def test_a_training_step_with_shared_prompts_makes_the_same_update(tiny):
    adapter = tiny("sdar", seed=4, block_size=4)
    trajs = grouped_trajectories(adapter, prompt_lengths=(29, 26), copies=4, seed=1)
    advantages = advantages_of(trajs)
    after = []
    for share in (True, False):
        trainer = one_step_trainer(tiny, share_prompts=share)
        assert len(trainer.train_step(trajs, advantages)) == 1  # one optimiser step
        after.append(flat_parameters(trainer))
    assert_the_same_update(flat_parameters(adapter), after)


def test_shuffled_micro_batches_keep_a_prompts_rows_together_and_make_the_same_update(tiny):
    """The micro-batches of one optimiser step add up, so dealing them a prompt at a time changes no update, while
    each micro-batch then forwards one shared prompt instead of several."""
    adapter = tiny("sdar", seed=4, block_size=4)
    trajs = grouped_trajectories(adapter, prompt_lengths=(29, 26, 21), copies=4, seed=1)
    random.Random(0).shuffle(trajs)  # the samples of a prompt arrive apart
    advantages = advantages_of(trajs)
    after = []
    for shuffle in (True, False):
        trainer = one_step_trainer(tiny, shuffle=shuffle)
        micro = trainer.micro_batches(trainer.build_views(trajs, advantages)[0], 0)
        assert [mb.num_rows for mb in micro] == [4, 4, 4]
        groups = [set(mb.extra["group"].tolist()) for mb in micro]
        assert all(len(g) == 1 for g in groups) and set().union(*groups) == {0, 1, 2}  # one prompt each
        assert all(len(shared_prefix_plan(mb).prefix_ids) == 1 for mb in micro)
        assert len(trainer.train_step(trajs, advantages)) == 1
        after.append(flat_parameters(trainer))
    assert_the_same_update(flat_parameters(adapter), after)


def test_grouped_order_lists_the_groups_in_the_order_drawn():
    """Each group's items stay adjacent and in their own order, the groups come in the order ``randperm`` draws
    them; one item per group is the plain ``randperm`` of the rows (the order SFT micro-batches always had)."""
    group = torch.tensor([7, 3, 7, 5, 3, 7])  # groups 7, 3, 5 in order of first appearance
    drawn = torch.randperm(3, generator=torch.Generator().manual_seed(0)).tolist()  # [2, 0, 1], not its own inverse
    items = {0: [0, 2, 5], 1: [1, 4], 2: [3]}
    expected = [i for g in drawn for i in items[g]]
    assert grouped_order(group, torch.Generator().manual_seed(0)).tolist() == expected
    assert grouped_order(group, None).tolist() == [0, 2, 5, 1, 4, 3]
    singletons = torch.tensor([4, 9, 1, 6, 0])
    assert torch.equal(grouped_order(singletons, torch.Generator().manual_seed(3)),
                       torch.randperm(5, generator=torch.Generator().manual_seed(3)))


def test_sharing_needs_fewer_padded_tokens(tiny):
    adapter = tiny("sdar", seed=3, block_size=4)
    traits = ModelTraits.from_adapter(adapter)
    trajs = grouped_trajectories(adapter, prompt_lengths=(25, 22, 17))
    batch = build_view(trajs, advantages_of(trajs), ViewConfig(layout="per_round"), traits)
    plan = shared_prefix_plan(batch)
    assert plan is not None and len(plan.prefix_ids) == 3
    assert plan.ids.numel() + plan.prefix_ids.numel() <= 0.9 * batch.input_ids.numel()


def test_a_prompt_decoded_at_two_block_sizes_is_two_prefixes(tiny):
    """Block 4 and block 8 rows of one 24-token prompt share 24 columns but attend otherwise inside them."""
    adapter = tiny("sdar", seed=3, block_size=4)
    rng = random.Random(2)
    vocab = adapter.model.config.vocab_size
    prompt = [rng.randrange(2, vocab) for _ in range(24)]
    trajs = [fake_block_trajectory(rng, f"s{i}", 24, 9, b, 3, vocab, adapter.mask_id) for i, b in enumerate([4, 8] * 3)]
    for t in trajs:
        t.prompt_ids = list(prompt)
    batch = build_view(trajs, advantages_of(trajs), ViewConfig(), ModelTraits.from_adapter(adapter))
    plan = shared_prefix_plan(batch)
    assert plan is not None and len(plan.prefix_ids) == 2
    assert sorted(plan.prefix_layout.block[:, -1].tolist()) == [2, 5]  # column 23 is in block 2 at b=8, 5 at b=4
    shared_logp, _ = logprobs_and_grads(adapter, batch, True)
    plain_logp, _ = logprobs_and_grads(adapter, batch, False)
    torch.testing.assert_close(shared_logp, plain_logp, rtol=0, atol=2e-5)


def test_a_row_whose_trained_token_lies_in_its_prefix_is_kept_whole(tiny, monkeypatch):
    monkeypatch.setattr("train.shared_prefix.MAX_SHARED_FRACTION", 10.0)
    adapter = tiny("sdar", seed=3, block_size=4)
    trajs = grouped_trajectories(adapter, prompt_lengths=(9,), copies=3)
    batch = build_view(trajs, advantages_of(trajs), ViewConfig(layout="per_round"), ModelTraits.from_adapter(adapter))
    first_col = int(batch.cols[batch.rows == 0].min())
    batch.shared_cols[0] = (first_col // 4 + 1) * 4  # claims a block past a trained token's predicting column
    plan = shared_prefix_plan(batch)
    assert plan is not None and not plan.visible[0].any() and plan.visible[1:].any(1).all()
    assert int(plan.layout.valid[0].sum()) == int(batch.layout.valid[0].sum())  # row 0: all of it in the remainder


def test_rows_without_a_shared_prompt_run_one_forward(tiny):
    adapter = tiny("sdar", seed=3, block_size=4)
    traits = ModelTraits.from_adapter(adapter)
    trajs = grouped_trajectories(adapter, prompt_lengths=(9, 10, 11), copies=1)  # three prompts, one sample each
    assert shared_prefix_plan(build_view(trajs, advantages_of(trajs), ViewConfig(), traits)) is None
    grouped = grouped_trajectories(adapter)
    masked = build_view(grouped, advantages_of(grouped), ViewConfig(prompt_mask_p=0.5), traits)
    assert masked.shared_cols is None  # a masked prompt is the row's own
    assert shared_prefix_plan(masked) is None


def test_full_attention_rows_share_nothing(tiny):
    adapter = tiny("llada", seed=3)
    rng = random.Random(0)
    from tests.test_train_views import fake_full_trajectory

    prompt = [rng.randrange(2, 60) for _ in range(8)]
    trajs = [fake_full_trajectory(rng, f"s{i}", 8, 6, 2, adapter.model.config.vocab_size, adapter.mask_id)
             for i in range(3)]
    for t in trajs:
        t.prompt_ids = list(prompt)
    batch = build_view(trajs, advantages_of(trajs), ViewConfig(method="random_masking"),
                       ModelTraits.from_adapter(adapter))
    assert batch.shared_cols is None and not make_trainer(adapter).share_prompts


def test_a_router_aux_loss_turns_sharing_off(tiny):
    adapter = tiny("sdar_moe", seed=3)
    adapter.model.config.output_router_logits = True
    adapter.model.config.router_aux_loss_coef = 0.01
    assert not make_trainer(adapter).share_prompts
    assert make_trainer(tiny("sdar_moe", seed=3)).share_prompts

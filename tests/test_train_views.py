"""Training views: shrink, TraceRL rounds, layouts, positions, post_num, filtering, random / coupled masking.

Hand-computed expectations follow the reference's TraceRL construction (Gen-Verse/dLLM-RL train/rl_trado.py), adapted to
our conventions (blocks at absolute
positions, explicit position ids, no left padding).
"""

from __future__ import annotations

import random

import pytest
import torch

from sample.trajectory import Trajectory
from train.algorithms.tracerl import group_ranks
from train.views import ModelTraits, ViewConfig, build_view

MASK, PAD, STOP = 99, 0, 1
BLOCK2 = ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=2)
FULL = ModelTraits(mask_id=MASK, pad_id=PAD, attention="full")
DREAM = ModelTraits(mask_id=MASK, pad_id=PAD, attention="full", shift_logits=True)


def traj(prompt, response, steps, sid="a", tail=(), tail_steps=(), finish="length", logprobs=None):
    lp = list(logprobs) if logprobs is not None else [-0.1 * (i + 1) for i in range(len(response))]
    return Trajectory(prompt_ids=list(prompt), response_ids=list(response), step_map=list(steps), logprobs=lp,
                      finish_reason=finish, tail_ids=list(tail), tail_steps=list(tail_steps), sample_id=sid)


def _token(rng: random.Random, vocab: int, mask_id: int) -> int:
    """A random ordinary token (never the mask id, never the pad/stop ids 0 and 1)."""
    while (t := rng.randrange(2, vocab)) == mask_id:
        pass
    return t


def fake_block_trajectory(rng: random.Random, sid: str, p_len: int, n_resp: int, b: int, steps_per_block: int,
                          vocab: int, mask_id: int, tail: bool = True) -> Trajectory:
    """A plausible block-diffusion record: absolute blocks, global 1-based steps, a tail in the final block."""
    prompt = [rng.randrange(2, vocab) for _ in range(p_len)]
    total = n_resp + ((-(p_len + n_resp)) % b if tail else 0)
    toks = [_token(rng, vocab, mask_id) for _ in range(total)]
    steps = []
    for j in range(total):
        k = (p_len + j) // b - p_len // b
        steps.append(k * steps_per_block + rng.randint(1, steps_per_block))
    return Trajectory(prompt_ids=prompt, response_ids=toks[:n_resp], step_map=steps[:n_resp],
                      logprobs=[0.0] * n_resp, tail_ids=toks[n_resp:], tail_steps=steps[n_resp:], block_size=b,
                      sample_id=sid)


def fake_full_trajectory(rng: random.Random, sid: str, p_len: int, n_resp: int, n_tail: int, vocab: int,
                         mask_id: int) -> Trajectory:
    prompt = [rng.randrange(2, vocab) for _ in range(p_len)]
    toks = [_token(rng, vocab, mask_id) for _ in range(n_resp + n_tail)]
    steps = [rng.randint(1, max(2, (n_resp + n_tail) // 2)) for _ in toks]
    return Trajectory(prompt_ids=prompt, response_ids=toks[:n_resp], step_map=steps[:n_resp],
                      logprobs=[0.0] * n_resp, tail_ids=toks[n_resp:], tail_steps=steps[n_resp:], sample_id=sid)


def trained_sets(batch) -> dict[int, list[int]]:
    """unit -> sorted response indices trained in it."""
    out: dict[int, list[int]] = {}
    for u, i in zip(batch.unit.tolist(), batch.token_index.tolist()):
        out.setdefault(u, []).append(i)
    return {u: sorted(v) for u, v in out.items()}


# ---------------------------------------------------------------- shrink


def collapse_k_unique(steps: list[int], k: int) -> list[int]:
    """The reference's collapse_k_unique over one group, through ``group_ranks``."""
    steps = torch.as_tensor(steps, dtype=torch.long)
    return group_ranks(torch.zeros_like(steps), steps, k)[1].tolist()


def test_collapse_k_unique_matches_reference_example():
    assert collapse_k_unique([5, 3, 3, 7], 2) == [5, 5, 5, 7]
    assert collapse_k_unique([5, 3, 3, 7], 1) == [5, 3, 3, 7]
    assert collapse_k_unique([1, 2, 3, 4, 5], 2) == [2, 2, 4, 4, 5]


def test_shrink_is_applied_per_block_for_block_models():
    # P=2, b=2: blocks {y0,y1}, {y2,y3}. Block 1 steps 1,2 -> one round; block 2 steps 3,4 -> one round.
    batch = build_view([traj([5, 6], [10, 11, 12, 13], [1, 2, 3, 4])], {"a": 1.0},
                       ViewConfig(layout="per_round", shrink=2), BLOCK2)
    assert trained_sets(batch) == {0: [0, 1, 2, 3]}
    assert batch.steps.tolist() == [2, 2, 4, 4]
    assert not batch.exact


# ---------------------------------------------------------------- rounds


def test_rounds_worked_example_prompt_multiple_of_block():
    t = traj([5, 6], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="per_round"), BLOCK2)
    assert trained_sets(batch) == {0: [1, 2, 3, 4], 1: [0]}  # T_1, T_2 of the reference's one_round_vectorized
    # row 0 = [clean p0 p1 y0 y1 y2 y3 | copy of blocks 1,2,3, everything masked (M_1 = {0..4})]
    assert batch.input_ids[0].tolist() == [5, 6, 20, 21, 22, 23, MASK, MASK, MASK, MASK, MASK]
    # row 1 = [clean p0 p1 | copy of block 1 only, y0 masked, y1 visible (M_2 = {0})], right padded
    assert batch.input_ids[1, :4].tolist() == [5, 6, MASK, 21]
    assert batch.layout.valid[1].tolist() == [True] * 4 + [False] * 7
    assert batch.cols.tolist() == [7, 8, 9, 10, 2]
    assert batch.old_logprobs.tolist() == pytest.approx([-0.2, -0.3, -0.4, -0.5, -0.1])
    # a micro-batch of row 1 keeps its token's fields (and per-token extras), renumbered to its own rows
    batch.extra["old_values"] = torch.arange(5.0)
    mb = batch.select_rows([1])
    assert (mb.rows.tolist(), mb.cols.tolist(), mb.token_index.tolist()) == ([0], [2], [0])
    assert mb.extra["old_values"].tolist() == [4.0] and mb.input_ids.shape == (1, 4)


def test_rounds_with_prompt_tail_inside_first_copy_block():
    # P=3, b=2: block 1 = {p2, y0}; block 2 = {y1, y2}; block 3 = {y3, y4}.
    t = traj([5, 6, 7], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="packed"), BLOCK2)
    assert batch.num_rows == 1
    assert trained_sets(batch) == {0: [0, 1, 3], 1: [2, 4]}
    assert batch.input_ids[0].tolist() == [5, 6, 7, 20, 21, 22,  # clean: positions 0..5
                                           7, MASK, MASK, MASK, MASK, MASK,  # round 1: blocks 1,2,3
                                           21, MASK, 23, MASK]  # round 2: blocks 2,3
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7]
    assert batch.layout.block[0].tolist() == [0, 0, 1, 1, 2, 2, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert batch.layout.copy[0].tolist() == [0] * 6 + [1] * 6 + [2] * 4


def test_tail_tokens_are_masked_context_never_trained():
    # P=3, b=2: block 1 = {p2, y0}, block 2 = {y1 (stop), t0}; the tail token shares the final block.
    t = traj([5, 6, 7], [20, STOP], [1, 2], tail=[30], tail_steps=[3], finish="eos")
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="per_round"), BLOCK2)
    assert trained_sets(batch) == {0: [0, 1]}  # the tail-only round of block 2 is skipped
    assert batch.input_ids[0].tolist() == [5, 6, 7, 20, 7, MASK, MASK, MASK]  # tail masked (step 3 >= 2)
    # tail decoded BEFORE the stop token: visible when the stop token was decoded
    t = traj([5, 6, 7], [20, STOP], [1, 3], tail=[30], tail_steps=[2], finish="eos")
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="per_round"), BLOCK2)
    assert trained_sets(batch) == {0: [0], 1: [1]}
    assert batch.input_ids[0, :4].tolist() == [5, 6, 7, MASK]
    assert batch.input_ids[1].tolist() == [5, 6, 7, 20, MASK, 30]


# ---------------------------------------------------------------- visibility


def _matrix(text: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in line.split()] for line in text.strip().splitlines()])


def test_layout_visibility_per_round_row_by_hand():
    t = traj([5, 6], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="per_round"), BLOCK2)
    #      p0 p1 y0 y1 y2 y3 | c0 c1 c2 c3 c4
    expected = _matrix("""
        1 1 0 0 0 0 0 0 0 0 0
        1 1 0 0 0 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 0
        1 1 0 0 0 0 1 1 0 0 0
        1 1 0 0 0 0 1 1 0 0 0
        1 1 1 1 0 0 0 0 1 1 0
        1 1 1 1 0 0 0 0 1 1 0
        1 1 1 1 1 1 0 0 0 0 1
    """)
    assert torch.equal(batch.layout.dense_mask()[0, 0], expected)


def test_layout_visibility_packed_row_by_hand():
    t = traj([5, 6, 7], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": 1.0}, ViewConfig(layout="packed"), BLOCK2)
    #      p0 p1 p2 y0 y1 y2 | round 1: p2 y0 y1 y2 y3 y4 | round 2: y1 y2 y3 y4
    expected = _matrix("""
        1 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0
        1 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 0 0 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 0 0 0 0 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 0 0 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 0 0 0 0 0 0
        1 1 0 0 0 0 1 1 0 0 0 0 0 0 0 0
        1 1 0 0 0 0 1 1 0 0 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 1 1 0 0 0 0 0 0
        1 1 1 1 0 0 0 0 1 1 0 0 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 1 1 0 0 0 0
        1 1 1 1 1 1 0 0 0 0 1 1 0 0 0 0
        1 1 1 1 0 0 0 0 0 0 0 0 1 1 0 0
        1 1 1 1 0 0 0 0 0 0 0 0 1 1 0 0
        1 1 1 1 1 1 0 0 0 0 0 0 0 0 1 1
        1 1 1 1 1 1 0 0 0 0 0 0 0 0 1 1
    """)
    assert torch.equal(batch.layout.dense_mask()[0, 0], expected)


# ---------------------------------------------------------------- positions


def test_position_ids_are_explicit_and_rows_right_padded():
    a = traj([5, 6, 7, 8], [20, 21], [1, 1], sid="a")
    b = traj([5], [20, 21, 22], [1, 1, 2], sid="b")
    batch = build_view([a, b], {"a": 1.0, "b": 1.0}, ViewConfig(layout="packed"), BLOCK2)
    # a: clean p0..p3 (block 2 is the last copied block: clean = positions < 4), copy y0 y1 at 4, 5
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert batch.layout.valid[0].tolist() == [True] * 6 + [False] * 2  # right padding, invalid keys
    # b: blocks {p0, y0}, {y1, y2}; round 1 copies both blocks, round 2 copies block 1
    assert batch.position_ids[1].tolist() == [0, 1, 0, 1, 2, 3, 2, 3]
    assert batch.layout.valid[1].all()
    # full attention: positions 0..n-1 of prompt + response + tail, no left padding
    full = build_view([a, b], {"a": 1.0, "b": 1.0}, ViewConfig(), FULL)
    assert full.position_ids[full.row_sample == 1][0, :4].tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------- post_num, stop token, truncation, filtering


def test_stop_token_is_trained_and_post_num_limits_other_pads():
    # PAD doubles as the stop token (TraDo: pad = EOS); the final one is the generated stop token.
    ids = ModelTraits(mask_id=MASK, pad_id=PAD, attention="full")
    t = traj([5], [20, PAD, PAD, 21, PAD], [1, 2, 3, 4, 5], finish="eos")
    for post_num, expected in ((0, [0, 3, 4]), (1, [0, 1, 3, 4]), (5, [0, 1, 2, 3, 4])):
        batch = build_view([t], {"a": 1.0}, ViewConfig(post_num=post_num), ids)
        assert sorted(batch.token_index.tolist()) == expected
    # a truncated response ends without its stop token: the final pad is an ordinary pad
    batch = build_view([t], {"a": 1.0}, ViewConfig(post_num=0, max_gen_length=3), ids)
    assert sorted(batch.token_index.tolist()) == [0]
    # nothing trainable in a sample: no rows, the others unaffected
    pads = traj([5], [PAD, PAD], [1, 2], sid="p")
    for view_ids in (ids, BLOCK2):
        batch = build_view([pads, t], {"a": 1.0, "p": 2.0}, ViewConfig(layout="packed"), view_ids)
        assert batch.sample_ids == ["p", "a"] and set(batch.sample_index.tolist()) == {1}


def test_over_long_prompt_is_dropped_and_rewards_stay_attached():
    trajs = [traj([5] * 2, [20, 21, 22], [1, 2, 3], sid="a"), traj([5] * 9, [30, 31], [1, 2], sid="b"),
             traj([5] * 3, [40, 41, 42, 43], [2, 1, 4, 3], sid="c")]
    adv = {"a": 1.5, "b": -7.0, "c": -0.5}
    for ids in (BLOCK2, FULL):
        batch = build_view(trajs, adv, ViewConfig(max_prompt_len=4), ids)
        assert batch.sample_ids == ["a", "c"]
        assert [d[0] for d in batch.dropped] == ["b"] and "max_prompt_len" in batch.dropped[0][1]
        kept = [trajs[0], trajs[2]]
        for s, i, label, a, step in zip(batch.sample_index.tolist(), batch.token_index.tolist(),
                                        batch.labels.tolist(), batch.advantages.tolist(), batch.steps.tolist()):
            assert label == kept[s].response_ids[i]
            assert a == adv[kept[s].sample_id]
            assert step == kept[s].step_map[i]
        assert sorted(zip(batch.sample_index.tolist(), batch.token_index.tolist())) == (
            [(0, i) for i in range(3)] + [(1, i) for i in range(4)])


def test_missing_advantage_and_duplicate_ids_are_errors():
    t = traj([5], [20], [1])
    with pytest.raises(ValueError, match="no advantage"):
        build_view([t], {}, ViewConfig(), FULL)
    with pytest.raises(ValueError, match="duplicate"):
        build_view([t, t], {"a": 1.0}, ViewConfig(), FULL)


def test_per_token_advantages_follow_their_tokens():
    t = traj([5, 6, 7], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": [0.0, 1.0, 2.0, 3.0, 4.0]}, ViewConfig(), BLOCK2)
    assert batch.advantages.tolist() == [float(i) for i in batch.token_index.tolist()]
    with pytest.raises(ValueError, match="per-token advantages"):
        build_view([t], {"a": [1.0, 2.0]}, ViewConfig(), BLOCK2)


def test_truncation_keeps_steps_aligned_and_cut_tokens_as_context():
    t = traj([5, 6, 7], [20, 21, 22, 23, 24], [3, 1, 4, 4, 6])
    batch = build_view([t], {"a": 1.0}, ViewConfig(max_gen_length=2, layout="packed"), BLOCK2)
    # kept y0 (block 1), y1 (block 2); y2 (block 2) stays masked/visible context, y3, y4 (block 3) vanish
    assert sorted(zip(batch.token_index.tolist(), batch.steps.tolist())) == [(0, 3), (1, 1)]
    assert batch.input_ids[0].tolist() == [5, 6, 7, 20, 7, MASK, MASK, MASK]
    assert batch.exact


# ---------------------------------------------------------------- full attention


def test_full_attention_rows_per_step_with_shift():
    t = traj([5, 6], [20, 21, 22], [2, 1, 2], tail=[MASK], tail_steps=[3])
    batch = build_view([t], {"a": 1.0}, ViewConfig(), DREAM)
    assert batch.input_ids.tolist() == [[5, 6, MASK, MASK, MASK, MASK], [5, 6, MASK, 21, MASK, MASK]]
    assert trained_sets(batch) == {0: [1], 1: [0, 2]}
    assert batch.token_cols.tolist() == [3, 2, 4]
    assert batch.cols.tolist() == [2, 1, 3]  # hidden i-1 predicts token i
    assert batch.layout.block.eq(0).all() and batch.layout.copy.eq(0).all()


def test_empty_prompt_shifted_first_token_uses_its_own_position():
    batch = build_view([traj([], [20, 21], [1, 2])], {"a": 1.0}, ViewConfig(), DREAM)
    assert batch.cols.tolist() == [0, 0]


# ---------------------------------------------------------------- weights


def test_loss_weights_are_layout_independent():
    rng = random.Random(0)
    trajs = [fake_block_trajectory(rng, str(i), rng.randint(1, 9), rng.randint(3, 15), 4, 3, 50, MASK)
             for i in range(4)]
    ids = ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4)
    adv = {t.sample_id: 1.0 for t in trajs}
    for norm in ("padded_length", "row_mean", "token_mean"):
        packed = build_view(trajs, adv, ViewConfig(layout="packed", loss_norm=norm), ids)
        per_round = build_view(trajs, adv, ViewConfig(layout="per_round", loss_norm=norm), ids)
        key = lambda b: sorted(zip(b.sample_index.tolist(), b.token_index.tolist(), b.weights.tolist()))  # noqa: E731
        assert key(packed) == key(per_round)
        assert packed.num_units == per_round.num_rows
        total = float(packed.weights.sum())
        if norm == "padded_length":
            l1max = max(len(t.response_ids) for t in trajs)
            assert total == pytest.approx(packed.num_tokens / (per_round.num_rows * l1max))
        else:
            assert total == pytest.approx(1.0)



@pytest.mark.parametrize("norm", ["padded_length", "row_mean", "token_mean", "unit_sum"])
def test_shards_normalised_over_processes_weigh_tokens_as_the_whole_batch(norm):
    """Three processes build views of their own shards (unequal units, tokens, longest responses); rescaled by the
    step's counts over all of them, every token weighs world x its weight in one process's view of the whole batch
    (data parallelism averages the gradients), and the batch-level normalisers are the whole batch's / world."""
    from train.views import NORM_COUNTS, normalised_over_processes

    rng = random.Random(3)
    trajs = [fake_block_trajectory(rng, str(i), rng.randint(1, 9), rng.randint(2, 15), 4, 3, 50, MASK)
             for i in range(7)]
    ids = ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4)
    adv = {t.sample_id: 1.0 for t in trajs}
    cfg = ViewConfig(loss_norm=norm)
    world, shards = 3, [trajs[0:1], trajs[1:4], trajs[4:7]]
    views = [build_view(shard, adv, cfg, ids) for shard in shards]
    totals = {k: sum(v.counts[k] for v in views) for k in NORM_COUNTS}
    totals["longest"] = max(v.counts["longest"] for v in views)
    whole = build_view(trajs, adv, cfg, ids)

    def weights(batch, scale=1.0):
        tokens = zip(batch.sample_index.tolist(), batch.token_index.tolist(), batch.weights.tolist())
        return {(batch.sample_ids[s], t): w * scale for s, t, w in tokens}

    got, before = {}, {}
    for view in views:
        rescaled = normalised_over_processes(view, totals, world)
        got.update(weights(rescaled, 1 / world))
        before.update(weights(view, 1 / world))
        for key in ("batch_resp_len", "batch_groups", "batch_samples", "batch_units"):
            assert float(rescaled.extra[key][0]) == pytest.approx(float(whole.extra[key][0]) / world)
    expected = weights(whole)
    assert got.keys() == expected.keys()
    assert all(got[k] == pytest.approx(expected[k], rel=1e-6) for k in expected)
    assert any(before[k] != pytest.approx(expected[k], rel=1e-3) for k in expected)  # per-shard weights differ


# ---------------------------------------------------------------- random masking and coupled


def _response_masks(batch, trajs) -> list[tuple[int, torch.Tensor]]:
    """(sample, masked flags over the response) per row, read from the inputs."""
    out = []
    for r in range(batch.num_rows):
        s = int(batch.row_sample[r])
        p, n = len(trajs[s].prompt_ids), len(trajs[s].response_ids)
        noisy = batch.layout.copy[r] > 0 if bool((batch.layout.copy[r] > 0).any()) else batch.layout.valid[r]
        pos, ids = batch.position_ids[r][noisy], batch.input_ids[r][noisy]
        sel = (pos >= p) & (pos < p + n)
        flags = torch.zeros(n, dtype=torch.bool)
        flags[pos[sel] - p] = ids[sel] == MASK
        out.append((s, flags))
    return out


@pytest.mark.parametrize("kind", ["block", "full"])
def test_coupled_rows_are_exact_complements(kind):
    rng = random.Random(1)
    if kind == "block":
        ids = ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4)
        trajs = [fake_block_trajectory(rng, str(i), rng.randint(1, 9), 40, 4, 4, 60, MASK) for i in range(3)]
    else:
        ids = FULL
        trajs = [fake_full_trajectory(rng, str(i), rng.randint(1, 9), 40, 5, 60, MASK) for i in range(3)]
    cfg = ViewConfig(method="coupled", layout="per_round", mask_times_per_sample=2, lower_p=0.3, upper_p=0.7)
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, cfg, ids)
    masks = _response_masks(batch, trajs)
    assert len(masks) == 3 * 2 * 2
    for (s1, m1), (s2, m2) in zip(masks[::2], masks[1::2]):
        assert s1 == s2 and torch.equal(m1, ~m2)
    assert not batch.exact and torch.isnan(batch.old_logprobs).all()
    # trained = the masked response tokens of the row
    assert trained_sets(batch)[0] == masks[0][1].nonzero().squeeze(1).tolist()


@pytest.mark.parametrize("mode", ["per_sequence", "per_position"])
def test_random_masking_noise_levels_in_range(mode):
    rng = random.Random(2)
    trajs = [fake_full_trajectory(rng, str(i), 3, 400, 0, 60, MASK) for i in range(4)]
    cfg = ViewConfig(method="random_masking", random_mask_mode=mode, mask_times_per_sample=5, lower_p=0.2,
                     upper_p=0.4, seed=3)
    batch = build_view(trajs, {t.sample_id: 1.0 for t in trajs}, cfg, FULL)
    fractions = torch.tensor([float(m.float().mean()) for _, m in _response_masks(batch, trajs)])
    assert len(fractions) == 20
    assert fractions.min() > 0.12 and fractions.max() < 0.48
    if mode == "per_sequence":  # per-row levels spread over the range, unlike the per-position draw
        assert fractions.std() > 0.02
    for lo, hi, rows in ((0.0, 0.0, 0), (1.0, 1.0, 20)):
        cfg = ViewConfig(method="random_masking", mask_times_per_sample=5, lower_p=lo, upper_p=hi)
        assert build_view(trajs, {t.sample_id: 1.0 for t in trajs}, cfg, FULL).num_rows == rows


def test_random_block_view_has_one_copy_over_all_response_blocks():
    t = traj([5, 6, 7], [20, 21, 22, 23], [3, 1, 4, 4], tail=[25], tail_steps=[7])
    cfg = ViewConfig(method="random_masking", lower_p=1.0, upper_p=1.0)
    batch = build_view([t], {"a": 1.0}, cfg, BLOCK2)
    assert batch.input_ids[0].tolist() == [5, 6, 7, 20, 21, 22, 7] + [MASK] * 5  # p2 kept, y0..y3 + tail masked
    assert batch.layout.copy[0].tolist() == [0] * 6 + [1] * 6
    assert trained_sets(batch) == {0: [0, 1, 2, 3]}


@pytest.mark.parametrize("layout", ["packed", "per_round"])
def test_split_attention_equals_the_dense_masked_attention(layout):
    """Long TraceRL rows on CPU attend piece by piece (each noisy copy, clean chunks) to the keys they may see:
    outputs and gradients equal one dense masked attention over the whole row."""
    import torch.nn.functional as F

    from models import common

    rng = random.Random(3)
    trajs = [fake_block_trajectory(rng, f"s{i}", 37 + 5 * i, 300, 4, 4, 90, MASK) for i in range(2)]
    batch = build_view(trajs, {"s0": 1.0, "s1": -1.0}, ViewConfig(layout=layout, seed=0),
                       ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4))
    lay = batch.layout
    rows, n = batch.input_ids.shape
    assert n >= common.SPLIT_MIN_TOKENS and common._split_pays(lay)  # the split path is the one taken
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, 4, n, 8, generator=g, requires_grad=True)
    k = torch.randn(rows, 2, n, 8, generator=g, requires_grad=True)
    v = torch.randn(rows, 2, n, 8, generator=g, requires_grad=True)
    w = torch.randn(rows, 4, n, 8, generator=g)
    split = common.attend(q, k, v, lay, None, 0, False)
    grads = torch.autograd.grad((split * w).sum(), (q, k, v))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=lay.dense_mask(), enable_gqa=True)
    dense_grads = torch.autograd.grad((dense * w).sum(), (q, k, v))
    pieces = sum(len(p) for p in common._split_plan(lay))
    assert pieces > rows  # really split
    torch.testing.assert_close(split, dense, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, dense_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_split_attention_keeps_each_piece_mask_once_for_all_layers(tiny):
    """Under autograd, the split path's piece masks (additive, built once per layout) are kept for the backward
    pass once, not once per layer as SDPA's own boolean-to-float conversion would."""
    from models import common

    a = tiny("sdar", block_size=4)
    rng = random.Random(3)
    traj = fake_block_trajectory(rng, "s0", 40, 300, 4, 4, 90, MASK)
    batch = build_view([traj], {"s0": 1.0}, ViewConfig(layout="packed", seed=0),
                       ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4))
    assert common._split_pays(batch.layout)
    saved = []
    head_dim = a.model.config.head_dim

    def pack(t):  # [1, 1, queries, keys] float tensors (RoPE's [1, 1, N, head_dim] cos / sin left out)
        if t.dim() == 4 and t.shape[:2] == (1, 1) and t.dtype.is_floating_point and t.shape[-1] != head_dim:
            saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        a.model.model(batch.input_ids, position_ids=batch.position_ids, layout=batch.layout)
    masks = {id(p[3]) for row in common._split_plan(batch.layout) for p in row if p[3] is not None}
    layers = a.model.config.num_hidden_layers
    assert layers >= 2 and len(masks) >= 2
    assert len(set(saved)) == len(masks) and len(saved) == layers * len(masks)


@pytest.mark.parametrize("budget", [1, 300, 450])
def test_packed_rows_under_a_token_budget_hold_the_same_trained_tokens(budget):
    """max_row_tokens spreads a sample's rounds over several packed rows; every row fits the budget (or holds one
    round) and the trained tokens, labels, inputs seen and weights are those of the unlimited packed view."""
    rng = random.Random(5)
    trajs = [fake_block_trajectory(rng, f"s{i}", 9 + 3 * i, 120, 4, 4, 90, MASK) for i in range(2)]
    traits = ModelTraits(mask_id=MASK, pad_id=PAD, attention="block", block_size=4)
    adv = {"s0": 1.0, "s1": -0.5}
    whole = build_view(trajs, adv, ViewConfig(seed=0), traits)
    split = build_view(trajs, adv, ViewConfig(seed=0, max_row_tokens=budget), traits)
    per_round = build_view(trajs, adv, ViewConfig(seed=0, layout="per_round"), traits)
    assert whole.num_rows == 2 < split.num_rows <= per_round.num_rows
    if budget == 1:
        assert split.num_rows == per_round.num_rows  # one round per row

    def by_token(b):
        order = torch.argsort(b.sample_index * 10_000 + b.token_index * 100 + b.unit)
        return [getattr(b, f)[order] for f in ("sample_index", "token_index", "unit", "labels", "weights")]

    for x, y in zip(by_token(split), by_token(whole)):
        assert torch.equal(x, y)
    lengths = split.layout.valid.sum(1)
    units_per_row = [len(set(split.unit[split.rows == r].tolist())) for r in range(split.num_rows)]
    assert all(int(n) <= budget or k == 1 for n, k in zip(lengths, units_per_row))

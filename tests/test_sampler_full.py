"""Full-attention sampler (Dream: shifted, LLaDA/MMaDA: unshifted): batching, cache modes, replay, stops."""

from __future__ import annotations

import pytest

from sample.generate import generate
from sample.params import SamplingParams
from tests.test_sampler_utils import DeviceWaits, prompts_of, replay_full, sharp_tiny

BL = 4


@pytest.fixture(scope="module", params=["dream", "llada"])
def full(request, demo_tokenizer):
    return sharp_tiny(request.param, demo_tokenizer, seed=2)


def _greedy(**kw) -> SamplingParams:
    base = dict(max_tokens=10, temperature=0.0, stop_token_ids=[], ignore_eos=True, block_size=BL, steps=9,
                further_horizon=2)
    return SamplingParams(**{**base, **kw})


def _key(traj):
    return traj.response_ids, traj.step_map, traj.tail_ids, traj.tail_steps, traj.finish_reason


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
def test_batched_left_padded_equals_one_at_a_time(full, cache):
    prompts = prompts_of()
    params = _greedy(cache=cache, max_active=3)
    batched = generate(full, prompts, params, progress=False)
    singles = [generate(full, [p], params, progress=False)[0] for p in prompts]
    assert [_key(t) for t in batched] == [_key(t) for t in singles]
    for b, s in zip(batched, singles):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
        assert b.block_size == BL and len(b.response_ids) == 10 and len(b.tail_ids) == 2
    assert len({tuple(t.response_ids) for t in batched}) > 1


def test_cache_none_logprobs_and_schedule_match_an_independent_replay(full):
    params = _greedy(steps=7, cache="none")  # 3 blocks of 4: steps 3, 2, 2 -> transfers [2,1,1], [2,2], [2,2]
    for traj in generate(full, prompts_of((0, 3, 6)), params, progress=False):
        assert replay_full(full, traj, BL, 7) == max(traj.step_map) >= 6


def test_no_zero_transfer_steps_and_per_row_counters(full):
    params = _greedy(steps=24, max_tokens=8)  # more steps than tokens: one token per step, never zero
    out = generate(full, prompts_of((2, 7)), params, progress=False)
    for traj in out:
        assert sorted(traj.step_map) == list(range(1, 9))


def test_stop_token_finishes_the_row_and_keeps_the_canvas_as_tail(full):
    prompt = prompts_of((5,))
    free = generate(full, prompt, _greedy(max_tokens=12), progress=False)[0]
    stop_at = next(i for i in range(1, 12) if free.response_ids[i] not in free.response_ids[:i])
    stop_tok = free.response_ids[stop_at]
    got = generate(full, prompt, _greedy(max_tokens=12, stop_token_ids=[stop_tok]), progress=False)[0]
    assert got.finish_reason == "stop" and got.response_ids == free.response_ids[:stop_at + 1]
    assert got.step_map == free.step_map[:stop_at + 1]
    assert len(got.response_ids) + len(got.tail_ids) == 12
    last = max(got.step_map + [s for t, s in zip(got.tail_ids, got.tail_steps) if t != full.mask_id])
    for tok, step, free_tok, free_step in zip(got.tail_ids, got.tail_steps, free.response_ids[stop_at + 1:],
                                              free.step_map[stop_at + 1:]):
        if tok == full.mask_id:
            assert step == last + 1  # never decoded: masked in every recorded context
        else:
            assert (tok, step) == (free_tok, free_step)


def test_max_tokens_not_a_multiple_of_the_block(full):
    traj = generate(full, prompts_of((3,)), _greedy(max_tokens=6, steps=8), progress=False)[0]
    assert traj.finish_reason == "length" and len(traj.response_ids) == 6
    assert len(traj.tail_ids) == 2


def test_prompt_plus_canvas_beyond_the_limit_is_a_clear_error(demo_tokenizer):
    small = sharp_tiny("llada", demo_tokenizer, max_position_embeddings=24)
    with pytest.raises(ValueError, match=r"prompt 1 has 20 tokens.*24"):
        generate(small, [[1, 2], [3] * 20], _greedy(), progress=False)


def test_sampling_options_run_and_are_reproducible(full):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=40, alg_temp=0.5, seed=3,
                            block_size=4, steps=6, target="margin_confidence", pad_target_penalty=2.0,
                            remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.3)
    a = generate(full, prompts_of((2, 4)), params, progress=False)
    b = generate(full, prompts_of((2, 4)), params, progress=False)
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert all(t.finish_reason in ("eos", "stop", "length") for t in a)


@pytest.mark.parametrize("option", [dict(top_k=3), dict(top_p=0.3)])
def test_top_k_and_top_p_bound_every_draw_of_the_full_sampler(full, monkeypatch, option):
    """At a high temperature the draws leave the 3 likeliest tokens (the nucleus of mass 0.3 of the tempered
    distribution); with top_k=3 (top_p=0.3) none does: the option reaches the sampler's draws, not only the filter's
    unit test."""
    import sample.full_sampler as full_sampler
    from sample.strategies import filter_logits

    real, outside = full_sampler.draw_tokens, []
    hot = dict(max_tokens=8, temperature=3.0, seed=3, block_size=4, steps=8, ignore_eos=True, stop_token_ids=[])
    support = {"top_k": 0, "top_p": 1.0, **option}

    def counting(logits, params, generator, mask_id, *args, **kwargs):
        draw = real(logits, params, generator, mask_id, *args, **kwargs)
        allowed = logits.float().clone()
        allowed[..., mask_id] = float("-inf")
        kept = filter_logits(allowed, hot["temperature"], support["top_k"], support["top_p"]).isfinite()
        outside.append(int((~kept.gather(-1, draw.tokens[..., None])).sum()))
        return draw

    monkeypatch.setattr(full_sampler, "draw_tokens", counting)
    generate(full, prompts_of((2, 4)), SamplingParams(**hot), progress=False)
    assert sum(outside) > 0
    outside.clear()
    generate(full, prompts_of((2, 4)), SamplingParams(**hot, **option), progress=False)
    assert outside and sum(outside) == 0


def test_alg_temp_reaches_the_full_samplers_choice_of_positions(full, monkeypatch):
    """Without alg_temp every step commits the best-scored masked positions; with alg_temp=1 some step commits
    others (positions drawn from softmax(score / alg_temp))."""
    import sample.full_sampler as full_sampler
    from sample.strategies import top_n

    real, off_top = full_sampler.select_transfer, []

    def counting(draw, candidate, n_transfer, params, generator):
        chosen = real(draw, candidate, n_transfer, params, generator)
        off_top.append(int((chosen != top_n(draw.score, candidate, n_transfer)).any()))
        return chosen

    monkeypatch.setattr(full_sampler, "select_transfer", counting)
    base = dict(max_tokens=8, temperature=1.0, seed=3, block_size=8, steps=4, ignore_eos=True, stop_token_ids=[],
                remasking_strategy="low_confidence_static")
    generate(full, prompts_of((2, 4)), SamplingParams(**base), progress=False)
    assert off_top and sum(off_top) == 0
    off_top.clear()
    generate(full, prompts_of((2, 4)), SamplingParams(**base, alg_temp=1.0), progress=False)
    assert sum(off_top) > 0


def test_mmada_uses_the_same_full_attention_path(demo_tokenizer):
    """MMaDA's steps re-derive from plain full forwards (cache none) like LLaDA's, and batched equals one at a time."""
    mmada = sharp_tiny("mmada", demo_tokenizer, seed=4)
    out = generate(mmada, prompts_of((2, 5)), _greedy(cache="none"), progress=False)
    assert [len(t.response_ids) for t in out] == [10, 10] and out[0].block_size == BL
    for traj in out:
        assert replay_full(mmada, traj, BL, 9) == max(traj.step_map)
    singles = [generate(mmada, [p], _greedy(cache="none"), progress=False)[0] for p in prompts_of((2, 5))]
    assert [_key(t) for t in out] == [_key(t) for t in singles]
    assert len({tuple(t.response_ids) for t in out}) > 1
    dual = generate(mmada, prompts_of((2, 5)), _greedy(cache="dual", max_active=1), progress=False)
    assert [len(t.response_ids) for t in dual] == [10, 10]  # the approximate cache: its own tokens, same layout


@pytest.mark.parametrize("cache", ["none", "dual"])
def test_committed_grows_by_whole_final_blocks(full, cache):
    """What a server streams: after each step every running row reports its complete blocks, which are a prefix
    of its final response (tokens and log-probs) and only grow."""
    import torch

    from sample.engine import Engine, Sequence, trajectory
    from sample.generate import make_sampler

    prompts = prompts_of((1, 4))
    params = _greedy(max_tokens=14, cache=cache)  # blocks of 4: 4, 8, 12 tokens committed before the end
    want = generate(full, prompts, params, progress=False)
    sampler = make_sampler(full, params, set(), None, torch.Generator().manual_seed(0))
    engine = Engine(sampler, max_active=2)
    for i, p in enumerate(prompts):
        engine.add(Sequence(i, list(p), sampler.check_prompt(i, list(p))))
    seen: dict[int, list[int]] = {0: [0], 1: [0]}
    while engine.busy:
        for done in engine.step():
            assert trajectory(done).response_ids == want[done.seq.index].response_ids
        for row in sampler.running:
            index, ids = row.seq.index, sampler.committed()[row.seq.index]
            assert len(ids) % BL == 0 and len(ids) >= seen[index][-1]
            assert ids == want[index].response_ids[:len(ids)]
            assert row.logprobs == pytest.approx(want[index].logprobs[:len(ids)], abs=1e-5)
            if len(ids) > seen[index][-1]:
                seen[index].append(len(ids))
    assert seen == {0: [0, 4, 8, 12], 1: [0, 4, 8, 12]}


@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_a_denoising_step_copies_nothing_to_the_device_from_pageable_memory(full, cache):
    """As for block models (``DeviceWaits``): host-side counters, row indices and new rows reach the device from
    pinned memory, and a step reads back at most a few times (its end, finished blocks, finished rows)."""
    # max_active 4 and 30 tokens: rows join while others are mid-block, so a prefix-cache step refreshes some rows
    # and runs the others' windows (the mixed branch of WindowCachedFullSampler._hidden)
    params = _greedy(max_tokens=30, steps=16, cache=cache, temperature=1.0, seed=0, max_active=4)
    with DeviceWaits() as waits:
        out = generate(full, prompts_of(), params, progress=False)
    assert all(len(t.response_ids) == 30 for t in out)
    assert waits.copies == {}
    assert sum(waits.reads.values()) <= 3 * out.stats.forwards

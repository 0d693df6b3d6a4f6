"""Block-model sampler (SDAR family): batching, cache, strategies, step maps, log-probs, stops and limits."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

from models.registry import Adapter
from sample.generate import Rollout, generate
from sample.params import SamplingParams
from tests.test_sampler_utils import DeviceWaits, prompts_of, replay_block, sharp_tiny

B = 4


@pytest.fixture(scope="module")
def sdar(demo_tokenizer):
    return sharp_tiny("sdar", demo_tokenizer, seed=1)


def _greedy(**kw) -> SamplingParams:
    base = dict(max_tokens=14, temperature=0.0, stop_token_ids=[], ignore_eos=True)
    return SamplingParams(**{**base, **kw})


def _key(traj):
    return traj.response_ids, traj.step_map, traj.tail_ids, traj.tail_steps, traj.finish_reason


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
def test_batched_equals_one_at_a_time_with_continuous_batching(sdar, strategy):
    prompts = prompts_of()
    params = _greedy(remasking_strategy=strategy, dynamic_threshold=0.5, max_active=3)
    batched = generate(sdar, prompts, params, progress=False)
    singles = [generate(sdar, [p], params, progress=False)[0] for p in prompts]
    assert [_key(t) for t in batched] == [_key(t) for t in singles]
    for b, s in zip(batched, singles):
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    assert len({tuple(t.response_ids) for t in batched}) > 1, "prompts should give different responses"


def test_top_k_one_is_greedy_with_ties_broken_left_to_right(sdar):
    """top_k=1 makes every confidence 1.0 (as in the reference engine), so static decodes left to right."""
    prompts = prompts_of((3, 7))
    a = generate(sdar, prompts, _greedy(remasking_strategy="sequential"), progress=False)
    b = generate(sdar, prompts, _greedy(temperature=1.0, top_k=1, seed=5), progress=False)
    assert [_key(t) for t in a] == [_key(t) for t in b]
    assert all(c == 1.0 for t in b for c in t.confidences)


def test_cache_and_no_cache_give_identical_tokens(sdar):
    prompts = prompts_of()
    cached = generate(sdar, prompts, _greedy(max_active=4), progress=False)
    slow = generate(sdar, prompts, _greedy(max_active=4, cache="none"), progress=False)
    assert [_key(t) for t in cached] == [_key(t) for t in slow]
    for c, s in zip(cached, slow):
        assert c.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    assert slow.stats.forwards < cached.stats.forwards  # no prefill / commit passes without a cache


@pytest.mark.parametrize("memory, prefilled", [(2**30, 2), ("one", 5), (0, 7)])
@pytest.mark.parametrize("graphs", [False, True])
def test_copies_of_a_prompt_share_one_prefill(sdar, monkeypatch, memory, prefilled, graphs):
    """An RL group samples one prompt n times: each distinct prompt prefix is prefilled once, also when its copies
    join the batch at different steps (kept for the next admissions within PREFIX_MEMORY_BYTES), and every copy
    decodes exactly as without a cache. With room for p's prefill only, the more recent q is kept and p is prefilled
    again at every admission; with none, each admission prefills its distinct prefixes."""
    from sample import block_runners

    p, q = prompts_of((3 * B, 2 * B))  # prefixes of 3 and 2 blocks
    rows = []
    prefill = block_runners.CachedRunner._prefill
    monkeypatch.setattr(block_runners.CachedRunner, "_prefill",
                        lambda self, chunk: rows.extend(map(len, chunk)) or prefill(self, chunk))
    if memory == "one":  # room for the prefill of p (3 blocks), not for both
        cfg = sdar.model.config
        memory = 2 * cfg.num_hidden_layers * (3 * B) * cfg.num_key_value_heads * cfg.head_dim * 4  # fp32 K and V
    monkeypatch.setattr(block_runners, "PREFIX_MEMORY_BYTES", memory)
    prompts = [p, q, p, q, q, p, p]  # max_active 2: [p q] [p q] [q p] [p], as rows finish together
    params = _greedy(max_active=2, cuda_graphs=graphs)
    cached = generate(sdar, prompts, params, progress=False)
    slow = generate(sdar, prompts, replace(params, cache="none", cuda_graphs=False), progress=False)
    assert [_key(t) for t in cached] == [_key(t) for t in slow]
    for c, s in zip(cached, slow):
        assert c.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    assert len(rows) == prefilled
    assert set(rows) == {3 * B, 2 * B}


def test_kept_prefills_stay_within_their_budget_the_oldest_going_first(sdar):
    """With room for one prefill, q's goes when p's is kept; a kept prefill owns its storage (a view would pin the
    whole prefill it was cut from); copies of a prompt add no read-back from the device."""
    from sample import block_runners
    from sample.engine import Engine, Sequence
    from sample.generate import make_sampler

    p, q = prompts_of((3 * B, 2 * B))
    cfg = sdar.model.config
    one = 2 * cfg.num_hidden_layers * (3 * B) * cfg.num_key_value_heads * cfg.head_dim * 4  # p's fp32 K and V
    sampler = make_sampler(sdar, _greedy(), set(), None, torch.Generator().manual_seed(0))
    engine = Engine(sampler, 4)
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(block_runners, "PREFIX_MEMORY_BYTES", one)
        for prompt in (q, p):
            with DeviceWaits() as waits:
                for i in range(4):
                    engine.add(Sequence(i, prompt, 14))
                while engine.busy:
                    engine.step()
            assert not [site for site in waits.reads if "kv_batch" in site or "block_runners" in site]
    memory = sampler.runner.memory
    assert list(memory) == [tuple(p)]
    keys = memory[tuple(p)].keys[0]
    assert keys.shape[2] == 3 * B and keys.untyped_storage().nbytes() == keys.nbytes


@pytest.mark.parametrize("graphs", [False, True])
def test_a_prompt_asked_again_after_the_batch_emptied_decodes_the_same(sdar, graphs):
    """A server's engine lives on between requests: a prompt whose prefill was kept comes back to an empty batch
    and the kept prefill must still be the prompt's (not the cache that later forwards wrote to)."""
    from sample.engine import Engine, Sequence
    from sample.generate import make_sampler

    p = next(pr for pr in prompts_of() if len(pr) >= 2 * B)
    params = _greedy(cuda_graphs=graphs)
    sampler = make_sampler(sdar, params, set(), None, torch.Generator().manual_seed(0))
    engine, runs = Engine(sampler, 4), []
    with torch.inference_mode():
        for i in range(3):
            engine.add(Sequence(i, p, 14))
            done = []
            while engine.busy:
                done += engine.step()
            runs.append((done[0].response, done[0].steps))
    assert runs[0] == runs[1] == runs[2]
    assert runs[0][0] == generate(sdar, [p], replace(params, cache="none", cuda_graphs=False),
                                  progress=False)[0].response_ids


@pytest.mark.parametrize("share, extra_forwards", [(0.5, 1), (1.0, 5)])
def test_a_row_that_joins_a_step_late_is_put_back_in_phase(sdar, monkeypatch, share, extra_forwards):
    """A server admits requests between steps, so a row may start a step after the others. Storing finished blocks
    fused whenever most rows carry one puts the late row back in phase: the batch costs the one step it started
    late. Without it (share 1.0: fused only when every row carries) the rows take turns storing their blocks, one
    extra forward per block (5 blocks here)."""
    import torch

    from sample import block_sampler
    from sample.engine import Engine, Sequence
    from sample.generate import make_sampler

    monkeypatch.setattr(block_sampler, "FUSE_MAX_TOKENS", {"cpu": 0, "cuda": 0})  # rows never fused for being few
    monkeypatch.setattr(block_sampler, "FUSE_CARRYING_SHARE", share)
    params = _greedy(max_tokens=20, ignore_eos=True, stop_token_ids=[], remasking_strategy="low_confidence_static")
    prompt = sdar.tokenizer.encode("What is 1 + 2? Then add 3.")
    prompt = prompt[: len(prompt) // 4 * 4]  # whole prompt blocks: every block takes its 4 steps

    def forwards(late: int) -> int:
        sampler = make_sampler(sdar, params, set(), None, torch.Generator().manual_seed(0))
        engine, done = Engine(sampler, 8), []
        with torch.inference_mode():
            for i in range(8):
                if i == 8 - late:
                    done += engine.step()  # the others join a step later
                engine.add(Sequence(i, prompt, 20))
            while engine.busy:
                done += engine.step()
        assert sorted(len(d.response) for d in done) == [20] * 8
        return sampler.stats.denoise_forwards

    assert forwards(late=7) == forwards(late=0) + extra_forwards


@pytest.mark.parametrize("fuse_max_tokens", [0, 10_000])
def test_finished_blocks_stored_fused_or_riding_alone_give_the_no_cache_tokens(sdar, monkeypatch, fuse_max_tokens):
    """A finished block is stored by the next forward: fused in front of the next block (one forward per block
    saved) or riding alone in its row (that row skips a step); both see exactly the no-cache context."""
    from sample import block_sampler

    monkeypatch.setattr(block_sampler, "FUSE_MAX_TOKENS", {"cpu": fuse_max_tokens, "cuda": fuse_max_tokens})
    # 0: a finished block rides alone unless every row carries one
    monkeypatch.setattr(block_sampler, "FUSE_CARRYING_SHARE", 0.5 if fuse_max_tokens else 1.0)
    prompts = prompts_of()
    params = _greedy(max_active=3, remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.5)
    cached = generate(sdar, prompts, params, progress=False)
    slow = generate(sdar, prompts, replace(params, cache="none"), progress=False)
    assert [_key(t) for t in cached] == [_key(t) for t in slow]
    for c, s in zip(cached, slow):
        assert c.logprobs == pytest.approx(s.logprobs, abs=1e-4)
    prompt = max(prompts, key=len)
    assert len(prompt) >= B  # one prefill forward
    one = generate(sdar, [prompt], params, progress=False)  # a single row always carries alone: fused
    blocks = -(-(len(prompt) % B + 14) // B)  # blocks the response touches
    assert one.stats.forwards == 1 + one.stats.denoise_forwards  # prefill + denoising only: no commit passes
    assert one.stats.denoise_forwards <= 4 * blocks


@pytest.mark.parametrize("strategy,steps", [("low_confidence_static", 4), ("low_confidence_static", 2),
                                            ("low_confidence_dynamic", 4), ("sequential", 3),
                                            ("entropy_bounded", 4)])
def test_step_maps_and_logprobs_match_an_independent_replay(sdar, strategy, steps):
    prompts = prompts_of((1, 3, 6, 8))
    params = _greedy(remasking_strategy=strategy, denoising_steps=steps, dynamic_threshold=0.5,
                     eb_threshold=1.0, max_active=2)
    for traj in generate(sdar, prompts, params, progress=False):
        assert traj.block_size == B and len(traj.response_ids) == 14
        replay_block(sdar, traj, B, steps, strategy, threshold=0.5, eb_threshold=1.0)


def test_static_commits_the_scheduled_count_and_sequential_goes_left_to_right(sdar):
    static = generate(sdar, prompts_of((4,)), _greedy(max_tokens=16, denoising_steps=2), progress=False)[0]
    counts = [static.step_map.count(s) for s in range(1, max(static.step_map) + 1)]
    assert counts == [2] * 8
    seq = generate(sdar, prompts_of((4,)), _greedy(max_tokens=16, remasking_strategy="sequential"),
                   progress=False)[0]
    assert seq.step_map == list(range(1, 17))


def test_dynamic_commits_above_threshold_in_one_step(sdar):
    params = _greedy(remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.0, max_tokens=12)
    traj = generate(sdar, prompts_of((4,)), params, progress=False)[0]
    assert traj.step_map == [1] * 4 + [2] * 4 + [3] * 4  # every confidence > 0: whole block per step


def test_reference_parity_step_ids_with_prompt_tail(sdar):
    """As the reference engine's trace: b=4, 4 steps, P mod 4 = 2, static: first block steps {1, 2}, next block
    {3..6}."""
    traj = generate(sdar, prompts_of((6,)), _greedy(max_tokens=6), progress=False)[0]
    assert set(traj.step_map[:2]) == {1, 2}
    assert set(traj.step_map[2:6]) == {3, 4, 5, 6}


def test_sampling_is_reproducible_with_a_seed(sdar):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True,
                            stop_token_ids=[])
    prompts = prompts_of((2, 5))
    a = generate(sdar, prompts, params, progress=False)
    b = generate(sdar, prompts, params, progress=False)
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    c = generate(sdar, prompts, replace(params, seed=8), progress=False)
    assert [t.response_ids for t in a] != [t.response_ids for t in c]


def test_stop_token_cuts_the_block_and_keeps_the_rest_as_tail(sdar):
    prompt = prompts_of((5,))
    free = generate(sdar, prompt, _greedy(max_tokens=16), progress=False)[0]
    stop_at = next(i for i in range(1, 16) if free.response_ids[i] not in free.response_ids[:i])
    stop_tok = free.response_ids[stop_at]
    got = generate(sdar, prompt, _greedy(max_tokens=16, stop_token_ids=[stop_tok]), progress=False)[0]
    assert got.finish_reason == "stop"
    assert got.response_ids == free.response_ids[:stop_at + 1]
    assert got.step_map == free.step_map[:stop_at + 1]
    block_end = ((5 + stop_at) // B + 1) * B - 5  # response index where the stop's block ends
    assert got.tail_ids == free.response_ids[stop_at + 1:block_end]
    assert got.tail_steps == free.step_map[stop_at + 1:block_end]
    eos_adapter = replace(sdar, eos_ids=(stop_tok,))
    as_eos = generate(eos_adapter, prompt, SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[]),
                      progress=False)[0]
    assert as_eos.finish_reason == "eos" and as_eos.response_ids == got.response_ids


def test_stop_in_the_prompt_tail_is_ignored(sdar, demo_tokenizer):
    eos = demo_tokenizer.eos_token_id
    prompt = [30, 31, 32, 33, 34, eos]  # the eos sits in the first active block, before the response
    free = generate(sdar, [prompt], _greedy(max_tokens=6), progress=False)[0]
    got = generate(sdar, [prompt], SamplingParams(max_tokens=6, temperature=0), progress=False)[0]
    cut = free.response_ids.index(eos) + 1 if eos in free.response_ids else 6
    assert got.response_ids == free.response_ids[:cut]
    assert got.finish_reason == ("eos" if cut < 6 or free.response_ids[-1] == eos else "length")


def test_max_tokens_cuts_mid_block(sdar):
    traj = generate(sdar, prompts_of((3,)), _greedy(max_tokens=3), progress=False)[0]
    assert traj.finish_reason == "length" and len(traj.response_ids) == 3
    assert len(traj.tail_ids) == 2  # the block [4, 8) holds response 1..3 and two decoded tail tokens


def test_stop_strings_must_be_single_tokens(sdar):
    stop = SamplingParams(stop=["<|im_end|>"]).stop_ids(sdar.tokenizer, sdar.eos_ids, sdar.stop_ids)
    assert sdar.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop
    with pytest.raises(ValueError, match="not a single token"):
        generate(sdar, [[1, 2]], SamplingParams(stop=["the quick brown fox"]), progress=False)


def test_prompt_longer_than_the_model_limit_is_a_clear_error(demo_tokenizer):
    small = sharp_tiny("sdar", demo_tokenizer, max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"prompt 1 has 40 tokens.*32 positions"):
        generate(small, [[1, 2], [5] * 40], _greedy(), progress=False)
    near = generate(small, [[5] * 26], _greedy(max_tokens=20), progress=False)[0]
    assert near.finish_reason == "length" and len(near.response_ids) == 32 - 26


def test_empty_prompt_and_chat_prompts(sdar):
    out = generate(sdar, [[], "hello", [{"role": "user", "content": "hi"}]], _greedy(max_tokens=4),
                   progress=False)
    assert isinstance(out, Rollout) and len(out) == 3
    assert out[0].prompt_ids == [] and len(out[0].response_ids) == 4
    assert out[1].prompt_ids == sdar.encode_chat("hello")
    assert out[2].prompt_ids == sdar.encode_chat([{"role": "user", "content": "hi"}])
    stats = out.stats
    assert stats.generated_tokens == 12 and stats.tokens_per_second > 0
    assert stats.tokens_per_forward == pytest.approx(12 / stats.forwards)
    ids = sdar.encode_chat("hello")
    for one in (ids, torch.tensor(ids), [{"role": "user", "content": "hello"}]):  # a single prompt: a batch of one
        (alone,) = generate(sdar, one, _greedy(max_tokens=4), progress=False)
        assert alone.prompt_ids == ids and alone.response_ids == out[1].response_ids
    assert [t.prompt_ids for t in generate(sdar, torch.tensor([ids, ids]), _greedy(max_tokens=4),
                                           progress=False)] == [ids, ids]
    with pytest.raises(TypeError, match="a prompt is a text, a list of token ids or a list of chat messages; got "
                                        "list holding float"):
        generate(sdar, [[1, 2.5]], _greedy(max_tokens=4), progress=False)  # named by the item that is no id



def test_python_api_mistakes_are_one_line_errors(sdar):
    rows = sdar.model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=f"prompt 1 holds token id {rows}, outside the model's vocabulary "
                                         f"\\(ids 0 to {rows - 1}\\)"):
        generate(sdar, [[1, 2], [3, rows]], _greedy(max_tokens=4), progress=False)
    with pytest.raises(ValueError, match="prompt 0 holds token id -1"):
        generate(sdar, [[-1]], _greedy(max_tokens=4), progress=False)
    as_dict = generate(sdar, [[1, 2]], {"max_tokens": 4, "temperature": 0.0, "stop_token_ids": [],
                                        "ignore_eos": True}, progress=False)
    assert as_dict[0].response_ids == generate(sdar, [[1, 2]], _greedy(max_tokens=4), progress=False)[0].response_ids
    with pytest.raises(TypeError, match="unknown sampling setting 'temprature'"):
        generate(sdar, [[1, 2]], {"temprature": 0.0}, progress=False)
    with pytest.raises(TypeError, match="params is a SamplingParams or a dict of its fields, got str"):
        generate(sdar, [[1, 2]], "greedy", progress=False)


class _ThinkAdapter(Adapter):
    """Pushes every prediction towards ``<think>`` to check that added tokens decode as themselves."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().logits(hidden).clone()
        out[..., self.tokenizer.convert_tokens_to_ids("<think>")] += 1000.0
        return out


def test_think_token_decodes_as_itself(sdar):
    think = _ThinkAdapter(**{f.name: getattr(sdar, f.name) for f in fields(sdar)})
    traj = generate(think, [[20, 21, 22]], _greedy(max_tokens=3), progress=False)[0]
    assert traj.text == "<think>" * 3


def test_bfloat16_model_samples(demo_tokenizer):
    """A bf16 model samples, and its recorded log-probs are the trainer's float32 ones of the same weights in the
    same contexts, within 0.1 (bf16 keeps 8 significant bits: logits near 10 round by up to 0.03, and their
    log-sum-exp with them; measured: 0.023 at most on log-probs of -2 to -7). A log-prob of another position or
    another context is off by more than 0.1."""
    import copy

    from tests.test_train_trainer import make_trainer
    from train.views import build_view

    bf16 = sharp_tiny("sdar", demo_tokenizer, seed=3)
    fp32 = copy.deepcopy(bf16)
    bf16.model.to(torch.bfloat16)
    out = generate(bf16, prompts_of((3, 8)), SamplingParams(max_tokens=6, seed=0, ignore_eos=True,
                                                             stop_token_ids=[], max_active=1), progress=False)
    assert [len(t.response_ids) for t in out] == [6, 6]
    assert all(isinstance(x, float) and x <= 0 for t in out for x in t.logprobs)
    fp32.model.load_state_dict({k: v.float() for k, v in bf16.model.state_dict().items()})  # the same weights
    for i, traj in enumerate(out):
        traj.sample_id = f"s{i}"
    trainer = make_trainer(fp32)
    batch = build_view(list(out), {t.sample_id: 1.0 for t in out}, trainer.cfg, trainer.traits)
    torch.testing.assert_close(trainer.logprobs(batch), batch.old_logprobs, atol=0.1, rtol=0)


@pytest.mark.parametrize("fuse_max_tokens", [0, 10_000])
@pytest.mark.parametrize("params", [
    dict(temperature=1.0, seed=3, remasking_strategy="low_confidence_static"),
    dict(temperature=0.8, top_k=20, top_p=0.9, seed=4, remasking_strategy="low_confidence_dynamic",
         dynamic_threshold=0.3),
    dict(temperature=1.0, seed=5, remasking_strategy="entropy_bounded", eb_threshold=0.5),
    dict(temperature=1.0, seed=6, remasking_strategy="sequential"),
    dict(temperature=1.0, seed=7, alg_temp=0.5, target="margin_confidence"),
    dict(temperature=0.0, target="neg_entropy", pad_target_penalty=2.0),
])
def test_lm_head_on_masked_positions_only_gives_the_tokens_of_a_head_everywhere(sdar, monkeypatch, params,
                                                                               fuse_max_tokens):
    """The sampler runs the LM head only where tokens are still masked; with the head on every position (the
    reference's way) the random stream, tokens, steps and log-probs are the same, under every strategy."""
    from sample import block_sampler
    from sample.strategies import draw_tokens

    monkeypatch.setattr(block_sampler, "FUSE_MAX_TOKENS", {"cpu": fuse_max_tokens, "cuda": fuse_max_tokens})
    # 0: a finished block rides alone unless every row carries one
    monkeypatch.setattr(block_sampler, "FUSE_CARRYING_SHARE", 0.5 if fuse_max_tokens else 1.0)
    prompts = prompts_of()
    p = SamplingParams(**{**dict(max_tokens=14, stop_token_ids=[], ignore_eos=True, max_active=3), **params})
    heads = []

    def count_rows(sampler, hidden, candidates):
        heads.append((int(candidates.sum()), candidates.numel()))
        return selected(sampler, hidden, candidates)

    selected = block_sampler.BlockSampler._draw
    monkeypatch.setattr(block_sampler.BlockSampler, "_draw", count_rows)
    ours = generate(sdar, prompts, p, progress=False)

    def head_everywhere(sampler, hidden, candidates):
        return draw_tokens(sampler.adapter.logits(hidden), sampler.params, sampler.generator, sampler.adapter.mask_id,
                           sampler.adapter.pad_id)

    monkeypatch.setattr(block_sampler.BlockSampler, "_draw", head_everywhere)
    everywhere = generate(sdar, prompts, p, progress=False)
    assert [_key(t) for t in ours] == [_key(t) for t in everywhere]
    for a, b in zip(ours, everywhere):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert sum(n for n, _ in heads) < sum(total for _, total in heads)  # fewer LM-head rows than positions


# ---------------------------------------------------------------- fixed-capacity cache (rollout.cuda_graphs)


@pytest.mark.parametrize("fuse_max_tokens", [0, 10_000])
@pytest.mark.parametrize(("strategy", "temperature"), [("low_confidence_static", 0.0),
                                                        ("low_confidence_dynamic", 1.0)])
def test_the_fixed_capacity_cache_gives_the_growing_caches_tokens(sdar, monkeypatch, strategy, temperature,
                                                                  fuse_max_tokens):
    """``cuda_graphs``: decode forwards over a fixed-capacity cache with the rows padded to a bucket (run eagerly on
    CPU) give the growing cache's tokens, step maps and log-probs, with rows joining and leaving (max_active 3) and
    finished blocks stored fused or riding alone, in the same number of forwards."""
    from sample import block_sampler

    monkeypatch.setattr(block_sampler, "FUSE_MAX_TOKENS", {"cpu": fuse_max_tokens, "cuda": fuse_max_tokens})
    monkeypatch.setattr(block_sampler, "FUSE_CARRYING_SHARE", 0.5 if fuse_max_tokens else 1.0)
    params = _greedy(max_active=3, remasking_strategy=strategy, dynamic_threshold=0.5, temperature=temperature,
                     seed=3)
    growing = generate(sdar, prompts_of(), params, progress=False)
    static = generate(sdar, prompts_of(), replace(params, cuda_graphs=True), progress=False)
    assert [_key(t) for t in static] == [_key(t) for t in growing]
    for s, g in zip(static, growing):
        assert s.logprobs == pytest.approx(g.logprobs, abs=1e-5)
    assert static.stats.forwards == growing.stats.forwards


def test_the_fixed_capacity_cache_repacks_and_grows_when_the_batch_outgrows_it(sdar, monkeypatch):
    """Started too small (no room reserved for the responses, one block of slack), the cache repacks its invalid
    columns away in place and, when that is not enough, grows (new buffers: the graphs would be captured again);
    the tokens stay the growing cache's."""
    from sample import block_runners
    from sample.kv_batch import StaticKVCache

    events = []
    repack, grow, init = StaticKVCache.repack, block_runners.StaticRunner._grow, block_runners.StaticRunner.__init__
    monkeypatch.setattr(StaticKVCache, "repack", lambda self, *a: events.append("repack") or repack(self, *a))
    monkeypatch.setattr(block_runners.StaticRunner, "_grow", lambda self, *a: events.append("grow") or grow(self, *a))
    monkeypatch.setattr(block_runners.StaticRunner, "__init__",
                        lambda self, *a, **kw: init(self, *a, **{**kw, "capacity_hint": 0}))
    monkeypatch.setattr(block_runners, "REPACK_SLACK", 1)
    params = _greedy(max_tokens=40, max_active=3, remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.5)
    growing = generate(sdar, prompts_of(), params, progress=False)
    static = generate(sdar, prompts_of(), replace(params, cuda_graphs=True), progress=False)
    assert [_key(t) for t in static] == [_key(t) for t in growing]
    assert "repack" in events and "grow" in events


def test_batch_buckets():
    from sample.block_runners import bucket_for

    got = [bucket_for(n) for n in (1, 2, 3, 5, 9, 16, 17, 25, 33, 100, 129, 256, 257, 600)]
    assert got == [1, 2, 4, 8, 16, 16, 24, 32, 48, 128, 192, 256, 512, 768]


def test_padding_rows_never_leak_into_real_rows_or_the_cache(sdar):
    """3 rows run in a bucket of 4: whatever the padding slot holds (its inputs, its cached keys, made valid),
    the real rows' hidden states are the same bit for bit, and equal the growing cache's; a storing forward never
    makes a column of a padding slot valid."""
    from sample.block_runners import CachedRunner, StaticRunner
    from sample.engine import RolloutStats

    prompts = [p for p in prompts_of() if len(p) >= B][:3]
    prefixes = [p[: len(p) // B * B] for p in prompts]
    tokens = torch.full((3, B), sdar.mask_id)
    tokens[:, 0] = torch.tensor([p[-1] for p in prompts])
    positions = torch.tensor([len(p) for p in prefixes])[:, None] + torch.arange(B)
    static, growing = StaticRunner(sdar, B, RolloutStats(), capacity_hint=16), CachedRunner(sdar, B, RolloutStats())
    with torch.inference_mode():
        for runner in (static, growing):
            runner.admit(prefixes)
        assert static.store.slots == 4
        want = growing.step(tokens, positions, None, None)
        clean = static.step(tokens, positions, None, None).clone()
        torch.testing.assert_close(clean, want, atol=1e-5, rtol=1e-5)
        static.inputs["ids"][3] = 11  # garbage in the padding slot
        static.inputs["pos"][3] = torch.arange(2 * B) + 37
        static.store.keys[:, 3] = 1e4
        static.store.valid[3, :8] = True
        assert torch.equal(static.step(tokens, positions, None, None), clean)
        static.store.valid[3] = False
        carry, carrying = tokens.clone(), torch.tensor([True, False, True])
        static.step(tokens, positions + B, carry, carrying, fused=True)  # stores the carried blocks
        assert not static.store.valid[3:].any()
        stored = static.store.valid[:, static.store.end - B:static.store.end]
        assert stored[[0, 2]].all() and not stored[1].any()


def test_cuda_graphs_is_refused_where_it_is_not_built_in_one_line(sdar, demo_tokenizer):
    from core.schema import SettingError
    from tests.test_sampler_utils import sharp_tiny

    _greedy(cuda_graphs=True).check_for(sdar)
    with pytest.raises(SettingError, match="cuda_graphs replays cached decode forwards: it needs cache 'prefix'"):
        _greedy(cuda_graphs=True, cache="none").check_for(sdar)
    with pytest.raises(SettingError, match="cuda_graphs is built for block models"):
        _greedy(cuda_graphs=True).check_for(sharp_tiny("dream", demo_tokenizer))



def test_generate_refuses_settings_the_model_cannot_honour(sdar, demo_tokenizer):
    from core.schema import SettingError
    from tests.test_sampler_utils import sharp_tiny

    dream = sharp_tiny("dream", demo_tokenizer)
    for adapter, params, field in [(dream, _greedy(editing_threshold=0.9), "editing_threshold"),
                                   (dream, _greedy(cuda_graphs=True), "cuda_graphs"),
                                   (sdar, _greedy(cuda_graphs=True, cache="none"), "cuda_graphs"),
                                   (sdar, _greedy(denoising_steps=sdar.block_size + 1), "denoising_steps"),
                                   # settings the chosen sampler would ignore
                                   (sdar, _greedy(steps=8), "steps"),
                                   (dream, _greedy(denoising_steps=2), "denoising_steps"),
                                   (sdar, _greedy(max_post_steps=3), "max_post_steps"),
                                   (dream, _greedy(max_post_steps=3), "max_post_steps"),
                                   (sdar, _greedy(remasking_strategy="sequential", alg_temp=0.5), "alg_temp"),
                                   (dream, _greedy(remasking_strategy="entropy_bounded", target="margin_confidence"),
                                    "target"),
                                   (sdar, _greedy(remasking_strategy="entropy_bounded", pad_target_penalty=2.0),
                                    "pad_target_penalty")]:
        with pytest.raises(SettingError) as err:
            generate(adapter, [[5, 6, 7]], params, progress=False)
        assert err.value.field == field
    # what each of them is for still runs
    for adapter, params in [(dream, _greedy(steps=8)), (sdar, _greedy(editing_threshold=0.9, max_post_steps=3)),
                            (sdar, _greedy(remasking_strategy="low_confidence_static", alg_temp=0.5, seed=1,
                                           target="margin_confidence", pad_target_penalty=2.0))]:
        generate(adapter, [[5, 6, 7]], params, progress=False)


def test_the_fixed_capacity_cache_gives_the_growing_caches_tokens_with_token_editing(sdar):
    """Token editing (post steps after a block's last mask) on the fixed-capacity cache: the growing cache's
    tokens, step maps and rewrites, in the same number of forwards (on CUDA this path is the default)."""
    params = _greedy(max_active=3, remasking_strategy="low_confidence_dynamic", dynamic_threshold=0.5,
                     editing_threshold=0.05, max_post_steps=2, temperature=1.0, seed=5)
    growing = generate(sdar, prompts_of(), replace(params, cuda_graphs=False), progress=False)
    static = generate(sdar, prompts_of(), replace(params, cuda_graphs=True), progress=False)
    assert [_key(t) + (t.rewrites,) for t in static] == [_key(t) + (t.rewrites,) for t in growing]
    assert any(any(t.rewrites) for t in growing)  # the edits happen
    assert static.stats.forwards == growing.stats.forwards


@pytest.mark.parametrize(("cuda_graphs", "capturable", "runner", "graphs"),
                         [(None, True, "StaticRunner", True), (None, False, "CachedRunner", None),
                          (False, True, "CachedRunner", None), (True, False, "StaticRunner", False),
                          (True, True, "StaticRunner", True)])
def test_cuda_graphs_default_captures_only_where_it_can(sdar, monkeypatch, cuda_graphs, capturable, runner, graphs):
    """``cuda_graphs`` None (default) takes the fixed-capacity cache with graphs exactly where a capture can work
    (CUDA, no host-syncing expert layer), else today's growing cache; False never; True always (eager where it
    cannot capture)."""
    from sample.block_sampler import BlockSampler
    from sample.generate import make_sampler

    monkeypatch.setattr(BlockSampler, "_capturable", lambda self: capturable)
    sampler = make_sampler(sdar, _greedy(cuda_graphs=cuda_graphs), set(), None, torch.Generator())
    assert type(sampler.runner).__name__ == runner
    assert getattr(sampler.runner, "graphs", None) == graphs


def test_expert_layers_are_sync_free_only_where_the_grouped_product_runs(tiny):
    """A dense model has no expert layer (sync-free); fused experts are while ``torch._grouped_mm`` takes their
    operands (fp32 on CPU, rows a multiple of 16 bytes), not in float64, where the split reads counts to the host."""
    from models.moe import expert_layers_sync_free

    assert expert_layers_sync_free(tiny("sdar").model)
    moe = tiny("sdar_moe", seed=0).model
    assert expert_layers_sync_free(moe)
    assert not expert_layers_sync_free(moe.double())


def test_what_a_cuda_sampler_would_capture(sdar, tiny):
    """On CUDA (the device faked: only its type is read): a dense float model is captured; host-syncing expert
    layers never are (a warning where cuda_graphs=true asked); quantized or ZeRO-3-partitioned weights only when
    asked."""
    import copy

    from sample.generate import make_sampler

    def capturable(adapter, cuda_graphs):
        sampler = make_sampler(adapter, _greedy(cuda_graphs=cuda_graphs), set(), None, torch.Generator())
        sampler.device = torch.device("cuda")
        return sampler._capturable()

    assert capturable(sdar, None) and capturable(sdar, True)
    moe = tiny("sdar_moe", seed=0)
    moe.model.double()
    assert not capturable(moe, None)
    with pytest.warns(UserWarning, match="expert layers read their counts back to the host"):
        assert not capturable(moe, True)
    quantized = copy.deepcopy(sdar)
    quantized.model.register_parameter("packed_4bit", torch.nn.Parameter(torch.zeros(4, dtype=torch.uint8),
                                                                         requires_grad=False))
    assert not capturable(quantized, None) and capturable(quantized, True)
    partitioned = copy.deepcopy(sdar)  # DeepSpeed ZeRO-3 marks its partitioned parameters with ds_id
    next(partitioned.model.parameters()).ds_id = 0
    assert not capturable(partitioned, None) and capturable(partitioned, True)


@pytest.mark.parametrize("free_bytes", [None, 10**12, 10**4])
def test_the_response_budget_is_reserved_only_where_memory_allows(sdar, monkeypatch, free_bytes):
    """The fixed-capacity cache reserves prompt + response budget up front while that fits half the device's free
    memory (None: a CPU, unbounded); with too little free it starts at the prompts and grows as the responses do
    (the graphs would be captured again). Either way the growing cache's tokens."""
    from sample import block_runners

    sizes, grows = [], []
    allocate, grow = block_runners.StaticRunner._allocate, block_runners.StaticRunner._grow
    monkeypatch.setattr(block_runners, "free_device_bytes", lambda device: free_bytes)
    monkeypatch.setattr(block_runners.StaticRunner, "_allocate",
                        lambda self, *a: allocate(self, *a) or sizes.append(self.store.capacity))
    monkeypatch.setattr(block_runners.StaticRunner, "_grow",
                        lambda self, slots, capacity: grows.append(capacity > self.store.capacity)
                        or grow(self, slots, capacity))
    params = _greedy(max_tokens=64, max_active=3)
    growing = generate(sdar, prompts_of(), replace(params, cuda_graphs=False), progress=False)
    static = generate(sdar, prompts_of(), replace(params, cuda_graphs=True), progress=False)
    assert [_key(t) for t in static] == [_key(t) for t in growing]
    # reserved: >= the prompts' cached length + 64 + the slack; not: <= the longest prompt + the slack (40) + 3
    longest = max(len(p) for p in prompts_of()[:3])
    assert (sizes[0] >= longest + 64) == (free_bytes != 10**4), sizes
    assert len(sizes) == 1  # allocated once; a grow resizes
    if free_bytes == 10**4:
        assert any(grows)  # 64-token responses outgrow 40 columns of slack: the cache widened as they grew


@pytest.mark.parametrize("cuda_graphs", [True, False])  # the fixed-capacity cache (CUDA's default), the growing one
def test_a_decode_step_waits_for_the_device_only_to_read_the_masked_positions_and_finished_blocks(sdar, cuda_graphs):
    """What ``pytest -m gpu`` counts with torch's sync debug mode on CUDA, pinned on CPU by ``DeviceWaits``: a step
    reads back once to find the still-masked positions and once at its end; a step in which blocks finish reads
    their records once more. Nothing is copied to the device from pageable memory (on an H100 the rows' index
    tensors and ``x[rows] = value`` resets were 200 of a 36-forward run's 292 host syncs)."""
    params = SamplingParams(max_tokens=32, temperature=1.0, stop_token_ids=[], ignore_eos=True, seed=0,
                            cuda_graphs=cuda_graphs)
    with DeviceWaits() as waits:
        out = generate(sdar, prompts_of(), params, progress=False)
    steps = out.stats.denoise_forwards
    assert all(len(t.response_ids) == 32 for t in out)
    assert waits.copies == {}
    by_kind = {}
    for site, n in waits.reads.items():
        by_kind[site.split(" @ ")[0]] = by_kind.get(site.split(" @ ")[0], 0) + n
    assert by_kind["nonzero"] - (0 if cuda_graphs else 1) == steps  # the growing cache compacts once (a row left)
    assert by_kind["tolist"] <= 2 * steps
    assert sum(waits.reads.values()) <= 3 * out.stats.forwards

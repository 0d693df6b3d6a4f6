"""Remasking strategies and token sampling on hand-made grids, and SamplingParams validation."""

from __future__ import annotations

import pytest
import torch

from sample.params import SamplingParams
from sample.strategies import Draw, draw_tokens, filter_logits, select_transfer, top_n


def _draw(conf, entropy=None) -> Draw:
    conf = torch.tensor(conf, dtype=torch.float32)
    ent = torch.tensor(entropy, dtype=torch.float32) if entropy is not None else 1 - conf
    return Draw(tokens=torch.zeros_like(conf, dtype=torch.long), confidence=conf, logprob=conf.log(), score=conf,
                entropy=ent)


def _select(strategy, conf, candidate, n, entropy=None, **kw):
    params = SamplingParams(remasking_strategy=strategy, **kw)
    cand = torch.tensor(candidate, dtype=torch.bool)
    out = select_transfer(_draw(conf, entropy), cand, torch.tensor(n), params, None)
    return out.int().tolist()


CONF = [[0.2, 0.95, 0.5, 0.97], [0.3, 0.1, 0.6, 0.2]]


def test_static_takes_the_top_n_candidates():
    assert _select("low_confidence_static", CONF, [[1, 1, 1, 1], [1, 1, 1, 1]], [2, 1]) == [[0, 1, 0, 1],
                                                                                           [0, 0, 1, 0]]


def test_never_selects_a_position_that_is_not_masked():
    """Asking for more than the masks left commits only the masks."""
    got = _select("low_confidence_static", CONF, [[1, 0, 0, 0], [0, 1, 0, 1]], [4, 4])
    assert got == [[1, 0, 0, 0], [0, 1, 0, 1]]
    seq = _select("sequential", CONF, [[0, 0, 1, 1], [1, 0, 0, 0]], [3, 3])
    assert seq == [[0, 0, 1, 1], [1, 0, 0, 0]]


def test_dynamic_takes_everything_above_threshold_else_top_n():
    got = _select("low_confidence_dynamic", CONF, [[1, 1, 1, 1], [1, 1, 1, 1]], [1, 1], dynamic_threshold=0.9)
    assert got == [[0, 1, 0, 1], [0, 0, 1, 0]]
    strict = _select("low_confidence_dynamic", [[0.5, 0.2, 0.5]], [[1, 1, 1]], [1], dynamic_threshold=0.5)
    assert strict == [[1, 0, 0]]  # 0.5 is not > 0.5: the fallback top-1 (ties to the left), not both 0.5s
    few = _select("low_confidence_dynamic", CONF, [[1, 1, 1, 1], [1, 1, 1, 1]], [3, 2], dynamic_threshold=0.9)
    assert few == [[0, 1, 1, 1], [1, 0, 1, 0]]  # 2 above but 3 scheduled: top-3


def test_sequential_goes_left_to_right():
    assert _select("sequential", CONF, [[0, 1, 1, 1], [1, 1, 1, 1]], [2, 3]) == [[0, 1, 1, 0], [1, 1, 1, 0]]


def test_entropy_bounded_takes_the_lowest_entropies_while_their_sum_stays_below_the_bound():
    ent = [[0.3, 0.1, 0.2, 0.05], [1.0, 2.0, 3.0, 0.5], [0.5, 0.1, 0.9, 0.2]]
    got = _select("entropy_bounded", CONF + [[0.5] * 4], [[1, 1, 1, 1]] * 3, [1, 1, 1], entropy=ent,
                  eb_threshold=0.35)
    # row 0: running 0.05, 0.15, 0.35 (reaches the bound: waits); row 1: 0.5 alone is over it: one, the lowest;
    # row 2 (sorted 0.1, 0.2, 0.5, 0.9 -> 0.1, 0.3, 0.8): the two lowest (the reference's searchsorted count)
    assert got == [[0, 1, 0, 1], [0, 0, 0, 1], [0, 1, 0, 1]]
    all_low = _select("entropy_bounded", CONF, [[1, 0, 1, 0], [1, 1, 1, 1]], [1, 1],
                      entropy=[[0.0, 0.0, 0.0, 0.0], [0.0] * 4], eb_threshold=0.35)
    assert all_low == [[1, 0, 1, 0], [1, 1, 1, 1]]  # never reaches the bound: every candidate


def test_top_n_breaks_ties_to_the_left():
    key = torch.ones(1, 4)
    assert top_n(key, torch.ones(1, 4, dtype=torch.bool), torch.tensor([2])).int().tolist() == [[1, 1, 0, 0]]


def test_alg_temp_samples_positions_reproducibly():
    params = SamplingParams(alg_temp=1.0)
    cand = torch.ones(2, 8, dtype=torch.bool)
    draw = _draw([[0.5] * 8] * 2)
    picks = [select_transfer(draw, cand, torch.tensor([3, 3]), params, torch.Generator().manual_seed(s))
             for s in (0, 0, 1)]
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])
    assert picks[0].sum(1).tolist() == [3, 3]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert filter_logits(logits, 1.0, 2, 1.0).isfinite().tolist() == [[True, True, False, False]]
    assert filter_logits(logits, 1.0, 0, 0.7).isfinite().tolist() == [[True, True, False, False]]
    assert filter_logits(logits, 1.0, 0, 0.4).isfinite().tolist() == [[True, False, False, False]]
    assert torch.allclose(filter_logits(logits, 0.5, 0, 1.0), logits / 0.5)


def test_draw_tokens_records_raw_logprob_and_filtered_confidence():
    logits = torch.tensor([[[2.0, 1.0, 0.0, 5.0]]])  # id 3 is the mask: never sampled
    params = SamplingParams(temperature=0.0, top_k=2)
    draw = draw_tokens(logits, params, None, banned_id=3, pad_id=1)
    assert draw.tokens.item() == 0
    assert draw.logprob.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 0, 0].item())
    two = torch.tensor([2.0, 1.0]).softmax(0)
    assert draw.confidence.item() == pytest.approx(two[0].item())
    penalised = draw_tokens(torch.tensor([[[0.0, 9.0, 0.0, 0.0]]]), SamplingParams(temperature=0.0,
                            pad_target_penalty=4.0), None, banned_id=3, pad_id=1)
    assert penalised.tokens.item() == 1 and penalised.score.item() == pytest.approx(
        penalised.confidence.item() / 4)


def test_draw_tokens_is_seeded_and_respects_top_k():
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_k=3)
    a = draw_tokens(logits, params, torch.Generator().manual_seed(1), banned_id=49, pad_id=0)
    b = draw_tokens(logits, params, torch.Generator().manual_seed(1), banned_id=49, pad_id=0)
    assert torch.equal(a.tokens, b.tokens)
    top3 = logits.index_fill(-1, torch.tensor([49]), float("-inf")).topk(3, -1).indices
    assert (top3 == a.tokens[..., None]).any(-1).all()


@pytest.mark.parametrize("target", ["confidence", "margin_confidence", "neg_entropy"])
def test_targets_prefer_peaked_distributions(target):
    logits = torch.tensor([[[5.0, 0.0, 0.0, 0.0], [1.0, 0.9, 0.0, 0.0]]])
    draw = draw_tokens(logits, SamplingParams(temperature=0.0, target=target), None, banned_id=3, pad_id=2)
    # the reference's LLaDA neg_entropy had the sign flipped: must not prefer uncertainty
    assert draw.score[0, 0] > draw.score[0, 1]


@pytest.mark.parametrize("kw,msg", [
    ({"remasking_strategy": "fancy"}, "remasking_strategy"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"cache": "paged"}, "cache"),
    ({"target": "x"}, "target"), ({"dynamic_threshold": 1.5}, "dynamic_threshold"),
    ({"denoising_steps": 0}, "denoising_steps"), ({"steps": 0}, "steps"), ({"block_size": 2.5}, "block_size"),
    ({"pad_target_penalty": 0}, "pad_target_penalty"), ({"max_active": 0}, "max_active"),
])
def test_params_validation_names_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_params_defaults_and_stop_ids(demo_tokenizer):
    p = SamplingParams()
    assert (p.max_tokens, p.denoising_steps, p.dynamic_threshold, p.eb_threshold, p.remasking_strategy) == (
        64, 4, 0.9, 0.35, "low_confidence_static")
    im_end = demo_tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = demo_tokenizer.eos_token_id
    assert p.stop_ids(demo_tokenizer, (eos,), (eos, im_end)) == {eos, im_end}
    assert SamplingParams(stop_token_ids=[]).stop_ids(demo_tokenizer, (eos,), (eos, im_end)) == {eos}
    assert SamplingParams(ignore_eos=True).stop_ids(demo_tokenizer, (eos,), (eos, im_end)) == {im_end}
    # an EOS asked for by name in stop_token_ids stops even under ignore_eos (vLLM's rule)
    assert SamplingParams(ignore_eos=True, stop_token_ids=[eos]).stop_ids(demo_tokenizer, (eos,), (im_end,)) == {eos}
    assert SamplingParams(stop="<think>", stop_token_ids=[]).stop_ids(demo_tokenizer, (eos,), ()) == {
        eos, demo_tokenizer.convert_tokens_to_ids("<think>")}

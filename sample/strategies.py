"""Token sampling and remasking strategies (as in Gen-Verse/dLLM-RL sample/jetengine_ext/engine/scheduler.py),
vectorised over a batch of rows.

Every function works on candidate grids ``[R, K]``: R rows, K candidate positions per row given in position
order (left to right). ``candidate`` marks positions that are still masked; nothing outside it is ever selected
(the reference engine's top-k could overwrite decoded or prompt-tail tokens: Gen-Verse/dLLM-RL
sample/jetengine_ext/engine/scheduler.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from core.errors import UserError
from sample.engine import on_device
from sample.params import SamplingParams

NEG_INF = float("-inf")


class Draw(NamedTuple):
    """One sampled token per candidate position, with the numbers the strategies and the trainer need."""

    tokens: Tensor  # [R, K] long
    confidence: Tensor  # p(token) under the filtered distribution (temperature, top-k, top-p)
    logprob: Tensor  # log_softmax of the raw fp32 logits at the token (temperature 1, no filtering)
    score: Tensor  # ranking score of the configured target, pad penalty applied
    entropy: Tensor | None  # entropy of the filtered distribution (only when a strategy or target needs it)


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Logits / temperature (0 means 1: greedy takes the argmax) -> top-k -> top-p, removed entries -inf."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop_sorted = probs.cumsum(-1) - probs > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


class DegenerateLogitsError(UserError, ValueError):
    """Sampling cannot continue: the distribution over tokens is undefined."""


class GridPositions(NamedTuple):
    """The True positions of a bool [R, K] grid, found once (one host sync, for their count); taking rows at them
    and putting values back are index operations after that, which never wait for the device."""

    shape: torch.Size
    index: Tensor  # [M] flat positions of the True entries, in row-major order

    @classmethod
    def of(cls, grid: Tensor) -> GridPositions:
        return cls(grid.shape, grid.reshape(-1).nonzero().squeeze(1))

    def take(self, x: Tensor) -> Tensor:
        """``x`` [R, K, ...] at the positions: [M, ...]."""
        return x.flatten(0, 1).index_select(0, self.index)

    def put(self, values: Tensor) -> Tensor:
        """``values`` [M] back on the grid: [R, K], zeros elsewhere."""
        return values.new_zeros(self.shape.numel()).index_copy_(0, self.index, values).view(self.shape)


def draw_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None,
                banned_id: int, pad_id: int, grid: GridPositions | None = None, check: bool = True) -> Draw:
    """Sample a token for every position of ``logits`` [R, K, V] (any dtype; computed in fp32).

    ``banned_id`` (the mask id) is never sampled: a committed mask token would be indistinguishable from an
    undecoded position. ``grid``: ``logits`` [M, V] holds only the grid's positions (the LM head ran where tokens
    are still masked); the draw comes back on the whole [R, K] grid, zeros elsewhere, and the random stream is the
    whole grid's (one uniform per grid position, the selected ones used), so tokens do not depend on it.
    ``check``: raise DegenerateLogitsError here (a host sync); without it the caller checks ``confidence``, NaN
    exactly at the degenerate positions (:func:`degenerate_positions`), when it next syncs.
    """
    if grid is not None:
        draw = draw_tokens(logits[None], params, _GridUniforms(generator, grid), banned_id, pad_id, check=check)
        return Draw(*(None if v is None else grid.put(v[0]) for v in draw))
    raw = logits.float()
    filtered = raw.clone()
    filtered[..., banned_id] = NEG_INF
    filtered = filter_logits(filtered, params.temperature, params.top_k, params.top_p)
    probs = filtered.softmax(-1)
    tokens = probs.argmax(-1) if params.greedy else _sample(probs, generator)
    # NaN logits, or filters that left no token with probability > 0: NaN in the softmax row (a +inf logit leaves
    # the other entries 0, so the drawn token's probability alone would not show it); marked in ``confidence``
    confidence = probs.gather(-1, tokens[..., None]).squeeze(-1).masked_fill(torch.isnan(probs).any(-1), float("nan"))
    if check and (bad := int(degenerate_positions(confidence))):
        raise degenerate_logits_error(bad)
    logprob = raw.gather(-1, tokens[..., None]).squeeze(-1) - raw.logsumexp(-1)
    needs_entropy = params.remasking_strategy == "entropy_bounded" or params.target == "neg_entropy"
    entropy = torch.special.entr(probs).sum(-1) if needs_entropy else None
    score = _target_score(params.target, probs, confidence, entropy)
    if params.pad_target_penalty != 1.0:
        score = _penalise_pad(score, tokens == pad_id, params.pad_target_penalty)
    return Draw(tokens, confidence, logprob, score, entropy)


def degenerate_positions(confidence: Tensor) -> Tensor:
    """How many positions of a draw had no distribution to draw from (a 0-dim tensor; ``draw_tokens`` marks them
    NaN in ``confidence``)."""
    return torch.isnan(confidence).sum()


def degenerate_logits_error(positions: int) -> DegenerateLogitsError:
    return DegenerateLogitsError(
        f"the model produced NaN logits or no token with probability > 0 at {positions} position(s) (check the "
        "checkpoint and dtype; a model trained with too high a learning rate diverges like this); stopping instead "
        "of committing an arbitrary token")


class _GridUniforms:
    """Stands for a generator when only the ``grid`` positions of an [R, K] draw are computed: the uniforms are
    drawn for the whole grid, as the full draw would, and the grid's positions returned."""

    def __init__(self, generator: torch.Generator | None, grid: GridPositions):
        self.generator, self.grid = generator, grid

    def uniforms(self, dtype: torch.dtype) -> Tensor:
        u = torch.rand(self.grid.shape + (1,), generator=self.generator, device=self.grid.index.device, dtype=dtype)
        return self.grid.take(u)[None]


def _sample(probs: Tensor, generator: torch.Generator | _GridUniforms | None) -> Tensor:
    """One categorical draw per row of ``probs`` [..., V] by inverse CDF: one uniform per row, so much cheaper
    than ``torch.multinomial`` (one exponential per vocabulary entry) on CPU. Zero-probability entries are
    never drawn (``right=True``: the first entry whose CDF exceeds u)."""
    cdf = probs.cumsum(-1)
    if isinstance(generator, _GridUniforms):
        u = generator.uniforms(cdf.dtype)
    else:
        u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=probs.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def _target_score(target: str, probs: Tensor, confidence: Tensor, entropy: Tensor | None) -> Tensor:
    """confidence: p(token); margin_confidence: top1 - top2; neg_entropy: sum p log p (low entropy first)."""
    if target == "confidence":
        return confidence
    if target == "margin_confidence":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    return -entropy


def _penalise_pad(score: Tensor, is_pad: Tensor, penalty: float) -> Tensor:
    """Make pad candidates less attractive: divide non-negative scores, multiply negative ones."""
    return torch.where(is_pad, torch.where(score >= 0, score / penalty, score * penalty), score)


def select_transfer(draw: Draw, candidate: Tensor, n_transfer: Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> Tensor:
    """Which candidates to commit this step: bool [R, K], a subset of ``candidate``.

    * static: exactly min(n_t, #candidates) with the highest score;
    * dynamic: every candidate with score > dynamic_threshold when there are at least n_t of them, else the
      top n_t (the block-model rule, used for full-attention models too);
    * sequential: the n_t left-most candidates;
    * entropy_bounded: candidates by ascending entropy while their cumulative entropy stays below eb_threshold,
      at least one (n_t unused; the reference's JetEngine rule).
    With ``alg_temp > 0`` the ranked (static / dynamic fallback) positions are sampled from
    softmax(score / alg_temp) without replacement (Gumbel top-k) instead of taken greedily.
    """
    strategy = params.remasking_strategy
    if strategy == "sequential":
        order_key = -torch.arange(candidate.shape[1], device=candidate.device, dtype=torch.float32)
        return top_n(order_key.expand(candidate.shape), candidate, n_transfer)
    if strategy == "entropy_bounded":
        return top_n(-draw.entropy, candidate, _entropy_bounded_count(draw.entropy, candidate, params.eb_threshold))
    key = draw.score
    if params.alg_temp > 0:
        key = key / params.alg_temp + _gumbel(key, generator)
    ranked = top_n(key, candidate, n_transfer)
    if strategy == "low_confidence_static":
        return ranked
    above = candidate & (draw.score > params.dynamic_threshold)
    enough = above.sum(1) >= torch.minimum(n_transfer, candidate.sum(1))
    return torch.where(enough[:, None], above, ranked)


def top_n(key: Tensor, candidate: Tensor, n: Tensor) -> Tensor:
    """The min(n, #candidates) candidates with the largest key per row; ties go to the left-most position."""
    finite_min = torch.finfo(key.dtype).min
    key = torch.where(candidate, key.clamp(min=finite_min), NEG_INF)
    order = key.sort(dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(key.shape[1], device=key.device).expand_as(order))
    n = torch.minimum(n, candidate.sum(1))
    return candidate & (ranks < n[:, None])


def _entropy_bounded_count(entropy: Tensor, candidate: Tensor, threshold: float) -> Tensor:
    """Per row: how many of the lowest-entropy candidates keep their cumulative entropy below ``threshold``, at
    least one (the reference's rule, Gen-Verse/dLLM-RL sample/jetengine_ext/engine/scheduler.py:
    ``searchsorted(cumsum, eb_threshold, right=False)``, 0 raised to 1: the candidate whose entropy crosses the
    bound waits for a later step)."""
    ent = torch.where(candidate, entropy, float("inf")).sort(dim=1).values
    cum = torch.where(ent.isfinite(), ent, 0.0).cumsum(1)
    below = ((cum < threshold) & ent.isfinite()).sum(1)
    return torch.minimum(below.clamp(min=1), candidate.sum(1))


def _gumbel(like: Tensor, generator: torch.Generator | None) -> Tensor:
    u = torch.rand(like.shape, generator=generator, device=like.device, dtype=torch.float32)
    return -torch.log(-torch.log(u.clamp(min=1e-20)))


def block_schedule(block_size: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block: b // steps, plus one for the first b mod steps steps."""
    steps = min(steps, block_size)
    return [block_size // steps + (1 if t < block_size % steps else 0) for t in range(steps)]


def split_steps(total: int, n_blocks: int) -> list[int]:
    """Denoising steps per block when ``total`` steps are spread over the answer (earlier blocks get more)."""
    if total < n_blocks:
        raise ValueError(f"SamplingParams.steps={total} is smaller than the number of blocks ({n_blocks}); "
                         "every block needs at least one step")
    return [total // n_blocks + (1 if k < total % n_blocks else 0) for k in range(n_blocks)]


def schedule_table(schedules: list[list[int]], fill: int, device: torch.device | str = "cpu") -> Tensor:
    """[len(schedules), max_len + 1] transfer counts on ``device``; steps past a schedule's end commit ``fill``
    (everything)."""
    width = max(len(s) for s in schedules) + 1
    return on_device([s + [fill] * (width - len(s)) for s in schedules], device)

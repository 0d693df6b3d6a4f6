"""Log-likelihood of a continuation given a context under a diffusion LM (lm-eval's ``loglikelihood``).

A masked-diffusion model gives no exact joint probability of several tokens: it gives the conditional of each masked
token given the visible ones, and its log-likelihood is bounded below by the ELBO

    ELBO(x | c) = E_{l ~ U{1..L}} E_{S, |S| = l} [ (L / l) * sum_{i in S} log p(x_i | c, x without S) ],

L = continuation length, S = the masked subset. This equals the average over unmasking orders of the
left-to-right log-probability in that order, so it is exact (a true log-probability, zero variance) for L = 1.

* Full-attention models: the Monte-Carlo estimate of this ELBO over the whole continuation (``mc_num`` draws).
* Block models: the block-causal factorisation over blocks is exact, p(x | c) = prod_k p(block k | clean blocks
  before k), and one forward of the [clean | noisy copies] layout gives every block its conditional. Inside a
  block the model is again a masked-diffusion denoiser, so each block contributes the ELBO of its continuation
  tokens (the context's tail in the block stays clean, the rest of the last block stays masked: the unknown
  future, as the sampler sees it). The result is exact when every block holds at most one continuation token
  (block size 1, or a one-token continuation), an ELBO otherwise.

Draws are stratified over l (each l in 1..L equally often when ``mc_num`` is a multiple of L) and seeded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from models.common import predicting_columns
from train.layouts import Segment, clean_segment, collate_rows
from train.logprobs import gather_hidden, token_logprobs

if TYPE_CHECKING:
    from models.registry import Adapter


@dataclass
class _Draw:
    """One noisy input row and what it scores: the masked columns, their labels and the ELBO weight L / l."""

    segments: list[Segment]
    cols: Tensor
    labels: Tensor
    weights: Tensor


def continuation_elbo(adapter: Adapter, context: list[int], continuation: list[int], mc_num: int,
                      generator: torch.Generator, batch_size: int = 32) -> float:
    """The (estimated) ELBO of ``continuation`` after ``context``: block-causal per block for block models,
    over the whole continuation for full-attention models (see the module docstring)."""
    if not continuation:
        raise ValueError("loglikelihood needs a non-empty continuation")
    if adapter.attention == "block":
        b, p = adapter.block_size, len(context)
        blocks = range(p // b, (p + len(continuation) - 1) // b + 1)
        sizes = [min((k + 1) * b, p + len(continuation)) - max(k * b, p) for k in blocks]
        levels = torch.stack([_stratified_levels(n, mc_num, generator) for n in sizes], 1)  # [mc_num, blocks]
        draws = [_block_draw(adapter, context, continuation, counts.tolist(), generator) for counts in levels]
    else:
        levels = _stratified_levels(len(continuation), mc_num, generator)
        draws = [_full_draw(adapter, context, continuation, int(l), generator) for l in levels]
    return float(_draw_scores(adapter, draws, batch_size).mean())


def _stratified_levels(n: int, draws: int, generator: torch.Generator) -> Tensor:
    """``draws`` masked counts in 1..n, each marginally uniform, spread evenly (one random offset for all)."""
    u = (torch.rand((), generator=generator) + torch.arange(draws)) / draws
    return (u * n).long().clamp(max=n - 1) + 1


def _masked_subset(n: int, count: int, generator: torch.Generator) -> Tensor:
    """A [n] bool mask with ``count`` True entries at uniformly random places."""
    order = torch.randperm(n, generator=generator)
    return order < count


def _full_draw(adapter: Adapter, context: list[int], continuation: list[int], count: int,
               generator: torch.Generator) -> _Draw:
    p, n = len(context), len(continuation)
    target = torch.tensor(continuation, dtype=torch.long)
    masked = _masked_subset(n, count, generator)
    noisy = torch.cat([torch.tensor(context, dtype=torch.long), torch.where(masked, adapter.mask_id, target)])
    hit = masked.nonzero().squeeze(1)
    # Shifted families predict token i from column i - 1 (never before column 0, as in the sampler).
    cols = predicting_columns(p + hit, adapter.shift_logits, first=0)
    return _Draw([clean_segment(noisy, None)], cols, target[hit], torch.full((len(hit),), n / count))


def _block_draw(adapter: Adapter, context: list[int], continuation: list[int], counts: list[int],
                generator: torch.Generator) -> _Draw:
    """One row: the clean sequence up to the last block, then a noisy copy of every block holding continuation
    tokens, ``counts[j]`` of them masked in the j-th; copies see clean earlier blocks and themselves only."""
    b = adapter.block_size
    seq = torch.tensor(context + continuation, dtype=torch.long)
    p, end = len(context), len(context) + len(continuation)
    first, last = p // b, (end - 1) // b
    segments, cols, labels, weights = [clean_segment(seq[:last * b], b)], [], [], []
    offset = last * b
    for k, count in zip(range(first, last + 1), counts, strict=True):
        pos = torch.arange(k * b, (k + 1) * b)
        is_target = (pos >= p) & (pos < end)
        n = int(is_target.sum())
        masked = torch.zeros(b, dtype=torch.bool)
        masked[is_target.nonzero().squeeze(1)] = _masked_subset(n, count, generator)
        ids = torch.full((b,), adapter.mask_id, dtype=torch.long)  # past the continuation: masked future
        known = pos < end
        ids[known] = torch.where(masked[known], adapter.mask_id, seq[pos[known]])
        segments.append(Segment(ids, pos, pos // b, 1))
        hit = masked.nonzero().squeeze(1)
        cols.append(offset + hit)
        labels.append(seq[pos[hit]])
        weights.append(torch.full((len(hit),), n / count))
        offset += b
    return _Draw(segments, torch.cat(cols), torch.cat(labels), torch.cat(weights))


def _draw_scores(adapter: Adapter, draws: list[_Draw], batch_size: int) -> Tensor:
    """Per draw: sum over its masked tokens of weight * log p(token), the rows run ``batch_size`` at a time."""
    device = next(adapter.model.parameters()).device
    scores = []
    with torch.inference_mode():
        for start in range(0, len(draws), batch_size):
            chunk = draws[start:start + batch_size]
            rows = collate_rows([d.segments for d in chunk], adapter.pad_id)
            hidden = adapter.hidden(rows.input_ids.to(device), rows.position_ids.to(device), rows.layout.to(device))
            row_of = torch.cat([torch.full((len(d.cols),), r) for r, d in enumerate(chunk)])
            picked = gather_hidden(hidden, row_of, torch.cat([d.cols for d in chunk]))
            logp = token_logprobs(adapter.logits, picked, torch.cat([d.labels for d in chunk]),
                                  head_weight=adapter.head_weight()).cpu()
            weighted = logp * torch.cat([d.weights for d in chunk])
            scores.append(torch.zeros(len(chunk)).index_add_(0, row_of, weighted))
    return torch.cat(scores)

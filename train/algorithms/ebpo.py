"""EBPO, ELBO-based block-level policy optimisation (LLaDA2.1, arXiv 2602.08676; DARE verl ebpo_actor_mixin.py):
block models only.

Per draw (``training.mask_times_per_sample``, EBPO's N, 16) every response block gets its own noise level, stratified
over the blocks (block b of a random order gets t = (rank + u) / blocks, rounded to a mask count in 1..its length),
and one block-causal [noisy | clean] forward scores every block given the clean blocks before it. The composite ELBO
C(o) = mean over draws of sum_b sum over block b's masked tokens of log p / t_b gives one ratio per sample,
exp(C - C_old), clipped at the sequence level; optional k3 KL of C to a frozen reference (``training.ref_beta``).
Full-attention models have no blocks to noise independently in one forward, so EBPO refuses them (its registry
entry says so at config load).
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import RESPONSE, Algorithm, BlockGeometry, Needs, Units, masked_response_block_units
from train.algorithms.sequence_elbo import elbo_ratio_loss
from train.batch import TrainBatch
from train.loss import LossOutput, kl_estimate
from train.settings import LossConfig, ViewConfig


def per_block_stratified_masks(block_of: Tensor, draws: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """[draws, L] masks of the response tokens (``block_of``: each token's block) with a stratified level per block,
    and each token's masking probability (its block's masked fraction)."""
    blocks, inverse = torch.unique(block_of, return_inverse=True)
    sizes = torch.bincount(inverse, minlength=len(blocks))
    masks, levels = [], []
    for _ in range(draws):
        rank = torch.randperm(len(blocks), generator=gen)
        t = (rank + float(torch.rand((), generator=gen))) / len(blocks)
        counts = (t * sizes).round().clamp(min=1).minimum(sizes)
        order = torch.rand(len(block_of), generator=gen)
        # rank of each token inside its block by a random key: the first `count` of each block are masked
        position = torch.zeros(len(block_of), dtype=torch.long)
        for b in range(len(blocks)):
            members = (inverse == b).nonzero().squeeze(1)
            position[members] = order[members].argsort().argsort()
        masks.append(position < counts[inverse])
        levels.append((counts.float() / sizes)[inverse])
    return torch.stack(masks), torch.stack(levels)


class EBPO(Algorithm):
    name = "ebpo"
    paper = "2602.08676"
    code = "DARE (yjyddq/DARE) verl ebpo_actor_mixin.py"
    needs = Needs(old_logprobs="recompute", whole_samples=True, monte_carlo_draws="training.mask_times_per_sample")

    def block_units(self, geometry: BlockGeometry, cfg: ViewConfig, gen: torch.Generator) -> Units:
        is_resp = geometry.kind == RESPONSE
        masks, level = per_block_stratified_masks(geometry.block[is_resp], cfg.mask_times_per_sample, gen)
        return masked_response_block_units(geometry, masks, level)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        return elbo_ratio_loss(logp_new, mb, cfg, logp_ref, per_token=False,
                               reference_penalty=lambda c, c_ref, _: kl_estimate(c, c_ref, cfg.use_kl_estimator_k3))

ALGORITHM = EBPO()

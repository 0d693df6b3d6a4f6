"""BGPO, boundary-guided policy optimisation (arXiv 2510.11683; DARE verl llada_dp_actor_bgpo.py
compute_policy_loss_bgpo).

Per sample ``training.mask_times_per_sample`` draws (BGPO's n_t, 16) with stratified mask counts; each draw j is a
unit whose normalised ELBO is l_j = (1/L) sum_k log p / t = the mean log-prob of its masked completion tokens. Its
ratio is linear where the advantage is positive, r_j = 1 + l_j - l_j_old (a lower bound of exp whose gradient does
not grow with the ratio), and exp(l_j - l_j_old) otherwise; loss = -mean over draws and samples of the clipped
surrogate, with DARE's dual clip max(surrogate, c A) for A < 0 (``training.dual_clip`` c, 3). Each draw's loss is its
own term, so a micro-batch need not hold whole samples (constant memory in n_t). BGPO: lr 5e-7, no KL.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import Needs, ResponseMasking, stratified_masks
from train.algorithms.sequence_elbo import first_per_sample, sequence_metrics
from train.batch import TrainBatch
from train.loss import LOG_RATIO_CLAMP, LossOutput
from train.settings import LossConfig, ViewConfig


def per_unit_mean(values: Tensor, unit: Tensor) -> Tensor:
    """Each distinct unit's (sorted) mean of ``values``."""
    _, unit_of = torch.unique(unit, return_inverse=True)
    n = int(unit_of.max()) + 1 if unit_of.numel() else 0
    sums = torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, unit_of, values)
    return sums / torch.bincount(unit_of, minlength=n).to(values.dtype)


def bgpo_surrogate(delta: Tensor, advantages: Tensor, eps: float, eps_high: float | None,
                   dual_clip: float) -> tuple[Tensor, Tensor]:
    """Per unit: BGPO's clipped surrogate from delta = l - l_old, and the ratios."""
    delta = torch.clamp(delta, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.where(advantages > 0, 1 + delta, torch.exp(delta))
    high = eps if eps_high is None else eps_high
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - eps, 1 + high) * advantages)
    if dual_clip:
        surrogate = torch.where(advantages < 0, torch.maximum(surrogate, dual_clip * advantages), surrogate)
    return surrogate, ratio


class BGPO(ResponseMasking):
    name = "bgpo"
    paper = "2510.11683"
    code = "DARE (yjyddq/DARE) verl llada_dp_actor_bgpo.py"
    needs = Needs(old_logprobs="recompute", monte_carlo_draws="training.mask_times_per_sample")

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return stratified_masks(length, cfg.mask_times_per_sample, gen)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        device, dtype = logp_new.device, logp_new.dtype
        unit = mb.unit.to(device)
        new = per_unit_mean(logp_new, unit)
        old = per_unit_mean(mb.old_logprobs.to(device, dtype), unit)
        advantages = first_per_sample(mb.advantages.to(device, dtype), unit)
        surrogate, ratio = bgpo_surrogate(new - old, advantages, cfg.eps, cfg.eps_high, cfg.dual_clip)
        # the step's units (over every process, / world: data parallelism averages the processes' gradients)
        units = float(mb.extra["batch_units"][0]) if mb.num_tokens else 1.0
        loss = -(surrogate / units).sum()
        return LossOutput(loss, sequence_metrics(loss, loss, ratio, cfg))


ALGORITHM = BGPO()

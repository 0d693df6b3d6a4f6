"""ESPO, ELBO-based sequence-level policy optimisation (arXiv 2512.03759; ML-GSAI/ESPO espo/espo_trainer.py).

Per sample, ``training.mask_times_per_sample`` draws (ESPO's num_mc, 2) with stratified mask counts, each followed by
its complement (ESPO's complementary pass); fresh draws every inner iteration (ESPO's mu, 8). ELBO = mean over the
units of sum over a unit's masked completion tokens of log p / t (t = the unit's masked fraction). The ratio is one
per sample, rho = exp((ELBO - ELBO_old) / L) with L the completion length; loss = -(1/B) sum_i min(rho A, clip(rho)
A) + ref_beta (1/B) sum_i (ELBO - ELBO_ref)^2 / (2 L) (ESPO's quadratic penalty to the reference, beta 1e-3); A by RLOO
without std (``reward.advantage: rloo``); ESPO's eps 0.2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import Needs, ResponseMasking, stratified_masks
from train.algorithms.sequence_elbo import elbo_ratio_loss
from train.batch import TrainBatch
from train.loss import LossOutput
from train.settings import LossConfig, ViewConfig


def with_complements(length: int, draws: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Stratified masks, each followed by its complement, and their masking probabilities."""
    masks, level = stratified_masks(length, draws, gen)
    return torch.stack([masks, ~masks], 1).flatten(0, 1), torch.stack([level, 1 - level], 1).flatten(0, 1)


def quadratic_penalty(elbo: Tensor, elbo_ref: Tensor, length: Tensor) -> Tensor:
    """ESPO's penalty to the reference: (ELBO - ELBO_ref)^2 / (2 L)."""
    return (elbo - elbo_ref) ** 2 / (2 * length)


class ESPO(ResponseMasking):
    name = "espo"
    paper = "2512.03759"
    code = "ML-GSAI/ESPO espo/espo_trainer.py"
    needs = Needs(old_logprobs="recompute", fresh_masks=True, whole_samples=True,
                  monte_carlo_draws="training.mask_times_per_sample")

    def response_masks(self, length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return with_complements(length, cfg.mask_times_per_sample, gen)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        return elbo_ratio_loss(logp_new, mb, cfg, logp_ref, per_token=True, reference_penalty=quadratic_penalty)

ALGORITHM = ESPO()

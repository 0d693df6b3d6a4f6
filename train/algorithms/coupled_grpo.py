"""coupled-GRPO as DiffuCoder defines it (arXiv 2506.20639; apple/ml-diffucoder src/open_r1/coupled_grpo.py). The
reference's "coupled" (train/algorithms/coupled.py) is a different estimator and stays as it is.

Per draw (``training.mask_times_per_sample``; DiffuCoder: one per inner iteration, mu 2, fresh masks each) a level
t ~ U(lower_p, upper_p) (DiffuCoder: U(0.2, 0.8)) and uniforms R_k give three units over a clean prompt: (a) the
completion fully masked, (b) tokens with R_k < t masked, (c) tokens with R_k > t masked (its complement). A token's
log-probability is l_k = 1/2 [l_k(a) + l_k(b) / t] when (b) masks it, else 1/2 [l_k(a) + l_k(c) / (1 - t)]: each of
its unit log-probs weighted 1 / (2 x its masking probability), averaged over draws. The ratio, clip and k3 KL to a
frozen reference (``training.ref_beta``; DiffuCoder: 0.01) act on that combined l_k, per token, mean over tokens;
advantages RLOO without std (``reward.advantage: rloo``). DiffuCoder: eps 0.5, lr 1e-6, 10 completions per prompt.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.algorithms.base import Needs, ResponseMasking
from train.algorithms.sequence_elbo import first_per_sample
from train.batch import TrainBatch
from train.loss import LossOutput, policy_loss
from train.settings import LossConfig, ViewConfig


def three_pass_masks(length: int, cfg: ViewConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """[3 D, length] masks (full, R < t, R > t per draw) and each mask's probability (1, t, 1 - t)."""
    masks, levels = [], []
    for _ in range(cfg.mask_times_per_sample):
        t = float(torch.empty(()).uniform_(cfg.lower_p, cfg.upper_p, generator=gen))
        below = torch.rand(length, generator=gen) < t
        masks += [torch.ones(length, dtype=torch.bool), below, ~below]
        levels += [1.0, t, 1.0 - t]
    return torch.stack(masks), torch.tensor(levels)[:, None].expand(len(levels), length).clone()


def combined_per_token(values: Tensor, key: Tensor, coef: Tensor) -> Tensor:
    """Per distinct ``key`` (a sample's token): the sum of ``coef * values`` of its entries, in key order."""
    _, inverse = torch.unique(key, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add(0, inverse, coef * values)


class CoupledGRPO(ResponseMasking):
    name = "coupled_grpo"
    paper = "2506.20639"
    code = "apple/ml-diffucoder src/open_r1/coupled_grpo.py"
    needs = Needs(old_logprobs="recompute", fresh_masks=True, whole_samples=True,
                  monte_carlo_draws="training.mask_times_per_sample")
    loss_norm = "token_mean"

    response_masks = staticmethod(three_pass_masks)

    def loss(self, logp_new: Tensor, mb: TrainBatch, cfg: LossConfig, logp_ref: Tensor | None = None) -> LossOutput:
        device = logp_new.device
        key = (mb.sample_index * (int(mb.token_index.max()) + 1 if mb.num_tokens else 1) + mb.token_index).to(device)
        draws = mb.extra["level"].new_tensor(float(cfg.mask_times_per_sample))
        coef = (0.5 / (mb.extra["level"] * draws)).to(device, logp_new.dtype)

        def combine(values: Tensor) -> Tensor:
            return combined_per_token(values.to(device, logp_new.dtype), key, coef)

        ones = torch.ones_like(coef)
        return policy_loss(combine(logp_new), combine(mb.old_logprobs), first_per_sample(mb.advantages.to(device), key),
                           combined_per_token(mb.weights.to(device, logp_new.dtype), key, ones), cfg,
                           None if logp_ref is None else combine(logp_ref))


ALGORITHM = CoupledGRPO()
